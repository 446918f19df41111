"""The error types every layer raises, and the one helper that words them.

The CLI turns a :class:`UserError` into one line and exit code 2. This module
imports nothing (no JAX), so catching these costs nothing, and every layer can
raise them without reaching up to the layer that defines a setting.
"""


class UserError(ValueError):
    """A mistake in the user's input; the message is one line that names it."""


class ConfigError(UserError):
    """A user mistake in the configuration; its message is one line naming the key."""


class DataError(UserError):
    """A user mistake in the data or tokenizer settings, or a corpus or tokenizer file that cannot be
    used; its message is one line naming the key or the file."""


def one_line(error: BaseException) -> str:
    """A library's error message squeezed onto one short line, to quote in a :class:`UserError`."""
    text = " ".join(str(error).split())
    return text[:200] + ("..." if len(text) > 200 else "")
