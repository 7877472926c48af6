"""Fault campaign, standalone replicas killed: standalone replicas (simulated engine on `tiny-cpu`,
the preset's torch engine serving the HF model with `TIDAL_FAULT_PRESET=tiny-hf`; real torch
GRPO trainer with its hybrid, the real controller and `training_step` flows on a local Ray
cluster) are SIGKILLed at seeded random moments, each while it has requests in flight, across the
first steps of a run. Every prompt of the run is trained exactly once, the accounting holds after
every step, and the run finishes, with `rollout.replace_failed_replicas` off or on:

- off (the default): a dead replica stays out for the rest of the run (its GPU is lost until the
  run is resumed, which builds all replicas anew); the replica count and capacity reported by the
  rollout service drop with each loss, and the last steps run on the hybrid alone;
- on: every kill (replacements are killed too) is followed by a replacement `standalone-I.rK`
  that rejoins the load balancer within a bounded time holding the current param version (no
  result it returns is older than the version in force when its request was sent), and the
  replica count and capacity go back to the full values.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid

import pytest
import ray
import sqlalchemy as sa

from cluster.actors import ControllerHost, call, replica_name
from cluster.builders import DataPlane, hybrid_ids, prompts_for
from rollout.rollouter import sample_uid
from config import load_config, to_plain, write_resolved
from fault_report import record
from flows.training_step import training_step
from loop import LendPlan
from storage import create_run, make_engine, migrate, session_scope
from storage.models import Decision
from storage.store import consumed_prompts, load_resume_state, read_step_metrics
from tasks.run_ref import RunRef

pytestmark = pytest.mark.slow

SEED = 20261129
STEPS = 6
STEPS_HF = 8
"""Steps on tiny-hf: its rollout runs ahead of the trainer up to the staleness cap, and with 6 steps
the replacement test's fourth kill (late in step 4) found no standalone replica busy for 60 s: the
run's prompts were all generated. Two more steps keep them coming through the kills."""
STANDALONE = 3
PER_REPLICA = 4  # samples per replica: small enough that every lost replica lowers the capacity


SIMULATED = ["engines.rollout=simulated",
             # ~8 decode iterations of ~40 ms: a sample is in flight for a few hundred ms
             "sim.response_len_mean_start=8", "sim.response_len_sigma=0.3", "sim.decode_step_base_s=0.04",
             "sim.prompt_tokens=12"]
"""The rollout engine on ``tiny-cpu``; on ``tiny-hf`` the preset's own (``FaultPreset.rollout_overrides``)."""


def _start(preset, tmp_path, ray_address, *overrides, lend_hybrid=True, simulated=SIMULATED):
    cfg = load_config(preset.name, [
        f"storage.url=sqlite:///{tmp_path}/tidal.db", f"trainer.default_local_dir={tmp_path}/runs",
        f"trainer.total_training_steps={STEPS_HF if preset.hf else STEPS}", "async_training.trigger_parameter_sync_step=2",
        "async_training.dynamic_schedule_policy=fixed_ratio",
        f"async_training.concurrent_samples_per_replica={PER_REPLICA}",
        f"rollout.n_gpus_per_node={STANDALONE}", "actor_rollout_ref.rollout.response_length=8",
        *preset.overrides(), *preset.rollout_overrides(simulated), *overrides,
    ])
    assert cfg.hybrid_replicas == cfg.trainer_gpus  # one per trainer rank (TIDAL_FAULT_TRAINER_RANKS)
    uid = f"kill-{uuid.uuid4().hex[:8]}"
    engine = make_engine(cfg.storage.url)
    migrate(engine)
    with session_scope(engine) as s:
        create_run(s, uid=uid, name="kill", project="tests", policy=cfg.async_training.dynamic_schedule_policy,
                   seed=0, config=to_plain(cfg), output_dir=str(tmp_path / "runs" / uid))
    write_resolved(cfg, tmp_path / "runs" / uid)  # as `tidal run` does: validation (tiny-hf's) reads it
    plane = DataPlane.build(cfg, uid)
    run = RunRef.from_config(cfg, uid=uid, output_dir=str(tmp_path / "runs" / uid), ray_address=ray_address)
    run = run.model_copy(update={"wait_timeout_s": 120.0})
    ray.get(plane.controller.broadcast_sync.remote(0, False))  # no staleness window before the start
    ray.get(plane.rollout.start.remote(prompts_for(cfg)))
    if lend_hybrid:
        lend_all = LendPlan(step=0, count=cfg.hybrid_replicas, of=cfg.hybrid_replicas)
        ray.get(plane.controller.hybrid_sync.remote(lend_all, 0))
        ray.get(plane.controller.activate.remote(lend_all, []))
    return cfg, plane, run, engine


def _standalones_reached(plane, version: int) -> int:
    """How many standalone replicas the controller reaches now: what its broadcast at ``version``
    (the one in force, so nothing changes) loads, as the next step's would. It skips the replicas
    it knows dead, and a load that fails marks its replica dead."""
    return ray.get(call(plane.controller, ControllerHost.broadcast_sync, version, False)).replicas


def _version(engine, uid: str) -> int:
    """The param version of the run's last committed step."""
    with session_scope(engine) as s:
        return load_resume_state(s, uid).param_version


class Killer(threading.Thread):
    """Kills the standalone replicas in a seeded order, each in a seeded step after a seeded
    random delay, and only once it has requests in flight (mid-generation); notes what was in
    flight at that moment.

    With ``pick_at_kill`` the victim of each kill is drawn (seeded) at that moment among the
    standalone replicas routable and busy then, replacements included, so a slot can die more
    than once. (Drawn among the busy ones: late in a run only some replicas still get requests,
    and on ``tiny-hf`` the rollout runs ahead of the trainer, so a replica drawn while idle could
    stay idle until the run's last prompt was generated.)

    The wait for a busy victim is bounded in time spent inside steps (the test wraps each step
    in ``in_step``), not in wall time: on ``tiny-hf`` the rollout fills the queue up to the
    staleness cap, and then no request is in flight while the test waits between steps for a
    replacement to join (seen: the fourth kill timed out that way). Once the test calls
    ``run_ended`` a kill still waiting fails at once, naming it.
    """

    def __init__(self, plane: DataPlane, rng: random.Random, steps: list[int], delays: list[float],
                 *, pick_at_kill: bool = False):
        super().__init__(daemon=True)
        self.plane = plane
        self.rng = rng
        if pick_at_kill:
            self.order: list[str | None] = [None] * len(steps)
        else:
            self.order = rng.sample(sorted(plane.standalone), len(plane.standalone))
        self.schedule = list(zip(self.order, steps, delays, strict=True))
        self.step = 0
        self.killed: list[dict] = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # held by the test while it compares counts with the kills
        self._stepping = threading.Event()  # set while the test runs a step
        self._ended = threading.Event()

    @contextlib.contextmanager
    def in_step(self, step: int):
        """Wraps the test's step ``step``: the kills planned for it may start, and the time spent
        in it counts towards a kill's bound."""
        self.step = step
        self._stepping.set()
        try:
            yield
        finally:
            self._stepping.clear()

    def run_ended(self) -> None:
        self._ended.set()

    def _handle(self, rid: str):
        return self.plane.standalone.get(rid) or ray.get_actor(replica_name(rid), namespace=self.plane.namespace)

    def run(self) -> None:
        try:
            for planned, step, delay in self.schedule:
                while self.step < step and not self._ended.is_set():
                    time.sleep(0.01)
                time.sleep(delay)
                self._kill_when_busy(planned)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            self.error = exc

    def _busy(self, rids: list[str]) -> list[str]:
        return [rid for rid in rids if ray.get(self.plane.rollout.lb_in_flight.remote([rid])) > 0]

    def _kill_when_busy(self, planned: str | None) -> None:
        """Kill ``planned`` (or one drawn among the routable standalone replicas) at a moment it has
        requests in flight (read just before the kill). A drawn victim may have to wait for a
        replacement to join: every routable one may be dead by then."""
        budget = 60 + (0 if planned else REJOIN_S)  # seconds inside steps
        spent, last = 0.0, time.monotonic()
        while True:
            now = time.monotonic()
            if self._stepping.is_set():
                spent += now - last
            last = now
            if self._ended.is_set():
                raise TimeoutError(f"kill {len(self.killed) + 1} ({planned or 'drawn'}): the run ended before a "
                                   "standalone replica had a request in flight")
            routable = [planned] if planned else sorted(ray.get(self.plane.rollout.stats.remote())["standalone_replicas"])
            if busy := self._busy(routable):
                rid = planned or self.rng.choice(busy)
                with self.lock:
                    in_flight = ray.get(self.plane.rollout.in_flight_uids.remote())
                    on_replica = ray.get(self.plane.rollout.lb_in_flight.remote([rid]))
                    if on_replica > 0:  # still busy: its requests could have finished meanwhile
                        ray.kill(self._handle(rid), no_restart=True)
                        self.killed.append({"replica": rid, "step": self.step, "at": time.monotonic(),
                                            "wall": time.time(), "requests_on_it": on_replica,
                                            "samples_in_flight": in_flight})
                        return
            if spent > budget:
                raise TimeoutError(f"{planned or 'no routable standalone replica'}: no request in flight within "
                                   f"{budget:.0f} s of steps")
            time.sleep(0.005)


def _routable_standalone(plane, dead: set[str]) -> set[str]:
    """The standalone replicas still routable, once the rollouter noticed every kill so far (a kill
    a moment ago is noticed when its in-flight requests fail: within milliseconds on a quiet
    machine, but the tiny-hf campaign at load ~8 once still routed to a replica killed late in
    step 1 after 5 s, so the bound is 30 s)."""
    deadline = time.monotonic() + 30
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


def _check_every_prompt_trained_once(cfg, engine, run, trained: int, killer: Killer) -> tuple[list, list, list]:
    """The run went on to the end: every prompt of the run trained exactly once, and the samples
    in flight on each kill were finished elsewhere and trained. Returns (want, got, step rows)."""
    steps = cfg.trainer.total_training_steps
    assert trained == steps * cfg.step_required_samples
    want = sorted((e, i) for e, i, _ in prompts_for(cfg))
    with session_scope(engine) as s:
        got = consumed_prompts(s, run.uid)
        rows = read_step_metrics(s, run.uid)
    assert len(got) == len(set(got)) == trained  # nothing duplicated
    assert sorted(got) == want  # nothing lost
    trained_uids = {sample_uid(e, i) for e, i in got}
    for k in killer.killed:
        assert set(k["samples_in_flight"]) <= trained_uids, k
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return want, got, rows


def test_standalone_replicas_killed_at_random_moments_lose_and_duplicate_no_sample(tmp_path, ray_address, fault_preset):
    cfg, plane, run, engine = _start(fault_preset, tmp_path, ray_address)
    rng = random.Random(SEED)
    # one kill in each of three distinct steps among the first four, at a random moment in it
    killer = Killer(plane, rng, steps=sorted(rng.sample(range(1, 5), STANDALONE)),
                    delays=[rng.uniform(0.0, 1.0) for _ in range(STANDALONE)])
    try:
        trained, per_step = 0, []
        killer.start()
        for step in range(1, cfg.trainer.total_training_steps + 1):
            try:
                with killer.in_step(step):
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
        killer.run_ended()
        killer.join(timeout=60)
        assert killer.error is None, killer.error
        assert len(killer.killed) == STANDALONE, killer.killed
        assert all(k["requests_on_it"] > 0 for k in killer.killed)  # each died mid-generation
        assert len({k["step"] for k in killer.killed}) > 1, killer.killed  # spread over steps

        stats = ray.get(plane.rollout.stats.remote())
        # the loss is reflected: no standalone replica left, capacity of the hybrid alone at most
        assert sorted(stats["failed_replicas"]) == sorted(plane.standalone)
        assert set(stats["active_replicas"]) <= set(hybrid_ids(cfg))
        assert stats["max_concurrent_samples"] <= PER_REPLICA * cfg.hybrid_replicas
        assert stats["failed_requests"] >= STANDALONE
        assert _standalones_reached(plane, _version(engine, run.uid)) == 0
        print("per step (step, dead, routable standalone, max_concurrent_samples):", per_step)
        print("kills:", [(k["replica"], k["step"], k["requests_on_it"]) for k in killer.killed])

        want, got, rows = _check_every_prompt_trained_once(cfg, engine, run, trained, killer)
        assert stats["replaced_replicas"] == []  # the option is off
        record("standalone_replica_kill", injected=len(killer.killed), survived=len(killer.killed),
               samples_lost=len(set(want) - set(got)), samples_duplicated=len(got) - len(set(got)), replaced=0)
    finally:
        killer.join(timeout=5)
        plane.shutdown()


KILLS = 4
REJOIN_S = 60.0
"""Bound on a replacement's start: scheduled on the freed GPU, engine built, weights loaded, routable."""
REPLICAS = "fully_async/rollouter/standalone_replicas"
FAILED = "fully_async/rollouter/failed_replicas"
REPLACED = "fully_async/rollouter/replaced_replicas"


def _settled(plane, timeout_s: float = REJOIN_S) -> dict:
    """The rollout service's stats once no replacement is starting (or the bound ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(plane.rollout.stats.remote())
        if not stats["replacements_in_progress"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_killed_standalone_replicas_are_replaced_and_rejoin_at_the_current_version(tmp_path, ray_address,
                                                                                  fault_preset):
    """`rollout.replace_failed_replicas` on: four SIGKILLs at seeded random moments of the first
    four steps, each of a standalone replica drawn among those routable at that moment (so
    replacements are killed too). Proves: every death gets a replacement that joins the load
    balancer within ``REJOIN_S`` with the param version of the last broadcast (bounded by the
    step boundaries around it), and none of the results it returns was generated with weights
    older than the version in force when its request was sent; the routable standalone count and
    ``max_concurrent_samples`` come back to the full values, also in the per-step metrics; no
    sample is lost or duplicated, the accounting holds after every step, and the run finishes.

    A step that ends with a replacement still starting is followed by a wait (within ``REJOIN_S``)
    for it to join before the next step begins. A replacement starts in a fresh Ray worker that
    imports torch (and on ``tiny-hf`` transformers) and builds its engine, about 10 s of CPU: 35-40 s
    at a load average of 9-12 on 2 cores, while a ``tiny-hf`` step takes a few seconds. Without the
    wait all three replacements joined at version 8 of 8, with the run's prompts all generated, so
    the last kill found no busy replica and nothing showed that a replacement serves (seen twice)."""
    cfg, plane, run, engine = _start(fault_preset, tmp_path, ray_address, "rollout.replace_failed_replicas=true",
                                     f"rollout.max_replacements={KILLS}")  # the bound never bites here
    rng = random.Random(SEED + 1)
    killer = Killer(plane, rng, steps=sorted(rng.choices(range(1, 5), k=KILLS)),
                    delays=[rng.uniform(0.0, 1.0) for _ in range(KILLS)], pick_at_kill=True)
    try:
        trained, per_step, bounds = 0, [], []  # bounds: (step, wall time it started, wall time it ended)
        killer.start()
        for step in range(1, cfg.trainer.total_training_steps + 1):
            started = time.time()
            try:
                with killer.in_step(step):
                    result = training_step(run, step)
            except Exception:
                print("step", step, "failed; kills so far:", [(k["replica"], k["step"]) for k in killer.killed],
                      "per step:", per_step)
                raise
            bounds.append((step, started, time.time()))
            trained += result["trained"]
            run = run.model_copy(update={"consumed_before": trained})
            with killer.lock:
                stats = _check_accounting(plane, trained)
            per_step.append((step, [k["replica"] for k in killer.killed if k["step"] == step],
                             sorted(stats["standalone_replicas"]), stats["max_concurrent_samples"]))
            if stats["replacements_in_progress"]:  # the next step starts once they joined (docstring)
                _settled(plane)
        killer.run_ended()
        killer.join(timeout=60)
        assert killer.error is None, (killer.error, per_step)
        assert len(killer.killed) == KILLS, killer.killed
        assert all(k["requests_on_it"] > 0 for k in killer.killed)  # each died mid-generation
        killed = [k["replica"] for k in killer.killed]  # 4 distinct victims, so a replacement too

        stats = _settled(plane)
        deaths = stats["replaced_replicas"]
        print("per step (step, killed in it, routable standalone, max_concurrent_samples):", per_step)
        print("deaths:", [(d["failed"], d["replacement"], d["version"], round(d["joined_at"] - d["failed_at"], 2))
                          for d in deaths if d["joined_at"]])
        print("served:", stats["replica_versions"])
        # every kill was followed by exactly one replacement, which joined within the bound
        assert sorted(d["failed"] for d in deaths) == sorted(killed), deaths
        assert all(d["status"] == "joined" for d in deaths), deaths
        assert all(d["joined_at"] - d["failed_at"] <= REJOIN_S for d in deaths), deaths
        replacements = [d["replacement"] for d in deaths]
        assert len(set(replacements)) == KILLS and not set(replacements) & set(plane.standalone)
        # ... holding the version of the last broadcast: every replica held version v from the end
        # of step v on, and none before step v started
        for d in deaths:
            lowest = max((v for v, _, end in bounds if end <= d["failed_at"]), default=0)
            highest = max((v for v, start, _ in bounds if start <= d["joined_at"]), default=0)
            assert lowest <= d["version"] <= highest, (d, bounds)
        # ... and serving it: none of its results older than the version its request was sent at
        served = stats["replica_versions"]
        for d in deaths:
            got = served.get(d["replacement"])
            if got is not None:
                assert got["behind"] == 0 and got["min_version"] >= d["version"], (d, got)
        # replacements really took traffic: results came back from one, or one was killed with
        # requests in flight on it. Results alone are not enough on a loaded machine: a
        # replacement killed mid-generation may die before its first result comes back, and the
        # last ones may join after the last step, with the queue full (seen in CI: .r1 and .r2
        # killed in flight, .r3 and standalone-0.r1 joined at version 6 of 6)
        served_results = sum(served.get(r, {}).get("results", 0) for r in replacements)
        killed_in_flight = [k["replica"] for k in killer.killed if k["replica"] in replacements and k["requests_on_it"]]
        assert served_results > 0 or killed_in_flight, (deaths, served, killer.killed)
        assert all(entry["behind"] == 0 for entry in served.values()), served  # nor any other replica

        # the count and the capacity are back to the full values
        alive = (set(plane.standalone) | set(replacements)) - set(killed)
        assert sorted(stats["standalone_replicas"]) == sorted(alive) and len(alive) == STANDALONE, stats
        active = stats["active_replicas"]
        assert stats["max_concurrent_samples"] == min(len(active) * PER_REPLICA, stats["max_required_samples"])
        assert len(active) in (STANDALONE, STANDALONE + cfg.hybrid_replicas)  # + the hybrids when lent
        assert sorted(stats["failed_replicas"]) == sorted(killed)
        assert _standalones_reached(plane, _version(engine, run.uid)) == STANDALONE

        want, got, rows = _check_every_prompt_trained_once(cfg, engine, run, trained, killer)
        # the per-step metrics follow: counts at each step's sync, all back by the last one
        print("metrics (step, standalone, failed, replaced):",
              [(r["step"], r[REPLICAS], r[FAILED], r[REPLACED]) for r in rows])
        assert all(0 <= r[REPLICAS] <= STANDALONE for r in rows)
        assert [r[REPLACED] for r in rows] == sorted(r[REPLACED] for r in rows)
        joined_before_last = sum(d["joined_at"] <= rows[-1]["started_at"] for d in deaths)
        assert joined_before_last <= rows[-1][REPLACED] <= KILLS
        if joined_before_last == KILLS:
            assert rows[-1][REPLICAS] == STANDALONE and rows[-1][FAILED] == KILLS
        record("standalone_replica_kill", injected=len(killer.killed), survived=len(killer.killed),
               samples_lost=len(set(want) - set(got)), samples_duplicated=len(got) - len(set(got)),
               replaced=len(replacements))
    finally:
        killer.join(timeout=5)
        plane.shutdown()
    # shutdown ended the replacements with the rest (their names are freed once they are dead)
    deadline = time.monotonic() + 30
    while left := [rid for rid in replacements if _named(plane.namespace, replica_name(rid))]:
        assert time.monotonic() < deadline, left
        time.sleep(0.1)


def _named(namespace: str, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def _wait(predicate, what: str, timeout_s: float = REJOIN_S):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"no {what} after {timeout_s}s"
        time.sleep(0.01)
    return value


def _kill_mid_generation(plane, rid: str) -> None:
    _wait(lambda: ray.get(plane.rollout.lb_in_flight.remote([rid])) > 0, f"request in flight on {rid}")
    ray.kill(ray.get_actor(replica_name(rid), namespace=plane.namespace), no_restart=True)


def _stats(plane) -> dict:
    return ray.get(plane.rollout.stats.remote())


def test_a_replacement_started_across_a_broadcast_joins_at_the_new_version_and_the_bound_holds(
        tmp_path, ray_address, fault_preset):
    """One standalone replica, `max_replacements=2`, no Prefect flow: the rollout service and
    controller driven by hand. Proves: (1) a broadcast made while the replacement is still
    starting reaches it: it joins holding the new version and serves nothing older; (2) resume
    after a driver crash (a new data plane built in the same namespace, from the replacement
    state the last step committed, while the old actors, the replacement included, are still
    alive) ends the old replacement and continues the slot's ids and budget: the next
    replacement is `.r2`, not `.r1` again; (3) once the slot's two replacements over the run
    are spent, the slot stays out: no further actor, no routable standalone replica, capacity 0,
    the death recorded as `not_replaced`."""
    cfg, plane, _, _ = _start(fault_preset, tmp_path, ray_address, "rollout.n_gpus_per_node=1",
                              "rollout.replace_failed_replicas=true", "rollout.max_replacements=2", lend_hybrid=False)
    planes = [plane]
    try:
        _kill_mid_generation(plane, "standalone-0")
        _wait(lambda: _stats(plane)["replacements_in_progress"] == ["standalone-0.r1"], "replacement starting")
        ray.get(plane.controller.broadcast_sync.remote(1))  # the weights move on while it starts (window too)
        assert _stats(plane)["replacements_in_progress"] == ["standalone-0.r1"]  # the race really happened
        stats = _wait(lambda: (st := _stats(plane))["standalone_replicas"] == ["standalone-0.r1"] and st, "rejoin")
        (death,) = stats["replaced_replicas"]
        assert (death["failed"], death["replacement"], death["status"], death["version"]) == (
            "standalone-0", "standalone-0.r1", "joined", 1)
        assert stats["max_concurrent_samples"] == PER_REPLICA  # capacity back
        assert _standalones_reached(plane, 1) == 1
        served = _wait(lambda: _stats(plane)["replica_versions"].get("standalone-0.r1"), "result from it")
        assert served["min_version"] == 1 and served["behind"] == 0, served
        old = ray.get_actor(replica_name("standalone-0.r1"), namespace=plane.namespace)

        # what the step commits (tasks.commit: data_position["replacements"])
        committed = ray.get(plane.rollout.replacement_state.remote())
        assert committed == {"spent": {"standalone-0": 1}, "joined": 1}

        # a driver crash leaves the old actors behind; the resumed run's build ends them all
        planes.append(plane := DataPlane.build(cfg, plane.namespace, param_version=1, replacement_state=committed))
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(old.ping.remote(), timeout=30)
        ray.get(plane.controller.broadcast_sync.remote(1, False))
        ray.get(plane.rollout.start.remote(prompts_for(cfg)))
        _kill_mid_generation(plane, "standalone-0")
        _wait(lambda: _stats(plane)["standalone_replicas"] == ["standalone-0.r2"], "rejoin as the slot's second")
        assert ray.get(plane.rollout.on_weight_sync.remote(1))["fully_async/rollouter/replaced_replicas"] == 2

        _kill_mid_generation(plane, "standalone-0.r2")  # the slot's budget is spent now
        _wait(lambda: _stats(plane)["failed_replicas"] == ["standalone-0", "standalone-0.r2"], "second death noticed")
        time.sleep(1.0)  # nothing starts later either
        stats = _stats(plane)
        assert [(d["failed"], d["replacement"], d["status"]) for d in stats["replaced_replicas"]] == [
            ("standalone-0", "standalone-0.r2", "joined"), ("standalone-0.r2", None, "not_replaced")]
        assert stats["replacements_in_progress"] == [] and stats["standalone_replicas"] == []
        assert stats["max_concurrent_samples"] == 0 and stats["error"] is None
        assert sorted(ray.get(plane.rollout.standalone_handles.remote())) == ["standalone-0", "standalone-0.r2"]
        assert _standalones_reached(plane, 1) == 0
        assert ray.get(plane.rollout.replacement_state.remote()) == {"spent": {"standalone-0": 2}, "joined": 2}
    finally:
        for p in reversed(planes):
            p.shutdown()


def test_the_last_standalone_replica_dying_while_the_hybrid_sleeps_does_not_stall_training(
        tmp_path, ray_address, monkeypatch, fault_preset):
    """The hard case: the only standalone replica dies at the start of a micro-step, with the hybrid
    asleep (a static policy never lends it) and the queue short of a micro-step's samples. Nothing
    else generates, so the trainer would wait until its timeout; instead the hybrid is lent until
    the micro-step's samples are queued, and from the next step on the run is only-hybrid."""
    import flows.training_step as ts

    if fault_preset.hf:
        pytest.skip("needs a rollout-bound run, so that the queue is short when the replica dies: the simulated "
                    "engine's decode time gives one on tiny-cpu; tiny-hf's torch engine outpaces its trainer "
                    "(16 samples queued at the kill, 8 needed)")
    steps = 3
    cfg, plane, run, engine = _start(
        fault_preset, tmp_path, ray_address, "rollout.n_gpus_per_node=1", f"trainer.total_training_steps={steps}",
        "async_training.dynamic_schedule_policy=static_fully_async", lend_hybrid=False,
        simulated=[*SIMULATED, "sim.decode_step_base_s=0.1"])  # rollout-bound: the trainer drains the queue every step
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
        assert _standalones_reached(plane, _version(engine, run.uid)) == 0
        stats = ray.get(plane.rollout.stats.remote())
        assert rid not in stats["active_replicas"]
        assert trained == steps * cfg.step_required_samples
        with session_scope(engine) as s:
            got = consumed_prompts(s, run.uid)
        assert len(got) == len(set(got)) == trained
        assert sorted(got) == sorted((e, i) for e, i, _ in prompts_for(cfg))
        # the refill and the forced lend are recorded decisions: nothing switched unrecorded
        with session_scope(engine) as s:
            rows = s.execute(sa.select(Decision.hook, Decision.answer_json).where(Decision.step == kill_at[0])
                             .order_by(Decision.id)).all()
        assert [(hook, answer) for hook, answer in rows] == [
            ("refill_if_stranded", True), ("should_activate_after_step", cfg.hybrid_replicas), ("request_rebalance", False),
            ("update_after_step", None)]
    finally:
        plane.shutdown()
