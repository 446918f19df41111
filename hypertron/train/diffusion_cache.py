"""Cached encodings for ``task: diffusion`` (issue 44): every caption's prompt embeddings, and with
``diffusion.cache_latents`` every image's VAE posterior (its ``mean`` and ``logvar``; a pixel
model's processed pixels), encoded once by ``hypertron diffusion cache RECIPE`` into ArrayRecord
shards in ``diffusion.cache_dir``. A run with ``diffusion.cache_dir`` reads them in place of
encoding each batch: it never loads the text encoder, nor with cached latents the VAE, and it draws
the same caption dropout (the empty caption's embeddings, cached too), latent samples, noise and
timesteps, so its losses are the uncached run's.

The folder: ``cache.json`` (the fingerprint, the sample count, the shards), ``empty.npz`` and
``encodings-IIIII-of-NNNNN.array_record``, record ``i`` the ``i``-th sample of the source in its
order (every process reads its share as it would read the source). A record is an ``.npz`` of
``context`` (and SDXL's ``pooled``) and, with latents, ``mean`` and ``logvar`` or ``pixels``, and
the picture's ``geometry`` (SDXL's micro-conditioning, :func:`hypertron.data.images.processed`);
an image that could not be decoded is a record without them, skipped and counted when read, as
the source's would be.

The fingerprint (:func:`fingerprint`) covers the text encoders' and tokenizers' files, with
latents the VAE's, the resolution and crop, and the source (its kind, fields and every sample's
place and caption). Each file's digest is kept with its size and time, so a run whose encoders
did not change checks them without reading them; a cache whose fingerprint is not the run's is
refused in one line naming what changed.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.pipeline import read_config
from hypertron.train.diffusion import Cached, frozen_encoders

VERSION = 1
CACHE_FILE = "cache.json"
EMPTY_FILE = "empty.npz"  # the empty caption's embeddings (context, and SDXL's pooled)
PER_SHARD = 4096  # records a shard
TEXT_CHUNK, IMAGE_CHUNK = 64, 16  # captions, images encoded a call
# what a fingerprint's keys are, in a stale cache's message (its components': "the NAME's files")
WHAT = {"version": "the cache format", "latents": "diffusion.cache_latents", "resolution": "data.resolution",
        "center_crop": "data.center_crop", "source": "data.source", "fields": "data.image_field / data.text_field",
        "samples": "the samples (their files or captions)"}


def shard_name(i: int, n: int) -> str:
    return f"encodings-{i:05d}-of-{n:05d}.array_record"


def _stat(folder: Path) -> list:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return [[str(f.relative_to(folder)), st.st_size, st.st_mtime_ns] for f in files for st in [f.stat()]]


def _files_digest(folder: Path, known: dict | None) -> dict:
    """``{"stat", "sha256"}`` of every file under ``folder`` (names and contents); the digest in
    ``known`` is taken while the files' names, sizes and times are its."""
    stat = _stat(folder)
    if isinstance(known, dict) and known.get("stat") == stat:
        return known
    digest = hashlib.sha256()
    for name, _, _ in stat:
        digest.update(name.encode())
        with open(folder / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return {"stat": stat, "sha256": digest.hexdigest()}


def fingerprint(cfg, spec, side: int, records: Sequence, known: dict | None = None) -> dict:
    """What a cache's encodings depend on (see the module's docstring). ``spec``: the pipeline's
    (its text encoders and tokenizers, and with latents its VAE); ``records``: every sample of the
    source (``data.images.Record``s); ``known``: a cache's ``files`` (digests by stat)."""
    d, latents, known = cfg.data, cfg.diffusion.cache_latents, known or {}
    names = [*spec.kind.text_encoders, *spec.kind.tokenizers] + (["vae"] if latents and spec.vae is not None else [])
    files = {name: _files_digest(Path(spec.folder) / name, known.get(name)) for name in names}
    samples = hashlib.sha256()
    for r in records:
        samples.update(json.dumps([r.where, r.caption]).encode())
    return {"version": VERSION, "components": {k: v["sha256"] for k, v in files.items()}, "latents": latents,
            "resolution": side if latents else None, "center_crop": d.center_crop if latents else None,
            "source": d.source, "fields": [d.image_field, d.text_field], "samples": samples.hexdigest(),
            "files": files}


def _stale(want: dict, have: dict) -> str | None:
    """What differs between two fingerprints, in words; None if nothing does."""
    if want["version"] != have.get("version"):
        return WHAT["version"]
    theirs = have.get("components") or {}
    for name, digest in want["components"].items():
        if theirs.get(name) != digest:
            return f"the {name.replace('_', ' ')}'s files"
    for key in WHAT:
        if want.get(key) != have.get(key):
            return WHAT[key]
    return None


def check_cache(cfg, spec, side: int, records: Sequence) -> tuple[Cached, dict]:
    """The cache in ``diffusion.cache_dir`` for this run, and its ``cache.json``: a
    :class:`DiffusionError` naming the folder if there is none or it was made for other encoders,
    settings or samples."""
    where = Path(cfg.diffusion.cache_dir)
    if not (where / CACHE_FILE).is_file():
        raise DiffusionError(f"diffusion.cache_dir={where}: no cache there (write it with: hypertron diffusion "
                             f"cache RECIPE ...)")
    meta = read_config(where / CACHE_FILE)
    changed = _stale(fingerprint(cfg, spec, side, records, meta.get("fingerprint", {}).get("files")),
                     meta.get("fingerprint", {}))
    if changed is not None:
        raise DiffusionError(f"diffusion.cache_dir={where}: stale, {changed} changed since it was written "
                             f"(write it again: hypertron diffusion cache RECIPE ... --overwrite)")
    if meta.get("records") != len(records):
        raise DiffusionError(f"diffusion.cache_dir={where}: holds {meta.get('records')} samples, the source "
                             f"{len(records)}")
    with np.load(where / EMPTY_FILE, allow_pickle=False) as empty:
        return Cached({k: empty[k] for k in empty.files}, bool(meta["fingerprint"]["latents"])), meta


def _npz(**arrays) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


class Reader:
    """Random access to a cache's records (thread-safe, as Grain's ArrayRecord source)."""

    def __init__(self, where: Path, meta: dict):
        import grain

        self._source = grain.sources.ArrayRecordDataSource([str(where / name) for name in meta["shards"]])

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        with np.load(io.BytesIO(self._source[i]), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}


def write_cache(cfg, spec, side: int, records: Sequence, *, process: Callable[[Any], tuple | None],
                overwrite: bool, console) -> Path:
    """Encode every sample of ``records`` into ``diffusion.cache_dir`` (see the module's docstring):
    the captions by the pipeline's text encoders, with latents the images (``process``: a record's
    pixels and geometry, None if undecodable) by its VAE. Written to a temporary folder and renamed;
    an existing cache is replaced only with ``overwrite``, a folder holding anything else never."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from hypertron.diffusion.text_encoders import prompt_ids
    from hypertron.tokenizer import get_tokenizer

    where = Path(cfg.diffusion.cache_dir)
    if where.exists() and any(where.iterdir()):
        if not (where / CACHE_FILE).is_file():
            raise DiffusionError(f"diffusion.cache_dir={where}: not empty and not a cache; nothing written")
        if not overwrite:
            raise DiffusionError(f"diffusion.cache_dir={where}: holds a cache already (--overwrite replaces it)")
    latents = cfg.diffusion.cache_latents
    frozen, cond = frozen_encoders(Path(spec.folder), spec, None, cfg.diffusion.max_sequence_length)
    if not latents:
        frozen.pop("vae", None)
    encode_text = jax.jit(lambda f, ids: cond.text(f, ids))
    encode_image = jax.jit(lambda f, pixels: cond.moments(f, pixels))

    def chunked(fn, rows, size: int, pad):
        """``fn`` over ``rows`` (a tuple of arrays) in calls of ``size`` rows, the last padded with ``pad``."""
        out = []
        for i in range(0, len(rows[0]), size):
            chunk = [r[i:i + size] for r in rows]
            n = len(chunk[0])
            padded = tuple(np.concatenate([c, np.repeat(p[None], size - n, 0)]) for c, p in zip(chunk, pad))
            out.append(jax.tree.map(lambda a: np.asarray(a)[:n], fn(frozen, tuple(map(jnp.asarray, padded)))))
        return jax.tree.map(lambda *parts: np.concatenate(parts), *out)

    tokenizers = [get_tokenizer(str(Path(spec.folder) / name)) for name in spec.kind.tokenizers]
    empty = jax.tree.map(lambda a: np.asarray(a)[0], encode_text(frozen, tuple(jnp.asarray(e)[None]
                                                                          for e in cond.empty_ids)))
    tmp = where.with_name(where.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.savez(tmp / EMPTY_FILE, **empty)
    count = -(-len(records) // PER_SHARD)
    shards = [shard_name(i, count) for i in range(count)]
    skipped, writer = 0, None
    # images decoded on threads (Pillow lets go of the GIL while it decodes and resizes)
    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)))
    # TEXT_CHUNK samples at a time, each written at once: the encodings are never all in memory
    # (Flux's T5 states are 8 MB a caption in float32)
    for first in range(0, len(records), TEXT_CHUNK):
        part = records[first:first + TEXT_CHUNK]
        ids = tuple(prompt_ids(t, [r.caption for r in part], n, bos=b)
                    for t, n, b in zip(tokenizers, cond.lengths, cond.bos))
        texts = chunked(encode_text, ids, TEXT_CHUNK, cond.empty_ids)
        images: dict[int, dict] = {}
        if latents:
            done = list(pool.map(process, part))
            good = [j for j, x in enumerate(done) if x is not None]
            skipped += len(part) - len(good)
            images = {j: {"pixels": done[j][0], "geometry": done[j][1]} for j in good}
            if good and "vae" in frozen:
                stacked = np.stack([done[j][0] for j in good])
                mean, logvar = chunked(lambda f, x: encode_image(f, x[0]), (stacked,), IMAGE_CHUNK, (stacked[0],))
                images = {j: {"mean": mean[k], "logvar": logvar[k], "geometry": done[j][1]} for k, j in enumerate(good)}
        for j in range(len(part)):
            if (first + j) % PER_SHARD == 0:
                if writer is not None:
                    writer.close()
                writer = ArrayRecordWriter(str(tmp / shards[(first + j) // PER_SHARD]), "group_size:1")
            writer.write(_npz(**{k: v[j] for k, v in texts.items()}, **images.get(j, {})))
    writer.close()
    pool.shutdown()
    meta = {"fingerprint": fingerprint(cfg, spec, side, records), "records": len(records), "shards": shards,
            "skipped": skipped}
    (tmp / CACHE_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if where.exists():
        shutil.rmtree(where)
    tmp.replace(where)
    console.print(f"wrote {len(records)} samples' encodings to {where}"
                  + (f" ({skipped} undecodable images among them)" if skipped else ""), highlight=False)
    return where


def unloaded_bytes(spec, cached: Cached) -> dict[str, int]:
    """The bytes of the frozen components a cached run does not load, by name (their weight files)."""
    names = [*spec.kind.text_encoders] + (["vae"] if cached.latents and spec.vae is not None else [])
    return {name: sum(p.stat().st_size for p in (Path(spec.folder) / name).glob("*.safetensors")) for name in names}


__all__ = ["CACHE_FILE", "Reader", "check_cache", "fingerprint", "unloaded_bytes", "write_cache"]
