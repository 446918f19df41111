// Paged decode attention on a CPU, one query a row: hypertron.kernels.cpu_decode builds this file
// with the machine's C++ compiler and registers it as an XLA FFI target (see that module).
//
// Each (row, kv head) reads its row's pages in order, a page at a time, straight from the pool
// (no gathered copy), and keeps an online softmax in float32 for the GQA group's query heads;
// the (row, kv head) items are shared out over XLA's intra-op thread pool. Layout as
// hypertron/kernels/ragged_attention.py's: q [rows, heads, head_dim] float32; k, v [kv_heads,
// pages, page_size, head_dim] float32 or int8; int8 pages' scales [kv_heads, pages, page_size]
// float32 or bfloat16 (anything otherwise); lengths [rows] int32 (0: zeros out); table [rows,
// pages_per_seq] int32; window [] int32: a row attends to its positions [length - window, length).
// Where two or more rows' tables start with the same pages (a prefix the prefix cache shares) and
// no row's window cuts into it, those pages are read once for all the rows first (cascade
// attention: each kv head's keys against every row's queries), and each row goes on from there.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 16;    // query heads a kv head
constexpr int64_t kMaxDim = 256;     // head_dim
constexpr int64_t kMaxPage = 64;     // page_size
constexpr int64_t kLanes = 16;       // queries a block of the shared pages' products (one AVX-512 register)

struct Call {
  const float* q;
  const void* k;
  const void* v;
  const void* k_scales;
  const void* v_scales;
  bool int8, bf16_scales;
  const int32_t* lengths;
  const int32_t* table;
  float *m0, *l0, *acc0;  // the shared pages' online softmax state [kv_heads, rows, group(, dim)]
  int64_t shared;         // tokens of those pages (0: none)
  float* out;
  int64_t rows, heads, dim, kv_heads, pages, page_size, pages_per_seq;
  int32_t window;
  float sm_scale;

  float scale(const void* scales, int64_t i) const {
    if (!int8) return 1.f;
    if (!bf16_scales) return static_cast<const float*>(scales)[i];
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(scales)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

// exp(x) for x <= 0 (a score less its running max) in a form the compiler vectorises: x = n ln2 + r
// with |r| <= ln2 / 2, e^r by Cephes' expf polynomial (about 1 ulp), times 2^n through the exponent.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float e = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &e, 4);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&e, &bits, 4);
  return e;
}

template <typename T>
void attend(const Call& c, int64_t row, int64_t kv_head) {
  const int64_t group = c.heads / c.kv_heads, dim = c.dim, page_size = c.page_size;
  float* out = c.out + (row * c.heads + kv_head * group) * dim;
  const int64_t length = std::min<int64_t>(std::max<int32_t>(c.lengths[row], 0), c.pages_per_seq * page_size);
  if (length == 0) {
    std::fill(out, out + group * dim, 0.f);
    return;
  }
  const int64_t start = std::max<int64_t>(length - c.window, c.shared);
  const float* q = c.q + (row * c.heads + kv_head * group) * dim;
  alignas(64) float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup * kMaxDim], s[kMaxGroup * kMaxPage];
  if (c.shared) {  // the shared pages' state
    const int64_t state = (kv_head * c.rows + row) * group;
    std::copy(c.m0 + state, c.m0 + state + group, m);
    std::copy(c.l0 + state, c.l0 + state + group, l);
    std::copy(c.acc0 + state * dim, c.acc0 + (state + group) * dim, acc);
  } else {
    std::fill(m, m + group, -std::numeric_limits<float>::infinity());
    std::fill(l, l + group, 0.f);
    std::fill(acc, acc + group * dim, 0.f);
  }
  const T* keys = static_cast<const T*>(c.k);
  const T* values = static_cast<const T*>(c.v);
  const int64_t last_page = (length - 1) / page_size;
  for (int64_t j = start / page_size; j <= last_page && start < length; ++j) {
    const int64_t base = (kv_head * c.pages + c.table[row * c.pages_per_seq + j]) * page_size;
    if (j < last_page) {  // the next page's keys and values on their way while this one is read
      const int64_t next = (kv_head * c.pages + c.table[row * c.pages_per_seq + j + 1]) * page_size * dim;
      for (int64_t b = 0; b < page_size * dim * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(keys + next) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(values + next) + b);
      }
    }
    const int64_t t0 = std::max<int64_t>(start - j * page_size, 0);
    const int64_t t1 = std::min<int64_t>(length - j * page_size, page_size);
    for (int64_t t = t0; t < t1; ++t) {  // the page's scores, every head of the group
      const T* k = keys + (base + t) * dim;
      const float scale = c.sm_scale * c.scale(c.k_scales, base + t);
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += q[g * dim + d] * static_cast<float>(k[d]);
        s[g * kMaxPage + t] = dot * scale;
      }
    }
    for (int64_t g = 0; g < group; ++g) {  // the online softmax over them
      float* sg = s + g * kMaxPage;
      float top = m[g];
      for (int64_t t = t0; t < t1; ++t) top = std::max(top, sg[t]);
      const float alpha = std::isinf(m[g]) ? 0.f : exp_nonpositive(m[g] - top);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = t0; t < t1; ++t) {
        sg[t] = exp_nonpositive(sg[t] - top);
        sum += sg[t];
      }
      l[g] = alpha * l[g] + sum;
      m[g] = top;
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] *= alpha;
    }
    for (int64_t t = t0; t < t1; ++t) {  // and the values they weigh
      const T* v = values + (base + t) * dim;
      const float scale = c.scale(c.v_scales, base + t);
      for (int64_t g = 0; g < group; ++g) {
        const float p = s[g * kMaxPage + t] * scale;
        float* ag = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] += p * static_cast<float>(v[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = acc[g * dim + d] * inv;
  }
}

// The first c.shared / page_size pages of row live[0], which every row in live holds alike and has
// filled, for one kv head: each key read once against every live row's queries, the products
// vectorised over the queries (a key's score for all of them at once, no sums across lanes); the
// online softmax's state goes to c.m0, c.l0, c.acc0.
template <typename T>
void shared_pages(const Call& c, const std::vector<int64_t>& live, int64_t kv_head) {
  const int64_t group = c.heads / c.kv_heads, dim = c.dim, page_size = c.page_size;
  const int64_t nq = static_cast<int64_t>(live.size()) * group;
  std::vector<float> m(nq, -std::numeric_limits<float>::infinity()), l(nq, 0.f), top(nq), alpha(nq);
  const int64_t nb = (nq + kLanes - 1) / kLanes;  // blocks of kLanes queries (the last padded with zeros)
  std::vector<float> acc(nq * dim, 0.f), s(page_size * nb * kLanes), qt(nb * dim * kLanes, 0.f);
  for (int64_t i = 0; i < nq; ++i) {  // s [token][query], qt [block][d][lane]
    const float* qi = c.q + (live[i / group] * c.heads + kv_head * group + i % group) * dim;
    for (int64_t d = 0; d < dim; ++d) qt[((i / kLanes) * dim + d) * kLanes + i % kLanes] = qi[d];
  }
  const T* keys = static_cast<const T*>(c.k);
  const T* values = static_cast<const T*>(c.v);
  for (int64_t j = 0; j < c.shared / page_size; ++j) {
    const int64_t base = (kv_head * c.pages + c.table[live[0] * c.pages_per_seq + j]) * page_size;
    for (int64_t t = 0; t < page_size; ++t) {
      const T* k = keys + (base + t) * dim;
      float* st = s.data() + t * nb * kLanes;
      const float scale = c.sm_scale * c.scale(c.k_scales, base + t);
      for (int64_t b = 0; b < nb; ++b) {  // a block's scores in one register through the key's dims
        float sum[kLanes] = {};
        const float* qb = qt.data() + b * dim * kLanes;
        for (int64_t d = 0; d < dim; ++d) {
          const float kd = static_cast<float>(k[d]);
#pragma omp simd
          for (int64_t i = 0; i < kLanes; ++i) sum[i] += qb[d * kLanes + i] * kd;
        }
#pragma omp simd
        for (int64_t i = 0; i < kLanes; ++i) st[b * kLanes + i] = sum[i] * scale;
      }
    }
    std::copy(m.begin(), m.end(), top.begin());
    for (int64_t t = 0; t < page_size; ++t) {
      const float* st = s.data() + t * nb * kLanes;
#pragma omp simd
      for (int64_t i = 0; i < nq; ++i) top[i] = std::max(top[i], st[i]);
    }
#pragma omp simd
    for (int64_t i = 0; i < nq; ++i) {
      alpha[i] = m[i] == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(m[i] - top[i]);
      l[i] *= alpha[i];
      m[i] = top[i];
    }
    for (int64_t t = 0; t < page_size; ++t) {
      float* st = s.data() + t * nb * kLanes;
#pragma omp simd
      for (int64_t i = 0; i < nq; ++i) {
        st[i] = exp_nonpositive(st[i] - top[i]);
        l[i] += st[i];
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      float* ai = acc.data() + i * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ai[d] *= alpha[i];
    }
    for (int64_t t = 0; t < page_size; ++t) {
      const T* v = values + (base + t) * dim;
      const float scale = c.scale(c.v_scales, base + t);
      const float* st = s.data() + t * nb * kLanes;
      for (int64_t i = 0; i < nq; ++i) {
        const float p = st[i] * scale;
        float* ai = acc.data() + i * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ai[d] += p * static_cast<float>(v[d]);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t state = (kv_head * c.rows + live[i / group]) * group + i % group;
    c.m0[state] = m[i];
    c.l0[state] = l[i];
    std::copy_n(acc.data() + i * dim, dim, c.acc0 + state * dim);
  }
}

void run(const Call& c, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    if (c.int8) {
      attend<int8_t>(c, i / c.kv_heads, i % c.kv_heads);
    } else {
      attend<float>(c, i / c.kv_heads, i % c.kv_heads);
    }
  }
}

// Tokens of whole pages every live row's table starts with alike and every live row has filled,
// when two or more rows are live and no row's window starts after 0 (else 0); `live` the live rows.
int64_t shared_tokens(const Call& c, std::vector<int64_t>& live) {
  int64_t filled = std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t length = std::min<int64_t>(std::max<int32_t>(c.lengths[r], 0), c.pages_per_seq * c.page_size);
    if (length == 0) continue;
    if (length > c.window) return 0;
    live.push_back(r);
    filled = std::min(filled, length);
  }
  if (live.size() < 2) return 0;
  int64_t pages = 0;
  for (; pages < filled / c.page_size; ++pages) {
    const int32_t page = c.table[live[0] * c.pages_per_seq + pages];
    bool same = true;
    for (int64_t r : live) same &= c.table[r * c.pages_per_seq + pages] == page;
    if (!same) break;
  }
  return pages * c.page_size;
}

// Items handed out in grains from one counter: the calling thread takes its share too, so the
// call finishes even when the pool's other threads are busy; it waits only for grains already taken.
struct Progress {
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// f(lo, hi) over [0, items) in grains shared out over XLA's pool, the calling thread taking its share.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t items, F f) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t grain = std::max<int64_t>(1, items / (4 * threads));
  if (threads == 1 || items <= grain) {
    f(0, items);
    return;
  }
  auto progress = std::make_shared<Progress>();
  auto work = [f, progress, items, grain]() {
    int64_t mine = 0;
    for (int64_t lo; (lo = progress->next.fetch_add(grain)) < items;) {
      const int64_t hi = std::min(lo + grain, items);
      f(lo, hi);
      mine += hi - lo;
    }
    if (mine && progress->done.fetch_add(mine) + mine == items) {
      std::lock_guard<std::mutex> lock(progress->mu);
      progress->cv.notify_all();
    }
  };
  for (int64_t t = 1; t < std::min(threads, items); ++t) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(progress->mu);
  progress->cv.wait(lock, [&] { return progress->done.load() == items; });
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales, ffi::Buffer<ffi::S32> lengths,
                       ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> window, float sm_scale,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("cpu paged decode: bad ranks or page dtypes");
  const bool int8 = k.element_type() == ffi::DataType::S8;
  if (!int8 && k.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("cpu paged decode: pages must be float32 or int8");
  Call c{q.typed_data(), k.untyped_data(), v.untyped_data(), k_scales.untyped_data(), v_scales.untyped_data(),
         int8, k_scales.element_type() == ffi::DataType::BF16, lengths.typed_data(), table.typed_data(),
         nullptr, nullptr, nullptr, 0, out->typed_data(), qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1],
         window.typed_data()[0], sm_scale};
  if (c.heads % c.kv_heads || c.heads / c.kv_heads > kMaxGroup || c.dim > kMaxDim || c.page_size > kMaxPage ||
      kd[3] != c.dim || td[0] != c.rows)
    return ffi::Error::InvalidArgument("cpu paged decode: shapes out of range");
  std::vector<int64_t> live;
  std::vector<float> state;
  if ((c.shared = shared_tokens(c, live))) {  // read once for all the rows, a kv head an item
    const int64_t n = c.kv_heads * c.rows * (c.heads / c.kv_heads);
    state.resize(n * (2 + c.dim));
    c.m0 = state.data(), c.l0 = c.m0 + n, c.acc0 = c.l0 + n;
    parallel_for(pool, c.kv_heads, [&c, &live](int64_t lo, int64_t hi) {
      for (int64_t h = lo; h < hi; ++h) c.int8 ? shared_pages<int8_t>(c, live, h) : shared_pages<float>(c, live, h);
    });
  }
  parallel_for(pool, c.rows * c.kv_heads, [c](int64_t lo, int64_t hi) { run(c, lo, hi); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HypertronCpuPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k pages
                                  .Arg<ffi::AnyBuffer>()         // v pages
                                  .Arg<ffi::AnyBuffer>()         // k scales
                                  .Arg<ffi::AnyBuffer>()         // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
