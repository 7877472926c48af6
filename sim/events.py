"""The event heap: one queue, one virtual clock, a total order on events.

Events are ordered by ``(time, priority, seq)``. ``seq`` is a per-loop counter assigned when an
event is pushed, so two events never compare equal and events at the same time and priority run in
the order they were scheduled. The key is the whole order: no event object is ever compared, and no
counter is shared between loops (two simulators in one process do not disturb each other's order).

Handlers are plain callables ``handler(*args) -> list[Event]``: they read the clock from the loop,
change their own state, and return the events they want scheduled. Nothing else pushes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

# Priorities at equal times: the data plane settles before the control plane looks at it, so a
# sample that finishes at the very instant the trainer checks the queue is already in the queue.
DATA_PLANE = 0
CONTROL_PLANE = 1


class Event(NamedTuple):
    """Run ``handler(*args)`` at virtual ``time``; lower ``priority`` first among equal times."""

    time: float
    priority: int
    handler: Callable[..., list[Event]]
    args: tuple[Any, ...] = ()


class EventLoop:
    """A heap of events keyed ``(time, priority, seq)`` and the clock they advance."""

    def __init__(self) -> None:
        self.now: float = 0.0
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.handled = 0
        """Events handled so far (stale ones included)."""

    def push(self, events: Iterable[Event]) -> None:
        """Schedule events; none may lie in the past."""
        heap = self._heap
        for ev in events:
            if ev.time < self.now:
                raise ValueError(f"event {ev.handler.__name__} at t={ev.time} is before now={self.now}")
            self._seq += 1
            heapq.heappush(heap, (ev.time, ev.priority, self._seq, ev))

    def run(self, until: Callable[[], bool]) -> None:
        """Pop and handle events in order until ``until()`` holds or the heap is empty."""
        heap = self._heap
        pop = heapq.heappop
        while heap and not until():
            time, _, _, ev = pop(heap)
            self.now = time
            self.handled += 1
            self.push(ev.handler(*ev.args))

    def __len__(self) -> int:
        return len(self._heap)
