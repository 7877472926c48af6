"""Counts the Ray actor method calls one driver process makes: the control plane's round trips.

``TIDAL_COUNT_RAY_CALLS=OUT.json python benchmarks/ray_call_counter.py MODULE [ARGS...]`` runs
``python -m MODULE ARGS...``; with the variable set, every ``ActorMethod`` call in this process is
recorded as ``[wall-clock time, method name]`` and written to OUT.json at exit. Calls the actors
make among themselves are not seen. Must not: change what a call does, or be imported by Tidal.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time

ENV = "TIDAL_COUNT_RAY_CALLS"


def install(out: str) -> list[tuple[float, str]]:
    """Wrap ``ActorMethod._remote`` (``.remote()`` and ``.options(...).remote()`` both end there)."""
    from ray.actor import ActorMethod

    calls: list[tuple[float, str]] = []
    original = ActorMethod._remote

    def counted(self, *args, **kwargs):
        calls.append((time.time(), self._method_name))  # list.append is atomic: threads are fine
        return original(self, *args, **kwargs)

    ActorMethod._remote = counted
    atexit.register(_dump, out, calls)
    return calls


def _dump(out: str, calls: list[tuple[float, str]]) -> None:
    with open(out, "w", encoding="utf-8") as f:
        json.dump(list(calls), f)


def main() -> None:
    if os.environ.get(ENV):
        install(os.environ[ENV])
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
