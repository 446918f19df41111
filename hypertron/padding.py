"""Padded sizes, so that compiled shapes stay few: the next power of two, and the serving engine's
buckets (a power of two up to 8, then a fixed fraction of the power of two below)."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def bucket(n: int, parts: int = 4) -> int:
    """The padded size of ``n`` rows, tokens or pages: a power of two up to 8, then a multiple of
    ``1 / parts`` of the power of two below it (quarters: 10, 12, 14, 16, 20, ...: under 25 %
    padding, about 4 sizes per doubling; eighths: under 12.5 %, 8 sizes)."""
    if n <= 8:
        return next_pow2(n)
    step = max((1 << (n.bit_length() - 1)) // parts, 1)
    return -(-n // step) * step
