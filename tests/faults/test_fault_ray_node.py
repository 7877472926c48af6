"""Fault campaign, the platform: a Ray worker node lost in a multi-node cluster. A real `tidal run
tiny-cpu` on a Ray cluster of one head and worker nodes started on this machine
(``cluster.ray_cluster.LocalMultiNodeCluster``: every node a raylet of its own, with its own temp
dir, ports, role label and ``tidal_gpu``), and one whole worker node lost mid-run: its raylet and
every process of it SIGKILLed at once, by pid (``LocalMultiNodeCluster.kill``: only the processes
of that node), as a machine that dies. The head notices by its health check (here within ~3 s:
``health_check_s``; Ray's default 15-30 s), and then:

- the node held a standalone replica (``rollout.replace_failed_replicas=true``): its placement
  group is placed again on the other rollout node, the replacement starts there, joins with the
  current weights, and the run carries on to its end (CI's case);
- the node held a trainer rank (``trainer.nnodes=2``): the run stops with exit 3 and one line with
  the resume command; a trainer node is added again, and `tidal resume` finishes the run (the
  campaign's case: it runs when ``TIDAL_FAULT_REPORT`` is set).

Either way every prompt of the run is trained exactly once: the prompts trained are the run's
prompts (``prompts_for``), none twice, steps 1..N committed once each.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from driver_support import (POLICY, actor_nodes, attached_to, end_group, final_state, next_log, pythonpath, start,
                            steps_committed, store_url)
from fault_report import record

from cluster.actors import replica_name
from cluster.actors.trainer_rank import rank_name
from cluster.builders import prompts_for
from cluster.ray_cluster import LocalMultiNodeCluster, NodeSpec
from config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROLE = "tidal.io/role"
HEALTH_CHECK_S = 3.0
"""The head declares a silent node dead after ~3 s of failed probes (one a second)."""
CAMPAIGN = bool(os.environ.get("TIDAL_FAULT_REPORT"))


def _cluster(*workers: NodeSpec) -> LocalMultiNodeCluster:
    """The head is a trainer node (one ``tidal_gpu``; the driver, the control actors, trainer rank
    0 land there: it is never the one lost), then ``workers``."""
    return LocalMultiNodeCluster(NodeSpec(gpus=1, labels={ROLE: "trainer"}, num_cpus=2, memory_gb=3.0),
                                 list(workers), health_check_s=HEALTH_CHECK_S)


@pytest.fixture
def with_pythonpath():
    """Workers import the test-only policy by name: PYTHONPATH goes to every node (they inherit it)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _overrides(tmp_path, address: str, steps: int, *extra: str) -> list[str]:
    return [f"storage.url={store_url(tmp_path, 'node')}", f"trainer.default_local_dir={tmp_path}/runs",
            f"ray.address={address}", f"trainer.total_training_steps={steps}",
            f"async_training.dynamic_schedule_policy={POLICY}", "async_training.trigger_parameter_sync_step=2",
            "actor_rollout_ref.rollout.response_length=8", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
            "async_training.concurrent_samples_per_replica=4", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}


def _args(command: list[str], overrides: list[str]) -> list[str]:
    return [*command, *(a for o in overrides for a in ("--set", o))]


def _run_and_lose(nodes: LocalMultiNodeCluster, args: list[str], tmp_path, url: str, actors: list[str], *,
                  after_step: int, timeout: float = 600) -> tuple[int, str, dict]:
    """Start `tidal ARGS`; once ``after_step`` is committed, kill the worker node the first of
    ``actors`` that runs on a worker node (not the head) runs on; wait for the driver's end.
    Returns (exit code, log, what was lost: node, actor, pids, placement)."""
    log = next_log(tmp_path)
    lost: dict = {}
    with open(log, "w") as out:
        proc = start(args, tmp_path, out, _env())
        try:
            deadline = time.monotonic() + timeout
            while steps_committed(url) < after_step and proc.poll() is None:
                assert time.monotonic() < deadline, f"the run did not reach step {after_step}"
                time.sleep(0.2)
            assert proc.poll() is None, log.read_text()[-3000:]
            placed = actor_nodes()
            workers = {n.node_id: n for n in nodes.workers}
            actor = next(a for a in actors if placed[a] in workers)  # never the head
            victim = workers[placed[actor]]
            lost = {"node": victim.node_id, "actor": actor, "placed": placed, "at": time.monotonic(),
                    "pids": nodes.kill(victim), "step": steps_committed(url)}
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            lost["ended_after_s"] = time.monotonic() - lost["at"]
        finally:
            end_group(proc)
    return code, log.read_text(), lost


def _alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def _trained_exactly_once(overrides: list[str], url: str, steps: int) -> tuple[int, int, list[dict]]:
    """Every prompt of the run trained once, steps 1..``steps`` committed once each; returns
    (samples lost, samples duplicated, step rows)."""
    summary, _, rows, prompts = final_state(url)
    assert summary.status == "finished"
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    cfg = load_config("tiny-cpu", overrides)
    want = sorted((e, i) for e, i, _ in prompts_for(cfg))
    assert len(prompts) == len(set(prompts)) == steps * cfg.step_required_samples
    assert sorted(prompts) == want
    return len(set(want) - set(prompts)), len(prompts) - len(set(prompts)), rows


def test_the_node_of_a_standalone_replica_lost_it_is_replaced_on_another_node_and_the_run_ends(
        with_pythonpath, tmp_path):
    """Head (trainer), two rollout nodes, one standalone replica and no hybrid: its node is lost
    after step 1; the replacement lands on the other rollout node, joins, and generates the rest:
    the run finishes, every prompt once."""
    steps = 4
    nodes = _cluster(NodeSpec(labels={ROLE: "rollout"}), NodeSpec(labels={ROLE: "rollout"}))
    with attached_to(nodes):
        rollout_nodes = {n.node_id for n in nodes.workers}
        url = store_url(tmp_path, "node")
        # no hybrid (no dynamic scheduling): the standalone replica is the only one generating, so
        # the run can carry on past the samples queued before the loss only once its replacement
        # serves; a replacement that never joins fails the run within sample_wait_timeout_s
        overrides = _overrides(tmp_path, nodes.address, steps, "rollout.replace_failed_replicas=true",
                               "rollout.max_replacements=1", "rollout.replacement_timeout_s=120",
                               "async_training.use_dynamic_resource_scheduling=false",
                               "async_training.sample_wait_timeout_s=240")
        t0 = time.monotonic()
        code, text, lost = _run_and_lose(nodes, _args(["run", "tiny-cpu"], overrides), tmp_path, url,
                                         [replica_name("standalone-0")], after_step=1)
        took = time.monotonic() - t0
        assert code == 0, text[-3000:]
        assert not _alive(lost["node"])
        placed = actor_nodes()
        print(text[-1500:])
    print(f"lost node after step {lost['step']} ({len(lost['pids'])} processes killed); run ended "
          f"{lost['ended_after_s']:.1f}s later, {took:.1f}s in all")

    # the replacement went to the other rollout node, never the dead one
    assert lost["node"] in rollout_nodes
    assert placed[replica_name("standalone-0.r1")] == (rollout_nodes - {lost["node"]}).pop(), placed
    lost_, duplicated, rows = _trained_exactly_once(overrides, url, steps)
    print("standalone/failed/replaced per step:",
          [(r["fully_async/rollouter/standalone_replicas"], r["fully_async/rollouter/failed_replicas"],
            r["fully_async/rollouter/replaced_replicas"]) for r in rows])
    assert rows[-1]["fully_async/rollouter/failed_replicas"] == 1.0
    assert rows[-1]["fully_async/rollouter/replaced_replicas"] == 1.0  # joined before the last step's sync
    assert rows[-1]["fully_async/rollouter/standalone_replicas"] == 1.0
    record("ray_node_lost_standalone", injected=1, survived=1, samples_lost=lost_, samples_duplicated=duplicated,
           killed_processes=len(lost["pids"]), after_step=lost["step"])


@pytest.mark.skipif(not CAMPAIGN, reason="the trainer-rank node case runs with the fault campaign "
                                         "(TIDAL_FAULT_REPORT), not in CI")
def test_the_node_of_a_trainer_rank_lost_the_run_stops_in_one_line_and_resumes_to_the_end(
        with_pythonpath, tmp_path):
    """Head (trainer node 0), a second trainer node, a rollout node; the trainer is 2 nodes × 1 rank.
    The node of the rank not on the head is lost after step 1: exit 3, one line naming `tidal
    resume`; a trainer node is added again and the resume finishes, every prompt once."""
    steps = 4
    nodes = _cluster(NodeSpec(labels={ROLE: "trainer"}), NodeSpec(labels={ROLE: "rollout"}))
    with attached_to(nodes):
        url = store_url(tmp_path, "node")
        overrides = _overrides(tmp_path, nodes.address, steps, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")
        head = nodes.cluster.head_node.node_id
        trainer_node = nodes.workers[0].node_id
        code, text, lost = _run_and_lose(nodes, _args(["run", "tiny-cpu"], overrides), tmp_path, url,
                                         [rank_name(1), rank_name(0)], after_step=1)
        # one rank on each trainer node (STRICT_SPREAD); the one on the worker node was lost
        assert {lost["placed"][rank_name(0)], lost["placed"][rank_name(1)]} == {head, trainer_node}
        assert lost["node"] == trainer_node
        lines = [line for line in text.strip().splitlines() if line.strip()]
        assert code == 3, text[-3000:]
        summary, state, *_ = final_state(url)
        uid = summary.uid
        assert "an actor of the run died" in lines[-1] and f"tidal resume {uid}" in lines[-1], lines[-5:]
        assert [line for line in lines if line.startswith("tidal:")] == [lines[-1]], lines[-5:]
        stopped_at = state.step
        print(f"lost {lost['actor']}'s node after step {lost['step']}: exit {code} {lost['ended_after_s']:.1f}s later, "
              f"at step {stopped_at}: {lines[-1]}")

        # the resume on the remaining nodes alone is refused in one line: one trainer node is missing
        code, text = _resume(uid, url, tmp_path, timeout=180)
        assert code == 2, text[-3000:]
        assert "too small for this config: it needs 2 trainer node(s)" in text.strip().splitlines()[-1]
        # a trainer node is back: the resume finishes the run
        nodes.workers.append(nodes.add_worker(NodeSpec(labels={ROLE: "trainer"})))
        code, text = _resume(uid, url, tmp_path, timeout=600)
        assert code == 0, text[-3000:]
    lost_, duplicated, _ = _trained_exactly_once(overrides, url, steps)
    record("ray_node_lost_trainer_rank", injected=1, survived=1, samples_lost=lost_, samples_duplicated=duplicated,
           killed_processes=len(lost["pids"]), stopped_at_step=stopped_at)


def _resume(uid: str, url: str, tmp_path, *, timeout: float) -> tuple[int, str]:
    log = next_log(tmp_path)
    with open(log, "w") as out:
        proc = start(["resume", uid, "--storage", url], tmp_path, out, _env())
        try:
            code = proc.wait(timeout=timeout)
        finally:
            end_group(proc)
    return code, log.read_text()
