"""The weight transports on a real data plane (tiny-cpu on a local Ray cluster, a 2-rank trainer
over gloo, two standalone torch replicas, `rollout.replace_failed_replicas`): each hybrid lives
on its trainer rank and starts asleep; the broadcast goes by the collective; a standalone replica
that dies while the trainer broadcasts (failpoint ``TIDAL_KILL_REPLICA_IN_SYNC``) fails nothing
but itself: the sync finishes without it in a new generation, the rollout service replaces it,
and the replacement loads the current version through the same transport; lent hybrids load it
in their ranks, and lending k of m wakes only the first k."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from cluster.actors.replica import KILL_IN_SYNC_ENV
from cluster.builders import DataPlane, prompts_for
from config import load_config
from loop import LendPlan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _replaced(plane: DataPlane, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = ray.get(plane.rollout.stats.remote())["replaced_replicas"]
        if any(r.get("joined_at") for r in records):
            return records
        time.sleep(0.5)
    raise AssertionError(f"no replacement joined within {timeout_s:g}s: {records}")


def test_hybrids_on_their_ranks_and_a_replica_lost_mid_broadcast_replaced_at_the_current_version(
        tmp_path, ray_address, monkeypatch):
    cfg = load_config("tiny-cpu", [
        f"storage.url=sqlite:///{tmp_path}/tidal.db", f"trainer.default_local_dir={tmp_path}/runs",
        "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2", "rollout.replace_failed_replicas=true",
        "actor_rollout_ref.rollout.weight_sync.timeout_s=5", "actor_rollout_ref.rollout.response_length=8",
    ])
    assert (cfg.standalone_transport, cfg.hybrid_replicas) == ("collective", 2)
    monkeypatch.setenv(KILL_IN_SYNC_ENV, "standalone-0:1")  # read by the driver (here) at build
    plane = DataPlane.build(cfg, f"sync-{uuid.uuid4().hex[:8]}")
    try:
        # each hybrid on its own rank (TP 1), asleep: no weights, no cache until lent
        handles = ray.get(plane.trainer.hybrid_handles.remote())
        assert {rid: h._actor_id for rid, h in handles.items()} == {
            "hybrid-0": plane.ranks[0]._actor_id, "hybrid-1": plane.ranks[1]._actor_id}
        hosted = [ray.get(rank.hybrid_stats.remote()) for rank in plane.ranks]
        assert [sorted(h) for h in hosted] == [["hybrid-0"], ["hybrid-1"]]
        assert all(s["weight_bytes"] == s["kv_cache_bytes"] == 0 for h in hosted for s in h.values())

        first = ray.get(plane.controller.broadcast_sync.remote(0, False), timeout=120)
        assert (first.transport, first.replicas, first.retries) == ("collective", 2, 0)
        assert first.sent_bytes > 0

        ray.get(plane.rollout.start.remote(prompts_for(cfg)))
        t0 = time.monotonic()
        lost = ray.get(plane.controller.broadcast_sync.remote(1, False), timeout=120)
        assert time.monotonic() - t0 < 60  # bounded by the group's timeout, no hang
        # synced without standalone-0 (the controller marked it dead and ended it) after one retry
        assert (lost.transport, lost.replicas, lost.retries) == ("collective", 1, 1)

        (record, *_) = [r for r in _replaced(plane) if r.get("joined_at")]
        assert (record["failed"], record["version"]) == ("standalone-0", 1)
        new = ray.get(plane.rollout.standalone_handles.remote())[record["replacement"]]
        assert ray.get(new.engine_stats.remote())["param_version"] == 1.0

        # 1 of 2 lent: only hybrid-0 wakes, on rank 0, and loads version 1 in that rank
        ray.get(plane.controller.hybrid_sync.remote(LendPlan(step=1, count=1, of=2), 1), timeout=120)
        (one,), (other,) = [ray.get(rank.hybrid_stats.remote()).values() for rank in plane.ranks]
        assert (one["param_version"], one["weight_bytes"] > 0, other["weight_bytes"]) == (1.0, True, 0)
        ray.get(plane.controller.hybrid_sync.remote(LendPlan(step=1, count=2, of=2), 1), timeout=120)
        hosted = [ray.get(rank.hybrid_stats.remote()) for rank in plane.ranks]
        assert [s["param_version"] for h in hosted for s in h.values()] == [1.0, 1.0]
        assert all(s["weight_bytes"] > 0 for h in hosted for s in h.values())
    finally:
        plane.shutdown()
