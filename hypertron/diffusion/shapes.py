"""The CPU demo's world: 32 x 32 images of one red, green or blue circle or square on black, drawn
with numpy and captioned ("a red circle"), and a judge that reads a picture's colour and shape back
from its pixels, so a model trained on them can be scored without anyone looking.

The judge: the foreground is every pixel whose largest channel is over 0.5; the colour is the channel
with the highest mean over the foreground; the shape is a square when more than half of the four
corner triangles of the foreground's bounding box (legs 30 % of its sides) is foreground, else a
circle. On clean renders a circle fills at most 0.22 of those triangles and a square all of them
(tests/test_diffusion_shapes.py).
"""

from __future__ import annotations

import dataclasses
import sys

import grain
import numpy as np

COLOURS = ("red", "green", "blue")  # channel 0, 1, 2
SHAPES = ("circle", "square")
SIZE = 32
MIN_SIDE, MAX_SIDE = 10, 22  # a square's side, a circle's diameter, in pixels
CORNER_LEG = 0.3  # of the bounding box's side
SQUARE_ABOVE = 0.5  # of the corner triangles foreground: a square


def caption(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def render(colour: str, shape: str, top: int, left: int, side: int, size: int = SIZE) -> np.ndarray:
    """One picture ``[size, size, 3]`` float32 in [0, 1]: the shape in ``colour`` filling the box of
    ``side`` pixels from (``top``, ``left``), black elsewhere."""
    if colour not in COLOURS or shape not in SHAPES:
        raise ValueError(f"no such picture: {caption(colour, shape)!r}")
    if not (0 <= top and 0 <= left and top + side <= size and left + side <= size and side > 0):
        raise ValueError(f"a box of {side} at ({top}, {left}) does not fit {size} x {size}")
    rows, cols = np.mgrid[:size, :size] + 0.5  # pixel centres
    inside = (rows >= top) & (rows < top + side) & (cols >= left) & (cols < left + side)
    if shape == "circle":
        r = side / 2
        inside &= (rows - top - r) ** 2 + (cols - left - r) ** 2 <= r * r
    image = np.zeros((size, size, 3), np.float32)
    image[inside, COLOURS.index(colour)] = 1.0
    return image


def sample(rng: np.random.Generator, size: int = SIZE) -> tuple[np.ndarray, str]:
    """A random picture and its caption: colour, shape, side and position uniform."""
    colour, shape = COLOURS[rng.integers(len(COLOURS))], SHAPES[rng.integers(len(SHAPES))]
    side = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
    top, left = (int(rng.integers(0, size - side + 1)) for _ in range(2))
    return render(colour, shape, top, left, side, size), caption(colour, shape)


def dataset(seed: int = 0, size: int = SIZE) -> grain.MapDataset:
    """The ``shapes`` data source: an endless Grain dataset of ``{"pixels", "caption"}``, picture
    ``i`` drawn from ``(seed, i)`` (so a restored iterator repeats it), pixels scaled to [-1, 1]
    as :mod:`hypertron.data.images` gives them."""
    def picture(i: int) -> dict:
        image, text = sample(np.random.default_rng([seed, i]), size)
        return {"pixels": image * 2.0 - 1.0, "caption": text}

    return grain.MapDataset.range(sys.maxsize).map(picture)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the judge read: ``colour`` and ``shape`` (None with no foreground), and the share of
    the corner triangles that is foreground."""

    colour: str | None
    shape: str | None
    corners: float

    def matches(self, text: str) -> tuple[bool, bool]:
        """``(colour right, shape right)`` against a caption such as "a blue square"."""
        words = text.split()
        return self.colour in words, self.shape in words


def judge(image: np.ndarray) -> Verdict:
    """Read a picture ``[h, w, 3]`` (float in [0, 1], or uint8) back (see the module's docstring)."""
    x = np.asarray(image)
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    fg = x.max(axis=-1) > 0.5
    if not fg.any():
        return Verdict(None, None, 0.0)
    colour = COLOURS[int(np.argmax(x[fg].mean(axis=0)))]
    rows, cols = np.nonzero(fg)
    r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    box = fg[r0:r1, c0:c1]
    h, w = box.shape
    dr, dc = np.mgrid[:h, :w] + 0.5
    leg_r, leg_c = CORNER_LEG * h, CORNER_LEG * w
    corners = np.zeros_like(box)
    for near_r in (dr, h - dr):
        for near_c in (dc, w - dc):
            corners |= near_r / leg_r + near_c / leg_c <= 1
    share = float(box[corners].mean()) if corners.any() else 0.0
    return Verdict(colour, "square" if share > SQUARE_ABOVE else "circle", share)


def prompts() -> list[str]:
    """Every caption the source draws, one per colour and shape."""
    return [caption(c, s) for c in COLOURS for s in SHAPES]


@dataclasses.dataclass(frozen=True)
class Score:
    """How many of ``total`` samples the judge found in their prompt's colour and shape."""

    colour: int
    shape: int
    total: int

    def __str__(self) -> str:
        return f"colour_right={self.colour}/{self.total} shape_right={self.shape}/{self.total}"


def score(pipe, *, per_prompt: int = 8, steps: int = 25, guidance: float | None = None, seed: int = 0,
          zero_prompts: bool = False) -> Score:
    """Sample ``per_prompt`` pictures of each of :func:`prompts` from the loaded pipeline ``pipe``
    (``steps`` steps of its scheduler, ``guidance`` its default when None, picture i of prompt p
    from seed ``seed + p``) and judge them. ``zero_prompts``: with every prompt embedding zeroed,
    the ablation that shows the conditioning decides the picture."""
    import jax
    import jax.numpy as jnp

    from hypertron.diffusion import sampling

    guidance = pipe.spec.kind.guidance if guidance is None else guidance
    colour = shape = total = 0
    for p, text in enumerate(prompts()):
        args = sampling.request_args(pipe, text, None, count=per_prompt, seed=seed + p, steps=steps,
                                     guidance=guidance, height=SIZE, width=SIZE)
        if zero_prompts:
            args = (*args[:2], jax.tree.map(jnp.zeros_like, args[2]), *args[3:])
        _, images = sampling.program(pipe, (SIZE, SIZE)).fn(*args)
        for image in np.asarray(images):
            right = judge(image).matches(text)
            colour, shape, total = colour + right[0], shape + right[1], total + 1
    return Score(colour, shape, total)
