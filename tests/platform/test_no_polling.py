"""No busy polling on the control plane (issue 46 item 4): nothing there waits by sleeping in a loop.

The control plane is the step's phases and the controller: ``loop/`` (the controller and its
switches), ``tasks/``, the actors of ``cluster/actors/`` and the flows that drive a run. A wait
there waits on what it waits for (a completion, a queue, a condition; Ray refs with a timeout),
never on a loop that sleeps and asks again: the rebalance's drain used to poll the balancer
every 10 ms (``lb.in_flight`` in a ``while`` with ``sleep``), a Ray call per poll. The check
reads the code (every ``for``/``while`` loop's calls), so it covers every path, taken or not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTROL_PLANE = ["loop", "tasks", "cluster/actors", "flows/training_step.py", "flows/training_run.py",
                 "flows/runners.py", "flows/driver.py"]
SLEEPS = {"sleep", "_sleep"}


def sleeping_loops(source: str) -> list[tuple[int, str]]:
    """Each loop of ``source`` that calls a sleep, with the line and the calls it makes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.While | ast.For | ast.AsyncFor):
            calls = [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]
            if any(name.split(".")[-1] in SLEEPS for name in calls):
                found.append((node.lineno, ", ".join(calls)))
    return found


def _files() -> list[Path]:
    out: list[Path] = []
    for place in CONTROL_PLANE:
        path = ROOT / place
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_loop_on_the_control_plane_sleeps_and_asks_again(path):
    assert sleeping_loops(path.read_text(encoding="utf-8")) == [], (
        f"{path.relative_to(ROOT)} polls: wait on a completion (an awaitable, a condition, a Ray ref "
        f"with a timeout) instead")


def test_the_check_finds_the_drain_poll_the_controller_had():
    old_drain = '''
def _wait_for_drain(self, ids):
    begin = self._clock()
    while True:
        left = int(self._lb.in_flight(ids))
        if left <= 0:
            return 0
        if self._clock() - begin >= self._rebalance_timeout_s:
            return left
        self._sleep(DRAIN_POLL_INTERVAL_S)
'''
    [(line, calls)] = sleeping_loops(old_drain)
    assert line == 4 and "self._lb.in_flight" in calls
    assert sleeping_loops("async def f(x):\n    while not x():\n        await asyncio.sleep(0.01)\n")
    assert sleeping_loops("def f(ref):\n    return ray.get(ref, timeout=5.0)\n") == []
