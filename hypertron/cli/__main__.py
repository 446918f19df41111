"""``python -m hypertron.cli``: the ``hypertron`` command."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hypertron.cli import main  # noqa: E402  (after the environment it reads)

sys.exit(main())
