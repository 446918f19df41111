"""Schemathesis against a served ``/openapi.json``: every operation, generated from its schema,
positive (bodies the schema allows) and negative (bodies it does not), sent over HTTP, each
answer checked: no 5xx, the status code, content type and body as the description says, and an
answer within ``hang_s``. Used by tests/test_hostile_inputs.py (a few hundred examples) and
bench/fuzz.py (thousands)."""

from __future__ import annotations

import collections
import dataclasses

# Positive and negative data for the two POST operations (what can hurt the server), positive only
# for the GETs (they take no parameters: nothing to make negative).
_WEIGHTS = {"POST": {"positive": 0.225, "negative": 0.225}, "GET": {"positive": 0.0333}}


@dataclasses.dataclass
class FuzzCounts:
    """What a run sent and got: ``statuses`` by code, ``hangs`` (no answer within the limit) and
    the first ``failures`` as text (the check that failed and the request)."""

    requests: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    hangs: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    failed: int = 0

    @property
    def client_errors(self) -> int:
        return sum(n for code, n in self.statuses.items() if 400 <= code < 500)

    @property
    def server_errors(self) -> int:
        return sum(n for code, n in self.statuses.items() if code >= 500)


def fuzz_server(url: str, *, examples: int = 300, seed: int = 0, hang_s: float = 30.0,
                keep_failures: int = 10) -> FuzzCounts:
    """Run about ``examples`` generated requests against the server at ``url`` (its schema read
    from ``url + "/openapi.json"``), ``seed`` fixing what is generated; the counts."""
    import hypothesis
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.config import SchemathesisConfig
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=SchemathesisConfig())
    counts = FuzzCounts()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode, weight in _WEIGHTS[op.method.upper()].items():
            n = max(1, round(examples * weight))

            @hypothesis.seed(seed)
            @settings(max_examples=n, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck), derandomize=False)
            @given(op.as_strategy(generation_mode=GenerationMode(mode)))
            def send(case) -> None:
                counts.requests += 1
                try:
                    response = case.call(base_url=url, timeout=hang_s)
                except requests.Timeout:
                    counts.hangs += 1
                    _note(counts, keep_failures, f"no answer in {hang_s} s: {case.as_curl_command()}")
                    return
                counts.statuses[response.status_code] += 1
                try:
                    case.validate_response(response, checks=checks)
                except (AssertionError, BaseExceptionGroup) as e:  # schemathesis' Failure, FailureGroup
                    _note(counts, keep_failures, f"{type(e).__name__}: {str(e)[:800]}\n  {case.as_curl_command()}")

            send()
    return counts


def _note(counts: FuzzCounts, keep: int, text: str) -> None:
    counts.failed += 1
    if len(counts.failures) < keep:
        counts.failures.append(text)
