"""Step flow runs send no heartbeats; the parent run keeps its own.

Prefect joins a flow run's heartbeat thread on exit, and that thread sleeps in whole seconds, so a
heartbeating flow run ends up to 1 s late; `flows.runners.step_flow_settings` turns heartbeats off
for the `training_step` runs only (benchmarks/RESULTS.md, control-plane overhead, has the effect).
"""

from __future__ import annotations

import pytest
from prefect import flow
from prefect.settings import get_current_settings

from flows.runners import step_flow_settings

pytestmark = pytest.mark.slow


@flow(name="heartbeat-probe-child")
def _child() -> object:
    return get_current_settings().flows.heartbeat_frequency


@flow(name="heartbeat-probe-parent")
def _parent() -> tuple[object, object, object]:
    outside = _child()
    with step_flow_settings():
        inside = _child()
    return get_current_settings().flows.heartbeat_frequency, outside, inside


def test_step_flow_runs_skip_heartbeats_and_the_parent_keeps_them():
    parent, plain_child, step_child = _parent()
    assert parent == plain_child == get_current_settings().flows.heartbeat_frequency
    assert isinstance(parent, int) and parent >= 30
    assert step_child is None


def test_the_training_run_flow_runs_its_steps_inside_step_flow_settings():
    import ast
    import inspect

    import flows.training_run as tr

    tree = ast.parse(inspect.getsource(tr))
    inside = [ast.unparse(node.func) for w in ast.walk(tree) if isinstance(w, ast.With)
              and any(ast.unparse(item.context_expr) == "step_flow_settings()" for item in w.items)
              for node in ast.walk(w) if isinstance(node, ast.Call)]
    direct = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "step_flow"]
    # the step flow runs only through StepRuns, built and run inside the settings
    assert (inside.count("StepRuns"), inside.count("step_runs.run"), len(direct)) == (1, 1, 0)
