"""The staleness gate of DESIGN §5 and the rollout history, shared by both rollouters.

Owns when a new sample may start and the ``(t, in flight, capacity)`` change points the rollout
utilization is computed from. Must not start samples, route them or read a clock: the rollouter
(production's asyncio one, the simulator's event-driven one) asks and passes ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessGate:
    """``max_required_samples`` = required × (1 + staleness) × trigger (``TidalConfig``'s) is the
    queue capacity and the cap on samples started per param version. Starts are allowed while in flight < capacity, the version's cap is not reached and the queue
    is not full. ``capacity`` (max_concurrent_samples) = min(routable × per replica, max_required)."""

    max_required_samples: int
    concurrent_samples_per_replica: int
    capacity: int = 0
    started_this_version: int = 0

    def set_routable(self, replicas: int) -> bool:
        """The routable set changed size; True when the capacity changed."""
        capacity = min(int(replicas) * self.concurrent_samples_per_replica, self.max_required_samples)
        changed, self.capacity = capacity != self.capacity, capacity
        return changed

    def allows(self, in_flight: int, queued: int, queue_capacity: int | None = None) -> bool:
        """May one more sample start now? (``queue_capacity`` defaults to ``max_required_samples``.)"""
        full_at = self.max_required_samples if queue_capacity is None else queue_capacity
        return (
            in_flight < self.capacity
            and self.started_this_version < self.max_required_samples
            and queued < full_at
        )

    def started(self) -> None:
        self.started_this_version += 1

    def on_sync(self, in_flight: int, queued: int) -> None:
        """A weight sync: what is in flight or queued counts as started in the new version."""
        self.started_this_version = in_flight + queued


def record_change(history: list[tuple[float, int, int]], now: float, in_flight: int, capacity: int) -> None:
    """Add a ``(t, in flight, capacity)`` change point (``history`` is seeded, never empty).

    A point at the last point's time replaces it (a zero-length interval weighs nothing); an
    unchanged state adds nothing.
    """
    point, last = (now, in_flight, capacity), history[-1]
    if now == last[0]:
        history[-1] = point
    elif point[1:] != last[1:]:
        history.append(point)
