"""A directory's every entry, to prove a command left it as it was."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry below ``root``: directories by name, files by size, mtime and content hash."""
    snap: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), root)] = ("dir",)
        for f in filenames:
            p = os.path.join(dirpath, f)
            st = os.stat(p)
            digest = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            snap[os.path.relpath(p, root)] = ("file", st.st_size, st.st_mtime_ns, digest)
    return snap


def assert_unchanged(root: Path, before: dict[str, tuple], why: str = "") -> None:
    after = snapshot(root)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or removed or changed), (
        f"{root} changed: added {added}, removed {removed}, modified {changed}\n{why}")
