"""Child processes of the benchmarks: each run in its own process group, ended by that group only."""

from __future__ import annotations

import os
import signal
import subprocess


def wait_or_stop(proc: subprocess.Popen, timeout_s: float, grace_s: float = 20.0) -> int:
    """``proc``'s exit code, or 124 once ``timeout_s`` has passed: its process group (the child was
    started with ``start_new_session=True``) then gets SIGTERM, and SIGKILL after ``grace_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return 124
