"""The KV page pool with automatic prefix caching: full pages keyed by what they hold, shared.

A full page's *key* is a digest of its parent's key (the page before it in its sequence), its
tokens and the request's extra keys (``cache_salt``, as vLLM's): :func:`page_key`, SHA-256, so
keys are the same in every process (Python's ``hash`` of a string is salted per process). Equal
keys mean equal tokens at the same positions after the same prefix: the same keys and values.

:class:`PagePool` holds pages ``1 .. num_pages`` (0 is the engine's null page): a reference count
per page (the sequences whose page tables hold it), ``key -> page`` for the pages that hold a
known full page, and the free pages: those never keyed (taken first, they hold nothing worth
keeping) and the cached ones at count 0, least recently freed first. Taking a free page takes an
unkeyed one if any, else evicts the least recently used cached page (its key is dropped). A
sequence's pages are freed last page first, so that its tail goes before its head (which more
requests share). Cached free pages count as free: :attr:`PagePool.num_free` holds them.

The scheduler decides when a page is full and written (:mod:`hypertron.serve.scheduler`); this
module only keeps the books. Host only, no JAX.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence


def page_key(parent: bytes | None, tokens: Sequence[int], salt: str | None = None,
             adapter: str | None = None) -> bytes:
    """The key of a full page holding ``tokens`` after the page keyed ``parent`` (None: the
    sequence's first page), for requests of ``salt`` (None: no salt) under the LoRA adapter
    loaded as ``adapter`` (its :attr:`~hypertron.serve.lora_slots.Adapter.key`; None: the base
    model): a SHA-256 digest. Each extra key is tagged and length-prefixed, so no salt spells an
    adapter."""
    h = hashlib.sha256(parent if parent is not None else b"root")
    h.update(struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens))
    for tag, extra in ((b"", salt), (b"lora", adapter)):
        if extra is not None:
            data = extra.encode("utf-8", "surrogatepass")
            h.update(tag + struct.pack("<I", len(data)) + data)
    return h.digest()


class PagePool:
    """Pages ``1 .. num_pages``: reference counts, keys, free and cached pages (see the module
    docstring). ``enabled=False``: no page is ever keyed (no prefix caching), the books are the same."""

    def __init__(self, num_pages: int, *, enabled: bool = True):
        self.num_pages, self.enabled = num_pages, enabled
        self.refs = [0] * (num_pages + 1)
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._empty = list(range(num_pages, 0, -1))  # free and unkeyed; pop() hands out 1, 2, ...
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # free and keyed, LRU first
        self.queries = self.hits = 0  # tokens looked up, and of them found (the scheduler counts)

    @property
    def num_free(self) -> int:
        """Pages at count 0, cached ones included: what a sequence can take."""
        return len(self._empty) + len(self._cached)

    @property
    def num_empty(self) -> int:
        """Free pages holding no key: taken before any cached one is evicted."""
        return len(self._empty)

    @property
    def num_cached(self) -> int:
        """Pages holding a key: shared, in use or free."""
        return len(self._key_of)

    def take(self) -> int | None:
        """A free page at count 1 (an unkeyed one, else the least recently used cached one, whose
        key is dropped), or None: every page is in use."""
        if self._empty:
            page = self._empty.pop()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        else:
            return None
        self.refs[page] = 1
        return page

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of ``keys`` (a sequence's first pages' keys, in order)
        that are cached; nothing is taken."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """One more sequence holds ``pages`` (cached pages, from :meth:`cached_prefix`)."""
        for page in pages:
            if self.refs[page] == 0:
                del self._cached[page]
            self.refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """A sequence gives ``pages`` (its page table, in order) back; those at count 0 go free,
        the last page first: a cached one to the end of the LRU queue, an unkeyed one to be
        taken next."""
        for page in reversed(pages):
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released more often than taken"
            if self.refs[page]:
                continue
            if page in self._key_of:
                self._cached[page] = None
            else:
                self._empty.append(page)

    def register(self, page: int, key: bytes) -> None:
        """``page`` (in use) holds the full page ``key``, written or being written by a step
        already dispatched. A key cached already keeps its page (this one stays unkeyed)."""
        if self.enabled and key not in self._page_of and page not in self._key_of:
            self._key_of[page], self._page_of[key] = key, page

    def forget(self, page: int) -> None:
        """``page`` no longer holds what its key says (the step writing it failed)."""
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]
            if page in self._cached:  # it was free: it goes to the unkeyed ones
                del self._cached[page]
                self._empty.append(page)

    def reset(self) -> int:
        """Drop every cached page at count 0 (``POST /reset_prefix_cache``); returns how many."""
        dropped = list(self._cached)
        for page in dropped:
            self.forget(page)
        return len(dropped)
