"""One result for the whole session, whichever pytest-xdist worker asks first."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path


def once(tmp_path_factory, key: str, produce: Callable[[Path], dict]) -> dict:
    """``produce(directory)`` once per test session, shared by every worker: the first to ask runs
    it under a file lock and leaves its JSON-able result in the session's base folder; the others
    wait for the lock and read that."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base folders share this parent
    done = root / f"{key}.json"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            directory = root / key
            directory.mkdir()
            done.write_text(json.dumps(produce(directory)))
    return json.loads(done.read_text())
