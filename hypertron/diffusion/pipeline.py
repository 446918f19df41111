"""A diffusers pipeline folder: ``model_index.json`` and its components, read strictly.

Two steps, so that a request can be checked before any weight is read: :func:`read_pipeline` reads
the configs only (``model_index.json``, the scheduler's, the VAE's, the denoiser's) into a
:class:`PipelineSpec`, and :func:`load_pipeline` adds the weights (text encoders, tokenizers, the
denoiser, the VAE) as a :class:`Pipeline`. What each supported class holds is a row of
:data:`KINDS`; the denoiser's loader is found by its class name in :data:`DENOISERS` and imported
when it is loaded. Anything hypertron cannot use is a one-line :class:`DiffusionError` naming the
file and the key.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config.loading import read_json
from hypertron.config.numbers import shown
from hypertron.config.schema import MODEL_INDEX
from hypertron.diffusion import schedulers as S
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.text_encoders import TextEncoder, load_text_encoder
from hypertron.diffusion.vae import VaeConfig, load_vae, vae_config
from hypertron.tokenizer import Tokenizer, get_tokenizer

SD, SDXL, FLUX = "StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxPipeline"
# hypertron's own class: SD's components without a VAE, its UNet denoising pixels (the CPU demo's
# model, trained from scratch: docs/diffusion.md). Its components are still diffusers' and
# transformers' own formats; diffusers has no pipeline of this name.
PIXEL = "PixelDiffusionPipeline"


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a pipeline class holds and how diffusers runs it by default."""

    denoiser: str  # the component folder: unet or transformer
    denoiser_class: str
    text_encoders: tuple[str, ...]  # component folders, in the pipeline's order
    tokenizers: tuple[str, ...]
    steps: int  # diffusers' default num_inference_steps
    guidance: float  # and guidance_scale
    default_sample_size: int | None  # latent side of the default image; None: the denoiser's sample_size
    size_multiple: int  # the latent side must divide by this (Flux packs 2x2 patches)
    vae: bool = True  # False: the denoiser works on pixels in [-1, 1]


KINDS = {
    SD: Kind("unet", "UNet2DConditionModel", ("text_encoder",), ("tokenizer",), 50, 7.5, None, 1),
    SDXL: Kind("unet", "UNet2DConditionModel", ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"),
               50, 5.0, 128, 1),
    FLUX: Kind("transformer", "FluxTransformer2DModel", ("text_encoder", "text_encoder_2"),
               ("tokenizer", "tokenizer_2"), 28, 3.5, 128, 2),
    PIXEL: Kind("unet", "UNet2DConditionModel", ("text_encoder",), ("tokenizer",), 25, 3.0, None, 1, vae=False),
}
# The denoiser's class -> (module, its loader: folder -> (cfg, params), its declaration: cfg -> specs,
# its config: (config.json's dict, where) -> cfg), imported when loaded.
DENOISERS = {
    "UNet2DConditionModel": ("hypertron.diffusion.unet", "load_unet", "declare_unet", "unet_config"),
    "FluxTransformer2DModel": ("hypertron.diffusion.flux", "load_flux", "declare_flux", "flux_config"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """A pipeline folder's configs: what a request is checked against before weights are read."""

    folder: Path
    class_name: str
    kind: Kind
    scheduler: S.SchedulerConfig
    vae: VaeConfig | None  # None: a pixel pipeline (PIXEL)
    denoiser_config: dict  # the denoiser's config.json as diffusers wrote it
    options: dict  # model_index.json's own settings (SDXL's force_zeros_for_empty_prompt)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along a side: 2 per VAE block but the last (diffusers' ``vae_scale_factor``);
        1 without a VAE."""
        return 1 if self.vae is None else 2 ** (len(self.vae.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        """Channels of the denoised tensor: the VAE's latents', or the UNet's input's (pixels)."""
        return self.vae.latent_channels if self.vae is not None else int(self.denoiser_config.get("in_channels", 4))

    @property
    def is_flux(self) -> bool:
        return self.class_name == FLUX

    @property
    def guidance_embeds(self) -> bool:
        """Flux-dev: the guidance scale is an input of the transformer (no CFG rows)."""
        return self.is_flux and bool(self.denoiser_config.get("guidance_embeds", False))

    def default_size(self) -> int:
        """The default image side in pixels, as the diffusers pipeline's."""
        latent = self.kind.default_sample_size or self.denoiser_config.get("sample_size", 64)
        return int(latent) * self.vae_scale_factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """One image's latents in diffusers' layout: ``[c, h, w]`` (UNet) or packed ``[tokens, 4c]``
        (Flux). A size the model cannot take is a :class:`DiffusionError` naming it."""
        multiple = self.vae_scale_factor * self.kind.size_multiple
        for name, value in (("height", height), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < multiple or value % multiple:
                raise DiffusionError(f"{name}={shown(value)}: {self.class_name} takes image sides that are "
                                     f"positive multiples of {multiple}")
        h, w, c = height // self.vae_scale_factor, width // self.vae_scale_factor, self.latent_channels
        return ((h // 2) * (w // 2), 4 * c) if self.is_flux else (c, h, w)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Pipeline:
    """A loaded pipeline: its spec and every component (parameters as device arrays)."""

    spec: PipelineSpec
    text_encoders: tuple[TextEncoder, ...]
    tokenizers: tuple[Tokenizer, ...]
    denoiser_cfg: Any
    denoiser_params: Any
    vae_params: Any
    dtype: Any  # what the denoiser and the VAE compute in
    denoise: Callable  # the denoiser module's pure ``apply`` (see hypertron.diffusion.sampling)
    quantize: str = "none"  # the denoiser's matmuls: none, int8 or fp8 (hypertron.diffusion.placement)
    mesh: Any = None  # where the weights are placed (placement.place); None: one device
    rules: Any = None  # the sharding rules of that placement
    # Compiled, by sampling; not an argument, so dataclasses.replace (placement's) starts a copy empty.
    programs: dict = dataclasses.field(default_factory=dict, compare=False, init=False)


def read_config(path: Path) -> dict:
    """A JSON object from ``path``; a missing, malformed or non-object file is a one-line
    :class:`DiffusionError` naming it."""
    value = read_json(path, DiffusionError, f"{path}: not found", lambda reason: f"{path}: invalid JSON ({reason})")
    if not isinstance(value, dict):
        raise DiffusionError(f"{path}: must be a JSON object")
    return value


def _component(folder: Path, index: dict, name: str, want: str | None = None) -> Path:
    """The folder of component ``name``, after checking model_index.json names it (as ``want``)."""
    where = folder / MODEL_INDEX
    entry = index.get(name)
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
        raise DiffusionError(f"{where}: no component {name!r} (expected [library, class])")
    if want is not None and entry[1] != want:
        raise DiffusionError(f"{where}: {name} is {shown(entry[1])}, not supported (supported: {want})")
    path = folder / name
    if not path.is_dir():
        raise DiffusionError(f"{path}: component folder not found (named in {where})")
    return path


def read_pipeline(folder: str | Path, scheduler: str | None = None) -> PipelineSpec:
    """The :class:`PipelineSpec` of the diffusers folder (configs only; no weights read).

    ``scheduler``: a scheduler class to run instead of the folder's, with the folder's options (as
    diffusers' ``Scheduler.from_config(pipe.scheduler.config)``)."""
    folder = Path(folder)
    index = read_config(folder / MODEL_INDEX) if folder.is_dir() else None
    if index is None:
        raise DiffusionError(f"{folder}: not a directory")
    class_name = index.get("_class_name")
    if class_name not in KINDS:
        raise DiffusionError(f"{folder / MODEL_INDEX}: pipeline class {shown(class_name)} is not supported "
                             f"(supported: {', '.join(KINDS)})")
    kind = KINDS[class_name]
    for name in kind.text_encoders + kind.tokenizers:
        _component(folder, index, name)
    config_file = _component(folder, index, "scheduler") / "scheduler_config.json"
    scheduler_cfg = S.parse_config(read_config(config_file), source=str(config_file), class_name=scheduler)
    vae = None
    if kind.vae:
        vae_file = _component(folder, index, "vae", "AutoencoderKL") / "config.json"
        vae = vae_config(read_config(vae_file), str(vae_file))
    denoiser_file = _component(folder, index, kind.denoiser, kind.denoiser_class) / "config.json"
    options = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
    return PipelineSpec(folder=folder, class_name=class_name, kind=kind, scheduler=scheduler_cfg, vae=vae,
                        denoiser_config=read_config(denoiser_file), options=options)


def _denoiser_module(spec: PipelineSpec) -> Any:
    module_name = DENOISERS[spec.kind.denoiser_class][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise DiffusionError(f"{spec.folder / spec.kind.denoiser}: {spec.kind.denoiser_class} is not "
                             f"available in this build ({module_name} is missing)") from None


def denoiser_specs(pipe: Pipeline) -> Any:
    """The denoiser's parameter declaration (its module's ``declare_*`` of its config)."""
    return declare_denoiser(pipe.spec, pipe.denoiser_cfg)


def declare_denoiser(spec: PipelineSpec, cfg: Any) -> Any:
    """The declaration of ``spec``'s denoiser at config ``cfg``."""
    return getattr(_denoiser_module(spec), DENOISERS[spec.kind.denoiser_class][2])(cfg)


def denoiser_config(spec: PipelineSpec) -> Any:
    """``spec``'s denoiser's config (from its ``config.json``, no weights read)."""
    return getattr(_denoiser_module(spec), DENOISERS[spec.kind.denoiser_class][3])(
        spec.denoiser_config, str(spec.folder / spec.kind.denoiser / "config.json"))


def load_denoiser(spec: PipelineSpec) -> tuple[Any, Any, Any]:
    """``(module, cfg, params)`` of ``spec``'s denoiser: the module holding its ``apply``, its config
    and its weights (numpy, float32)."""
    module = _denoiser_module(spec)
    cfg, params = getattr(module, DENOISERS[spec.kind.denoiser_class][1])(spec.folder / spec.kind.denoiser)
    return module, cfg, params


def _on_device(params: Any, dtype: Any) -> Any:
    """Float parameters as device arrays in ``dtype`` (cast once, at load), the others as they are."""
    def put(a):
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.asarray(a, dtype)
        return jnp.asarray(a) if isinstance(a, np.ndarray) else a
    return jax.tree.map(put, params)


def load_pipeline(folder: str | Path, *, scheduler: str | None = None, dtype: Any = jnp.float32,
                  spec: PipelineSpec | None = None) -> Pipeline:
    """The diffusers pipeline in ``folder`` (``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``,
    ``FluxPipeline`` or our ``PixelDiffusionPipeline``), every component loaded; ``dtype`` the denoiser's and VAE's weights. ``spec``:
    :func:`read_pipeline`'s result when the caller already has it."""
    spec = spec or read_pipeline(folder, scheduler)
    encoders = tuple(load_text_encoder(spec.folder / name) for name in spec.kind.text_encoders)
    tokenizers = tuple(get_tokenizer(str(spec.folder / name)) for name in spec.kind.tokenizers)
    vae_params = load_vae(spec.folder / "vae")[1] if spec.vae is not None else None
    module, denoiser_cfg, denoiser_params = load_denoiser(spec)
    encoders = tuple(TextEncoder(e.cfg, _on_device(e.params, jnp.float32)) for e in encoders)
    return Pipeline(spec=spec, text_encoders=encoders, tokenizers=tokenizers, denoiser_cfg=denoiser_cfg,
                    denoiser_params=_on_device(denoiser_params, dtype), vae_params=_on_device(vae_params, dtype),
                    dtype=jnp.dtype(dtype), denoise=module.apply)
