"""Where a loaded pipeline's weights live and in what precision (``hypertron diffuse --mesh --dtype
--quantize``, the image server's flags of the same names).

* :func:`place`: the denoiser's and the VAE's weights on a mesh, each by its declaration's logical
  axes through the one sharding table (:mod:`hypertron.parallel.rules`); the text encoders are
  replicated. The sampling program of a placed pipeline runs under those rules: its images (the
  latents' and the conditioning's batch axis, and the VAE decode's) are sharded over the ``batch``
  axes (data, then fsdp and expert where the batch divides).
* :func:`load_placed`: what ``hypertron diffuse`` and the image server both run: load, quantise,
  place (``--mesh`` read by :func:`mesh_of`).
* :func:`quantize_text`: ``int8`` text encoders (``--text-encoder-quantize``): every matmul weight
  and the token embedding of each (CLIP, T5) an int8 :class:`~hypertron.quant.int8.QArray`, about a
  quarter of its float32 bytes (T5-XXL: 4.7 B parameters, 19 GB in float32).
* :func:`quantize`: ``int8`` replaces the denoiser's matmul weights (those declared ``quantize``)
  by :class:`~hypertron.quant.int8.QArray`, which the einsum hook multiplies as int8 with
  per-output-channel scales; ``fp8`` keeps the weights and runs the denoiser's matmuls through
  the fp8 hook (e4m3 operands, per-tensor current scaling). Convolutions and norms stay as loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from hypertron.config.schema import DIFFUSION_DTYPE, DiffusionDtype, DiffusionQuantization, WeightQuantization, choices
from hypertron.diffusion import vae as V
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.lora import with_lora
from hypertron.diffusion.pipeline import Pipeline, PipelineSpec, denoiser_specs, load_pipeline
from hypertron.diffusion.text_encoders import TextEncoder
from hypertron.diffusion.text_encoders import declare as declare_text
from hypertron.errors import ConfigError
from hypertron.models.params import is_spec, quantize_params
from hypertron.parallel.mesh import mesh_from_text
from hypertron.parallel.rules import DEFAULT_RULES, MeshAxes, spec_for
from hypertron.quant import QArray

QUANTIZE = choices(DiffusionQuantization)  # hypertron diffuse --quantize, the image server's
DTYPES = choices(DiffusionDtype)  # hypertron diffuse --dtype, the image server's
TEXT_QUANTIZE = choices(WeightQuantization)  # hypertron diffuse --text-encoder-quantize, the image server's


def _put(specs: Any, params: Any, mesh: Mesh, rules: dict[str, MeshAxes]) -> Any:
    """``params`` on ``mesh``, each leaf by its spec's logical axes (an int8 weight's values and
    scales each by their own shape: a size-1 scale axis stays whole)."""
    def one(spec, value):
        arrays = (value.values, value.scales) if isinstance(value, QArray) else (value,)
        placed = [jax.device_put(a, NamedSharding(mesh, spec_for(spec.axes, rules, mesh, tuple(a.shape))))
                  for a in arrays]
        return QArray(*placed) if isinstance(value, QArray) else placed[0]
    return jax.tree.map(one, specs, params, is_leaf=is_spec)


def place(pipe: Pipeline, mesh: Mesh, rules: dict[str, MeshAxes] = DEFAULT_RULES) -> Pipeline:
    """``pipe`` with its weights on ``mesh`` by ``rules`` and its sampling program sharded by image
    (a new pipeline: programs compiled for the old placement are not reused)."""
    replicated = NamedSharding(mesh, spec_for((), rules, mesh))
    encoders = tuple(e._replace(params=jax.device_put(e.params, replicated)) for e in pipe.text_encoders)
    return dataclasses.replace(
        pipe, text_encoders=encoders, denoiser_params=_put(denoiser_specs(pipe), pipe.denoiser_params, mesh, rules),
        vae_params=None if pipe.spec.vae is None else _put(V.declare(pipe.spec.vae), pipe.vae_params, mesh, rules),
        mesh=mesh, rules=rules)


def quantize(pipe: Pipeline, mode: str) -> Pipeline:
    """``pipe`` with its denoiser's matmuls in ``mode`` (one of :data:`QUANTIZE`; see the module's
    docstring). Quantise before :func:`place`: the int8 weights are placed by the same rules."""
    if mode not in QUANTIZE:
        raise ValueError(f"quantize={mode!r}: expected one of {', '.join(QUANTIZE)}")
    params = quantize_params(denoiser_specs(pipe), pipe.denoiser_params) if mode == "int8" else pipe.denoiser_params
    return dataclasses.replace(pipe, denoiser_params=params, quantize=mode)


def quantize_text(pipe: Pipeline, mode: str) -> Pipeline:
    """``pipe`` with its text encoders' matmul weights (and token embeddings) in ``mode`` (one of
    :data:`TEXT_QUANTIZE`); their norms and position tables stay as loaded."""
    if mode not in TEXT_QUANTIZE:
        raise ValueError(f"text encoder quantize={mode!r}: expected one of {', '.join(TEXT_QUANTIZE)}")
    if mode == "none":
        return pipe
    encoders = tuple(TextEncoder(e.cfg, quantize_params(declare_text(e.cfg), e.params), mode)
                     for e in pipe.text_encoders)
    return dataclasses.replace(pipe, text_encoders=encoders)


def mesh_of(text: str | None) -> Mesh | None:
    """The mesh of ``--mesh AXIS=N,...`` (``data=2,fsdp=2``, over the first devices); None for none
    (one device). A malformed mesh, or one of more devices than there are, is a :class:`DiffusionError`."""
    if text is None:
        return None
    try:
        return mesh_from_text(text)
    except ConfigError as e:
        raise DiffusionError(str(e)) from None


def load_placed(spec: PipelineSpec, *, dtype: Any = DIFFUSION_DTYPE, quantize_mode: str = "none",
                text_quantize: str = "none", mesh: Mesh | None = None, lora: tuple | None = None) -> Pipeline:
    """The pipeline of ``spec`` loaded in ``dtype`` (one of :data:`DTYPES`, or its ``jnp`` dtype),
    ``lora`` (a diffusers LoRA file and its scale) merged into its denoiser, its denoiser's matmuls
    in ``quantize_mode`` (:func:`quantize`), its text encoders' in ``text_quantize``
    (:func:`quantize_text`), placed on ``mesh`` when given (:func:`place`)."""
    pipe = load_pipeline(spec.folder, dtype=jnp.dtype(dtype), spec=spec)
    if lora is not None:
        pipe = with_lora(pipe, *lora)
    pipe = quantize(quantize_text(pipe, text_quantize), quantize_mode)
    return pipe if mesh is None else place(pipe, mesh)


def described(pipe: Pipeline) -> str:
    """Where and how ``pipe`` runs, for a log line: its class, dtype, quantisation and mesh."""
    where = " x ".join(f"{a}={n}" for a, n in pipe.mesh.shape.items() if n > 1) if pipe.mesh is not None else ""
    text = {e.quantize for e in pipe.text_encoders} - {"none"}
    return (f"{pipe.spec.class_name}, {jnp.dtype(pipe.dtype).name}, quantize {pipe.quantize}, "
            + (f"text encoders {', '.join(sorted(text))}, " if text else "")
            + f"{'mesh ' + where if where else 'one device'}")
