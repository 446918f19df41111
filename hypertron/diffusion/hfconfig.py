"""What the readers of diffusers' component ``config.json`` files share: the file checked as the one
class a reader takes, with the keys hypertron computes one way only fixed to that value, the
value tests their typed keys use, and those keys read with their dataclass's defaults. Every refusal is one :class:`DiffusionError` line naming the
file and the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hypertron.config.numbers import shown
from hypertron.diffusion.errors import DiffusionError


def positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))


def check_class(hf: Any, where: str, class_name: str, fixed: dict[str, Any] | None = None) -> None:
    """``hf`` is a JSON object of ``class_name`` (its ``_class_name``, when given) whose ``fixed``
    keys, when given, hold the one value each that hypertron computes."""
    if not isinstance(hf, dict):
        raise DiffusionError(f"{where}: must be a JSON object")
    if hf.get("_class_name", class_name) != class_name:
        raise DiffusionError(f"{where}: _class_name={shown(hf['_class_name'])} is not supported "
                             f"(supported: {class_name})")
    for key, value in (fixed or {}).items():
        if hf.get(key, value) != value:
            raise DiffusionError(f"{where}: {key}={shown(hf[key])} is not supported (supported: {shown(value)})")


def read_keys(hf: dict, where: str, default: Any, keys: tuple[str, ...], ok: Callable[[Any], bool],
              what: str) -> dict[str, Any]:
    """Each of ``keys`` of ``hf`` (where absent, its value in the config dataclass ``default``),
    by name; one that ``ok`` refuses is ``{where}: {key}={value} must be {what}``."""
    values = {}
    for key in keys:
        v = values[key] = hf.get(key, getattr(default, key))
        if not ok(v):
            raise DiffusionError(f"{where}: {key}={shown(v)} must be {what}")
    return values


def positive_ints(hf: dict, where: str, default: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """:func:`read_keys` of keys that are positive integers."""
    return read_keys(hf, where, default, keys, positive_int, "a positive integer")


def booleans(hf: dict, where: str, default: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """:func:`read_keys` of keys that are true or false."""
    return read_keys(hf, where, default, keys, lambda v: isinstance(v, bool), "true or false")
