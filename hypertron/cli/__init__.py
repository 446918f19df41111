"""The ``hypertron`` command: parse, then call one function.

User mistakes (bad config, missing files, unusable checkpoints) end with one line on stderr naming
the problem and exit code 2, never a traceback.

- :mod:`~hypertron.cli.parser`: every subcommand's flags, and :func:`main`;
- :mod:`~hypertron.cli.training`: ``train``, ``plan``, ``generate``, ``convert``, ``tokenize``, ``embed plan``;
- :mod:`~hypertron.cli.serving`: ``serve`` (one flag per ``ServeConfig`` field) and ``bench serve``;
- :mod:`~hypertron.cli.launching`: ``launch``, ``recipes``, ``workload``, ``cluster``;
- :mod:`~hypertron.cli.monitoring`: ``monitor``.

Each command imports what it runs when it runs, so ``hypertron --help`` imports no JAX.
"""

from hypertron.cli.parser import build_parser, main
from hypertron.cli.serving import _flag, serve_config_from_args

__all__ = ["_flag", "build_parser", "main", "serve_config_from_args"]
