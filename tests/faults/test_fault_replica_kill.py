"""Fault campaign, standalone replicas killed: three standalone replicas (simulated engine, real
torch GRPO trainer with its hybrid, the real controller and `training_step` flows on a local Ray
cluster) are SIGKILLed one after another at seeded random moments, each while it has requests in
flight, across the first steps of a run. The run goes on (the last steps on the hybrid alone),
every prompt of the run is trained exactly once, the accounting holds after every step, and the
replica count and capacity reported by the rollout service drop with each loss.

A replacement replica that rejoins is not built: a dead standalone replica stays out for the rest
of the run (its GPU is lost until the run is resumed, which builds all replicas anew).
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
import ray

from cluster.builders import DataPlane, prompts_for
from cluster.rollouter import sample_uid
from cluster.ray_cluster import LocalRayCluster
from config import load_config, to_plain
from flows.training_step import training_step
from storage import create_run, make_engine, migrate, session_scope
from storage.store import consumed_prompts, step_metrics
from tasks.run_ref import RunRef

pytestmark = pytest.mark.slow

SEED = 20261129
STEPS = 6
STANDALONE = 3
PER_REPLICA = 4  # samples per replica: small enough that every lost replica lowers the capacity


@pytest.fixture(scope="module")
def ray_address():
    """This module's own Ray head (or the session's, when another test folder already made one)."""
    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    cluster = LocalRayCluster(num_cpus=2, gpus=4, memory_gb=4.0, object_store_memory_gb=0.5).start()
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


def _start(tmp_path, ray_address, *overrides, lend_hybrid=True):
    cfg = load_config("tiny-cpu", [
        f"storage.url=sqlite:///{tmp_path}/tidal.db", f"trainer.default_local_dir={tmp_path}/runs",
        f"trainer.total_training_steps={STEPS}", "async_training.trigger_parameter_sync_step=2",
        "async_training.dynamic_schedule_policy=fixed_ratio",
        f"async_training.concurrent_samples_per_replica={PER_REPLICA}",
        f"rollout.n_gpus_per_node={STANDALONE}",
        "engines.rollout=simulated", "actor_rollout_ref.rollout.response_length=8",
        # ~8 decode iterations of ~40 ms: a sample is in flight for a few hundred ms
        "sim.response_len_mean_start=8", "sim.response_len_sigma=0.3", "sim.decode_step_base_s=0.04",
        "sim.prompt_tokens=12", *overrides,
    ])
    assert cfg.hybrid_replicas == 1
    uid = f"kill-{uuid.uuid4().hex[:8]}"
    engine = make_engine(cfg.storage.url)
    migrate(engine)
    with session_scope(engine) as s:
        create_run(s, uid=uid, name="kill", project="tests", policy=cfg.async_training.dynamic_schedule_policy,
                   seed=0, config=to_plain(cfg), output_dir=str(tmp_path / "runs" / uid))
    plane = DataPlane.build(cfg, uid)
    run = RunRef.from_config(cfg, uid=uid, output_dir=str(tmp_path / "runs" / uid), ray_address=ray_address)
    run = run.model_copy(update={"wait_timeout_s": 120.0})
    ray.get(plane.controller.broadcast.remote(0))
    ray.get(plane.rollout.start.remote(prompts_for(cfg)))
    if lend_hybrid:
        ray.get(plane.controller.call.remote("hybrid_sync", 0))
        ray.get(plane.controller.call.remote("activate"))
    ray.get(plane.controller.drain_records.remote())
    return cfg, plane, run, engine


class Killer(threading.Thread):
    """Kills the standalone replicas in a seeded order, each in a seeded step after a seeded
    random delay, and only once it has requests in flight (mid-generation); notes what was in
    flight at that moment. The test sets ``step`` as its steps begin."""

    def __init__(self, plane: DataPlane, rng: random.Random, steps: list[int], delays: list[float]):
        super().__init__(daemon=True)
        self.plane = plane
        self.order = rng.sample(sorted(plane.standalone), len(plane.standalone))
        self.schedule = list(zip(self.order, steps, delays, strict=True))
        self.step = 0
        self.killed: list[dict] = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # held by the test while it compares counts with the kills

    def run(self) -> None:
        try:
            for rid, step, delay in self.schedule:
                while self.step < step:
                    time.sleep(0.01)
                time.sleep(delay)
                deadline = time.monotonic() + 60
                while ray.get(self.plane.rollout.lb_in_flight.remote([rid])) == 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{rid} never had a request in flight")
                    time.sleep(0.005)
                with self.lock:
                    in_flight = ray.get(self.plane.rollout.in_flight_uids.remote())
                    on_replica = ray.get(self.plane.rollout.lb_in_flight.remote([rid]))
                    ray.kill(self.plane.standalone[rid], no_restart=True)
                    self.killed.append({"replica": rid, "step": self.step, "at": time.monotonic(),
                                        "requests_on_it": on_replica, "samples_in_flight": in_flight})
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            self.error = exc


def _routable_standalone(plane, dead: set[str]) -> set[str]:
    """The standalone replicas still routable, once the rollouter noticed every kill so far (a kill
    a moment ago is noticed when its in-flight requests fail, within milliseconds)."""
    deadline = time.monotonic() + 5
    while True:
        routable = set(ray.get(plane.rollout.stats.remote())["active_replicas"]) & set(plane.standalone)
        if not (routable & dead) or time.monotonic() > deadline:
            return routable
        time.sleep(0.01)


def _check_accounting(plane, trained: int) -> dict:
    stats = ray.get(plane.rollout.stats.remote())
    assert stats["error"] is None, stats["error"]
    assert stats["total_generated_samples"] == trained + stats["queue_size"]
    assert stats["total_started_samples"] == stats["total_generated_samples"] + stats["in_flight_samples"]
    active = stats["active_replicas"]
    assert len(active) == len(set(active))
    assert stats["max_concurrent_samples"] == min(len(active) * PER_REPLICA, stats["max_required_samples"])
    return stats


def test_standalone_replicas_killed_at_random_moments_lose_and_duplicate_no_sample(tmp_path, ray_address):
    cfg, plane, run, engine = _start(tmp_path, ray_address)
    rng = random.Random(SEED)
    # one kill in each of three distinct steps among the first four, at a random moment in it
    killer = Killer(plane, rng, steps=sorted(rng.sample(range(1, 5), STANDALONE)),
                    delays=[rng.uniform(0.0, 1.0) for _ in range(STANDALONE)])
    try:
        trained, per_step = 0, []
        killer.start()
        for step in range(1, STEPS + 1):
            killer.step = step
            try:
                result = training_step(run, step)
            except Exception:
                print("step", step, "failed; kills so far:", [(k["replica"], k["step"]) for k in killer.killed],
                      "per step:", per_step)
                raise
            trained += result["trained"]
            run = run.model_copy(update={"consumed_before": trained})
            with killer.lock:
                dead = {k["replica"] for k in killer.killed}
                routable = _routable_standalone(plane, dead)
                stats = _check_accounting(plane, trained)  # capacity = routable replicas x per replica
            per_step.append((step, sorted(dead), sorted(routable), stats["max_concurrent_samples"]))
            assert routable == set(plane.standalone) - dead, per_step  # the count reflects each loss
        killer.join(timeout=60)
        assert killer.error is None, killer.error
        assert len(killer.killed) == STANDALONE, killer.killed
        assert all(k["requests_on_it"] > 0 for k in killer.killed)  # each died mid-generation
        assert len({k["step"] for k in killer.killed}) > 1, killer.killed  # spread over steps

        stats = ray.get(plane.rollout.stats.remote())
        # the loss is reflected: no standalone replica left, capacity of the hybrid alone at most
        assert sorted(stats["failed_replicas"]) == sorted(plane.standalone)
        assert set(stats["active_replicas"]) <= {"hybrid-0"}
        assert stats["max_concurrent_samples"] <= PER_REPLICA
        assert stats["failed_requests"] >= STANDALONE
        assert ray.get(plane.controller.standalone_alive.remote()) == 0
        print("per step (step, dead, routable standalone, max_concurrent_samples):", per_step)
        print("kills:", [(k["replica"], k["step"], k["requests_on_it"]) for k in killer.killed])

        # the run went on to the end: every prompt of the run trained exactly once
        assert trained == STEPS * cfg.step_required_samples
        want = sorted((e, i) for e, i, _ in prompts_for(cfg))
        with session_scope(engine) as s:
            got = consumed_prompts(s, run.uid)
            rows = step_metrics(s, run.uid)
        assert len(got) == len(set(got)) == trained  # nothing duplicated
        assert sorted(got) == want  # nothing lost
        # the samples that were in flight on each kill were finished elsewhere and trained
        trained_uids = {sample_uid(e, i) for e, i in got}
        for k in killer.killed:
            assert set(k["samples_in_flight"]) <= trained_uids, k
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    finally:
        killer.join(timeout=5)
        plane.shutdown()


def test_the_last_standalone_replica_dying_while_the_hybrid_sleeps_does_not_stall_training(
        tmp_path, ray_address, monkeypatch):
    """The hard case: the only standalone replica dies at the start of a micro-step, with the hybrid
    asleep (a static policy never lends it) and the queue short of a micro-step's samples. Nothing
    else generates, so the trainer would wait until its timeout; instead the hybrid is lent until
    the micro-step's samples are queued, and from the next step on the run is only-hybrid."""
    import flows.training_step as ts

    steps = 3
    cfg, plane, run, engine = _start(
        tmp_path, ray_address, "rollout.n_gpus_per_node=1", f"trainer.total_training_steps={steps}",
        "async_training.dynamic_schedule_policy=static_fully_async",
        "sim.decode_step_base_s=0.1",  # rollout-bound: the trainer drains the queue every step
        lend_hybrid=False)
    run = run.model_copy(update={"wait_timeout_s": 45.0})  # a stall fails fast
    (rid,) = plane.standalone
    kill_at = (2, 1)  # step 2, second micro-step: the hybrid is asleep, the queue nearly empty
    seen = {}
    original = ts.run_phase

    def run_phase(phase, run_ref, step, *args):
        if phase is ts.train and (step, args[0]) == kill_at:
            seen["queue_at_kill"] = ray.get(plane.rollout.queue_size.remote())
            seen["hybrid_active_at_kill"] = ray.get(plane.controller.hybrid_active.remote())
            ray.kill(plane.standalone[rid], no_restart=True)
        return original(phase, run_ref, step, *args)

    monkeypatch.setattr(ts, "run_phase", run_phase)
    try:
        trained = 0
        for step in range(1, steps + 1):
            result = training_step(run, step)
            trained += result["trained"]
            run = run.model_copy(update={"consumed_before": trained})
            _check_accounting(plane, trained)
        print("at the kill:", seen)
        assert seen["hybrid_active_at_kill"] is False
        assert seen["queue_at_kill"] < cfg.required_samples, seen  # it really was stranded
        assert ray.get(plane.controller.standalone_alive.remote()) == 0
        stats = ray.get(plane.rollout.stats.remote())
        assert rid not in stats["active_replicas"]
        assert trained == steps * cfg.step_required_samples
        with session_scope(engine) as s:
            got = consumed_prompts(s, run.uid)
        assert len(got) == len(set(got)) == trained
        assert sorted(got) == sorted((e, i) for e, i, _ in prompts_for(cfg))
    finally:
        plane.shutdown()
