"""Image-caption data (hypertron.data.images): the same images written as an imagefolder (sidecar
captions, and metadata.jsonl), a parquet file and a webdataset tar shard give the same processed
batches; the processing is train_text_to_image.py's (torchvision's Resize, CenterCrop, Normalize,
worked by hand); two processes read disjoint halves; an undecodable image is counted, not
fatal; a bad source is one line naming its file."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from hypertron.data import images as I
from hypertron.errors import DataError

CAPTIONS = ["a red circle", "a blue square", "a green circle", "a red square", "a blue circle"]


def _png(i: int) -> bytes:
    rng = np.random.default_rng(i)
    pixels = rng.integers(0, 256, (12 + 2 * i, 16, 3), np.uint8)  # not square: resize, then crop
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("images")
    folder, meta = base / "folder", base / "meta"
    folder.mkdir(), meta.mkdir()
    rows = []
    with tarfile.open(base / "shard-0.tar", "w") as shard:
        for i, text in enumerate(CAPTIONS):
            data = _png(i)
            (folder / f"{i:03d}.png").write_bytes(data)
            (folder / f"{i:03d}.txt").write_text(text + "\n")
            (meta / f"{i:03d}.png").write_bytes(data)
            rows.append({"file_name": f"{i:03d}.png", "text": text})
            for name, payload in ((f"{i:03d}.png", data), (f"{i:03d}.txt", text.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                shard.addfile(info, io.BytesIO(payload))
    (meta / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [{"bytes": _png(i), "path": None} for i in range(len(CAPTIONS))],
                             "text": CAPTIONS}), base / "data.parquet", row_group_size=2)
    return {"imagefolder": [str(folder)], "metadata": [str(meta)], "parquet": [str(base / "data.parquet")],
            "webdataset": [str(base / "shard-0.tar")], "base": base}


def _all(source, paths, **kw):
    ds = I.image_dataset(I.image_records(source, paths), 8, **kw)
    return [x for x in ds.to_iter_dataset()]


def test_every_source_gives_the_same_samples(sources):
    want = _all("imagefolder", sources["imagefolder"])
    assert [x["caption"] for x in want] == CAPTIONS
    assert want[0]["pixels"].shape == (8, 8, 3) and want[0]["pixels"].dtype == np.float32
    for source, paths in (("imagefolder", sources["metadata"]), ("parquet", sources["parquet"]),
                          ("webdataset", sources["webdataset"])):
        got = _all(source, paths)
        assert [x["caption"] for x in got] == CAPTIONS, source
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a["pixels"], b["pixels"])


def test_processing_is_train_text_to_images():
    """torchvision's Resize(8, bilinear) + CenterCrop(8) + ToTensor + Normalize(0.5, 0.5), worked by
    hand for a 16 x 12 picture: the short side to 8 (10 x 8, the long side int(8 * 16 / 12)), the
    crop's left round((10 - 8) / 2) = 1, then x / 255 * 2 - 1 (torchvision is not installed here)."""
    image = Image.open(io.BytesIO(_png(0))).convert("RGB")
    assert image.size == (16, 12)
    resized = np.asarray(image.resize((10, 8), Image.Resampling.BILINEAR), np.float32)
    want = resized[0:8, 1:9] / 255.0 * 2.0 - 1.0
    np.testing.assert_allclose(I.process(_png(0), 8), want, atol=1e-6)
    tall = I.process(_png(4), 8)  # 16 x 20: 8 x 10, the crop's top 1
    assert tall.shape == (8, 8, 3)
    np.testing.assert_array_equal(I.process(_png(0), 8, flip=True), I.process(_png(0), 8)[:, ::-1])
    crop = I.process(_png(4), 8, center_crop=False, rng=np.random.default_rng(0))
    assert crop.shape == (8, 8, 3) and crop.min() >= -1 and crop.max() <= 1
    # SDXL's micro-conditioning as train_text_to_image_sdxl.py computes it: the original 12 x 16, the
    # crop's corner (0, 1) in the resized 8 x 10; flipped, its left mirrored: 8 - 1
    np.testing.assert_array_equal(I.processed(_png(0), 8)[1], [12, 16, 0, 1])
    np.testing.assert_array_equal(I.processed(_png(0), 8, flip=True)[1], [12, 16, 0, 7])
    np.testing.assert_array_equal(I.processed(_png(4), 8)[1], [20, 16, 1, 0])


def test_two_processes_read_disjoint_halves_and_random_crops_repeat(sources):
    halves = [I.image_records("webdataset", sources["webdataset"], process_index=i, process_count=2) for i in (0, 1)]
    assert [r.caption for r in halves[0]] == CAPTIONS[0::2] and [r.caption for r in halves[1]] == CAPTIONS[1::2]
    records = I.image_records("imagefolder", sources["imagefolder"])
    a, b = (list(I.image_dataset(records, 8, center_crop=False, random_flip=True, seed=3).to_iter_dataset())
            for _ in range(2))
    assert all(np.array_equal(x["pixels"], y["pixels"]) for x, y in zip(a, b))


def test_an_undecodable_image_is_skipped_and_counted(sources, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.png").write_bytes(_png(i) if i != 1 else b"not an image")
        (folder / f"{i}.txt").write_text(CAPTIONS[i])
    skipped = I.Skipped()
    got = list(I.image_dataset(I.image_records("imagefolder", [str(folder)]), 8, skipped=skipped).to_iter_dataset())
    assert [x["caption"] for x in got] == [CAPTIONS[0], CAPTIONS[2]]
    assert skipped.count == 1 and skipped.last.endswith("1.png")


def test_bad_sources_are_one_line_naming_the_file(sources, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty"
    empty.mkdir()
    uncaptioned = tmp_path / "uncaptioned"
    uncaptioned.mkdir()
    (uncaptioned / "a.png").write_bytes(_png(0))
    pq.write_table(pa.table({"img": [_png(0)], "text": ["x"]}), tmp_path / "cols.parquet")
    with tarfile.open(tmp_path / "nocap.tar", "w") as shard:
        info = tarfile.TarInfo("k.png")
        info.size = len(_png(0))
        shard.addfile(info, io.BytesIO(_png(0)))
    for source, paths, words in [
        ("imagefolder", [str(empty)], "data.paths: no image files under"),
        ("imagefolder", [str(tmp_path / "nowhere")], "does not exist"),
        ("imagefolder", [str(uncaptioned)], "a.png has no caption (no a.txt beside it"),
        ("parquet", [str(tmp_path / "cols.parquet")], "data.image_field: 'image' is not a column of"),
        ("webdataset", [str(tmp_path / "nocap.tar")], "sample 'k' of"),
        ("pictures", [str(empty)], "data.source: 'pictures' is not an image source"),
    ]:
        with pytest.raises(DataError) as e:
            I.image_records(source, paths)
        assert words in str(e.value) and "\n" not in str(e.value), (source, str(e.value))
