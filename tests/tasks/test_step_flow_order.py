"""The step flow's orchestration order, with recording fakes in place of the Ray actors.

The whole event list is asserted with `==`: which actor verbs run, in which order, and which are
skipped (no wait when the policy keeps the hybrids off, no hybrid sync when it does not lend them).
"""

from __future__ import annotations

import types
from typing import Any

import pytest

import tasks.commit
from cluster.controller import SwitchTiming
import tasks.phases as phases
from flows.training_step import training_step
from tasks.run_ref import RunRef

RUN = RunRef(uid="unit", namespace="unit", storage_url="sqlite://", output_dir="/nonexistent",
             required_samples=4, trigger_parameter_sync_step=2, buffer_samples=4, only_hybrid=False,
             standalone_replicas=1, hybrid_replicas=1, trainer_gpus=1, standalone_gpus=1, policy="fake")


class FakeCluster:
    """Every actor verb appends (actor, verb, args) to one list and answers from a script."""

    def __init__(self, *, active: bool, deactivate: bool, activate: bool, standalone_alive: int = 1):
        self.events: list[tuple] = []
        self.active, self.deactivate, self.activate, self.alive = active, deactivate, activate, standalone_alive

    def actor(self, run: RunRef, name: str) -> Any:
        cluster = self

        class Actor:
            def __getattr__(self, verb: str):
                return types.SimpleNamespace(remote=lambda *a, **k: cluster.answer(name, verb, a))

        return Actor()

    def answer(self, actor: str, verb: str, args: tuple) -> Any:
        if verb == "call":
            method, *rest = args
            self.events.append((actor, method))
            return {
                "context": rest[0] if rest else None,
                "should_deactivate": self.deactivate,
                "deactivate_wait_samples": 3,
                "should_activate": self.activate,
                "request_rebalance": True,
                "update_policy": None,
            }.get(method, SwitchTiming(kind=method, started_at=0.0, duration_s=0.5))
        self.events.append((actor, verb))
        return {
            "hybrid_active": self.active,
            "standalone_alive": self.alive,
            "stats": {"total_generated_samples": 8, "queue_size": 2},
            "wait_for_queue": {"waited_s": 1.5, "mq_size": 3, "exhausted": False},
            "train_micro_step": {"samples": [(0, i, 0, 0) for i in range(4)], "wait_s": 0.1, "wait_samples": 1,
                                 "mq_size": 1, "exhausted": False, "metrics": {"reward_mean": 0.5},
                                 "timing_s": {"update_actor": 0.2}, "compute_s": 0.2, "allocated_s": 0.3},
            "broadcast": {"broadcast_s": 0.05},
            "on_weight_sync": {"dynamic_resource/rollout_resource_utilization": 0.9},
            "policy_state": {"ratio": 0.5},
        }[verb]


@pytest.fixture
def fake(monkeypatch):
    def install(**script):
        cluster = FakeCluster(**script)
        monkeypatch.setattr(phases, "_actor", cluster.actor)
        monkeypatch.setattr(phases, "ray", types.SimpleNamespace(get=lambda x: x, is_initialized=lambda: True))
        monkeypatch.setattr(tasks.commit, "commit", lambda run, step, version, summary, now: (
            cluster.events.append(("store", "commit")) or {"step": step, "decisions": [], "switch_events": []}))
        monkeypatch.setattr("prefect.artifacts.create_markdown_artifact", lambda **kw: None)
        return cluster

    return install


# each micro-step first checks that some replica still generates (tasks.phases._refill_if_stranded)
TRAIN = [("controller", "standalone_alive"), ("trainer", "train_micro_step")] * 2
SYNC = [("controller", "broadcast"), ("rollout", "on_weight_sync")]


def ctx_events():
    return [("rollout", "stats"), ("controller", "context")]


def test_a_lent_hybrid_is_waited_for_deactivated_trained_synced_and_lent_again(fake):
    cluster = fake(active=True, deactivate=True, activate=True)
    result = training_step(RUN, 7)
    assert cluster.events == [
        *ctx_events(), ("controller", "hybrid_active"), ("controller", "should_deactivate"),
        ("controller", "deactivate_wait_samples"), ("controller", "standalone_alive"),
        ("rollout", "wait_for_queue"), ("controller", "deactivate"),
        *TRAIN, *SYNC,
        *ctx_events(), ("controller", "should_activate"),
        ("controller", "hybrid_sync"),
        ("controller", "activate"), *ctx_events(), ("controller", "request_rebalance"), ("controller", "rebalance"),
        *ctx_events(), ("controller", "update_policy"), ("controller", "policy_state"),
        ("store", "commit"),
    ]
    assert result["hybrid_active"] is True and result["trained"] == 8


def test_a_hybrid_the_policy_keeps_off_is_neither_waited_for_nor_synced(fake):
    cluster = fake(active=False, deactivate=True, activate=False)
    result = training_step(RUN, 3)
    assert cluster.events == [
        *ctx_events(), ("controller", "hybrid_active"),
        *TRAIN, *SYNC,
        *ctx_events(), ("controller", "should_activate"), ("controller", "standalone_alive"),
        *ctx_events(), ("controller", "update_policy"), ("controller", "policy_state"),
        ("store", "commit"),
    ]
    assert result["hybrid_active"] is False


def test_the_last_step_of_a_run_does_not_ask_to_lend_the_trainer(fake):
    cluster = fake(active=True, deactivate=True, activate=True)
    result = training_step(RUN, 9, final=True)
    assert cluster.events == [
        *ctx_events(), ("controller", "hybrid_active"), ("controller", "should_deactivate"),
        ("controller", "deactivate_wait_samples"), ("controller", "standalone_alive"),
        ("rollout", "wait_for_queue"), ("controller", "deactivate"),
        *TRAIN, *SYNC,
        *ctx_events(), ("controller", "update_policy"), ("controller", "policy_state"),
        ("store", "commit"),
    ]
    assert result["hybrid_active"] is False


def test_with_every_standalone_replica_dead_the_hybrid_waits_for_a_whole_cycle_and_is_lent_again(fake):
    cluster = fake(active=True, deactivate=True, activate=False, standalone_alive=0)
    training_step(RUN, 2)
    assert ("controller", "hybrid_sync") in cluster.events
    wait = phases.should_deactivate.fn(RUN, 2)
    assert wait == {"deactivate": True, "wait_samples": 8, "hybrid_active": True}  # 4 × 2, not the policy's 3
