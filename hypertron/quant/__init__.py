"""Matmul precision: the one einsum hook every model matmul goes through."""

from hypertron.quant.einsum import einsum_for

__all__ = ["einsum_for"]
