"""Comparing arrays with references."""

from __future__ import annotations

import numpy as np


def rel_err(ours, ref) -> float:
    """||ours - ref|| / ||ref||, in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
