"""The base of every user-facing error.

The CLI turns a :class:`UserError` into one line and exit code 2. It lives in
its own module (no JAX import) so catching it costs nothing.
"""


class UserError(ValueError):
    """A mistake in the user's input; the message is one line that names it."""
