"""What the readers of diffusers' component ``config.json`` files share: the file checked as the one
class a reader takes, with the keys hypertron computes one way only fixed to that value, and the
value tests their typed keys use. Every refusal is one :class:`DiffusionError` line naming the
file and the key."""

from __future__ import annotations

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
