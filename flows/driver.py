"""What ``tidal run`` / ``resume`` set up around the ``training_run`` flow, and take down after it.

Owns, in order: the run's lease (a resume takes it before anything starts, so a second driver
leaves in a second having written nothing), a dead driver's leftovers (ended through the run's
records, its flow run marked Crashed), the temporary Prefect server (started here in a session of
its own, on the user's ``PREFECT_HOME``, so a terminal's Ctrl-C reaches Tidal and not the server
under it), the Prefect API watched while the run goes (``ApiWatch``: Tidal's own server restarted
when it dies, a user's waited for up to ``prefect.api_outage_timeout_s``), where Prefect's logs go
(INFO to ``<run dir>/prefect.log`` and the UI, WARNING and above to the terminal), and the way out:
the server stopped, the lease released. Must not: run
steps (the flow does) or end anything a record of this run does not name.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from config import TidalConfig
from flows import lifecycle
from flows.progress import Progress
from storage import open_store, session_scope

log = logging.getLogger("tidal.driver")

PREFECT_LOG = "prefect.log"
"""Prefect's INFO lines of the run (task and flow run states), in the run's folder."""


@dataclass
class Embedded:
    """What the driver set up for one run (see ``embedded``)."""

    uid: str
    run_dir: Path
    progress: Progress
    took_over: list[str] = field(default_factory=list)
    """The dead driver's leftovers this driver ended (as words)."""


@contextmanager
def embedded(cfg: TidalConfig, uid: str, run_dir: Path, *, resume: bool, progress: Progress) -> Iterator[Embedded]:
    """Lease (resume), leftovers, Prefect server, logging; undone in reverse on the way out."""
    state = Embedded(uid, run_dir, progress)
    with ExitStack() as stack:
        stack.callback(lifecycle.let_go, uid)
        crashed = []
        if resume:
            if not lifecycle.holds(uid):  # `tidal resume` claims it first of all (lifecycle.claim)
                with session_scope(open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms),
                                   immediate=True) as session:
                    lifecycle.take_lease(session, uid, cfg.lifecycle.lease_timeout_s)
                lifecycle.keep_alive(cfg, uid)
            state.took_over, crashed = lifecycle.end_leftovers(run_dir)
        stack.enter_context(_prefect(cfg, uid, run_dir, progress))
        for record in crashed:
            _mark_crashed(record)
            lifecycle.drop_record(run_dir, record.kind)
        stack.enter_context(prefect_logs_to_file(run_dir / PREFECT_LOG))
        yield state


@contextmanager
def _prefect(cfg: TidalConfig, uid: str, run_dir: Path, progress: Progress) -> Iterator[None]:
    """The Prefect API this run talks to: the configured one, or a temporary server of its own;
    watched while the run goes (``ApiWatch``: the API killed mid-run)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, PREFECT_HOME, temporary_settings

    outage_s = cfg.prefect.api_outage_timeout_s
    retries = {PREFECT_CLIENT_MAX_RETRIES: max(PREFECT_CLIENT_MAX_RETRIES.value(), client_retries_for(outage_s))}
    if cfg.prefect.api_url or PREFECT_API_URL.value():
        url = cfg.prefect.api_url or PREFECT_API_URL.value()
        with temporary_settings(updates={PREFECT_API_URL: url, **retries}), \
                ApiWatch(url, outage_s, on_lost=_stop_run(cfg, uid, run_dir, url)):
            yield
        return
    from flows.prefect_server import LocalPrefectServer

    run_dir.mkdir(parents=True, exist_ok=True)
    server = LocalPrefectServer(home=str(PREFECT_HOME.value()), log_path=str(run_dir / "prefect-server.log"),
                                on_spawn=lambda pid: lifecycle.write_record(run_dir, "prefect-server", (pid,), session=True),
                                stop_wait_s=5.0)
    progress.stage("Prefect server")
    try:
        server.start(timeout_s=_startup_timeout_s())
        saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", lifecycle.TEMPORARY_SERVER_ENV)}
        os.environ.update(PREFECT_API_URL=server.api_url, **{lifecycle.TEMPORARY_SERVER_ENV: server.api_url})
        try:
            with temporary_settings(updates={PREFECT_API_URL: server.api_url, **retries}):
                with ApiWatch(server.api_url, outage_s, on_lost=_stop_run(cfg, uid, run_dir, server.api_url),
                              server=server):
                    try:
                        yield
                    finally:  # however the run ended: its last logs and events, while the server answers
                        _drain_prefect()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    finally:
        server.stop()
        lifecycle.drop_record(run_dir, "prefect-server")


def client_retries_for(outage_s: float) -> int:
    """Prefect client retries whose back-off (``2 ** try`` s after the try-th failure) spans
    ``outage_s``: a call in flight when the API went away is still retrying when ``ApiWatch``
    restarts the server or gives up on it, never failing the step first."""
    retries = 1
    while 2 ** (retries + 1) - 2 < outage_s + 2:
        retries += 1
    return retries


class ApiWatch:
    """Watches the run's Prefect API while the run goes: the API server killed mid-run.

    What Tidal does, and why. Measured first (a `tidal run tiny-cpu` of 8 steps, Tidal's own
    server SIGKILLed after step 2, before this watch existed): every Prefect call of the step retried
    for ~70 s (Prefect's client: 5 retries, ``2 ** try`` s apart), the step's task run then failed
    with ``httpx.ConnectError``, the flow runs failed one after another behind further rounds of
    retries, and the driver exited 1 with a page of tracebacks 6 minutes after the kill, the run
    marked failed. Nothing of the data plane needs Prefect between two calls, and every step is
    committed to Tidal's own store, not to Prefect's: so the run *carries on* while the API is away,
    and stops only when it cannot come back.

    - Tidal's own temporary server (``server``): when its process has ended, it is started again at
      once on the same port, ``PREFECT_HOME`` and database (~15-25 s); the calls in flight, retrying,
      then reach it, the step goes on and the UI shows the run's flow runs where they are. Task-run
      states sent as events while no server listened are lost (Prefect's events client drops them),
      so a task run of those seconds may show a stale state; the flow runs' and every later state
      are there.
    - A server of the user's (``prefect.api_url`` / ``PREFECT_API_URL``): Tidal cannot restart it,
      so it waits for it, as for a restart by its owner.

    Either way the wait is bounded by ``prefect.api_outage_timeout_s`` (the client's retries are
    raised to outlast it: ``client_retries_for``): once the API has not answered for that long,
    ``on_lost`` stops the run in one line with the resume command, exit 3 (``docs/cli.md``: as for
    a lost store, a platform service the run needs went away and every committed step is intact).
    """

    def __init__(self, api_url: str, outage_s: float, *, on_lost: Callable[[float], None],
                 server: Any = None, interval_s: float = 1.0, probe_s: float = 5.0) -> None:
        self.api_url, self.outage_s, self.on_lost, self.server = api_url, outage_s, on_lost, server
        self.interval_s = interval_s
        self.probe_s = probe_s
        """Between two health checks of an API that answered, only the own server's process is
        looked at (every ``interval_s``, free): an HTTP request a second would cost the server and
        the driver CPU for nothing, and a user's server has minutes (``outage_s``) to come back."""
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tidal-prefect-watch", daemon=True)

    def __enter__(self) -> ApiWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        from flows.prefect_server import api_healthy

        down_since: float | None = None
        probed = -float("inf")
        while not self._stop.wait(self.interval_s):
            died = self.server is not None and self.server.exited
            if not died and down_since is None and time.monotonic() - probed < self.probe_s:
                continue
            probed = time.monotonic()
            if not died and api_healthy(self.api_url):
                if down_since is not None:
                    _API_QUIET_UNTIL[0] = time.monotonic() + 10.0
                    log.warning("the Prefect API at %s answers again after %.0f s; the run carried on",
                                self.api_url, time.monotonic() - down_since)
                down_since = None
                continue
            down_since = down_since if down_since is not None else time.monotonic()
            _API_QUIET_UNTIL[0] = time.monotonic() + 10.0
            left = self.outage_s - (time.monotonic() - down_since)
            if self.server is not None and self.server.exited and left > 0 and not self._stop.is_set():
                self._restart(left)
                continue
            if left <= 0 and not self._stop.is_set():
                self.on_lost(time.monotonic() - down_since)
                return

    def _restart(self, left_s: float) -> None:
        old = self.server.pid
        log.warning("Tidal's Prefect server (pid %s) died mid-run; restarting it on %s (same database)",
                    old, self.api_url)
        try:
            self.server.restart(timeout_s=max(left_s, 1.0))
        except (RuntimeError, TimeoutError, OSError) as exc:
            log.warning("restarting Tidal's Prefect server failed: %s", exc)
            return
        self.restarts += 1
        log.warning("Tidal's Prefect server is back (pid %s); the run carries on", self.server.pid)


def _stop_run(cfg: TidalConfig, uid: str, run_dir: Path, api_url: str) -> Callable[[float], None]:
    """``ApiWatch``'s way out: one line with the resume command, the run marked failed, what this
    driver started ended through its records, the lease released, exit 3. The flow-run record
    stays: the resume marks that flow run Crashed once the API answers again."""

    def stop(silent_s: float) -> None:
        import sys

        from flows.errors import EXIT_STORE_LOST, prefect_lost_message
        from storage import RunStatus, get_run, load_resume_state, redact_url, set_run_status

        committed, status = 0, None
        try:
            with session_scope(open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms)) as session:
                row = get_run(session, uid)
                status = None if row is None else RunStatus(row.status)
                state = load_resume_state(session, uid) if row is not None else None
                committed = state.step if state is not None else 0
                if status not in (None, RunStatus.FINISHED):
                    set_run_status(session, uid, RunStatus.FAILED)
        except Exception as exc:  # noqa: BLE001 - the line still goes out; the lease goes stale
            log.debug("could not mark run %s failed: %s", uid, exc)
        code = EXIT_STORE_LOST
        if status is RunStatus.FINISHED:  # every step committed, only Prefect's last states missing
            line = (f"tidal: run {uid} finished, but the Prefect API at {api_url} has not answered for "
                    f"{silent_s:.0f} s (prefect.api_outage_timeout_s): its last flow-run states are missing there")
            code = 0
        elif status is None:
            line = (f"tidal: error: the Prefect API at {api_url} has not answered for {silent_s:.0f} s "
                    f"(prefect.api_outage_timeout_s); the run had not started and nothing of it was written")
        else:
            line = "tidal: error: " + prefect_lost_message(api_url=api_url, silent_s=silent_s, uid=uid,
                                                          last_step=committed,
                                                          storage_arg=redact_url(cfg.storage.url))
        sys.stdout.flush()
        os.write(2, (line + "\n").encode())  # fd 2 itself: Prefect's log_prints may hold a print
        try:
            lifecycle.end_leftovers(run_dir)  # this driver's own Ray head and Prefect server, if any
            lifecycle.let_go(uid)
        finally:
            sys.stdout.flush()
            os._exit(code)

    return stop


def _startup_timeout_s() -> float:
    """How long the temporary server may take to answer: Prefect's own setting for its temporary
    server (``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``), at least 180 s (a loaded
    2-core machine needs minutes)."""
    from prefect.settings import get_current_settings

    return max(180.0, float(get_current_settings().server.ephemeral.startup_timeout_seconds))


def _drain_prefect() -> None:
    """Let Prefect's log and event workers send what they hold while the server still answers."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=5)
        except Exception as exc:  # noqa: BLE001 - a lost log line must not hide how the run ended
            log.debug("draining %s failed: %s", worker.__name__, exc)


def _mark_crashed(record: lifecycle.Record) -> None:
    """Mark a dead driver's ``training-run`` flow run (and its running step) Crashed; delete the
    step flow run it had prepared and never started (``flows.step_runs``)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Crashed

    message = "its driver died; the run was taken over by a resume"
    flow_run_id = UUID((record.info or {})["id"])
    try:
        with get_client(sync_client=True) as client:
            children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
            for run in [*children, client.read_flow_run(flow_run_id)]:
                if run.state is None or run.state.is_final():
                    continue
                if run.id != flow_run_id and run.start_time is None and run.state.is_pending():
                    client.delete_flow_run(run.id)  # prepared ahead, never started
                    if run.parent_task_run_id is not None:
                        client.delete_task_run(run.parent_task_run_id)
                else:
                    client.set_flow_run_state(run.id, Crashed(message=message), force=True)
    except Exception as exc:  # noqa: BLE001 - the run goes on; the UI keeps a stale state
        log.warning("could not mark the dead driver's flow run %s Crashed: %s", flow_run_id, exc)


@contextmanager
def prefect_logs_to_file(path: Path) -> Iterator[None]:
    """Prefect's INFO lines to ``path`` (and, as before, to the UI); only WARNING and above to the
    terminal. ``PREFECT_LOGGING_LEVEL`` set to INFO or DEBUG keeps them on the terminal too."""
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # Prefect configures logging lazily: done later, it would undo what follows
    path.parent.mkdir(parents=True, exist_ok=True)
    prefect_logger = logging.getLogger("prefect")
    asked = logging.getLevelName(os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING").upper())
    console_level = asked if isinstance(asked, int) and asked < logging.WARNING else logging.WARNING
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(_file_formatter())
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]
    saved = prefect_logger.level, [h.level for h in consoles]
    prefect_logger.setLevel(min(logging.INFO, console_level))
    for h in consoles:
        h.setLevel(max(h.level, console_level))
        h.addFilter(_quiet_while_stopping)
    prefect_logger.addHandler(handler)
    try:
        yield
    finally:
        prefect_logger.removeHandler(handler)
        handler.close()
        prefect_logger.setLevel(saved[0])
        for h, level in zip(consoles, saved[1], strict=True):
            h.setLevel(level)
            h.removeFilter(_quiet_while_stopping)


def _file_formatter() -> logging.Formatter:
    return _RunFormatter("%(asctime)s | %(levelname)-7s | %(where)s - %(message)s")


class _RunFormatter(logging.Formatter):
    """Names the flow or task run a line came from, as Prefect's console does (else the logger)."""

    def format(self, record: logging.LogRecord) -> str:
        task, flow_run = getattr(record, "task_run_name", None), getattr(record, "flow_run_name", None)
        record.where = f"Task run {task!r}" if task else f"Flow run {flow_run!r}" if flow_run else record.name
        return super().format(record)


def _quiet_while_stopping(record: logging.LogRecord) -> bool:
    """Once a stop signal arrived, Prefect's echoes of it ("Crash detected! Execution was aborted
    by an interrupt signal", the step's failed tasks) go to the log file only: the terminal's
    last word is the driver's own line with the resume command. So do Prefect's complaints while
    its API is away (``ApiWatch``: each event it could not send, dumped whole): the driver's own
    lines say that the server went and came back."""
    quiet = lifecycle.stopping() or time.monotonic() < _API_QUIET_UNTIL[0]
    return not (quiet and record.name.startswith("prefect"))


_API_QUIET_UNTIL = [0.0]
"""Prefect's console lines are kept off the terminal until then (monotonic): ``ApiWatch`` sets
it while the API is away, and for a few seconds after it answers again."""


def resume_hint(uid: str, storage: str | None) -> str:
    """The command that continues ``uid``."""
    return f"tidal resume {uid}" + (f" --storage '{storage}'" if storage else "")


def new_uid(cfg: TidalConfig) -> str:
    import uuid

    return f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def run_dir_of(cfg: TidalConfig, uid: str) -> Path:
    return Path(cfg.trainer.default_local_dir) / uid

