"""One asyncio wake-up: coroutines wait until a condition holds, re-checked at every ``notify``.

Owns the waiter-future loop that the load balancer, the message queue and the rollouter share.
Must not: know what it waits for (the caller passes the condition), use threads, or run anything
but the awaiting coroutine (``notify`` only resolves futures).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Wakeup"]


class Wakeup:
    """Wakes every coroutine waiting in ``wait_until`` whenever ``notify`` is called.

    Use it from the one event loop that owns the object it guards. A waiter that is cancelled (or
    times out) while waiting leaves nothing behind.
    """

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def waiting(self) -> int:
        """Coroutines waiting now."""
        return len(self._waiters)

    def notify(self) -> None:
        """Wake every waiter; each re-checks its condition and waits again while it is false."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` is true: at once when it already is, else at a ``notify``."""
        while not predicate():
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
