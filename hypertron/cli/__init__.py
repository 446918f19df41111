"""The ``hypertron`` command: parse, then call one function.

User mistakes (bad config, missing files, unusable checkpoints) end with one line on stderr naming
the problem and exit code 2, never a traceback.

Each command module adds its own commands to the parser (its ``register(subparsers)``) and holds
the functions they call:

- :mod:`~hypertron.cli.parser`: the root parser, which calls each ``register``, and :func:`main`;
- :mod:`~hypertron.cli.training`: ``train``, ``plan``, ``generate``, ``convert``, ``embed plan``, ``tokenize``;
- :mod:`~hypertron.cli.launching`: ``launch``, ``recipes``, ``workload``, ``cluster``;
- :mod:`~hypertron.cli.monitoring`: ``monitor``;
- :mod:`~hypertron.cli.serving`: ``serve`` and ``bench serve``;
- :mod:`~hypertron.cli.flags`: what they share: the parser with one-line errors, flags made from a
  settings dataclass (one ``--field-name`` per field, its default, type and choices the field's),
  sizes as flag values, ``--dry-run`` / ``--output``.

Each command imports what it runs when it runs, so building the parser imports no JAX.
"""

from hypertron.cli.flags import flag
from hypertron.cli.parser import build_parser, main
from hypertron.cli.serving import serve_config_from_args

__all__ = ["build_parser", "flag", "main", "serve_config_from_args"]
