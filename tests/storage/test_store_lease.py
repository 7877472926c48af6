"""The driver lease: one live holder per run, stale holders taken over, and the status a reader sees."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from storage import (
    LeaseHeld,
    LeaseHolder,
    acquire_lease,
    create_run,
    effective_status,
    lease_of,
    release_lease,
    renew_lease,
    run_statuses,
    session_scope,
)
from storage.lease import process_alive, process_started

ME = os.getpid()


def _run(engine, uid: str = "r1") -> None:
    with session_scope(engine) as s:
        create_run(s, uid=uid, name="n", project="p", policy="default", seed=0, config={}, output_dir="/out")


def _take(engine, driver: str, *, now: float, host: str = "here", pid: int = ME, timeout_s: float = 30.0):
    with session_scope(engine, immediate=True) as s:
        return acquire_lease(s, "r1", driver_id=driver, host=host, pid=pid, pid_started=process_started(pid),
                             timeout_s=timeout_s, now=now)


def test_a_second_driver_is_refused_while_the_first_one_is_alive_and_the_refusal_names_it(engine):
    _run(engine)
    assert _take(engine, "d1", now=100.0) is None
    with pytest.raises(LeaseHeld) as refused:
        _take(engine, "d2", now=110.0)
    assert str(refused.value) == (f"run 'r1' is already being driven by driver d1 (pid {ME} on here, last heartbeat "
                                  f"{refused.value.holder.describe().split('heartbeat ')[1]}; stop that one first "
                                  f"(nothing was written)")
    with session_scope(engine) as s:
        assert lease_of(s, "r1") == LeaseHolder("d1", "here", ME, process_started(ME), 100.0, 100.0, 30.0)


def test_a_lease_whose_heartbeat_stopped_is_taken_over_and_the_old_holder_is_returned(engine):
    _run(engine)
    _take(engine, "d1", now=100.0, host="elsewhere")
    previous = _take(engine, "d2", now=131.0)
    assert previous == LeaseHolder("d1", "elsewhere", ME, process_started(ME), 100.0, 100.0, 30.0)
    with session_scope(engine) as s:
        assert lease_of(s, "r1").driver_id == "d2"


def test_a_lease_whose_process_is_gone_on_this_host_is_taken_over_at_once(engine):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _run(engine)
    _take(engine, "d1", now=100.0, pid=dead.pid)
    assert _take(engine, "d2", now=101.0).driver_id == "d1"


def test_renewing_moves_the_heartbeat_and_fails_once_the_lease_was_taken_over(engine):
    _run(engine)
    _take(engine, "d1", now=100.0, host="elsewhere")
    with session_scope(engine) as s:
        assert renew_lease(s, "r1", "d1", 120.0) is True
        assert lease_of(s, "r1").heartbeat_at == 120.0
    _take(engine, "d2", now=151.0)
    with session_scope(engine) as s:
        assert renew_lease(s, "r1", "d1", 152.0) is False
        release_lease(s, "r1", "d1")  # not d1's any more: d2 keeps it
        assert lease_of(s, "r1").driver_id == "d2"
        release_lease(s, "r1", "d2")
        assert lease_of(s, "r1") is None


def test_a_running_run_reads_interrupted_once_its_heartbeat_is_older_than_the_timeout(engine):
    _run(engine)
    _take(engine, "d1", now=100.0, timeout_s=5.0)
    with session_scope(engine) as s:
        assert run_statuses(s, now=104.0) == {"r1": "running"}
        assert run_statuses(s, now=106.0) == {"r1": "interrupted"}
        release_lease(s, "r1", "d1")
        assert run_statuses(s, now=104.0) == {"r1": "interrupted"}


def test_only_a_running_run_can_read_as_interrupted():
    assert [effective_status(s, None, 0.0) for s in ("running", "finished", "failed", "interrupted")] == [
        "interrupted", "finished", "failed", "interrupted"]


def test_a_live_process_is_alive_and_a_reused_pid_with_another_start_time_is_not():
    assert (process_alive(ME), process_alive(ME, process_started(ME)), process_alive(ME, process_started(ME) + 1)) == (
        True, True, False)
