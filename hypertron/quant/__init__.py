"""Matmul precision: the one einsum hook every model matmul goes through, and int8 weights for serving.

Which parameters are quantised is declared with each parameter (:mod:`hypertron.models.params`);
this package knows operations on arrays, not parameter names.
"""

from hypertron.quant.einsum import einsum_for, take_rows
from hypertron.quant.int8 import QArray, dense, param_bytes, quantize

__all__ = ["QArray", "dense", "einsum_for", "param_bytes", "quantize", "take_rows"]
