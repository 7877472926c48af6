"""The switches written once (``loop.switches``): their operations in order, the rebalance's
cleanup, and the state machine both production's controller and the twin run."""

from __future__ import annotations

import json

import pytest

from loop.switches import (
    NOT_HERE,
    Abort,
    ClearSticky,
    ControllerState,
    Drain,
    Hold,
    IllegalTransition,
    Resume,
    SwitchMachine,
    Unhold,
    run_switch,
)

HYBRIDS = ("h0", "h1")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def executor(clock: Clock, answers: dict[type, object] | None = None, raises: type | None = None):
    """Runs every operation in 1 s, answering from ``answers`` (``raises``: that operation fails)."""
    ran: list[str] = []

    def execute(op):
        clock.now += 1.0
        ran.append(op.name)
        if raises is not None and isinstance(op, raises):
            raise RuntimeError(f"{op.name} failed (injected)")
        return (answers or {}).get(type(op))

    return execute, ran


def lent_machine() -> tuple[SwitchMachine, Clock]:
    machine, clock = SwitchMachine(HYBRIDS), Clock()
    run_switch(machine.hybrid_sync(3, 2), executor(clock)[0], clock)
    run_switch(machine.activate(3), executor(clock)[0], clock)
    return machine, clock


def test_each_switch_runs_its_operations_in_order_and_times_each_phase():
    machine, clock = SwitchMachine(HYBRIDS), Clock()
    execute, ran = executor(clock, {Abort: 5})
    sync = run_switch(machine.hybrid_sync(3, 1), execute, clock)
    lend = run_switch(machine.activate(3), execute, clock)
    back = run_switch(machine.take_back(), execute, clock)

    assert ran == ["offload", "wake_up", "load_weights", "add", "resume", "remove", "abort", "sleep", "reload"]
    assert (sync.ops, lend.ops, back.ops) == (("offload", "wake_up", "load_weights"), ("add", "resume"),
                                              ("remove", "abort", "sleep", "reload"))
    assert sync.replicas == lend.replicas == back.replicas == ("h0",)  # graded: the first of two
    assert back.phases == {"remove": 1.0, "abort": 1.0, "sleep": 1.0, "reload": 1.0} and back.aborted == 5
    assert (back.started_at, back.duration_s) == (5.0, 4.0)
    assert machine.state is ControllerState.STANDALONE_ONLY and machine.book.count == 2


def test_an_operation_the_side_has_nothing_for_is_not_recorded():
    machine, clock = SwitchMachine(HYBRIDS), Clock()
    report = run_switch(machine.hybrid_sync(1), lambda op: NOT_HERE if op.name == "offload" else None, clock)
    assert report.ops == ("wake_up", "load_weights") and "offload" not in report.phases


def test_a_rebalance_whose_drain_times_out_resumes_and_unholds_before_it_raises():
    machine, clock = lent_machine()
    execute, ran = executor(clock, {Abort: 7, Drain: 2})
    with pytest.raises(TimeoutError, match="rebalance: 2 requests still in flight on 2 replicas after 5s"):
        run_switch(machine.rebalance(HYBRIDS, 5.0), execute, clock)
    assert ran == [ClearSticky().name, "hold", "abort", "drain", "resume", "unhold"]
    assert machine.book.log[-1].kind == "activate"  # nothing booked for the failed switch


def test_a_rebalance_whose_abort_fails_still_resumes_and_unholds_and_the_error_leaves():
    machine, clock = lent_machine()
    execute, ran = executor(clock, raises=Abort)
    with pytest.raises(RuntimeError, match="abort failed"):
        run_switch(machine.rebalance(HYBRIDS, 5.0), execute, clock)
    assert ran == ["clear_sticky", Hold().name, "abort", Resume().name, Unhold().name]
    assert machine.state is ControllerState.HYBRID_ACTIVE


def test_the_machine_refuses_what_the_state_does_not_allow_before_anything_runs():
    machine, clock = SwitchMachine(HYBRIDS), Clock()
    with pytest.raises(IllegalTransition, match="no hybrid_sync since the last deactivate"):
        machine.activate()
    with pytest.raises(IllegalTransition, match="not active"):
        machine.take_back()
    machine, clock = lent_machine()
    for second in (lambda: machine.activate(), lambda: machine.hybrid_sync(4)):  # a second lend, on either side
        with pytest.raises(IllegalTransition):
            second()
    with pytest.raises(IllegalTransition, match="cannot lend 1 hybrids: 2 were synced"):
        _synced_then_lend(1)
    with pytest.raises(IllegalTransition, match="no hybrid replicas"):
        SwitchMachine(()).hybrid_sync(1)


def _synced_then_lend(count: int) -> None:
    machine, clock = SwitchMachine(HYBRIDS), Clock()
    run_switch(machine.hybrid_sync(3), executor(clock)[0], clock)
    machine.activate(count=count)


def test_a_failed_operation_leaves_the_state_as_it_was():
    machine, clock = lent_machine()
    with pytest.raises(RuntimeError):
        run_switch(machine.take_back(), executor(clock, raises=Abort)[0], clock)
    assert machine.state is ControllerState.HYBRID_ACTIVE and machine.lent == HYBRIDS


def test_the_machine_restores_exactly_through_json():
    machine, clock = SwitchMachine(HYBRIDS), Clock()
    run_switch(machine.hybrid_sync(3, 1), executor(clock)[0], clock)
    run_switch(machine.activate(3), executor(clock)[0], clock)
    restored = SwitchMachine(HYBRIDS)
    restored.load_state_dict(json.loads(json.dumps(machine.state_dict())))
    assert (restored.state, restored.lent, restored.synced_version, restored.book.count, restored.relend_count) == (
        ControllerState.HYBRID_ACTIVE, ("h0",), 3, 1, 1)
    assert restored.state_dict() == machine.state_dict()
