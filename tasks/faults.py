"""Failpoints for the crash tests: `TIDAL_CRASH_AT=phase:step` SIGKILLs this process there;
`TIDAL_KILL_RANK_AT=phase:step` kills the trainer's last rank actor there (a rank lost mid-step).

Unset (always, outside the fault tests) each is one environment lookup and nothing else.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "TIDAL_CRASH_AT"
KILL_RANK_ENV = "TIDAL_KILL_RANK_AT"
POINTS = ("wait_for_samples", "train", "broadcast_sync", "commit")


def crash_point(point: str, step: int) -> None:
    if os.environ.get(CRASH_ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def kill_rank_point(point: str, step: int, namespace: str, world: int) -> None:
    """Kill rank ``world - 1`` of the run's trainer here (a trainer of several ranks only)."""
    if world > 1 and os.environ.get(KILL_RANK_ENV) == f"{point}:{step}":
        import ray

        from cluster.actors.trainer_rank import rank_name

        ray.kill(ray.get_actor(rank_name(world - 1), namespace=namespace), no_restart=True)
