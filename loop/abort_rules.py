"""When to spare a lent hybrid work that its take-back would abort, shared by both rollouters.

A lent hybrid is taken back once the queue holds the policy's ``wait_samples``
(``DeactivatePlan``); whatever it is generating then is aborted and re-prefilled elsewhere. These
rules estimate that moment from what a rollouter sees (the queue, the plan, the times samples
finished) and how likely a sample routed to the hybrid now is to finish before it (the durations
of the samples the hybrids finished lately). Pure functions: no clock (``now`` is an argument),
no I/O, no replica objects. Must not route, start or abort anything (the rollouters do).
"""

from __future__ import annotations

from collections.abc import Sequence


def completion_rate(finished_at: Sequence[float]) -> float | None:
    """Samples finished per second over ``finished_at`` (ascending times); None with fewer than
    two, or no time between them."""
    if len(finished_at) < 2:
        return None
    span = finished_at[-1] - finished_at[0]
    return (len(finished_at) - 1) / span if span > 0 else None


def takeback_eta_s(wait_samples: int | None, queued: int, rate: float | None) -> float | None:
    """Seconds until the queue reaches ``wait_samples`` at ``rate`` samples per second: 0 when it
    already holds them, None when either is unknown."""
    if wait_samples is None:
        return None
    missing = wait_samples - queued
    if missing <= 0:
        return 0.0
    if not rate:
        return None
    return missing / rate


def finish_share(eta_s: float | None, durations: Sequence[float]) -> float:
    """Share of ``durations`` (seconds from routing to finishing, of recent samples on a lent
    hybrid) no longer than ``eta_s``: how likely a sample routed now finishes before the take-back.
    1 when either is unknown (no guard without evidence)."""
    if eta_s is None or not durations:
        return 1.0
    return sum(1 for d in durations if d <= eta_s) / len(durations)


def may_route(share: float, min_share: float) -> bool:
    """Route a sample to a lent hybrid only when it finishes before the take-back with at least
    ``min_share`` probability (``finish_share``)."""
    return share >= min_share


def shrunk_cap(per_replica: int, share: float) -> int:
    """A lent hybrid's concurrency near its take-back: ``per_replica`` × ``share`` (rounded up),
    so it starts only as many samples as are likely to finish before it goes."""
    if share >= 1.0:
        return per_replica
    whole = int(per_replica * share)
    return min(per_replica, whole + (whole < per_replica * share))
