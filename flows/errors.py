"""Why a run stopped, in one line, and the exit code the CLI maps it to.

Kept free of Ray, torch and Prefect so that ``flows.cli`` can catch these without importing them.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator

EXIT_BAD_INPUT = 2
"""Something the user gave (config, flag, store URL, a run's files) is wrong; nothing was started."""
EXIT_STORE_LOST = 3
"""The store became unreachable while the run was going; every committed step is intact and
``tidal resume`` continues once the store is back."""
EXIT_REWARD_FAILED = 4
"""A reward function raised, hung past ``custom_reward_function.timeout_s`` or returned no score;
the line names the function and the sample. Every committed step is intact."""
EXIT_DISK_FULL = 5
"""The disk filled while a checkpoint was written; the line names the path. The checkpoints before
it are intact, a half-written one is never taken for one, and ``tidal resume`` continues once
there is room."""


class RunError(RuntimeError):
    """A run could not go on; ``str()`` is one line fit for the terminal."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class StoreLost(RunError):
    """The store's server went away in the middle of a run (exit 3)."""

    exit_code = EXIT_STORE_LOST


class CheckpointRefused(RunError):
    """A resume refused the run's trainer checkpoint (checksum mismatch, not ours, or carrying
    pickled objects that could run code when loaded); exit 2, nothing was trained."""

    exit_code = EXIT_BAD_INPUT


class RewardFunctionFailed(RunError):
    """The reward function failed on a sample (exit 4)."""

    exit_code = EXIT_REWARD_FAILED


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything behind it: causes, contexts, and the ``cause`` a Ray task error carries."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        inner = getattr(e, "cause", None)
        todo += [e.__cause__, e.__context__, inner if isinstance(inner, BaseException) else None]


def reward_failure(exc: BaseException) -> RewardFunctionFailed | None:
    """The ``RewardFunctionFailed`` for a run that stopped because a reward call failed: found
    anywhere in ``exc``'s chain."""
    from data.reward import RewardFailed

    for e in _chain(exc):
        if isinstance(e, RewardFailed):
            inner = getattr(e, "cause", None)
            return RewardFunctionFailed(str(inner if isinstance(inner, RewardFailed) else e))
    return None


def store_lost_message(*, url: str, reason: str, uid: str, last_step: int, storage_arg: str) -> str:
    """``the store at URL is unreachable (REASON); the run stopped after step K; resume with: ...``.

    ``url`` and ``storage_arg`` must already have their password hidden (``storage.redact_url``).
    """
    after = f"after step {last_step}" if last_step else "before its first step"
    hint = " (with the password in place of ***)" if ":***@" in storage_arg else ""
    return (f"the store at {url} is unreachable ({reason}); the run stopped {after} and every committed "
            f"step is intact; once the store is back, resume with: tidal resume {uid} --storage '{storage_arg}'"
            f"{hint}")


def prefect_lost_message(*, api_url: str, silent_s: float, uid: str, last_step: int, storage_arg: str) -> str:
    """``the Prefect API at URL has not answered for N s (prefect.api_outage_timeout_s); the run
    stopped after step K ...; resume with: ...`` (exit 3, ``flows.driver.ApiWatch``).
    ``storage_arg`` must have its password hidden already."""
    after = f"after step {last_step}" if last_step else "before its first step"
    return (f"the Prefect API at {api_url} has not answered for {silent_s:.0f} s (prefect.api_outage_timeout_s); "
            f"the run stopped {after} and every committed step is intact; once the Prefect server is back, "
            f"resume with: tidal resume {uid} --storage '{storage_arg}'")


class ActorLost(RunError):
    """An actor of the run died mid-step (out of memory, a lost GPU, killed): exit 3, as for a
    lost store; every committed step is intact and ``tidal resume`` continues."""

    exit_code = EXIT_STORE_LOST


def actor_lost(exc: BaseException, *, uid: str, last_step: int, storage_arg: str) -> ActorLost | None:
    """The ``ActorLost`` for a run that stopped because a Ray actor died: found anywhere in
    ``exc``'s chain (Ray's ``RayActorError`` and its subclasses, by name: no Ray import here).
    ``storage_arg`` must have its password hidden already."""
    for e in _chain(exc):
        if any(c.__name__ == "RayActorError" for c in type(e).__mro__):
            after = f"after step {last_step}" if last_step else "before its first step"
            cause = re.sub(r"\x1b\[[0-9;]*m", "", " ".join(str(getattr(e, "error_msg", "") or e).split()))[:300]
            return ActorLost(f"an actor of the run died ({type(e).__name__}: {cause}); the run stopped {after} "
                             f"and every committed step is intact; resume with: tidal resume {uid} "
                             f"--storage '{storage_arg}'")
    return None


class RunStopped(RunError):
    """SIGINT or SIGTERM stopped the run cleanly: exit 128 + the signal (130, 143)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DiskFull(RunError):
    """No space was left to write a checkpoint (exit 5)."""

    exit_code = EXIT_DISK_FULL


def disk_full(exc: BaseException, *, uid: str, storage_arg: str) -> DiskFull | None:
    """The ``DiskFull`` for a run that stopped because a write found the disk (or the quota) full:
    an ``OSError`` ENOSPC or EDQUOT anywhere in ``exc``'s chain; the line names its path.
    ``storage_arg`` must have its password hidden already."""
    if (e := full_disk(exc)) is not None:
        where = f" writing {e.filename}" if e.filename else ""
        return DiskFull(f"the disk is full (no space left on device{where}); the run stopped, every "
                        f"checkpoint before it is intact and nothing half-written is kept; free some space "
                        f"there, then resume with: tidal resume {uid} --storage '{storage_arg}'")
    return None


def full_disk(exc: BaseException) -> OSError | None:
    """The ``OSError`` ENOSPC or EDQUOT anywhere in ``exc``'s chain (the disk or the quota full)."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)),
                None)
