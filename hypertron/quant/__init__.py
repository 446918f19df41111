"""Matmul precision: the one einsum hook every model matmul goes through, and int8 weights for serving."""

from hypertron.quant.einsum import einsum_for, take_rows
from hypertron.quant.int8 import QArray, dense, param_bytes, quantize, quantize_params

__all__ = ["QArray", "dense", "einsum_for", "param_bytes", "quantize", "quantize_params", "take_rows"]
