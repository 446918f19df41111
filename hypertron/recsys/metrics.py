"""Click-prediction metrics: log-loss and ROC AUC, on the host, in float64 numpy."""

from __future__ import annotations

import numpy as np


def log_loss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of ``labels`` (0 or 1) under ``sigmoid(logits)``, computed stably."""
    x, y = np.asarray(logits, np.float64), np.asarray(labels, np.float64)
    return float(np.mean(np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve: the chance that a random positive scores above a random
    negative, ties counting half (the Mann-Whitney U statistic, from average ranks). NaN when the
    labels are all one class."""
    s, y = np.asarray(scores, np.float64).ravel(), np.asarray(labels).ravel() > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty(len(s), np.float64)
    # Average ranks (1-based) over runs of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))
