"""``task: diffusion`` (issue 44): the :class:`hypertron.train.task.Task` that trains a diffusion
model's denoiser on the shared loop, with the trainer of :mod:`hypertron.train.diffusion`.

It trains the denoiser of ``diffusion.model``: a diffusers folder (SD 1.x / 2.x, SDXL, Flux), or a
preset trained from scratch (``shapes-unet``: :mod:`hypertron.diffusion.folders`, written to
``RUN/preset`` at the run's start). The data: the shapes source, or image files (:mod:`hypertron.data.images`), or with
``diffusion.cache_dir`` their cached encodings (:mod:`hypertron.train.diffusion_cache`). The
evaluation takes the held-out loss at ``diffusion.eval_timesteps`` fixed timesteps with fixed
noise; ``finish`` writes ``RUN/model``: the base folder with the trained (or EMA) denoiser in
place of its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hypertron.config import Config, ConfigError
from hypertron.diffusion import objectives as O
from hypertron.diffusion import lora as DL
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.pipeline import (FLUX, PIXEL, SD, SDXL, PipelineSpec, declare_denoiser,
                                         denoiser_config, load_denoiser, read_pipeline)
from hypertron.models import lora as L
from hypertron.models import params as param_lib
from hypertron.parallel.mesh import make_mesh
from hypertron.parallel.rules import DEFAULT_RULES, mesh_axes, spec_for
from hypertron.train import diffusion_cache as C
from hypertron.train.diffusion import EVAL_SEED, IDS, DiffusionTrainer, lora_of, make_diffusion_trainer, token_layout
from hypertron.train.metrics import Throughput

TRAINABLE = (SD, SDXL, FLUX, PIXEL)  # the pipeline classes whose denoiser the task trains so far
PRESET_DIR = "preset"  # RUN/preset: a preset's folder, written at the run's start


def base_folder(cfg: Config) -> Path:
    """Where ``diffusion.model``'s folder is: itself, or for a preset ``RUN/preset``."""
    from hypertron.diffusion.folders import PRESETS

    return Path(cfg.run_dir) / PRESET_DIR if cfg.diffusion.model in PRESETS else Path(cfg.diffusion.model)


def base_spec(cfg: Config) -> PipelineSpec:
    """``diffusion.model``'s configs, no weights read: a preset's from memory, a folder's from it."""
    from hypertron.diffusion.folders import PRESETS, preset_spec

    name = cfg.diffusion.model
    if name in PRESETS:
        return preset_spec(name)
    if not Path(name).is_dir():
        raise DiffusionError(f"diffusion.model={name}: neither a diffusers folder nor a preset "
                             f"({', '.join(PRESETS)})")
    return read_pipeline(name)


def objective_of(cfg: Config, spec: PipelineSpec) -> str:
    """``diffusion.objective``; ``auto``: flow for a flow-matching scheduler, else its ``prediction_type``."""
    if cfg.diffusion.objective != "auto":
        return cfg.diffusion.objective
    return "flow" if spec.scheduler.class_name == "FlowMatchEulerDiscreteScheduler" else spec.scheduler.prediction_type


def resolution_of(cfg: Config, spec: PipelineSpec) -> int:
    """``data.resolution`` (0: the model's default side), checked against what the model takes."""
    from hypertron.diffusion import shapes

    side = cfg.data.resolution or spec.default_size()
    if cfg.data.source == "shapes" and side != shapes.SIZE:
        raise ConfigError(f"data.resolution={side}: the shapes source draws {shapes.SIZE} x {shapes.SIZE} pictures")
    multiple = spec.vae_scale_factor * getattr(denoiser_config(spec), "size_multiple", spec.kind.size_multiple)
    if side % multiple:
        raise ConfigError(f"data.resolution={side}: {spec.class_name} at {spec.folder} takes sides that are "
                          f"multiples of {multiple}")
    return side


def training_shift(cfg: Config, spec: PipelineSpec, side: int) -> float | None:
    """The flow objective's shift: ``diffusion.shift``, or with ``diffusion.dynamic_shift`` Flux's
    ``exp(mu)`` of the denoiser's tokens at ``side`` x ``side`` pixels (latent pixels, Flux's packed
    2 x 2); None: the scheduler's own."""
    from hypertron.diffusion.schedulers import dynamic_shift

    f = cfg.diffusion
    if not f.dynamic_shift:
        return f.shift or None
    tokens = (side // spec.vae_scale_factor // (2 if spec.class_name == FLUX else 1)) ** 2
    return dynamic_shift(spec.scheduler, tokens)


def check_diffusion(cfg: Config) -> tuple[PipelineSpec, str, int]:
    """What needs the model's configs, before anything is compiled or written: the class, the
    objective and weighting against its scheduler, the resolution. ``(spec, objective, side)``."""
    from hypertron.diffusion.folders import PRESETS

    f = cfg.diffusion
    spec = base_spec(cfg)
    if spec.class_name not in TRAINABLE:
        raise DiffusionError(f"diffusion.model={f.model}: training a {spec.class_name} is not built yet "
                             f"({', '.join(TRAINABLE)} are)")
    objective = objective_of(cfg, spec)
    O.check_objective(objective, spec.scheduler)
    O.check_weighting(f.weighting, objective)
    if (f.shift or f.dynamic_shift) and objective != "flow":
        raise ConfigError(f"diffusion.shift={f.shift}, diffusion.dynamic_shift={f.dynamic_shift}: a shift applies to "
                          f"the flow objective only, not {objective}")
    if f.shift and f.dynamic_shift:
        raise ConfigError(f"diffusion.shift={f.shift} and diffusion.dynamic_shift: one shift or the other")
    if f.cache_dir and f.model in PRESETS:
        raise ConfigError(f"diffusion.cache_dir: caches a diffusers folder's encoders, and {f.model} is a preset "
                          f"(its encoders are made at the run's start)")
    if cfg.lora.rank:  # targets the denoiser has
        L.targets(declare_denoiser(spec, denoiser_config(spec)), lora_of(cfg).targets)
    return spec, objective, resolution_of(cfg, spec)


class DiffusionTask:
    """``task: diffusion``: the :class:`hypertron.train.task.Task` of a denoiser (see the module's docstring)."""

    def __init__(self):
        self._checked: tuple[PipelineSpec, str, int] | None = None
        self._flops: float = 0.0
        self._written = False  # the preset's folder, once per run
        self._skipped = None  # the training reader's count of undecodable images (data.images.Skipped)
        self._records: list | None = None  # the image source's samples, listed once
        self._cached: tuple | None = None  # (Cached, cache.json) with diffusion.cache_dir

    def _check(self, cfg: Config) -> tuple[PipelineSpec, str, int]:
        if self._checked is None:
            self._checked = check_diffusion(cfg)
        return self._checked

    def check_inputs(self, cfg: Config) -> None:
        self._check(cfg)
        if cfg.data.source != "shapes":  # every record listed and checked (before the backend starts)
            self._all_records(cfg)
            if cfg.diffusion.cache_dir:  # a stale cache refused before anything is compiled or written
                self._cache(cfg)

    def mesh(self, cfg: Config, devices: list) -> Mesh:
        mesh = make_mesh(cfg.mesh, devices)
        rows = int(np.prod([mesh.shape[a] for a in mesh_axes(spec_for(("batch",), DEFAULT_RULES, mesh)[0])]))
        if cfg.train.global_batch % max(rows, jax.process_count()):
            raise ConfigError(f"train.global_batch={cfg.train.global_batch}: must divide over the {rows} batch "
                              f"shards of mesh {dict(mesh.shape)} and the {jax.process_count()} processes")
        return mesh

    def check_init_from(self, cfg: Config) -> None:
        pass  # validate_diffusion refuses train.init_from: diffusion.model is the start

    def folder(self, cfg: Config) -> Path:
        """The base pipeline folder: ``diffusion.model``, or a preset's in ``RUN/preset``, written
        by process 0 the first time a run asks (the same bytes each time: seeded by ``train.seed``),
        every process waiting for it."""
        from hypertron.diffusion.folders import PRESETS, write_preset

        folder = base_folder(cfg)
        if cfg.diffusion.model in PRESETS and not self._written:
            if jax.process_index() == 0 and not folder.exists():
                write_preset(folder, PRESETS[cfg.diffusion.model], cfg.train.seed)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("hypertron diffusion preset")
            self._written = True
        return folder

    def _all_records(self, cfg: Config) -> list:
        """Every sample of the image source, in its order (each process takes its share, :func:`_mine`);
        listed once a run."""
        from hypertron.data.images import image_records

        if self._records is None:
            d = cfg.data
            self._records = image_records(d.source, d.paths, image_field=d.image_field, text_field=d.text_field)
        return self._records

    def _cache(self, cfg: Config) -> tuple:
        """The run's cached encodings and their ``cache.json`` (:func:`diffusion_cache.check_cache`), checked once."""
        if self._cached is None:
            spec, _, side = self._check(cfg)
            self._cached = C.check_cache(cfg, spec, side, self._all_records(cfg))
        return self._cached

    def batches(self, cfg: Config, split: str = "train") -> Iterator[dict]:
        """This process's batches of ``split``: the shapes source's pictures, image files, or their
        cached encodings (records ``i`` of the cache and of the source are one sample, so a cached
        run's batches are the uncached one's). Undecodable images are dropped and counted."""
        import grain

        from hypertron.diffusion import shapes
        from hypertron.data.images import Skipped, image_dataset

        d, t = cfg.data, cfg.train
        spec, _, side = self._check(cfg)
        folder = self.folder(cfg)
        seed = d.seed + (EVAL_SEED if split == "eval" else 0)
        skipped = Skipped()
        if split == "train" and d.source != "shapes":
            self._skipped = skipped
        if d.source == "shapes":
            ds = shapes.dataset(seed)[jax.process_index()::jax.process_count()]
        else:
            records = self._all_records(cfg)
            mine = _mine(list(range(len(records))), d.eval_fraction, split, jax.process_index(), jax.process_count())
            if cfg.diffusion.cache_dir:
                cached, meta = self._cache(cfg)
                reader = C.Reader(Path(cfg.diffusion.cache_dir), meta)
            if cfg.diffusion.cache_dir and cached.latents:
                def load(j: int):
                    encoded = reader[mine[j]]
                    if "geometry" not in encoded:  # the caption's alone: an image the cache could not decode
                        skipped.add(records[mine[j]].where)
                        return None
                    return encoded

                ds = grain.MapDataset.range(len(mine)).map(load).filter(lambda x: x is not None)
            else:
                ds = image_dataset([records[i] for i in mine], side, center_crop=d.center_crop,
                                   random_flip=d.random_flip, seed=seed, skipped=skipped)
                if cfg.diffusion.cache_dir:
                    ds = ds.map(lambda x: {**x, **reader[mine[x["index"]]]})
            if d.shuffle and split == "train":
                ds = ds.shuffle(seed=seed)
            ds = ds.repeat()
        example = _example_fn(cfg, spec, folder, side)
        per_process = t.global_batch // jax.process_count()
        # to an IterDataset before batching: the image sources' filter (undecodable images) may drop elements
        return iter(ds.map(example).to_iter_dataset().batch(per_process, drop_remainder=True))

    def write_cache(self, cfg: Config, console, *, overwrite: bool = False) -> Path:
        """``hypertron diffusion cache``: every sample's encodings into ``diffusion.cache_dir``."""
        from hypertron.data.images import Undecodable, processed

        if cfg.task != "diffusion" or not cfg.diffusion.cache_dir:
            raise ConfigError("diffusion.cache_dir: set it (and task=diffusion) to say where the cache goes")
        spec, _, side = self._check(cfg)  # (the shapes source with a cache_dir: refused by the config's validation)
        d = cfg.data

        def pixels(record):
            try:
                return processed(record.read(), side, center_crop=d.center_crop)
            except Undecodable:  # kept as such: skipped and counted when read, as the source's would be
                return None

        return C.write_cache(cfg, spec, side, self._all_records(cfg), process=pixels,
                             overwrite=overwrite, console=console)

    def data_fingerprint(self, cfg: Config) -> dict[str, Any]:
        d = cfg.data
        return {"source": d.source, "paths": list(d.paths), "image_field": d.image_field, "text_field": d.text_field,
                "resolution": d.resolution, "center_crop": d.center_crop, "random_flip": d.random_flip,
                "shuffle": d.shuffle, "seed": d.seed, "eval_fraction": d.eval_fraction,
                "global_batch": cfg.train.global_batch, "process_count": jax.process_count(),
                "model": cfg.diffusion.model}

    def trainer(self, cfg: Config, mesh: Mesh) -> DiffusionTrainer:
        spec, objective, side = self._check(cfg)
        cached = self._cache(cfg)[0] if cfg.diffusion.cache_dir else None
        trainer = make_diffusion_trainer(cfg, mesh, self.folder(cfg), objective, cached=cached,
                                         shift=training_shift(cfg, spec, side))
        self._flops = _compile_step(trainer, cfg, side)
        return trainer

    def initial_state(self, cfg: Config, trainer: DiffusionTrainer, console) -> dict:
        console.print(f"training the {trainer.spec.class_name} denoiser of {trainer.folder} "
                      f"({param_lib.count(trainer.specs) / 1e6:.2f}M parameters)", highlight=False)
        _say_cached(cfg, trainer, console)
        return trainer.initial()

    def restored(self, cfg: Config, trainer: DiffusionTrainer, state: dict, console) -> None:
        """The frozen text encoder and VAE are the trainer's (read from the folder); the host's
        count of updates takes the restored step."""
        trainer.updates = int(jax.device_get(state["step"]))
        _say_cached(cfg, trainer, console)

    def step(self, trainer: DiffusionTrainer, state: dict, local: dict) -> tuple[dict, dict]:
        """The trainer's step; with image files, ``data_skipped``: the undecodable images this
        process's reader has met so far (it reads ahead of the step)."""
        state, metrics = trainer.step(state, local)
        return state, metrics if self._skipped is None else {**metrics, "data_skipped": self._skipped.count}

    def evaluate(self, trainer: DiffusionTrainer, state: dict, batches: Iterator[dict], count: int
                 ) -> dict[str, float]:
        """The held-out loss at the fixed timesteps (of the EMA weights with ``diffusion.use_ema``)."""
        params = state["ema"] if "ema" in state else state["params"]
        losses = [trainer.eval_fn(params, trainer.frozen, trainer.batch(next(batches)), np.int32(j))
                  for j in range(count)]
        return {"loss": float(np.mean(jax.device_get(losses))), "images": float(count * trainer.cfg.train.global_batch)}

    def throughput(self, cfg: Config) -> Throughput:
        from hypertron.models.flops import device_peak_flops

        return Throughput(cfg.train.global_batch, self._flops, jax.device_count(),
                          device_peak_flops(cfg.train.peak_flops), unit="images")

    def finish(self, cfg: Config, state: dict, console) -> None:
        """``RUN/model``: the base folder with the trained denoiser (the EMA's with ``use_ema``); with
        ``lora.rank``, the adapters in ``RUN/lora/pytorch_lora_weights.safetensors`` and merged
        into ``RUN/model``'s denoiser."""
        from hypertron.diffusion.folders import write_component

        params = state["ema"] if "ema" in state else state["params"]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            params = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return
        base = base_folder(cfg)  # written already; process 0 alone is here: no waiting for the others
        spec = read_pipeline(base)
        name = spec.kind.denoiser  # unet or transformer
        out = Path(cfg.run_dir) / "model"
        tmp = out.with_name("model.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        denoiser = (base / name).resolve()
        # every component as the base has it, but the denoiser's weights (the VAE's keep theirs)
        shutil.copytree(base, tmp, ignore=lambda d, names: [n for n in names if Path(d).resolve() == denoiser
                                                             and n.startswith("diffusion_pytorch_model")])
        specs = declare_denoiser(spec, denoiser_config(spec))
        settings = lora_of(cfg)
        if settings is not None:  # the adapters in diffusers' file, and merged into the folder's denoiser
            saved = DL.save_lora(Path(cfg.run_dir) / "lora", params, settings, specs,
                                 DL.COMPONENTS[spec.kind.denoiser_class])
            console.print(f"wrote the LoRA file {saved}", highlight=False)
            params = L.merge(load_denoiser(spec)[2], params, settings)
        write_component(tmp / name, spec.denoiser_config, specs, params)
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
        console.print(f"wrote the diffusers folder {out}" + (" (the EMA weights)" if "ema" in state else ""),
                      highlight=False)


def _mine(items: Sequence, eval_fraction: float, split: str, process_index: int, process_count: int) -> list:
    """This process's share of a source's samples (every ``process_count``-th from its index), the last
    ``eval_fraction`` of it held out as ``eval``."""
    share = list(items)[process_index::process_count]
    held = int(len(share) * eval_fraction)
    return share[len(share) - held:] if split == "eval" else share[:len(share) - held]


def _example_fn(cfg: Config, spec: PipelineSpec, folder: Path, side: int):
    """What one example of a batch holds, from a dataset element: cached encodings (``context``,
    ``pooled``, ``mean``, ``logvar``, ``pixels``) as they are, or the pixels and each tokenizer's
    ids of the caption; for SDXL its ``time_ids`` (original size, crop corner, target size, as
    ``train_text_to_image_sdxl.py``'s ``add_time_ids``)."""
    from hypertron.diffusion.text_encoders import prompt_ids
    from hypertron.tokenizer import get_tokenizer

    sdxl = spec.class_name == SDXL
    if cfg.diffusion.cache_dir:
        keys = ("context", "pooled", "mean", "logvar", "pixels")
        text = lambda x: {k: np.asarray(x[k], np.float32) for k in keys if k in x}  # noqa: E731
    else:
        _, lengths, bos = token_layout(folder, spec, cfg.diffusion.max_sequence_length)
        tokenizers = [(key, get_tokenizer(str(folder / name)), n, b)
                      for key, name, n, b in zip(IDS, spec.kind.tokenizers, lengths, bos)]
        text = lambda x: {"pixels": np.asarray(x["pixels"], np.float32),  # noqa: E731
                          **{k: prompt_ids(tok, [x["caption"]], n, bos=b)[0] for k, tok, n, b in tokenizers}}
    if not sdxl:
        return text
    return lambda x: {**text(x), "time_ids": np.asarray([*x["geometry"], side, side], np.float32)}


def _say_cached(cfg: Config, trainer: DiffusionTrainer, console) -> None:
    """With cached encodings, the line saying what the run did not load (the memory it saved)."""
    if trainer.cached is None:
        return
    unloaded = C.unloaded_bytes(trainer.spec, trainer.cached)
    console.print(f"reading cached encodings from {cfg.diffusion.cache_dir}: not loaded "
                  + ", ".join(f"the {name.replace('_', ' ')} ({size / 2**20:.1f} MiB)" for name, size in unloaded.items()),
                  highlight=False)


def _compile_step(trainer: DiffusionTrainer, cfg: Config, side: int) -> float:
    """Compile the trainer's step (its lowering is the one the step then runs: the step is traced
    once, not once for its FLOPs and again for its first call) and give its FLOPs, from XLA's cost
    analysis of the lowered step (the denoiser's forward and backward and the frozen encoders'
    forwards), 0 where the backend gives none."""
    state, b = trainer.abstract_state(), cfg.train.global_batch
    batch = {k: jax.ShapeDtypeStruct((b, *shape), jnp.int32 if k in IDS else jnp.float32,
                                     sharding=trainer.batch_shardings[k])
             for k, shape in trainer.example_shapes(side).items()}
    lowered = trainer.step_fn.lower(state, trainer.frozen, batch, np.float32(0))
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no FLOPs, no MFU
        cost = None
    trainer.step_fn = lowered.compile()
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", 0.0))
