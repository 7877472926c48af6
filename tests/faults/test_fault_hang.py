"""Fault campaign, a member that hangs rather than dies: a real process SIGSTOPped (its Ray actor
stays "alive", so nothing that waits for a death notices it). Every switch and sync call has a
deadline, the member is declared lost within it, and the run either goes on or stops in one line.

- CI: a standalone replica (`tiny-cpu`, simulated engine) SIGSTOPped while it has requests in
  flight is declared lost by the rollout service's heartbeat (`rollout.heartbeat_timeout_s`)
  within 1.25 deadlines, its unanswered requests are retried elsewhere, its process is ended, a
  replacement joins, and the run completes with every prompt trained exactly once.
- Campaign only (`TIDAL_FAULT_REPORT` set): `tidal run` whose trainer actor (it hosts the hybrid)
  is SIGSTOPped as the hybrid sync, the take-back and the broadcast begin (failpoint
  `TIDAL_HANG_TRAINER_AT`); each time the driver stops with exit 3 and one line naming the resume
  command within the deadline (`async_training.switch_call_timeout_s`; the broadcast's:
  `actor_rollout_ref.rollout.weight_sync.timeout_s` + 30 s), the stopped process is gone, and
  `tidal resume` ends exactly where an uninterrupted run ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from driver_support import assert_resumed_exactly, config_args, final_state, run_tidal, store_url
from fault_report import record
from test_fault_replica_kill import _check_accounting, _check_every_prompt_trained_once, _settled, _start

from cluster.actors.controller_actor import HANG_TRAINER_AT_ENV
from cluster.actors.remote_engine import local_pid
from flows.training_step import training_step

pytestmark = pytest.mark.slow

HEARTBEAT_S = 6.0
"""The CI case's `rollout.heartbeat_timeout_s`: small, so the case is short; large enough that a
healthy replica on a loaded 2-core machine answers its pings."""


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _end(pid: int | None) -> None:
    """Teardown: nothing this test stopped is left (the run should have ended it already)."""
    if pid is None or not _alive(pid):
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


class Stopper(threading.Thread):
    """SIGSTOPs standalone replica ``rid``'s process at a moment it has requests in flight (read
    just before), once step ``step`` has begun; notes what was in flight then."""

    def __init__(self, plane, rid: str, step: int = 1):
        super().__init__(daemon=True)
        self.plane, self.rid, self.at_step = plane, rid, step
        self.step = 0
        self.pid = local_pid(plane.standalone[rid])
        self.stopped: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.step < self.at_step:
                time.sleep(0.01)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if ray.get(self.plane.rollout.lb_in_flight.remote([self.rid])) > 0:
                    in_flight = ray.get(self.plane.rollout.in_flight_uids.remote())
                    os.kill(self.pid, signal.SIGSTOP)
                    self.stopped = {"replica": self.rid, "at": time.time(), "samples_in_flight": in_flight,
                                    "pid": self.pid}
                    return
                time.sleep(0.005)
            raise TimeoutError(f"{self.rid} had no request in flight within 120 s")
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            self.error = exc


def test_a_standalone_replica_that_hangs_mid_generation_is_declared_lost_and_replaced(
        tmp_path, ray_address, fault_preset):
    cfg, plane, run, engine = _start(
        fault_preset, tmp_path, ray_address, "trainer.total_training_steps=4", "rollout.n_gpus_per_node=2",
        "rollout.replace_failed_replicas=true", "rollout.max_replacements=1",
        f"rollout.heartbeat_timeout_s={HEARTBEAT_S}", "async_training.switch_call_timeout_s=30")
    rid = "standalone-0"
    stopper = Stopper(plane, rid)
    assert stopper.pid is not None and _alive(stopper.pid)
    try:
        stopper.start()
        trained = 0
        for step in range(1, cfg.trainer.total_training_steps + 1):
            stopper.step = step
            result = training_step(run, step)
            trained += result["trained"]
            run = run.model_copy(update={"consumed_before": trained})
            _check_accounting(plane, trained)
            if step == 1:  # the next steps begin once the stopped replica is declared lost
                stopper.join(timeout=150)
                assert stopper.error is None, stopper.error
                assert stopper.stopped is not None
                deadline = time.monotonic() + 2 * HEARTBEAT_S + 60
                while not ray.get(plane.rollout.stats.remote())["hung_replicas"]:
                    assert time.monotonic() < deadline, "the stopped replica was never declared lost"
                    time.sleep(0.05)
        stats = _settled(plane)
        stopped = stopper.stopped
        print("stopped:", {k: v for k, v in stopped.items() if k != "samples_in_flight"},
              "hung:", stats["hung_replicas"], "replaced:", stats["replaced_replicas"])
        hung = {h["replica"]: h for h in stats["hung_replicas"]}
        assert rid in hung, stats["hung_replicas"]
        # declared lost within the deadline: a ping every quarter of it, each waited for up to it
        # (plus room for a loaded machine's scheduling: a bound on liveness, not on speed)
        assert hung[rid]["at"] - stopped["at"] <= 1.25 * HEARTBEAT_S + 30, (hung[rid], stopped)
        assert not _alive(stopped["pid"]), "the stopped process was not ended"
        assert rid in stats["failed_replicas"] and rid not in stats["active_replicas"]
        (death,) = [d for d in stats["replaced_replicas"] if d["failed"] == rid]
        assert death["replacement"] == f"{rid}.r1", death
        want, got, _ = _check_every_prompt_trained_once(cfg, engine, run, trained, _Stopped(stopped))
        record("standalone_replica_hang", injected=1, survived=1, samples_lost=len(set(want) - set(got)),
               samples_duplicated=len(got) - len(set(got)), moment="generation",
               deadline_key="rollout.heartbeat_timeout_s", detected_s=round(hung[rid]["at"] - stopped["at"], 2),
               requests_failed_over=hung[rid]["requests_failed_over"], replacement=death["status"])
    finally:
        stopper.join(timeout=5)
        _end(stopper.pid)
        plane.shutdown()


class _Stopped:
    """What ``_check_every_prompt_trained_once`` reads of a killer: the samples in flight at each fault."""

    def __init__(self, stopped: dict):
        self.killed = [stopped]


# ------------------------------------------------------------------ the campaign's cases

STEPS = 5  # the uninterrupted run is the session's, shared with test_fault_rank_kill.py
SWITCH_S = 15.0
SYNC_S = 5.0
DEADLINES = ["--set", f"async_training.switch_call_timeout_s={SWITCH_S:g}",
             "--set", f"actor_rollout_ref.rollout.weight_sync.timeout_s={SYNC_S:g}"]
SHUTDOWN_S = 120.0
"""Room after the deadline for the driver to stop: the data plane's shutdown and Prefect's exit."""

MOMENTS = [  # (failpoint, its deadline in seconds, the config key of that deadline)
    ("hybrid_sync:1", SWITCH_S, "async_training.switch_call_timeout_s"),  # step 1 lends (the policy's odd steps)
    ("take_back:2", SWITCH_S, "async_training.switch_call_timeout_s"),  # ... and step 2 takes it back
    ("broadcast:4", SYNC_S + 30, "actor_rollout_ref.rollout.weight_sync.timeout_s + 30"),
]


CAMPAIGN_ONLY = pytest.mark.skipif(
    not os.environ.get("TIDAL_FAULT_REPORT"),
    reason="stopped runs and their resumes run with the fault campaign (benchmarks/fault_campaign.py sets "
           "TIDAL_FAULT_REPORT), not in CI")


def _stop_and_resume(tmp_path, ray_address, straight: str, moments, extra: list[str]) -> tuple[int, int, list]:
    """`tidal run` (then `tidal resume`) with each failpoint of ``moments`` in turn, each stopping
    the driver with exit 3 and the resume line within its deadline; then a resume to the end.
    Returns (samples lost, samples duplicated, per moment: seconds from the stop to the exit)."""
    stopped = store_url(tmp_path, "stopped")
    pids: list[int] = []
    uid, took = None, []
    try:
        for i, (moment, deadline_s, _key) in enumerate(moments):
            pid_file = tmp_path / f"hang-{i}.pid"
            args = (["run", "tiny-cpu", *config_args(tmp_path, ray_address, "stopped", STEPS), *extra, *DEADLINES]
                    if uid is None else ["resume", uid, "--storage", stopped])  # a resume keeps the run's config
            code, log = run_tidal(args, tmp_path, extra={HANG_TRAINER_AT_ENV: f"{moment}@{pid_file}"},
                                  timeout=600)
            ended = time.time()
            assert pid_file.exists(), f"{moment}: the failpoint never fired (exit {code}): {log[-3000:]}"
            pid, stopped_at = pid_file.read_text().split()
            pids.append(int(pid))
            uid = uid or final_state(stopped)[0].uid
            assert code == 3, (moment, log[-3000:])
            last = log.strip().splitlines()[-1]
            assert "an actor of the run died" in last and "ActorHung" in last and f"tidal resume {uid}" in last, last
            took.append(round(ended - float(stopped_at), 1))
            assert took[-1] <= deadline_s + SHUTDOWN_S, (moment, took[-1])
            assert not _alive(int(pid)), f"{moment}: the stopped process was not ended"
            print(moment, "stopped the run in", took[-1], "s:", last[:200])
        code, log = run_tidal(["resume", uid, "--storage", stopped], tmp_path, timeout=600)
        assert code == 0, log[-3000:]
        lost, duplicated = assert_resumed_exactly(straight, stopped, STEPS)
    finally:
        for pid in pids:
            _end(pid)
    return lost, duplicated, took


@pytest.mark.timeout(1800)
@CAMPAIGN_ONLY
def test_a_trainer_that_hangs_in_a_switch_or_a_sync_stops_the_run_in_one_line_and_resumes_exactly(
        tmp_path, ray_address, uninterrupted):
    straight = store_url(uninterrupted(STEPS), "straight")
    lost, duplicated, took = _stop_and_resume(tmp_path, ray_address, straight, MOMENTS, [])
    for (moment, deadline_s, key), s in zip(MOMENTS, took, strict=True):
        record("trainer_hang", injected=1, survived=1, samples_lost=lost, samples_duplicated=duplicated,
               moment=moment.split(":")[0], point=moment, deadline_key=key, deadline_s=deadline_s, stopped_in_s=s)


RANKS = ["--set", "trainer.n_gpus_per_node=2"]
RANK_MOMENTS = [("take_back:2/rank0", SWITCH_S, "async_training.switch_call_timeout_s")]
"""Rank 0 of a 2-rank trainer hosts the lent hybrid: the take-back's first call (pause) waits on it."""


@pytest.mark.timeout(1500)
@CAMPAIGN_ONLY
def test_a_trainer_rank_that_hangs_in_a_take_back_stops_the_run_in_one_line_and_resumes_exactly(
        tmp_path, ray_address, uninterrupted):
    straight = store_url(uninterrupted(STEPS, *RANKS), "straight")  # the one test_fault_rank_kill.py compares with
    lost, duplicated, took = _stop_and_resume(tmp_path, ray_address, straight, RANK_MOMENTS, RANKS)
    for (moment, deadline_s, key), s in zip(RANK_MOMENTS, took, strict=True):
        record("trainer_hang", injected=1, survived=1, samples_lost=lost, samples_duplicated=duplicated,
               moment="take_back", point=moment, deadline_key=key, deadline_s=deadline_s, stopped_in_s=s)
