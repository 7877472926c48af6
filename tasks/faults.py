"""Failpoints for the crash tests: `TIDAL_CRASH_AT=phase:step` SIGKILLs this process there.

Unset (always, outside the fault tests) this is one environment lookup and nothing else.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "TIDAL_CRASH_AT"
POINTS = ("wait_for_samples", "train", "broadcast_sync", "commit_step")


def crash_point(point: str, step: int) -> None:
    if os.environ.get(CRASH_ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
