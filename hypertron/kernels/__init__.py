"""Pallas kernels, each beside its pure-JAX reference, and their PyTorch bindings.

* :mod:`hypertron.kernels.gmm`: grouped matmul for dropless MoE (``gmm``, ``tgmm``).
* :mod:`hypertron.kernels.ragged_attention`: paged decode attention, float or int8 KV pages.
* :mod:`hypertron.kernels.ragged_paged_attention`: the same over any number of queries a row
  (decode rows, prompts, chunks after cached tokens), every row of a serving step in one call.
* :mod:`hypertron.kernels.splash`: JAX's TPU splash attention kernel for the decoder's packed
  causal self-attention (interpreted off a TPU).
* :mod:`hypertron.kernels.torch`: ``gmm`` for torch tensors (torch imported lazily).

Import the functions from their modules (``from hypertron.kernels.gmm import gmm``):
this package does not re-export them, so that ``hypertron.kernels.gmm`` stays the module.
"""
