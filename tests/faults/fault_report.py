"""Tally of the fault campaign: each fault test records what it injected and what it found.

When ``TIDAL_FAULT_REPORT`` names a file, :func:`record` appends one JSON line per call to it
(``benchmarks/fault_campaign.py`` sets it, runs the campaign and sums the lines into
``benchmarks/RESULTS.md`` and ``benchmarks/results.json``). Without it, ``record`` does nothing,
so the tests behave the same in a plain ``pytest`` run.

A test calls ``record`` only after its assertions passed, so a recorded fault was survived; a
failing test records nothing and the campaign reports it as failed from pytest's own outcome.
"""

from __future__ import annotations

import json
import os
import time

ENV = "TIDAL_FAULT_REPORT"


def record(kind: str, *, injected: int, survived: int, samples_lost: int = 0, samples_duplicated: int = 0,
           test: str | None = None, **details) -> None:
    """Append ``{kind, injected, survived, samples_lost, samples_duplicated, test, details}``."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = {
        "kind": kind, "injected": int(injected), "survived": int(survived),
        "samples_lost": int(samples_lost), "samples_duplicated": int(samples_duplicated),
        "test": test or os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        "at": time.time(), "details": details,
    }
    with open(path, "a", encoding="utf-8") as f:  # one write per line: safe for concurrent appends
        f.write(json.dumps(line, default=str) + "\n")
