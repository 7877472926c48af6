"""A driver's lifecycle: its lease on the run, the servers it starts, how it stops.

Owns: this process's driver identity and the heartbeat that keeps its lease (``storage.lease``)
alive; the run's records of what it started (``<run dir>/driver/*.json``: pid, process group,
start tick, temp dirs) and ending a dead driver's leftovers through those records (never by
process name); turning SIGINT / SIGTERM into ``RunInterrupted`` once, so a stop is one clean
exception and a second signal cannot interrupt the cleanup. Must not: decide what a step does,
or end any process that is not in a record of this run. More: ``docs/lifecycle.md``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage import (
    LeaseHolder,
    RunStatus,
    StoreError,
    acquire_lease,
    open_store,
    release_lease,
    renew_lease,
    session_scope,
    set_run_status,
)
from storage.lease import process_alive, process_started

log = logging.getLogger("tidal.lifecycle")

RECORDS_DIR = "driver"
"""Folder of a run's records, inside its output folder."""
TEMPORARY_SERVER_ENV = "TIDAL_TEMPORARY_PREFECT_API_URL"
"""Set by ``flows.driver`` to the API URL of the temporary server it started for one run: that
server stands in for Prefect's own temporary one, so ``prefect.task_runner: auto`` still means
threads (``flows.runners.server_configured``)."""


# ------------------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class DriverIdentity:
    """Who this driver process is, as its lease shows it."""

    driver_id: str
    host: str
    pid: int
    pid_started: int


DRIVER = DriverIdentity(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), process_started(os.getpid()))
"""This process (a forked child gets its own id: see ``identity``)."""


def identity() -> DriverIdentity:
    global DRIVER
    if DRIVER.pid != os.getpid():
        DRIVER = DriverIdentity(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), process_started(os.getpid()))
    return DRIVER


# ---------------------------------------------------------------------------------------- leases


def take_lease(session: Any, uid: str, timeout_s: float) -> LeaseHolder | None:
    """Take ``uid``'s lease for this process inside the caller's transaction; the stale holder it
    replaced (or None). ``storage.LeaseHeld`` when a live driver holds it."""
    me = identity()
    return acquire_lease(session, uid, driver_id=me.driver_id, host=me.host, pid=me.pid,
                         pid_started=me.pid_started, timeout_s=timeout_s, now=time.time())


class Heartbeat:
    """Renews this driver's lease on one run every ``interval_s`` until ``stop()`` (which also
    releases the lease). A renewal that finds the lease taken over sets ``lost``."""

    def __init__(self, url: str, busy_timeout_ms: int, uid: str, interval_s: float) -> None:
        self.url, self.busy_timeout_ms, self.uid, self.interval_s = url, busy_timeout_ms, uid, interval_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"tidal-lease-{uid}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with session_scope(open_store(self.url, busy_timeout_ms=self.busy_timeout_ms)) as session:
                    if not renew_lease(session, self.uid, identity().driver_id, time.time()):
                        self.lost.set()
                        log.warning("run %s: this driver's lease was taken over by another driver", self.uid)
                        return
            except StoreError as exc:  # the store is away: the step's own writes will say so
                log.debug("lease heartbeat of %s failed: %s", self.uid, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            with session_scope(open_store(self.url, busy_timeout_ms=self.busy_timeout_ms)) as session:
                release_lease(session, self.uid, identity().driver_id)
        except StoreError as exc:  # the lease then goes stale on its own
            log.debug("releasing the lease of %s failed: %s", self.uid, exc)


_HEARTBEATS: dict[str, Heartbeat] = {}
"""The leases this process holds, by run uid."""


def holds(uid: str) -> bool:
    return uid in _HEARTBEATS


def keep_alive(cfg: Any, uid: str) -> Heartbeat:
    """Start renewing the lease just taken on ``uid`` (once per run and process). Sets the store's
    reconnect bound in this process (``storage.reconnect_timeout_s``: every store call of the
    driver, the in-process step commit among them, shares the engine)."""
    open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms,
               reconnect_timeout_s=cfg.storage.reconnect_timeout_s)
    return _beat(cfg.storage.url, cfg.storage.busy_timeout_ms, uid, cfg.lifecycle.heartbeat_interval_s)


def _beat(url: str, busy_timeout_ms: int, uid: str, interval_s: float) -> Heartbeat:
    if uid not in _HEARTBEATS:
        _HEARTBEATS[uid] = Heartbeat(url, busy_timeout_ms, uid, interval_s).start()
    return _HEARTBEATS[uid]


def claim(url: str, uid: str, lifecycle: dict[str, Any], busy_timeout_ms: int = 30_000,
          reconnect_timeout_s: float | None = None) -> None:
    """Take ``uid``'s lease and keep it alive, before anything else of a resume happens (the
    run's config is not even loaded: ``lifecycle`` is its stored ``lifecycle`` section, maybe
    empty; ``reconnect_timeout_s`` its stored ``storage.reconnect_timeout_s``, None: the
    default). ``storage.LeaseHeld`` when a live driver holds it."""
    from config.lifecycle_keys import LifecycleSection

    keys = LifecycleSection(**lifecycle)
    engine = open_store(url, busy_timeout_ms=busy_timeout_ms, reconnect_timeout_s=reconnect_timeout_s)
    with session_scope(engine, immediate=True) as session:
        take_lease(session, uid, keys.lease_timeout_s)
    _beat(url, busy_timeout_ms, uid, keys.heartbeat_interval_s)


END_LOCK_WAIT_MS = 1000
"""The most one try of ``record_end`` waits for SQLite's lock, whatever the store's busy timeout."""


def record_end(url: str, uid: str, status: RunStatus, *, busy_timeout_ms: int, within_s: float = 5.0) -> bool:
    """Write the status a run ends with (``failed`` or ``interrupted``), trying again half a second
    apart until it is written or ``within_s`` has passed (a step's commit may hold the store a
    moment while a stop arrives; each try waits for SQLite's lock at most the store's
    ``busy_timeout_ms``, and never over ``END_LOCK_WAIT_MS``, so a stop stays quick). The error that
    ended the run matters more than this write: a write that still fails is logged, not raised.
    Whether it was written."""
    busy_timeout_ms = min(busy_timeout_ms, END_LOCK_WAIT_MS)
    deadline = time.monotonic() + within_s
    tries, error = 0, None
    while True:
        tries += 1
        try:
            with session_scope(open_store(url, busy_timeout_ms=busy_timeout_ms)) as session:
                set_run_status(session, uid, status)
            return True
        except Exception as exc:  # noqa: BLE001 - the store may be what failed
            error = exc
        if time.monotonic() + 0.5 >= deadline:
            break
        time.sleep(0.5)
    log.warning("run %s: could not record it %s (%d tries): %s", uid, status.value, tries, error)
    return False


def let_go(uid: str) -> None:
    """Stop renewing and release ``uid``'s lease, if this process holds it."""
    beat = _HEARTBEATS.pop(uid, None)
    if beat is not None:
        beat.stop()


# --------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Record:
    """Something a driver started for its run: its processes as ``(pid, start tick)`` (with
    ``session``, the first leads a session of its own, whose other members end with it) and the
    folders to delete once they are gone."""

    kind: str
    procs: tuple[tuple[int, int], ...] = ()
    session: bool = False
    dirs: tuple[str, ...] = ()
    info: dict[str, Any] | None = None


def records_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / RECORDS_DIR


def write_record(run_dir: str | Path, kind: str, pids: tuple[int, ...] = (), *, session: bool = False,
                 dirs: tuple[str, ...] = (), info: dict[str, Any] | None = None) -> None:
    """Record (atomically: temp file + rename) what this driver started, as ``<run dir>/driver/KIND.json``."""
    folder = records_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"kind": kind, "procs": [[pid, process_started(pid)] for pid in pids], "session": session,
              "dirs": list(dirs), "info": info}
    tmp = folder / f".{kind}.json.tmp"
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, folder / f"{kind}.json")


def drop_record(run_dir: str | Path, kind: str) -> None:
    (records_dir(run_dir) / f"{kind}.json").unlink(missing_ok=True)


def read_records(run_dir: str | Path) -> list[Record]:
    out = []
    for path in sorted(records_dir(run_dir).glob("*.json")):
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            out.append(Record(raw["kind"], tuple((int(p), int(t)) for p, t in raw["procs"]), bool(raw["session"]),
                              tuple(raw["dirs"]), raw.get("info")))
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable record %s", path)
    return out


def _live_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every live, non-zombie process."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            yield int(proc.name), fields


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a server we started leads its own session: its
    children stay in it even when they move to process groups of their own)."""
    return [pid for pid, fields in _live_stats() if int(fields[3]) == sid]


def children() -> set[int]:
    """This process's live child processes (what a call started shows up here)."""
    me = os.getpid()
    return {pid for pid, fields in _live_stats() if int(fields[1]) == me}


def live_pids(record: Record) -> list[int]:
    """The processes of ``record`` still alive: the recorded ones that are still the processes
    recorded (same start tick), and the members of a recorded session leader's session."""
    alive = [pid for pid, started in record.procs if process_alive(pid, started)]
    if record.session and record.procs and record.procs[0][0] in alive:
        alive = sorted({*alive, *session_members(record.procs[0][0])})
    return alive


def end_record(record: Record, wait_s: float = 5.0) -> None:
    """End what ``record`` names (SIGTERM, then SIGKILL to what is left after ``wait_s``), then
    delete its folders."""
    pids = live_pids(record)
    for sig, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 2.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [pid for pid in pids if process_alive(pid)]
        if not pids:
            break
    for folder in record.dirs:
        shutil.rmtree(folder, ignore_errors=True)


def end_leftovers(run_dir: str | Path) -> tuple[list[str], list[Record]]:
    """End every process group a dead driver of this run recorded and delete its temp dirs.
    Returns (what was ended, as words; the records that name something else, e.g. its flow run)."""
    ended, others = [], []
    for record in read_records(run_dir):
        if record.kind == "flow-run":
            others.append(record)
            continue
        pids = live_pids(record)
        end_record(record)
        if pids:
            ended.append(f"{record.kind} (pids {', '.join(map(str, pids))})")
        drop_record(run_dir, record.kind)
    return ended, others


# --------------------------------------------------------------------------------------- signals


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM asked the run to stop. A ``KeyboardInterrupt`` so that Prefect marks the
    flow runs it passes through Crashed and nothing catches it as an ordinary error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_STOPPING: list[int] = []
"""The signal that asked this process to stop (empty until one did)."""


def stopping() -> bool:
    """Whether a stop signal arrived: what Prefect logs from then on is the stop's echo, kept
    out of the terminal (``flows.driver``)."""
    return bool(_STOPPING)


def note_stop(signum: int) -> None:
    """A stop arrived another way (Prefect's own SIGTERM bridge inside a flow run raised it)."""
    if not _STOPPING:
        _STOPPING.append(signum)


class StopSignals:
    """While entered (in the main thread), the first SIGINT or SIGTERM raises ``RunInterrupted``;
    later ones are only counted, so the cleanup that follows runs to its end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
            _STOPPING.append(signum)
            raise RunInterrupted(signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
        _STOPPING.clear()


def interruption(exc: BaseException | None) -> int | None:
    """The signal number when ``exc`` is (or was caused by) a stop request: ``RunInterrupted``,
    Prefect's ``TerminationSignal`` (its own SIGTERM bridge inside a flow run) or a plain
    ``KeyboardInterrupt``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RunInterrupted):
            return exc.signum
        if type(exc).__name__ == "TerminationSignal":
            return getattr(exc, "signal", signal.SIGTERM)
        if isinstance(exc, KeyboardInterrupt):
            return signal.SIGINT
        exc = exc.__cause__ or exc.__context__
    return None
