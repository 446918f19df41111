"""The one reader of numbers a person typed: a flag, a ``key=value`` override, a YAML field.

A number is accepted only when it is finite and in range for what will hold it: an integer fits
int64 (numpy, JAX and Arrow hold it) unless the caller bounds it tighter, a float is never NaN or
infinite. The config loader's coercion, the CLI's numeric flags (``hypertron.cli.flags.number_arg``)
and the YAML files read outside the config (embedding plans, recipes' environment) all call
:func:`check_number` (or :func:`parse_number`, its error raised), so a refusal reads the same
wherever the number was typed.
"""

from __future__ import annotations

import math
from typing import Any

from hypertron.errors import ConfigError

INT64 = (-(2**63), 2**63 - 1)
INT32 = (-(2**31), 2**31 - 1)  # a count that reaches a device as int32 (samples, ids, rows) is bounded by it


def check_number(value: Any, kind: type = float, *, low: float | None = None, high: float | None = None,
                 above: float | None = None) -> tuple[int | float | None, str]:
    """``value`` (a string, an int or a float) as ``kind`` (``int`` or ``float``) and ``""``, or
    ``None`` and the reason it is refused (``expected an integer, got 'abc'``, ``nan is not a
    finite number``, ``-1 is below 0``). ``low``/``high`` bound it inclusively, ``above``
    exclusively; an ``int`` is also bounded by :data:`INT64`."""
    noun = "an integer" if kind is int else "a number"
    number: int | float | None = None
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            number = int(text) if kind is int else float(text)
        except ValueError:
            number = None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    if number is None:
        return None, f"expected {noun}, got {shown(value)}"
    if isinstance(number, float) and not math.isfinite(number):
        return None, f"{number} is not a finite number"
    if kind is int and isinstance(number, float):
        if not number.is_integer():
            return None, f"expected {noun}, got {shown(value)}"
        number = int(number)
    if kind is float:
        try:
            number = float(number)
        except OverflowError:
            return None, f"{shown(value)} is too large"
    lo, hi = (low, high) if kind is float else (max(INT64[0], low if low is not None else INT64[0]),
                                                min(INT64[1], high if high is not None else INT64[1]))
    if lo is not None and number < lo:
        return None, f"{number:g} is below {lo:g}" if kind is float else f"{shown(number)} is below {lo}"
    if above is not None and not number > above:
        return None, f"{number:g} must be above {above:g}"
    if hi is not None and number > hi:
        return None, f"{number:g} is above {hi:g}" if kind is float else f"{shown(number)} is above {hi}"
    return number, ""


def shown(value: Any) -> str:
    """``value`` as a message quotes it: its repr, cut to 60 characters (a line stays a line)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_number(value: Any, name: str, kind: type = float, *, low: float | None = None,
                 high: float | None = None, above: float | None = None) -> Any:
    """:func:`check_number`'s number, or :class:`ConfigError` ``"{name}: {reason}"``."""
    number, reason = check_number(value, kind, low=low, high=high, above=above)
    if number is None:
        raise ConfigError(f"{name}: {reason}")
    return number
