"""Step flow runs share one async Prefect client (`flows.runners.step_flow_client`).

Each subflow run's stand-in task run in the parent is created through `get_client()` on Prefect's
run-sync loop; without a client in context that builds a new `PrefectClient` (SSL context, httpx
client, connection) per step. benchmarks/RESULTS.md, control-plane overhead, has the effect.
"""

from __future__ import annotations

import ast
import inspect

import pytest
from prefect import flow
from prefect.client.orchestration import PrefectClient

from flows.runners import step_flow_client

pytestmark = pytest.mark.slow


@flow(name="client-probe-child")
def _child() -> int:
    return 1


BUILT: list[str] = []
"""What happened, in order: "client" per `PrefectClient` built, and the parent's marks."""


@flow(name="client-probe-parent")
def _parent() -> None:
    built = BUILT
    _child()  # warms Prefect up (its own one-off clients)
    built.append("plain")
    _child()
    _child()
    with step_flow_client():
        built.append("shared")
        _child()
        _child()
    built.append("after")


def test_subflows_inside_step_flow_client_build_no_async_client_of_their_own(monkeypatch):
    built = BUILT
    original = PrefectClient.__init__

    def counting(self, *args, **kwargs):
        built.append("client")
        original(self, *args, **kwargs)

    monkeypatch.setattr(PrefectClient, "__init__", counting)
    _parent()
    marks = [i for i, b in enumerate(built) if b != "client"]
    plain, shared = built[marks[0] + 1:marks[1]], built[marks[1] + 1:marks[2]]
    # a client per plain subflow at least (Prefect may build one more); the context's own is built before its mark
    assert (len(plain) >= 2, shared) == (True, [])


def test_the_training_run_flow_runs_its_steps_inside_step_flow_client():
    import flows.training_run as tr

    tree = ast.parse(inspect.getsource(tr))
    blocks = [w for w in ast.walk(tree) if isinstance(w, ast.With)
              and any(ast.unparse(item.context_expr) == "step_flow_client()" for item in w.items)]
    entered = [ast.unparse(item.context_expr) for w in blocks for item in w.items]
    runs = [ast.unparse(node.func) for w in blocks for node in ast.walk(w) if isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith(".run")]
    assert ("StepRuns(step_flow)" in entered, runs) == (True, ["step_runs.run"])
