"""The rollout load balancer: which replica serves the next generation request.

Routing rules:

- **Sticky sessions.** ``acquire(key)`` returns the replica that ``key`` (a request id) last went
  to, as long as that replica is still routable; a retried request therefore lands where its
  prefix may still be cached. ``forget(key)`` drops the entry once the request is done.
- **Least loaded otherwise.** A new key, or one whose replica left, goes to the routable replica
  with the fewest requests in flight; ties go to the first in replica order (standalones before
  hybrids, then natural id order: ``loop.balance``, the simulator's rule too), so routing is
  deterministic.
- **Removal routes retries elsewhere.** ``remove_replicas`` stops routing to the replicas at once
  and drops every sticky entry that points at them; their in-flight counts stay visible through
  ``in_flight`` until the aborted requests are released, so a caller can wait for them to drain.

In-flight counts go up in ``acquire`` and down in ``release``; a release that has nothing to
release is ignored (and counted in ``stats()["ignored_releases"]``), so a count never goes
negative. Adding an id twice registers it once.

Listeners registered with ``on_change`` are called with the new number of routable replicas
whenever the routable set changes (the rollouter recomputes its capacity from it).

Plain Python, no Ray and no threads: every method is meant to be called from the one event loop
that owns the balancer (the Ray actor that wraps it runs all calls on that loop). Only
``wait_routable`` is a coroutine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from loop.balance import least_loaded
from rollout.wakeups import Wakeup

__all__ = ["LoadBalancer"]

log = logging.getLogger(__name__)

ChangeListener = Callable[[int], None]


def _unique(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(str(i) for i in ids))


class LoadBalancer:
    """Sticky, least-loaded routing of requests over a changing set of replicas.

    Implements the controller's ``LoadBalancer`` protocol (``add_replicas``, ``remove_replicas``,
    ``clear_sticky``, ``in_flight``) plus what the rollouter needs (``acquire``, ``release``,
    ``forget``, ``wait_routable``, ``on_change``).
    """

    def __init__(self, replica_ids: Sequence[str] = ()) -> None:
        self._active: dict[str, None] = {}  # routable ids, insertion-ordered set
        self._load: dict[str, int] = {}  # in-flight per replica (active or draining)
        self._sticky: dict[str, str] = {}  # request key -> replica id
        self._keys_of: dict[str, set[str]] = {}  # replica id -> its sticky keys
        self._listeners: list[ChangeListener] = []
        self._routable = Wakeup()  # wakes wait_routable
        self._released = Wakeup()  # wakes wait_drained
        self._acquired = 0
        self._ignored_releases = 0
        self._held = False  # routing held (a rebalance drains): acquire answers None
        if replica_ids:
            self.add_replicas(replica_ids)

    # ------------------------------------------------------------ membership

    def add_replicas(self, ids: Sequence[str]) -> None:
        """Start routing to ``ids``; ids already routable are left as they are."""
        added = [rid for rid in _unique(ids) if rid not in self._active]
        if not added:
            return
        for rid in added:
            self._active[rid] = None
            self._load.setdefault(rid, 0)
        self._routable.notify()
        self._notify()

    def remove_replicas(self, ids: Sequence[str]) -> None:
        """Stop routing to ``ids`` and forget their sticky entries; unknown ids are ignored.

        Requests already in flight on them stay counted until released.
        """
        removed = [rid for rid in _unique(ids) if rid in self._active]
        if not removed:
            return
        for rid in removed:
            del self._active[rid]
            for key in self._keys_of.pop(rid, ()):
                del self._sticky[key]
            if self._load.get(rid) == 0:
                del self._load[rid]
        self._notify()

    def active_ids(self) -> tuple[str, ...]:
        """The routable replicas, in the order they were added."""
        return tuple(self._active)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def is_routable(self, replica_id: str) -> bool:
        return replica_id in self._active

    def on_change(self, callback: ChangeListener) -> Callable[[], None]:
        """Call ``callback(num_active)`` after every change of the routable set.

        Returns a function that unregisters the callback.
        """
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    def hold(self) -> None:
        """Route nothing until ``unhold``: ``acquire`` answers None and ``wait_routable`` waits.

        The routable set (and so the capacity the rollouter computes from it) is unchanged. A
        rebalance holds routing while it drains, so the retries of the requests it aborted wait
        here instead of being sent straight back to the paused replicas (which would keep the
        in-flight count above zero for as long as there are retries to send).
        """
        self._held = True

    def unhold(self) -> None:
        """Route again; wakes everything waiting in ``wait_routable``."""
        self._held = False
        self._routable.notify()

    @property
    def held(self) -> bool:
        return self._held

    async def wait_routable(self) -> None:
        """Return once a replica is routable and routing is not held (at once when so)."""
        await self._routable.wait_until(lambda: bool(self._active) and not self._held)

    # --------------------------------------------------------------- routing

    def acquire(self, request_key: str) -> str | None:
        """Pick the replica for ``request_key`` and count one request in flight on it.

        Returns None (and counts nothing) when no replica is routable or routing is held.
        """
        if self._held:
            return None
        rid = self._sticky.get(request_key)
        if rid is None or rid not in self._active:
            if not self._active:
                return None
            rid = least_loaded(self._active, self._load.__getitem__)
            self._stick(request_key, rid)
        self._load[rid] += 1
        self._acquired += 1
        return rid

    def release(self, replica_id: str) -> None:
        """One request on ``replica_id`` is over (finished, aborted or failed)."""
        count = self._load.get(replica_id, 0)
        if count <= 0:
            self._ignored_releases += 1
            log.debug("release(%r) with nothing in flight ignored", replica_id)
            return
        count -= 1
        if count == 0 and replica_id not in self._active:
            del self._load[replica_id]  # a removed replica has drained
        else:
            self._load[replica_id] = count
        self._released.notify()

    def forget(self, request_key: str) -> bool:
        """Drop ``request_key``'s sticky entry (its request is done); True when there was one."""
        rid = self._sticky.pop(request_key, None)
        if rid is None:
            return False
        keys = self._keys_of.get(rid)
        if keys is not None:
            keys.discard(request_key)
            if not keys:
                del self._keys_of[rid]
        return True

    def clear_sticky(self) -> int:
        """Forget every sticky entry; returns how many there were."""
        cleared = len(self._sticky)
        self._sticky.clear()
        self._keys_of.clear()
        return cleared

    def sticky_replica(self, request_key: str) -> str | None:
        """The replica ``request_key`` is stuck to, if any."""
        return self._sticky.get(request_key)

    # ---------------------------------------------------------------- counts

    def in_flight(self, ids: Sequence[str] | None = None) -> int:
        """Requests in flight on ``ids`` (on every replica, removed ones included, when None)."""
        if ids is None:
            return sum(self._load.values())
        return sum(self._load.get(rid, 0) for rid in _unique(ids))

    async def wait_drained(self, ids: Sequence[str], timeout_s: float) -> int:
        """Return 0 once nothing is in flight on ``ids``, or what still is after ``timeout_s``;
        woken by each ``release``, never by polling."""
        try:
            await asyncio.wait_for(self._released.wait_until(lambda: self.in_flight(ids) == 0), timeout_s)
        except TimeoutError:
            pass
        return self.in_flight(ids)

    def loads(self) -> dict[str, int]:
        """In-flight count per replica: every routable one, plus removed ones still draining."""
        return dict(self._load)

    def stats(self) -> dict[str, int]:
        return {
            "num_active": len(self._active),
            "in_flight": self.in_flight(),
            "sticky_entries": len(self._sticky),
            "acquired": self._acquired,
            "ignored_releases": self._ignored_releases,
            "held": int(self._held),
        }

    # --------------------------------------------------------------- helpers

    def _stick(self, key: str, rid: str) -> None:
        old = self._sticky.get(key)
        if old is not None and old != rid:
            keys = self._keys_of.get(old)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._keys_of[old]
        self._sticky[key] = rid
        self._keys_of.setdefault(rid, set()).add(key)

    def _notify(self) -> None:
        """Call every listener; the first error is raised after all of them ran."""
        count = len(self._active)
        error: BaseException | None = None
        for callback in list(self._listeners):
            try:
                callback(count)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                log.exception("load balancer listener %r failed", callback)
                error = error or exc
        if error is not None:
            raise error
