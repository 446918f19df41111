"""The shapes demo's pictures and judge (hypertron.diffusion.shapes): on clean renders of every
colour, shape, size and place the judge reads the caption back; a circle fills at most 0.22 of the
corner triangles and a square all of them; black reads as nothing; bad pictures are refused."""

from __future__ import annotations

import numpy as np
import pytest

from hypertron.diffusion import shapes as S


def test_the_judge_reads_every_clean_render_back():
    rng = np.random.default_rng(0)
    fills = {"circle": [], "square": []}
    for _ in range(300):
        image, text = S.sample(rng)
        assert image.shape == (32, 32, 3) and image.dtype == np.float32 and text.startswith("a ")
        verdict = S.judge(image)
        assert verdict.matches(text) == (True, True), (text, verdict)
        fills[verdict.shape].append(verdict.corners)
        assert S.judge((image * 255).astype(np.uint8)) == verdict  # what a pipeline writes
    assert max(fills["circle"]) <= 0.22 and min(fills["square"]) == 1.0
    assert len(fills["circle"]) > 100 and len(fills["square"]) > 100


@pytest.mark.parametrize("side", [S.MIN_SIDE, 15, S.MAX_SIDE])
def test_each_colour_and_shape_at_the_edges_of_the_sizes(side):
    for colour in S.COLOURS:
        for shape in S.SHAPES:
            for top, left in ((0, 0), (32 - side, 32 - side)):
                verdict = S.judge(S.render(colour, shape, top, left, side))
                assert (verdict.colour, verdict.shape) == (colour, shape)


def test_a_black_picture_reads_as_nothing_and_bad_pictures_are_refused():
    blank = S.judge(np.zeros((32, 32, 3), np.float32))
    assert blank.colour is None and blank.matches("a red circle") == (False, False)
    with pytest.raises(ValueError, match="no such picture: 'a purple circle'"):
        S.render("purple", "circle", 0, 0, 10)
    with pytest.raises(ValueError, match="does not fit 32 x 32"):
        S.render("red", "square", 20, 0, 16)


def test_the_shapes_source_is_endless_repeatable_and_in_the_data_range():
    ds = S.dataset(seed=5)
    first = [ds[i] for i in range(6)]
    assert [x["caption"] for x in first] == [S.dataset(seed=5)[i]["caption"] for i in range(6)]
    assert all(np.array_equal(a["pixels"], S.dataset(seed=5)[i]["pixels"]) for i, a in enumerate(first))
    assert [x["caption"] for x in first] != [S.dataset(seed=6)[i]["caption"] for i in range(6)]
    pixels = first[0]["pixels"]
    assert pixels.min() == -1.0 and pixels.max() == 1.0 and len(ds) > 10**12
    verdict = S.judge((pixels + 1) / 2)
    assert verdict.matches(first[0]["caption"]) == (True, True)
