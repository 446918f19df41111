"""What the host sends an engine step: every per-row and per-token input in one int32 array.

A step (:func:`hypertron.serve.device_step.step`) takes its prefill tokens ``pre_tokens`` /
``pre_pos`` / ``pre_row`` / ``pre_valid`` (and, for prompt log-probabilities, ``targets``), and
per row ``slot``, ``lengths``, ``out_idx``, ``out_slot``, ``temperature``, ``top_k``, ``top_p``,
``seed``, ``adapter`` (its LoRA slot + 1; 0: none) and ``draft`` (a decode row's proposed tokens). They travel as one array, each field a slice of it at an offset that the step's
sizes fix (float32 and uint32 fields as their bits), so a step costs one host-to-device copy,
not twelve: on a GPU each copy is its own transfer (about 60 us each in a traced `llama-1b`
step on an H100), and on a CPU each is a release and retake of the GIL that the event loop's
thread may hold for up to the switch interval. :class:`StepBatch` is the host's side: writable
numpy views of the fields over the one array. :func:`unpack` is the step's: the fields again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TOKEN_FIELDS = ("pre_tokens", "pre_pos", "pre_row", "pre_valid")
ROW_FIELDS = ("slot", "lengths", "out_idx", "out_slot", "temperature", "top_k", "top_p", "seed", "adapter", "draft")
_VIEWED = {"temperature": np.float32, "top_p": np.float32, "seed": np.uint32}  # carried as their bits


def _layout(rows: int, tokens: int, targets: bool, mask_words: int = 0, proposal: int = 0) -> list[tuple[str, int, int]]:
    """``(field, start, end)`` of each field in the array, in order."""
    sizes = [(f, tokens) for f in TOKEN_FIELDS + (("targets",) if targets else ())] + [(f, rows) for f in ROW_FIELDS]
    if mask_words:
        sizes.append(("mask", rows * mask_words))
    if proposal:
        sizes.append(("proposal", rows * proposal))
    out, at = [], 0
    for field, n in sizes:
        out.append((field, at, at + n))
        at += n
    return out


class StepBatch:
    """One step's inputs, all padding (``slot`` and ``out_slot`` ``nowhere``, ``top_p`` 1, the
    rest 0) until written through :attr:`fields`, each field a view of :attr:`array`. With
    ``mask_words``, a guided step's ``mask [rows, mask_words]`` (each row's allowed samples,
    :mod:`hypertron.serve.structured`'s bitmask) comes last, every id allowed until written; with
    ``proposal``, a step with speculative proposals' ``proposal [rows, proposal]`` (a decode row's
    proposed tokens, its first ``draft``)."""

    def __init__(self, rows: int, tokens: int, targets: bool, nowhere: int, mask_words: int = 0, proposal: int = 0):
        layout = _layout(rows, tokens, targets, mask_words, proposal)
        self.array = np.zeros(layout[-1][2], np.int32)
        self.fields = {f: self.array[a:b].view(_VIEWED.get(f, np.int32)) for f, a, b in layout}
        self.fields["slot"][:] = self.fields["out_slot"][:] = nowhere
        self.fields["top_p"][:] = 1.0
        if mask_words:
            self.fields["mask"] = self.fields["mask"].reshape(rows, mask_words)
            self.fields["mask"][:] = -1
        if proposal:
            self.fields["proposal"] = self.fields["proposal"].reshape(rows, proposal)


def unpack(array: jax.Array, rows: int, tokens: int, targets: bool, mask_words: int = 0,
           proposal: int = 0) -> dict[str, jax.Array]:
    """The fields of a :class:`StepBatch`'s array, inside the step: ``pre_valid`` as booleans,
    ``temperature`` and ``top_p`` as float32, ``seed`` as uint32, ``mask`` as ``[rows, mask_words]``,
    ``proposal`` as ``[rows, proposal]``."""
    out = {}
    for field, a, b in _layout(rows, tokens, targets, mask_words, proposal):
        x = array[a:b]
        if field in _VIEWED:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(_VIEWED[field]))
        out[field] = x > 0 if field == "pre_valid" else x
    if mask_words:
        out["mask"] = out["mask"].reshape(rows, mask_words)
    if proposal:
        out["proposal"] = out["proposal"].reshape(rows, proposal)
    return out
