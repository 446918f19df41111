"""Diffusion inference: pipelines of diffusers folders in JAX."""
