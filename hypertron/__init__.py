"""hypertron: train and serve LLMs in JAX, from one CPU to many accelerators."""

__version__ = "0.1.0"
