"""Issue 48's hypothesis tests: the CLI's config loader (``key=value`` overrides and YAML recipes),
the embedding-tables loader and the run-file readers, on hostile input, in process. Whatever the
input: no traceback; one ``error:`` line and exit 2, or an answer with the unreadable lines counted
(tests/support/fuzz.py holds the strategies and the checks; a bench reuses them with more examples)."""

from __future__ import annotations

import pytest

from support.fuzz import fuzz  # tests/support

# Examples per target: together about 12 s on two idle cores (the budget is 30 s).
EXAMPLES = {"config": 40, "recipe": 12, "embed": 40, "runfiles": 40}


@pytest.mark.parametrize("target", sorted(EXAMPLES))
def test_hostile_input_is_refused_in_one_line_or_counted(target):
    counts = fuzz(target, EXAMPLES[target])
    assert sum(n for outcome, n in counts.items() if outcome != "slowest_s") >= EXAMPLES[target] // 2, counts
