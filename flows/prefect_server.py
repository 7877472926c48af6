"""A private Prefect server for tests and benchmarks: own ``PREFECT_HOME``, loopback, free port.

``LocalPrefectServer`` runs a Prefect API server (``flows.prefect_app``'s, unless told
``factory=None``: then ``prefect server start``) as a child in its own session (so that
``stop()`` can end exactly it and what it started, by its process group), with its own
``PREFECT_HOME`` (and so its own SQLite database), no UI and no analytics, and waits until
``/api/health`` answers (~15–25 s here). ``env()`` is the environment a client, worker or
``tidal run`` needs to talk to it. Nothing here touches another Prefect server or home.

``tidal run`` / ``resume`` start one on the user's own ``PREFECT_HOME`` in place of Prefect's
temporary server (which shares the terminal's process group, so a Ctrl-C killed it under the run):
``on_spawn`` lets the driver record the server's pid before waiting for it to answer, and
``log_path`` puts the server's output in the run's folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.ports import free_port
from flows.prefect_app import FACTORY, server_command


QUIET_SERVICES = ("LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "TRIGGERS")
"""Prefect server services a Tidal-started server runs without (the event persister and the
task-run recorder, which the UI's timelines come from, and cancellation clean-up stay on)."""

BATCHED_WRITES = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",  # whole seconds (Prefect int()s it)
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "2",
}
"""How a Tidal-started server writes task runs and events: in batches, flushed at least every 1 s
(task runs) and 2 s (events) and at shutdown. Prefect's defaults write each task-run event in a
transaction of its own, the largest share of the server's CPU on a step (docs/control-plane-overhead.md);
the UI's task runs then lag by up to a second. A value already in the environment wins."""


def api_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether the Prefect API at ``api_url`` answers its health check now."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


@dataclass
class LocalPrefectServer:
    """``with LocalPrefectServer() as server: ...`` — ``server.api_url``, ``server.env()``."""

    home: str | None = None
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ("--no-ui", "--analytics-off", "--no-scheduler")  # prefect server start's
    factory: str | None = FACTORY  # uvicorn app factory; None: ``prefect server start``
    log_path: str | None = None
    """The server's output (default: ``server.log`` in its home)."""
    on_spawn: Callable[[int], None] | None = None
    """Called with the server's pid as soon as it is started."""
    stop_wait_s: float = 10.0
    """How long ``stop()`` waits after SIGINT before it SIGKILLs the server's process group."""
    _proc: subprocess.Popen | None = None
    _owns_home: bool = False

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) pointed at this server and its home."""
        env = dict(os.environ if base is None else base)
        env.update(PREFECT_HOME=str(self.home), PREFECT_API_URL=self.api_url,
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")
        env.pop("PREFECT_PROFILE", None)
        return env

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The server's command line and environment (``home`` set)."""
        env = self.env()
        env.pop("PREFECT_API_URL")  # the server itself is not a client of anything
        # the home's own SQLite, unless the caller chose a database (PostgreSQL: docs/deployment.md)
        env.setdefault("PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{Path(str(self.home)) / 'prefect.db'}")
        if self.factory is None:
            return [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                    "--port", str(self.port), *self.extra_args], env
        # what --no-ui / --no-scheduler set, for the app served directly
        env.update(PREFECT_UI_ENABLED="false", PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false")
        # and no loops a temporary server has no use for (no schedules, pauses, workers or
        # automations of its own): each polls the database and takes its write lock, which
        # the step transitions then wait behind (docs/benchmarks.md, Prefect's SQLite stalls)
        env.update({f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in QUIET_SERVICES})
        for key, value in BATCHED_WRITES.items():
            env.setdefault(key, value)
        return server_command(self.port, factory=self.factory), env

    def start(self, timeout_s: float = 120.0, *, append_log: bool = False) -> LocalPrefectServer:
        if self.home is None:
            self.home = tempfile.mkdtemp(prefix="tidal-prefect-")
            self._owns_home = True
        Path(self.home).mkdir(parents=True, exist_ok=True)
        cmd, env = self.command()
        log = open(self.log_path or Path(self.home) / "server.log", "a" if append_log else "w")  # noqa: SIM115
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if self.on_spawn is not None:
            self.on_spawn(self._proc.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self._proc.returncode}; see {log.name}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"prefect server did not answer on {self.api_url} within {timeout_s:.0f}s; see {log.name}")

    def healthy(self) -> bool:
        return api_healthy(self.api_url)

    @property
    def exited(self) -> bool:
        """Whether the server process this object started has ended (killed, crashed)."""
        return self._proc is not None and self._proc.poll() is not None

    def restart(self, timeout_s: float = 120.0) -> LocalPrefectServer:
        """Start the server again after its process ended: the same port, home and database (so
        the flow runs it knew are still there and a client's retried calls find them), its output
        appended to the same log. ``on_spawn`` is called with the new pid."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"the prefect server (pid {self._proc.pid}) is still running")
        self._proc = None
        return self.start(timeout_s, append_log=True)

    def stop(self) -> None:
        """End the server (its process group: the server and its children), then its home if we made it."""
        if self._proc is not None and self._proc.poll() is None:
            for sig, wait_s in ((signal.SIGINT, self.stop_wait_s), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self._proc.pid, sig)
                    self._proc.wait(timeout=wait_s)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._proc = None
        if self._owns_home and self.home:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> LocalPrefectServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
