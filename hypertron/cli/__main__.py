"""``python -m hypertron.cli``: the ``hypertron`` command. (Imported, as the GPU campaign's T0 imports
every module, it does nothing.)"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hypertron.cli.parser import main

    sys.exit(main())
