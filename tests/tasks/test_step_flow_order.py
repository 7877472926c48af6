"""The step flow's orchestration order and its Ray calls, with recording fakes in place of the actors.

Every actor call the tasks make (the step's control plane) is one event; the whole event list is
asserted with `==`: which calls run, in which order, with which arguments, and which are skipped
(no wait when the hybrids are asleep, no hybrid sync when the policy does not lend them). The
commit is the real one, against a SQLite file, so its checkpoint call is counted too.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

import tasks.commit
import tasks.phases as phases
from flows.training_step import training_step
from loop import (
    BroadcastReport,
    DeactivatePlan,
    DecisionRecord,
    LendPlan,
    MicroSummary,
    StepOutcome,
    SwitchReport,
    WaitReport,
)
from metrics import WASTE_SWITCH_S
from storage import create_run, latest_step, make_engine, migrate, session_scope, sqlite_url
from storage.store import get_run
from tasks.run_ref import MicroReport, RunRef

STEP_CALL_BUDGET = 10
"""The issue's target: at most this many actor calls by the control plane for a two-micro-step step."""


def switch(kind: str) -> SwitchReport:
    return SwitchReport(kind=kind, started_at=0.0, duration_s=0.5, replicas=("hybrid-0",))


class FakeCluster:
    """Every actor call appends (actor, method, args) to one list and answers from a script."""

    def __init__(self, *, active: bool, deactivate: bool, activate: bool, timeouts: int = 0):
        self.events: list[tuple] = []
        self.active, self.deactivate, self.activate, self.timeouts = active, deactivate, activate, timeouts
        self.lent = active  # the hybrids' state as the fake controller would report it
        self.pulled = 0  # prompts handed to the trainer so far (each once: the real store checks)

    def actor(self, run: RunRef, name: str) -> Any:
        cluster = self

        class Actor:
            def __getattr__(self, method: str):
                return types.SimpleNamespace(remote=lambda *a: cluster.answer(name, method, a))

        return Actor()

    def answer(self, actor: str, method: str, args: tuple) -> Any:
        self.events.append((actor, method, args))
        step = args[0] if args and isinstance(args[0], int) else None
        if method == "train_micro_step" and self.timeouts:
            self.timeouts -= 1
            return MicroReport(samples=0, timed_out=True, wait_s=5.0, queue_size_at_start=1, mq_size=1)
        if method == "train_micro_step":
            self.pulled += 4
        self.lent = {"wait_for_samples": False, "activate": True, "refill_if_stranded": True}.get(method, self.lent)
        return {
            "should_deactivate": lambda: DeactivatePlan(step=step, deactivate=self.active and self.deactivate,
                                                 wait_samples=3 if self.active and self.deactivate else 0,
                                                 hybrid_active=self.active),
            "wait_for_samples": lambda: WaitReport(waited_s=1.5, mq_size=3, deactivate=switch("deactivate")),
            "train_micro_step": lambda: MicroReport(
                samples=4, prompts=tuple((0, i) for i in range(self.pulled - 4, self.pulled)), versions=((0, 0),) * 4,
                wait_s=0.1, wait_samples=1, mq_size=1, exhausted=False, metrics={"reward_mean": 0.5},
                timing_s={"update_actor": 0.2}, compute_s=0.2, allocated_s=0.3),
            "refill_if_stranded": lambda: (switch("hybrid_sync"), switch("activate"), switch("deactivate")),
            "broadcast_sync": lambda: BroadcastReport(version=args[0], broadcast_s=0.05, replicas=1,
                                                 window={"dynamic_resource/rollout_resource_utilization": 0.9}),
            "should_activate": lambda: LendPlan(step=step, count=1 if self.activate else 0, of=1),
            "hybrid_sync": lambda: switch("hybrid_sync"),
            "activate": lambda: (switch("activate"), switch("rebalance")),
            "update_after_step": lambda: StepOutcome(
                step=step, hybrid_active=self.lent, policy_state={"ratio": 0.5},
                controller_state={"state": "HYBRID_ACTIVE" if self.lent else "STANDALONE_ONLY"},
                decisions=(DecisionRecord(step, "update_after_step", None, "", {}, 0.0),),
                switch_events=(switch("deactivate"),)),
            "save_checkpoint": lambda: {"path": args[0], "sha256": "0" * 64, "size_bytes": 7},
        }[method]()


@pytest.fixture
def run(tmp_path) -> RunRef:
    url = sqlite_url(tmp_path / "store.db")
    migrate(make_engine(url))
    with session_scope(make_engine(url)) as session:
        create_run(session, uid="unit", name="unit", project="unit", policy="fake", seed=0, config={},
                   output_dir=str(tmp_path))
    return RunRef(uid="unit", namespace="unit", storage_url=url, output_dir=str(tmp_path), required_samples=4,
                  trigger_parameter_sync_step=2, buffer_samples=4, only_hybrid=False, standalone_replicas=1,
                  hybrid_replicas=1, trainer_gpus=1, standalone_gpus=1, policy="fake")


@pytest.fixture
def fake(monkeypatch):
    def install(**script):
        cluster = FakeCluster(**script)
        fake_ray = types.SimpleNamespace(get=lambda x: x, is_initialized=lambda: True,
                                         get_actor=lambda name, namespace: cluster.actor(None, name))
        monkeypatch.setattr(phases, "_actor", cluster.actor)
        monkeypatch.setattr(phases, "ray", fake_ray)
        monkeypatch.setattr(tasks.commit, "ray", fake_ray)
        monkeypatch.setattr("tasks.artifact.publish_step", lambda *args, **kwargs: None)
        return cluster

    return install


MICRO = [MicroSummary(samples=4, wait_s=0.1, wait_samples=1)] * 2


def train(n: int = 2) -> list[tuple]:
    return [("trainer", "train_micro_step", (5.0,))] * n


def checkpoint(run: RunRef, step: int) -> tuple:
    # save_freq 1: exported; async_save off in these runs' RunRef (its default), so written at once
    return ("trainer", "save_checkpoint", (str(tasks.commit.checkpoint_path(run, step)), True, False))


def test_a_lent_hybrid_is_waited_for_deactivated_trained_synced_and_lent_again_in_ten_calls(fake, run):
    cluster = fake(active=True, deactivate=True, activate=True)

    result = training_step(run, 7)

    assert cluster.events == [
        ("controller", "should_deactivate", (7,)),
        ("controller", "wait_for_samples", (DeactivatePlan(7, True, 3, True), 600.0)),
        *train(),
        ("controller", "broadcast_sync", (7,)),
        ("controller", "should_activate", (7, MICRO)),
        ("controller", "hybrid_sync", (LendPlan(7, 1, 1), 7)),
        ("controller", "activate", (LendPlan(7, 1, 1), MICRO)),
        ("controller", "update_after_step", (7, MICRO)),
        checkpoint(run, 7),
    ]
    assert len(cluster.events) == STEP_CALL_BUDGET
    assert (result["hybrid_active"], result["trained"], result["exhausted"]) == (True, 8, False)
    assert [e["kind"] for e in result["switch_events"]] == ["deactivate"]
    with session_scope(make_engine(run.storage_url)) as session:
        assert latest_step(session, get_run(session, "unit").id).step == 7


def test_with_overlap_the_lend_is_asked_first_and_the_broadcast_syncs_the_hybrid_one_call_fewer(fake, run):
    """``dynamic_schedule_overlap_hybrid_sync``: should_activate before the broadcast, which gets the
    plan (and syncs the hybrid itself); no hybrid_sync call."""
    cluster = fake(active=True, deactivate=True, activate=True)

    result = training_step(run.model_copy(update={"overlap_hybrid_sync": True}), 7)

    assert cluster.events == [
        ("controller", "should_deactivate", (7,)),
        ("controller", "wait_for_samples", (DeactivatePlan(7, True, 3, True), 600.0)),
        *train(),
        ("controller", "should_activate", (7, MICRO)),
        ("controller", "broadcast_sync", (7, True, LendPlan(7, 1, 1))),
        ("controller", "activate", (LendPlan(7, 1, 1), MICRO)),
        ("controller", "update_after_step", (7, MICRO)),
        checkpoint(run, 7),
    ]
    assert len(cluster.events) == STEP_CALL_BUDGET - 1
    assert result["hybrid_active"] is True


def test_with_overlap_a_step_that_does_not_lend_broadcasts_as_before(fake, run):
    cluster = fake(active=False, deactivate=True, activate=False)

    training_step(run.model_copy(update={"overlap_hybrid_sync": True}), 3, lent=False)

    assert cluster.events == [
        *train(),
        ("controller", "should_activate", (3, MICRO)),
        ("controller", "broadcast_sync", (3,)),
        ("controller", "update_after_step", (3, MICRO)),
        checkpoint(run, 3),
    ]


def test_a_step_that_begins_with_the_hybrids_asleep_asks_no_take_back_and_syncs_no_hybrid(fake, run):
    cluster = fake(active=False, deactivate=True, activate=False)

    result = training_step(run, 3, lent=False)

    assert cluster.events == [
        *train(),
        ("controller", "broadcast_sync", (3,)),
        ("controller", "should_activate", (3, MICRO)),
        ("controller", "update_after_step", (3, MICRO)),
        checkpoint(run, 3),
    ]
    assert result["hybrid_active"] is False


def test_the_last_step_of_a_run_does_not_ask_to_lend_the_trainer(fake, run):
    cluster = fake(active=True, deactivate=True, activate=True)

    result = training_step(run, 9, final=True)

    assert cluster.events == [
        ("controller", "should_deactivate", (9,)),
        ("controller", "wait_for_samples", (DeactivatePlan(9, True, 3, True), 600.0)),
        *train(),
        ("controller", "broadcast_sync", (9,)),
        ("controller", "update_after_step", (9, MICRO)),
        checkpoint(run, 9),
    ]
    assert result["hybrid_active"] is False


def test_a_pull_that_times_out_lets_the_controller_refill_a_stranded_queue_before_pulling_again(fake, run):
    cluster = fake(active=False, deactivate=False, activate=False, timeouts=1)

    result = training_step(run, 2, lent=False)

    assert result["hybrid_active"] is True  # refilled: the next step begins lent and asks to take them back
    assert cluster.events[:3] == [
        ("trainer", "train_micro_step", (5.0,)),
        ("controller", "refill_if_stranded", (2, 600.0)),
        ("trainer", "train_micro_step", (5.0,)),
    ]
    assert result["metrics"][WASTE_SWITCH_S] == 1.5  # the refill's three switches (the step made no other)


def test_a_step_told_the_hybrids_are_lent_asks_the_controller_even_if_they_are_not(fake, run):
    cluster = fake(active=False, deactivate=True, activate=False)

    training_step(run, 4, lent=True)

    assert cluster.events[0] == ("controller", "should_deactivate", (4,))  # the controller's answer decides
    assert ("controller", "wait_for_samples") not in [e[:2] for e in cluster.events]
