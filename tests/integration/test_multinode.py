"""A `tidal run` on a Ray cluster of one head and three worker nodes on this machine (Ray's own
``ray.cluster_utils.Cluster``): one trainer node and two rollout nodes, each with its own
``tidal_gpu`` and role label. The actors land where the labels say, weights sync across nodes,
a rollout node taken away mid-run loses nothing, a cluster too small for the config fails at
start in one line (exit 2) instead of waiting forever for an unschedulable actor, and with a
second trainer node the trainer is one rank group across the two (gloo between nodes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray
from driver_support import (POLICY, actor_nodes, attached_to, end_group, final_state, next_log, pythonpath,
                            ray_driver_log, start, steps_committed, store_url)

from cluster.actors import CONTROLLER, ROLLOUT_SERVICE, TRAINER, replica_name
from cluster.builders import prompts_for
from cluster.ray_cluster import LocalMultiNodeCluster, NodeSpec
from config import load_config

pytestmark = pytest.mark.slow

ROLE = "tidal.io/role"
STEPS = 6
REMOVE_AFTER_STEP = 2


@pytest.fixture(scope="module")
def cluster():
    """Head (no GPU; the driver and the control actors), a trainer node, two rollout nodes; this
    process attached. Workers import the test-only policy by name: PYTHONPATH goes to every node."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath()
    nodes = LocalMultiNodeCluster(NodeSpec(gpus=0, num_cpus=2, memory_gb=2.0),
                                  [NodeSpec(labels={ROLE: "trainer"}), NodeSpec(labels={ROLE: "rollout"}),
                                   NodeSpec(labels={ROLE: "rollout"})])
    try:
        with attached_to(nodes):
            yield nodes
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _overrides(tmp_path, address: str, *extra: str) -> list[str]:
    return [f"storage.url={store_url(tmp_path, 'mn')}", f"trainer.default_local_dir={tmp_path}/runs",
            f"ray.address={address}", f"trainer.total_training_steps={STEPS}",
            f"async_training.dynamic_schedule_policy={POLICY}", "async_training.trigger_parameter_sync_step=2",
            "actor_rollout_ref.rollout.response_length=8", "rollout.nnodes=2", "rollout.n_gpus_per_node=1",
            "async_training.concurrent_samples_per_replica=4", *extra]


def _args(overrides: list[str]) -> list[str]:
    return ["run", "tiny-cpu", *(a for o in overrides for a in ("--set", o))]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}


def _run(overrides: list[str], tmp_path, *, timeout: float) -> tuple[int, str]:
    """`tidal run tiny-cpu` with ``overrides`` to its end; (exit code, log)."""
    log = next_log(tmp_path)
    with open(log, "w") as out:
        proc = start(_args(overrides), tmp_path, out, _env())
        try:
            code = proc.wait(timeout=timeout)
        finally:
            end_group(proc)
    return code, log.read_text()


def test_a_cluster_too_small_for_the_config_fails_at_start_in_one_line(cluster, tmp_path):
    overrides = _overrides(tmp_path, cluster.address, "rollout.nnodes=3")
    t0 = time.monotonic()
    code, text = _run(overrides, tmp_path, timeout=120)
    elapsed = time.monotonic() - t0
    lines = [line for line in text.splitlines() if line.strip()]
    assert code == 2, lines[-20:]
    assert [line for line in lines if line.startswith("tidal: error:")] == [
        f"tidal: error: the Ray cluster at {cluster.address} is too small for this config: it needs 3 rollout "
        f"node(s) (label {ROLE}=rollout) with 1 tidal_gpu each, found 2"]
    assert lines[-1].startswith("tidal: error:")
    print(f"unschedulable config: exit {code} after {elapsed:.1f}s")
    assert elapsed < 30, elapsed


def test_placement_groups_that_cannot_be_placed_in_time_fail_in_one_line_and_are_given_back(cluster, tmp_path):
    """Enough rollout nodes on paper, but their GPUs are taken (by another job, here this test's
    own placement group): the run's groups are not placed within ray.placement.timeout_s, so it
    fails naming them, and gives back what it had reserved (the trainer's group)."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from cluster.placement import ClusterTooSmall, place

    hog = placement_group([{"tidal_gpu": 1}] * 2, strategy="STRICT_SPREAD",
                          bundle_label_selector=[{ROLE: "rollout"}] * 2)
    ray.get(hog.ready(), timeout=60)
    cfg = load_config("tiny-cpu", _overrides(tmp_path, cluster.address, "ray.placement.timeout_s=3"))
    try:
        t0 = time.monotonic()
        with pytest.raises(ClusterTooSmall) as failure:
            place(cfg, "pg-timeout", ["standalone-0", "standalone-1"])
        elapsed = time.monotonic() - t0
    finally:
        remove_placement_group(hog)
    assert str(failure.value) == (
        f"the Ray cluster at {cluster.address} did not place the placement groups of standalone-0, standalone-1 "
        f"within 3s (ray.placement.timeout_s): their nodes are missing, full or unlabelled")
    assert elapsed < 30, elapsed
    ours = {g["name"]: g["state"] for g in placement_group_table().values() if g["name"].startswith("pg-timeout:")}
    assert ours == {"pg-timeout:trainer": "REMOVED", "pg-timeout:standalone-0": "REMOVED",
                    "pg-timeout:standalone-1": "REMOVED"}


SYNC_TIMEOUT_S = 20
"""The weight sync's deadline in the node-loss run. A broadcast the removed node's replica was a
member of waits for it until the deadline, then goes again without it: one rehearsal (load average
~10) saw that step's param_sync take 60.75 s under the default 60 s deadline."""


def test_a_run_places_its_actors_by_node_role_and_survives_losing_a_rollout_node(cluster, tmp_path):
    overrides = _overrides(tmp_path, cluster.address, f"actor_rollout_ref.rollout.weight_sync.timeout_s={SYNC_TIMEOUT_S}")
    url = store_url(tmp_path, "mn")
    trainer_node, rollout_a, rollout_b = cluster.workers
    head_id = cluster.cluster.head_node.node_id
    log = next_log(tmp_path)
    with open(log, "w") as out:
        proc = start(_args(overrides), tmp_path, out, _env())
        try:
            deadline = time.monotonic() + 600
            while steps_committed(url) < REMOVE_AFTER_STEP and proc.poll() is None:
                assert time.monotonic() < deadline, "the run did not reach step 2"
                time.sleep(0.5)
            placed = actor_nodes()
            victim_id = placed["replica:standalone-1"]
            victim = next(n for n in (rollout_a, rollout_b) if n.node_id == victim_id)
            cluster.remove(victim)
            code = proc.wait(timeout=600)
        finally:
            end_group(proc)
    text = log.read_text()
    assert code == 0, f"{text[-3000:]}\n{ray_driver_log(cluster.temp_dir, proc.pid)}"

    # placement: the trainer (and its hybrid) on the trainer node, one standalone replica on each
    # rollout node, the control actors on the head (where the driver is)
    names = (TRAINER, replica_name("standalone-0"), replica_name("standalone-1"), CONTROLLER, ROLLOUT_SERVICE)
    assert {name: placed[name] for name in names} == {
        TRAINER: trainer_node.node_id,
        replica_name("standalone-0"): ({rollout_a.node_id, rollout_b.node_id} - {victim_id}).pop(),
        replica_name("standalone-1"): victim_id,
        CONTROLLER: head_id,
        ROLLOUT_SERVICE: head_id,
    }

    summary, state, rows, prompts = final_state(url)
    assert summary.status == "finished"
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the hybrid was lent and reclaimed: the policy lends after odd steps only
    assert [r["hybrid_active_after"] for r in rows] == [True, False] * (STEPS // 2)
    # every step broadcast the trainer's weights (trainer node → rollout nodes) and timed it
    assert [r["param_version"] for r in rows] == list(range(1, STEPS + 1))
    sync_s = [r["timing_s/param_sync"] for r in rows]
    assert all(0 < s < SYNC_TIMEOUT_S + 30 for s in sync_s), sync_s  # a lost member costs the deadline at most
    print("cross-node param_sync s per step:", [round(s, 4) for s in sync_s])
    # the removed node's replica counted as lost (as a replica death), the other one went on
    standalone = [r["fully_async/rollouter/standalone_replicas"] for r in rows]
    assert standalone[:REMOVE_AFTER_STEP] == [2.0] * REMOVE_AFTER_STEP, standalone
    assert standalone[-1] == 1.0 and standalone == sorted(standalone, reverse=True), standalone
    assert rows[-1]["fully_async/rollouter/failed_replicas"] == 1.0

    # nothing lost or duplicated across the node loss: every prompt of the run trained exactly once
    cfg = load_config("tiny-cpu", overrides)
    want = sorted((e, i) for e, i, _ in prompts_for(cfg))
    assert len(prompts) == len(set(prompts)) == STEPS * cfg.step_required_samples
    assert sorted(prompts) == want


def test_a_trainer_of_two_nodes_trains_as_one_rank_group_across_them(cluster, tmp_path):
    """A second trainer node joins; the trainer is then 2 nodes × 1 rank, one gloo group across the
    nodes (FSDP2), beside one rollout node: its two hybrids are lent and taken back, every prompt is
    trained once, and each step leaves a shard per rank."""
    trainer_nodes = [n for n in cluster.workers if n.node_id in _labelled("trainer")]
    trainer_nodes.append(cluster.add_worker(NodeSpec(labels={ROLE: "trainer"})))
    overrides = _overrides(tmp_path, cluster.address, "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                           "rollout.nnodes=1")
    url = store_url(tmp_path, "mn")
    code, text = _run(overrides, tmp_path, timeout=600)
    assert code == 0, text[-3000:]

    placed = actor_nodes()
    assert {placed["trainer-rank-0"], placed["trainer-rank-1"]} == {n.node_id for n in trainer_nodes}
    assert placed[TRAINER] == placed["trainer-rank-0"]  # the hybrids' host: trainer node 0
    summary, state, rows, prompts = final_state(url)
    assert summary.status == "finished" and [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["hybrid_active_after"] for r in rows] == [True, False] * (STEPS // 2)
    cfg = load_config("tiny-cpu", overrides)
    assert cfg.hybrid_replicas == 2
    assert len(prompts) == len(set(prompts)) == STEPS * cfg.step_required_samples
    assert sorted(prompts) == sorted((e, i) for e, i, _ in prompts_for(cfg))
    shards = sorted(p.name for p in Path(state.checkpoint.path).parent.iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "tidal-commit.json"]


def _labelled(role: str) -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive") and (n.get("Labels") or {}).get(ROLE) == role}
