"""The real data plane on a local Ray cluster: torch engines, torch GRPO trainer, the controller.

Each test builds one run's actors in its own Ray namespace, drives real `training_step` flow runs
(in-process task runner, ephemeral Prefect), and checks the accounting from the actors' own counters.
"""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from cluster.builders import DataPlane, prompts_for
from config import load_config, to_plain
from flows.training_step import training_step
from loop import LendPlan
from storage import create_run, make_engine, migrate, session_scope
from storage.store import consumed_prompts, read_step_metrics
from tasks.run_ref import RunRef

pytestmark = pytest.mark.slow


def _start(tmp_path, ray_address, *overrides):
    cfg = load_config("tiny-cpu", [
        f"storage.url=sqlite:///{tmp_path}/tidal.db", f"trainer.default_local_dir={tmp_path}/runs",
        "trainer.total_training_steps=6", "async_training.trigger_parameter_sync_step=2",
        "actor_rollout_ref.rollout.response_length=12", *overrides,
    ])
    uid = f"it-{uuid.uuid4().hex[:8]}"
    engine = make_engine(cfg.storage.url)
    migrate(engine)
    with session_scope(engine) as s:
        create_run(s, uid=uid, name="it", project="tests", policy=cfg.async_training.dynamic_schedule_policy,
                   seed=0, config=to_plain(cfg), output_dir=str(tmp_path / "runs" / uid))
    plane = DataPlane.build(cfg, uid)
    run = RunRef.from_config(cfg, uid=uid, output_dir=str(tmp_path / "runs" / uid), ray_address=ray_address)
    run = run.model_copy(update={"wait_timeout_s": 120.0})
    ray.get(plane.controller.broadcast_sync.remote(0, False))  # no staleness window before the start
    ray.get(plane.rollout.start.remote(prompts_for(cfg)))
    lend_all = LendPlan(step=0, count=cfg.hybrid_replicas, of=cfg.hybrid_replicas)
    warm_up = [ray.get(plane.controller.hybrid_sync.remote(lend_all, 0)),
               *ray.get(plane.controller.activate.remote(lend_all, []))]
    return cfg, plane, run, engine, [r.kind for r in warm_up]


def _switch_kinds(results, warm_up):
    """Each step's switch kinds, as its commit stored them, less the warm-up's (``warm_up``): a
    (re)start's switches are committed with the first step, ahead of its own."""
    kinds = [[e["kind"] for e in r["switch_events"]] for r in results]
    assert kinds[0][:len(warm_up)] == warm_up, (kinds, warm_up)
    return [kinds[0][len(warm_up):], *kinds[1:]]


def _accounting(plane):
    stats = ray.get(plane.rollout.stats.remote())
    return stats["total_started_samples"], stats["total_generated_samples"], stats["in_flight_samples"], stats["queue_size"]


def test_three_sync_cycles_train_for_real_with_the_hybrid_lent_and_reclaimed(tmp_path, ray_address):
    cfg, plane, run, engine, warm_up = _start(tmp_path, ray_address,
                                              "async_training.dynamic_schedule_policy=fixed_ratio")
    try:
        trained = 0
        results = []
        for step in (1, 2, 3):
            result = training_step(run, step)
            results.append(result)
            trained += result["trained"]
            run = run.model_copy(update={"consumed_before": trained})
            started, generated, in_flight, queued = _accounting(plane)
            # every sample accounted for: generated = trained + queued; started = generated + in flight
            assert generated == trained + queued
            assert started == generated + in_flight
        assert trained == 3 * cfg.step_required_samples
        kinds = _switch_kinds(results, warm_up)
        # a step that starts with the hybrid lent (step 1: the warm-up lent it) takes it back before
        # training (deactivate), and only such a step; with fixed_ratio and an empty backlog after
        # training, a step lends it again (hybrid_sync, activate, rebalance). Whether the backlog is
        # empty after a given step depends on the machine's speed, so which steps lend does too.
        lent_before = [True] + ["activate" in k for k in kinds[:-1]]
        assert [k[:1] == ["deactivate"] for k in kinds] == lent_before, kinds
        assert any("activate" in k and "hybrid_sync" in k for k in kinds), kinds
        with session_scope(engine) as s:
            prompts = consumed_prompts(s, run.uid)
            rows = read_step_metrics(s, run.uid)
        assert len(prompts) == len(set(prompts)) == trained
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["fully_async/max_staleness"] <= cfg.async_training.staleness_threshold + 1 for r in rows)
    finally:
        plane.shutdown()


def test_killing_the_standalone_replica_mid_generation_loses_no_sample(tmp_path, ray_address):
    cfg, plane, run, engine, _ = _start(tmp_path, ray_address, "async_training.dynamic_schedule_policy=fixed_ratio")
    try:
        trained = 0
        result = training_step(run, 1)
        trained += result["trained"]
        run = run.model_copy(update={"consumed_before": trained})
        assert ray.get(plane.controller.hybrid_active.remote())
        deadline = time.monotonic() + 30
        while ray.get(plane.rollout.stats.remote())["in_flight_samples"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        ray.kill(plane.standalone["standalone-0"], no_restart=True)  # mid-generation
        for step in (2, 3):
            result = training_step(run, step)
            trained += result["trained"]
            run = run.model_copy(update={"consumed_before": trained})
        stats = ray.get(plane.rollout.stats.remote())
        assert stats["failed_replicas"] == ["standalone-0"]
        assert "standalone-0" not in stats["active_replicas"]
        assert stats["max_concurrent_samples"] <= cfg.async_training.concurrent_samples_per_replica
        started, generated, in_flight, queued = _accounting(plane)
        assert trained == 3 * cfg.step_required_samples  # the run went on, on the hybrid alone
        assert generated == trained + queued
        assert started == generated + in_flight
        with session_scope(engine) as s:
            prompts = consumed_prompts(s, run.uid)
        assert len(prompts) == len(set(prompts)) == trained
    finally:
        plane.shutdown()


def test_with_overlap_the_broadcast_syncs_the_lent_hybrid_which_then_serves_the_new_weights(tmp_path, ray_address):
    """``dynamic_schedule_overlap_hybrid_sync``: the step that lends syncs the hybrid inside its
    broadcast (the flow runs no hybrid-sync task), then activates it, and the hybrid returns
    results made with the weights of that step; every sample is still accounted for."""
    from driver_support import POLICY

    cfg, plane, run, engine, warm_up = _start(tmp_path, ray_address,
                                              f"async_training.dynamic_schedule_policy={POLICY}",
                                              "async_training.dynamic_schedule_overlap_hybrid_sync=true")
    try:
        assert run.overlap_hybrid_sync
        trained, results = 0, []
        for step in (1, 2, 3):
            result = training_step(run, step)
            trained += result["trained"]
            run = run.model_copy(update={"consumed_before": trained})
            results.append(result)
        kinds = _switch_kinds(results, warm_up)
        # the warm-up lent the hybrid; the step-counting policy takes it back before every step
        # that starts with it lent and lends it after odd steps
        lend = ["hybrid_sync", "activate", "rebalance"]
        assert kinds == [["deactivate", *lend], ["deactivate"], lend], kinds
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            served = ray.get(plane.rollout.stats.remote())["replica_versions"].get("hybrid-0", {})
            if served.get("max_version", -1) >= 3:
                break
            time.sleep(0.05)
        assert served.get("max_version") == 3, served  # it loaded step 3's weights during the broadcast
        started, generated, in_flight, queued = _accounting(plane)
        assert generated == trained + queued and started == generated + in_flight
        with session_scope(engine) as s:
            rows = read_step_metrics(s, run.uid)
        assert [r["step"] for r in rows] == [1, 2, 3]
    finally:
        plane.shutdown()
