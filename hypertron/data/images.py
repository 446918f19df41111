"""Image-caption data for diffusion training: three sources read as Grain datasets of records, and
the processing diffusers' ``train_text_to_image.py`` applies to each image.

Sources (``IMAGE_SOURCES``), each listed up front (files, parquet footers, tar members), each image
read when Grain asks for it:

``imagefolder``
    Image files under ``data.paths`` (searched recursively; ``IMAGE_SUFFIXES``), each captioned by
    ``<stem>.txt`` beside it, else by the ``metadata.jsonl`` of its folder (``file_name`` and the
    caption in ``text_field``), as Hugging Face ``datasets``' imagefolder lays them out.
``parquet``
    Rows of ``*.parquet`` files: the image's encoded bytes in ``image_field`` (bytes, or
    ``datasets``' Image struct ``{bytes, path}``) and its caption in ``text_field``.
``webdataset``
    Tar shards (``*.tar``): the members of one key, ``<key>.<image suffix>`` and ``<key>.txt``, are
    one sample.

Records are in file order (rows and members in theirs). Each process reads every
``process_count``-th record from its index on. Processing (:func:`process`): Pillow decodes, the
shorter side is resized to ``resolution`` (bilinear), then a centre (or random) crop of
``resolution`` x ``resolution``, an optional horizontal flip, and channels scaled to [-1, 1]. An
image Pillow cannot decode is skipped and counted (:class:`Skipped`), not fatal. A source with no
image, a missing column or an image without a caption is a :class:`DataError` naming the file.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
import grain
import numpy as np

from hypertron.errors import DataError

IMAGE_SOURCES = ("imagefolder", "parquet", "webdataset")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclasses.dataclass(frozen=True)
class Record:
    """One sample before decoding: where it is (for messages), how to read its bytes, its caption."""

    where: str
    caption: str
    read: Callable[[], bytes]


def _files(paths: Sequence[str], suffixes: tuple[str, ...], what: str) -> list[Path]:
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        elif p.is_file():
            found.append(p)
        else:
            raise DataError(f"data.paths: {p} does not exist")
    if not found:
        raise DataError(f"data.paths: no {what} under {', '.join(map(str, paths))}")
    return found


def _folder_records(paths: Sequence[str], text_field: str) -> list[Record]:
    metadata: dict[Path, dict[str, str]] = {}

    def captions_of(folder: Path) -> dict[str, str]:
        if folder not in metadata:
            table, path = {}, folder / "metadata.jsonl"
            if path.is_file():
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        raise DataError(f"data.paths: line {n} of {path} is not JSON") from None
                    if isinstance(row, dict) and isinstance(row.get(text_field), str) and "file_name" in row:
                        table[str(row["file_name"])] = row[text_field]
            metadata[folder] = table
        return metadata[folder]

    records = []
    for f in _files(paths, IMAGE_SUFFIXES, "image files"):
        sidecar = f.with_suffix(".txt")
        if sidecar.is_file():
            text = sidecar.read_text(encoding="utf-8").strip()
        else:
            text = captions_of(f.parent).get(f.name)
            if text is None:
                raise DataError(f"data.paths: {f} has no caption (no {sidecar.name} beside it, nor a "
                                f"metadata.jsonl row with file_name and {text_field!r})")
        records.append(Record(str(f), text, f.read_bytes))
    return records


def _parquet_records(paths: Sequence[str], image_field: str, text_field: str) -> list[Record]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("data.source: 'parquet' needs pyarrow, which is not installed") from None
    records = []
    for f in _files(paths, (".parquet",), "parquet files"):
        try:
            parquet = pq.ParquetFile(f)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data.paths: cannot read {f} as parquet ({str(e).splitlines()[0]})") from None
        names = parquet.schema_arrow.names
        for field, key in ((image_field, "image_field"), (text_field, "text_field")):
            if field not in names:
                raise DataError(f"data.{key}: {field!r} is not a column of {f} (columns: {', '.join(names)})")
        captions = parquet.read(columns=[text_field]).column(0).to_pylist()
        rows = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
        group_of = np.repeat(np.arange(len(rows)), rows)
        first_of = np.concatenate([[0], np.cumsum(rows)])
        for row, text in enumerate(captions):
            if not isinstance(text, str):
                raise DataError(f"data.text_field: {text_field!r} is null in row {row} of {f}")
            group = int(group_of[row])
            records.append(Record(f"row {row} of {f}", text,
                                  _ParquetCell(str(f), group, row - int(first_of[group]), image_field)))
    return records


@dataclasses.dataclass(frozen=True)
class _ParquetCell:
    """Reads one row's image bytes (its row group's column, not cached)."""

    path: str
    group: int
    row: int
    field: str

    def __call__(self) -> bytes:
        import pyarrow.parquet as pq

        column = pq.ParquetFile(self.path).read_row_group(self.group, columns=[self.field]).column(0)
        value = column[self.row].as_py()
        if isinstance(value, dict):  # datasets' Image feature
            value = value.get("bytes")
        if not isinstance(value, (bytes, bytearray)):
            raise Undecodable(f"row {self.row} of {self.path}: no image bytes")
        return bytes(value)


class _TarMember:
    """Reads one member of a tar shard (one open file per shard and thread)."""

    _local = threading.local()

    def __init__(self, path: str, member: tarfile.TarInfo):
        self.path, self.member = path, member

    def __call__(self) -> bytes:
        shards = self._local.__dict__.setdefault("shards", {})
        if self.path not in shards:
            shards[self.path] = tarfile.open(self.path)
        return shards[self.path].extractfile(self.member).read()


def _webdataset_records(paths: Sequence[str]) -> list[Record]:
    records = []
    for f in _files(paths, (".tar",), "tar shards"):
        try:
            with tarfile.open(f) as shard:
                members = [m for m in shard.getmembers() if m.isfile()]
                samples: dict[str, dict[str, tarfile.TarInfo]] = {}
                for m in members:
                    key, dot, suffix = m.name.rpartition(".")
                    if dot:
                        samples.setdefault(key, {})["." + suffix.lower()] = m
                for key, parts in samples.items():
                    image = next((parts[s] for s in IMAGE_SUFFIXES if s in parts), None)
                    if image is None:
                        continue
                    if ".txt" not in parts:
                        raise DataError(f"data.paths: sample {key!r} of {f} has no .txt caption")
                    text = shard.extractfile(parts[".txt"]).read().decode("utf-8").strip()
                    records.append(Record(f"{key} of {f}", text, _TarMember(str(f), image)))
        except tarfile.TarError as e:
            raise DataError(f"data.paths: cannot read {f} as a tar shard ({e})") from None
    if not records:
        raise DataError(f"data.paths: no image samples in the tar shards under {', '.join(map(str, paths))}")
    return records


def image_records(source: str, paths: Sequence[str], *, image_field: str = "image", text_field: str = "text",
                  process_index: int = 0, process_count: int = 1) -> list[Record]:
    """This process's records of ``source`` (every ``process_count``-th from ``process_index``)."""
    if source == "imagefolder":
        records = _folder_records(paths, text_field)
    elif source == "parquet":
        records = _parquet_records(paths, image_field, text_field)
    elif source == "webdataset":
        records = _webdataset_records(paths)
    else:
        raise DataError(f"data.source: {source!r} is not an image source (one of {', '.join(IMAGE_SOURCES)})")
    return records[process_index::process_count]


class Undecodable(Exception):
    """Bytes Pillow cannot read as an image (or a record without image bytes)."""


def process(data: bytes, resolution: int, *, center_crop: bool = True, flip: bool = False,
            rng: np.random.Generator | None = None) -> np.ndarray:
    """``[resolution, resolution, 3]`` float32 in [-1, 1] from an encoded image (see the module's
    docstring); ``rng`` places a random crop when ``center_crop`` is off. Raises
    :class:`Undecodable` for bytes Pillow cannot read."""
    return processed(data, resolution, center_crop=center_crop, flip=flip, rng=rng)[0]


def processed(data: bytes, resolution: int, *, center_crop: bool = True, flip: bool = False,
              rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`process`'s pixels and the picture's geometry as SDXL's micro-conditioning takes it:
    int32 ``[original height, original width, crop top, crop left]``, the crop's corner in the
    resized picture, its left mirrored (``resolution - left``) when flipped, as diffusers'
    ``train_text_to_image_sdxl.py`` computes ``crop_top_left``."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise Undecodable(str(e)) from None
    image = image.convert("RGB")
    w, h = original = image.size  # torchvision's Resize(resolution): the short side to it, the long in proportion
    size = (resolution, int(resolution * h / w)) if w <= h else (int(resolution * w / h), resolution)
    image = image.resize(size, Image.Resampling.BILINEAR)
    w, h = image.size
    if center_crop:
        top, left = int(round((h - resolution) / 2.0)), int(round((w - resolution) / 2.0))
    else:
        rng = rng or np.random.default_rng()
        top, left = int(rng.integers(0, h - resolution + 1)), int(rng.integers(0, w - resolution + 1))
    x = np.asarray(image.crop((left, top, left + resolution, top + resolution)), np.float32) / 255.0
    if flip:
        x, left = x[:, ::-1], resolution - left
    geometry = np.asarray([original[1], original[0], top, left], np.int32)
    return np.ascontiguousarray(x * 2.0 - 1.0), geometry


class Skipped:
    """How many images could not be decoded (thread-safe; the step metrics' ``data_skipped``)."""

    def __init__(self):
        self._lock, self.count, self.last = threading.Lock(), 0, ""

    def add(self, where: str) -> None:
        with self._lock:
            self.count += 1
            self.last = where


def image_dataset(records: Sequence[Record], resolution: int, *, center_crop: bool = True,
                  random_flip: bool = False, seed: int = 0, skipped: Skipped | None = None) -> grain.MapDataset:
    """A Grain dataset of ``{"pixels", "caption", "index", "geometry"}`` from ``records`` (``index``:
    the record's in ``records``; ``geometry``: :func:`processed`'s), undecodable images dropped and
    counted in ``skipped``. Random crops and flips draw from ``(seed, index)``, so a restored
    iterator repeats them."""
    skipped = skipped if skipped is not None else Skipped()

    def load(index: int):
        record = records[index]
        rng = np.random.default_rng([seed, index])
        try:
            pixels, geometry = processed(record.read(), resolution, center_crop=center_crop,
                                         flip=random_flip and bool(rng.integers(2)), rng=rng)
        except Undecodable:
            skipped.add(record.where)
            return None
        return {"pixels": pixels, "caption": record.caption, "index": index, "geometry": geometry}

    return grain.MapDataset.range(len(records)).map(load).filter(lambda x: x is not None)


__all__ = ["IMAGE_SOURCES", "IMAGE_SUFFIXES", "Record", "Skipped", "Undecodable", "image_dataset", "image_records",
           "process", "processed"]
