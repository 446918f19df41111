"""The server's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Where a serving loop turn's time goes (hypertron_step_phase_seconds{phase}), in the order a turn
# runs them; together they are the turn (hypertron_step_seconds). With dispatch ahead a turn
# dispatches step n + 1 and then collects step n, so "wait" is the device time the host's own work
# did not hide. See docs/serving.md, "Where a step's time goes".
STEP_PHASES = (
    "intake",    # new requests, cancellations and cache resets handed to the scheduler
    "schedule",  # Scheduler.schedule: the next step's rows
    "assemble",  # the step's host arrays and what changed in the device's state (the engine)
    "launch",    # the compiled step queued on the device (the engine; a compile it waits for too)
    "wait",      # the previous step's outputs reaching the host: device time not hidden
    "unpack",    # those outputs made a StepResult
    "update",    # Scheduler.update: tokens, stops, pages, outputs
    "deliver",   # outputs handed to the requests' event loops, gauges
)
STEP_BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)


# The metrics the consumer's side records (hypertron.serve.output.Generation: latency, finishes,
# detokenisation); the engine loop records the others. With the engine in a process of its own
# (hypertron.serve.engine_process) each process exports its side.
REQUEST_SIDE = frozenset({"hypertron_time_to_first_token_seconds", "hypertron_time_per_output_token_seconds",
                          "hypertron_request_latency_seconds", "hypertron_requests", "hypertron_detokenize_seconds"})


class ServeMetrics:
    """The server's Prometheus metrics, in a registry of its own (several servers per process)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, "hypertron_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "submit to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram(p + "time_per_output_token_seconds", "per request, after the first token",
                              registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.latency = Histogram(p + "request_latency_seconds", "submit to finish", registry=r,
                                 buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.requests = Counter(p + "requests", "finished requests", ["finish_reason"], registry=r)
        self.preemptions = Counter(p + "preemptions", "requests pre-empted for KV pages", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.slots_in_use = Gauge(p + "slots_in_use", "decode slots holding a sequence", registry=r)
        self.slots_total = Gauge(p + "slots_total", "decode slots", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "requests waiting for a slot", registry=r)
        self.pages_free = Gauge(p + "kv_pages_free", "free KV-cache pages", registry=r)
        self.pages_total = Gauge(p + "kv_pages_total", "KV-cache pages", registry=r)
        self.pages_cached = Gauge(p + "kv_pages_cached", "KV-cache pages holding a cached prefix (shared or "
                                  "free; free ones count in kv_pages_free)", registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "prefix cache lookups, in tokens: the tokens "
                                      "of each sequence admitted", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "prefix cache hits, in tokens: those found cached",
                                   registry=r)
        self.compiles = Counter(p + "step_compiles", "engine step shapes compiled (sync: a step waited for it; "
                                "background) and steps run padded to a larger compiled shape (padded)", ["mode"],
                                registry=r)
        self.compiles_queued = Gauge(p + "step_compiles_queued", "step shapes queued for the background compiler "
                                     "or being compiled", registry=r)
        self.step = Histogram(p + "step_seconds", "serving loop turns (each dispatches a step and/or collects "
                              "one), idle waits left out", registry=r, buckets=STEP_BUCKETS)
        self.step_phase = Histogram(p + "step_phase_seconds", "a serving loop turn's time by phase (they add "
                                    "up to hypertron_step_seconds)", ["phase"], registry=r, buckets=STEP_BUCKETS)
        self.step_phases = {p: self.step_phase.labels(p) for p in STEP_PHASES}  # each turn observes all
        self.structured_mask = Histogram(p + "structured_mask_seconds", "per step with guided rows: the host's "
                                         "time writing their grammars' masks (in schedule)", registry=r,
                                         buckets=STEP_BUCKETS)
        # Speculative decoding (vLLM's names; docs/serving.md defines the acceptance rate and tokens per step)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "verify rows run (a sequence's proposed "
                                   "tokens checked in a step)", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "tokens proposed in them",
                                         registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "proposed tokens kept", registry=r)
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "proposed tokens kept, "
                                             "by their place in the proposal (0: first)", ["position"], registry=r)
        self.detokenize = Counter(p + "detokenize_seconds", "event-loop time turning tokens into text chunks "
                                  "(detokenisation and stop strings)", registry=r)


class ImageMetrics:
    """The image server's Prometheus metrics, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, "hypertron_"
        self.requests = Counter(p + "image_requests", "finished image requests", ["status"], registry=r)
        self.images = Counter(p + "images", "images generated", registry=r)
        self.latency = Histogram(p + "image_request_latency_seconds", "a request's sampling and encoding, "
                                 "its wait for a batch included", registry=r,
                                 buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.batches = Counter(p + "image_batches", "program calls (batches of requests of one size, step count "
                               "and CFG or not)", registry=r)
        self.batch_rows = Counter(p + "image_batch_rows", "images in those batches: requested (real) and padding "
                                  "up to a compiled batch size (padded)", ["kind"], registry=r)
        self.prompt_cache = Counter(p + "image_prompt_cache", "prompt embeddings looked up: hit (the text encoders "
                                    "skipped) or miss (encoded)", ["result"], registry=r)
