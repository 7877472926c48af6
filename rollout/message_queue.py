"""The message queue between the rollouter and the trainer: a bounded FIFO of finished samples.

Capacity is ``max_required_samples`` (DESIGN §5). ``put`` waits while the queue is full;
``get_batch(k)`` waits until ``k`` samples are there and takes them all at once.

``get_batch`` semantics (chosen so that a timeout never loses or splits a batch):

- returns exactly ``k`` samples, in FIFO order;
- returns fewer than ``k`` only when the queue is closed: then it returns whatever is left (an
  empty list once the queue is closed and empty), without waiting;
- on timeout it raises ``TimeoutError`` (the builtin, which ``asyncio.TimeoutError`` is an alias
  of) and takes **nothing**: the samples that were there stay queued for the next call;
- ``k`` larger than the capacity is refused (``ValueError``) since it could never be met;
- concurrent callers are served one at a time, first come first served.

Every ``get_batch`` call leaves a ``PullRecord``: when it started, the queue size it saw when it
started, how long it waited, what it asked for and what it got. ``PullRecord.wait_samples`` (the
same number as the module function ``wait_samples``) is ``max(0, requested − size at start)``: the
samples the trainer really had to wait for, reported as ``step_wait_samples``.

Plain Python + asyncio, no Ray, no threads; the clock is injectable (``time.monotonic`` by
default) and only used for the records (timeouts use the event loop's own clock).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rollout.wakeups import Wakeup

__all__ = ["MessageQueue", "PullRecord", "QueueClosed", "wait_samples"]

log = logging.getLogger(__name__)


class QueueClosed(RuntimeError):
    """``put`` on a closed queue (or on one closed while the put was waiting)."""


def wait_samples(required: int, queue_size_at_start: int) -> int:
    """Samples that had to be waited for: ``max(0, required − queue size when pulling began)``."""
    return max(0, int(required) - int(queue_size_at_start))


@dataclass(frozen=True)
class PullRecord:
    """One ``get_batch`` call, as the trainer experienced it."""

    started_at: float
    """Clock time when the call began."""
    queue_size_at_start: int
    """Samples in the queue when the call began."""
    wait_s: float
    """Clock seconds from the start of the call until it returned (or timed out)."""
    got: int
    """Samples returned (0 on timeout)."""
    requested: int
    """The ``k`` asked for."""
    timed_out: bool = False

    @property
    def wait_samples(self) -> int:
        return wait_samples(self.requested, self.queue_size_at_start)


class MessageQueue:
    """Bounded async FIFO of samples with pull records (see the module docstring)."""

    def __init__(self, capacity: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self._capacity = int(capacity)
        self._clock = clock
        self._items: deque[Any] = deque()
        self._closed = False
        self._change = Wakeup()  # wakes waiting puts and gets
        self._getter_lock = asyncio.Lock()
        self._records: list[PullRecord] = []
        self._listeners: list[Callable[[int], None]] = []
        self._total_put = 0
        self._total_got = 0
        self._total_drained = 0
        self._total_put_back = 0

    # ------------------------------------------------------------------ state

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def exhausted(self) -> bool:
        """Closed and empty: no sample will ever come out again."""
        return self._closed and not self._items

    def size(self) -> int:
        return len(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def wait_samples(self, k: int) -> int:
        """``max(0, k − size now)``: call it as a micro-step starts pulling (the pull records
        keep the same number for every ``get_batch`` call)."""
        return wait_samples(k, len(self._items))

    def full(self) -> bool:
        return len(self._items) >= self._capacity

    def stats(self) -> dict[str, int]:
        """Counters: size, capacity, total_put, total_got, total_drained, total_put_back."""
        return {
            "size": len(self._items),
            "capacity": self._capacity,
            "total_put": self._total_put,
            "total_got": self._total_got,
            "total_drained": self._total_drained,
            "total_put_back": self._total_put_back,
        }

    def on_change(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Call ``callback(size)`` after every put, get, drain, put-back and close.

        Returns a function that unregisters it.
        """
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    # ------------------------------------------------------------------- put

    async def put(self, sample: Any) -> None:
        """Append ``sample``, waiting while the queue is full.

        Raises ``QueueClosed`` when the queue is closed (before or while waiting).
        """
        await self._change.wait_until(lambda: self._closed or len(self._items) < self._capacity)
        if self._closed:
            raise QueueClosed("put on a closed message queue")
        self._items.append(sample)
        self._total_put += 1
        self._changed()

    def put_back_front(self, samples: Iterable[Any]) -> None:
        """Return ``samples`` to the head of the queue in their order (e.g. an unused batch).

        They were already counted against the capacity once, so this may exceed it; it also
        works on a closed queue so that getters can still take them.
        """
        items = list(samples)
        if not items:
            return
        self._items.extendleft(reversed(items))
        self._total_put_back += len(items)
        self._changed()

    # ------------------------------------------------------------------- get

    async def get_batch(self, k: int, timeout_s: float | None = None) -> list[Any]:
        """Take ``k`` samples, waiting up to ``timeout_s`` seconds (forever when None).

        See the module docstring for the exact semantics; raises ``TimeoutError`` on timeout
        (taking nothing) and ``ValueError`` when ``k`` is negative or above the capacity.
        """
        k = int(k)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k > self._capacity:
            raise ValueError(
                f"k={k} exceeds the queue capacity {self._capacity}; it would never fill"
            )
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s!r}")
        started_at = self._clock()
        size_at_start = len(self._items)
        batch: list[Any] = []
        try:
            async with asyncio.timeout(timeout_s):
                async with self._getter_lock:
                    await self._change.wait_until(lambda: len(self._items) >= k or self._closed)
                    take = min(k, len(self._items))
                    batch = [self._items.popleft() for _ in range(take)]
        except TimeoutError:
            self._record(started_at, size_at_start, 0, k, timed_out=True)
            raise TimeoutError(
                f"get_batch({k}) timed out after {timeout_s}s "
                f"with {len(self._items)} samples queued"
            ) from None
        self._total_got += len(batch)
        self._record(started_at, size_at_start, len(batch), k)
        if batch:
            self._changed()
        return batch

    def drain(self) -> list[Any]:
        """Take everything queued now, without waiting and without a pull record."""
        items = list(self._items)
        self._items.clear()
        self._total_drained += len(items)
        if items:
            self._changed()
        return items

    def close(self) -> None:
        """No more puts (waiting puts fail); getters take what remains, then get ``[]``."""
        if self._closed:
            return
        self._closed = True
        self._changed()

    # --------------------------------------------------------------- records

    @property
    def pull_records(self) -> list[PullRecord]:
        """Every ``get_batch`` call since the last ``drain_pull_records``, oldest first."""
        return list(self._records)

    def last_pull(self) -> PullRecord | None:
        return self._records[-1] if self._records else None

    def drain_pull_records(self) -> list[PullRecord]:
        records, self._records = self._records, []
        return records

    # --------------------------------------------------------------- helpers

    def _record(
        self, started_at: float, size: int, got: int, k: int, *, timed_out: bool = False
    ) -> None:
        self._records.append(
            PullRecord(
                started_at=started_at,
                queue_size_at_start=size,
                wait_s=max(0.0, self._clock() - started_at),
                got=got,
                requested=k,
                timed_out=timed_out,
            )
        )

    def _changed(self) -> None:
        self._change.notify()
        size = len(self._items)
        for callback in list(self._listeners):
            try:
                callback(size)
            except Exception:  # noqa: BLE001 - a listener must not break the queue
                log.exception("message queue listener %r failed", callback)
