"""One driver per run: the lease a driver holds on its run, and the status a reader should show.

Owns: taking, renewing and releasing the ``driver_leases`` row, telling a live holder from a dead
one, and ``effective_status`` (a ``running`` run whose driver is gone reads as ``interrupted``).
Like every store function these take a Session, flush and never commit; take a lease inside
``session_scope(engine, immediate=True)`` so that two drivers cannot both win. Must not: start,
signal or end processes (``flows.leftovers`` ends a dead driver's servers).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

from storage.engine import StoreError
from storage.models import DriverLease, Run, RunStatus

__all__ = ["LeaseHeld", "LeaseHolder", "acquire_lease", "effective_status", "lease_of", "process_alive",
           "process_started", "release_lease", "renew_lease", "run_statuses"]


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds (or held) a run's lease."""

    driver_id: str
    host: str
    pid: int
    pid_started: int
    acquired_at: float
    heartbeat_at: float
    timeout_s: float

    def describe(self, now: float | None = None) -> str:
        ago = (time.time() if now is None else now) - self.heartbeat_at
        return f"driver {self.driver_id} (pid {self.pid} on {self.host}, last heartbeat {ago:.0f}s ago)"

    def stale(self, now: float, host: str) -> bool:
        """Whether the holder is gone: no heartbeat within ``timeout_s``, or (on this host) its
        process no longer exists."""
        if now - self.heartbeat_at > self.timeout_s:
            return True
        return self.host == host and not process_alive(self.pid, self.pid_started)


class LeaseHeld(StoreError):
    """Another live driver holds the run's lease; ``holder`` says who."""

    def __init__(self, uid: str, holder: LeaseHolder) -> None:
        super().__init__(f"run {uid!r} is already being driven by {holder.describe()}; "
                         f"stop that one first (nothing was written)")
        self.holder = holder


def process_started(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (0 when unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])


def process_alive(pid: int, started: int = 0) -> bool:
    """Whether process ``pid`` exists, is not a zombie and (when ``started`` is known) is the one
    that started at that tick, not a later process given the same pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return not Path("/proc/self").exists()  # no procfs: trust the signal probe
    if fields[0] == "Z":
        return False
    return not started or int(fields[19]) == started


def _holder(row: DriverLease) -> LeaseHolder:
    return LeaseHolder(row.driver_id, row.host, row.pid, row.pid_started, row.acquired_at, row.heartbeat_at,
                       row.timeout_s)


def _run_id(session: Session, uid: str) -> int:
    run_id = session.scalar(sa.select(Run.id).where(Run.uid == uid))
    if run_id is None:
        raise StoreError(f"no run {uid!r} in the store")
    return run_id


def lease_of(session: Session, uid: str) -> LeaseHolder | None:
    """The run's current lease, live or stale, or None."""
    row = session.scalars(sa.select(DriverLease).join(Run, Run.id == DriverLease.run_id)
                          .where(Run.uid == uid)).one_or_none()
    return None if row is None else _holder(row)


def acquire_lease(session: Session, uid: str, *, driver_id: str, host: str, pid: int, pid_started: int,
                  timeout_s: float, now: float) -> LeaseHolder | None:
    """Take the run's lease for this driver. Returns the stale holder it took over (its leftovers
    are the caller's to end), or None when the run had no lease. ``LeaseHeld`` when a live driver
    holds it."""
    run_id = _run_id(session, uid)
    row = session.scalars(sa.select(DriverLease).where(DriverLease.run_id == run_id).with_for_update()).one_or_none()
    previous = None
    if row is not None:
        previous = _holder(row)
        if previous.driver_id != driver_id and not previous.stale(now, host):
            raise LeaseHeld(uid, previous)
        session.delete(row)
        session.flush()
    session.add(DriverLease(run_id=run_id, driver_id=driver_id, host=host, pid=pid, pid_started=pid_started,
                            acquired_at=now, heartbeat_at=now, timeout_s=timeout_s))
    session.flush()
    return previous if previous is not None and previous.driver_id != driver_id else None


def renew_lease(session: Session, uid: str, driver_id: str, now: float) -> bool:
    """Move this driver's heartbeat to ``now``; False when the lease is no longer this driver's."""
    run_id = _run_id(session, uid)
    result = session.execute(sa.update(DriverLease)
                             .where(DriverLease.run_id == run_id, DriverLease.driver_id == driver_id)
                             .values(heartbeat_at=now))
    session.flush()
    return result.rowcount == 1


def release_lease(session: Session, uid: str, driver_id: str) -> None:
    """Give the lease up (only this driver's: a lease taken over meanwhile stays)."""
    run_id = _run_id(session, uid)
    session.execute(sa.delete(DriverLease).where(DriverLease.run_id == run_id, DriverLease.driver_id == driver_id))
    session.flush()


def effective_status(status: str, lease: LeaseHolder | None, now: float) -> str:
    """What to show for a run whose row says ``status``: a ``running`` run is ``interrupted``
    once its driver's heartbeat is older than the lease's timeout (or it has no lease at all)."""
    if status != RunStatus.RUNNING.value:
        return status
    if lease is None or now - lease.heartbeat_at > lease.timeout_s:
        return RunStatus.INTERRUPTED.value
    return status


def run_statuses(session: Session, now: float | None = None) -> dict[str, str]:
    """``{run uid: effective status}`` for every run (what ``tidal runs`` should print)."""
    now = time.time() if now is None else now
    rows = session.execute(sa.select(Run.uid, Run.status, DriverLease)
                           .outerjoin(DriverLease, DriverLease.run_id == Run.id).order_by(Run.id))
    return {uid: effective_status(status, None if lease is None else _holder(lease), now)
            for uid, status, lease in rows}
