"""Replacing dead standalone replicas: whether a replica gets a replacement, its id, the record.

Plain Python, no Ray and no clock (times are passed in): the rollout service asks
``ReplicaReplacer.on_failure`` when a standalone replica's actor died, starts the actor itself,
and reports back with ``joined`` or ``start_failed``.

- **Ids.** The K-th replacement of slot ``standalone-I`` is ``standalone-I.rK``: unique over a run,
  so an actor name, a load-balancer id or a metric never stands for two actors.
- **Bound.** A slot is replaced at most ``max_replacements`` times (a replacement that failed to
  start counts too); a death after that leaves the slot out for the rest of the run, logged once,
  so a crash-looping replica cannot spin forever.
- **One replacement per death.** A second report of the same death is ignored.
- **Over a resume.** ``state_dict()`` (replacements started per slot, and joined) is committed
  with every step; a resumed run's replacer starts from it, so the budget is per run, not per
  driver process, and ids keep counting (``standalone-0.r2`` after ``standalone-0.r1``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ReplacementRecord", "ReplicaReplacer"]

log = logging.getLogger(__name__)


@dataclass
class ReplacementRecord:
    """One death of a standalone replica and what became of its slot."""

    slot: str
    """The original replica id the slot started with (``standalone-I``)."""
    failed: str
    """The replica whose actor died (or whose replacement failed to start)."""
    replacement: str | None
    """The id started in its place; None when the slot's budget was spent."""
    failed_at: float
    joined_at: float | None = None
    """When the replacement became routable (None while starting, or when it never did)."""
    version: int | None = None
    """The param version it loaded before joining (None: joined before the first broadcast)."""
    error: str | None = None
    """Why the replacement did not join."""

    @property
    def status(self) -> str:
        """``joined``, ``starting``, ``start_failed`` or ``not_replaced``."""
        if self.replacement is None:
            return "not_replaced"
        if self.joined_at is not None:
            return "joined"
        return "start_failed" if self.error is not None else "starting"

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status}


class ReplicaReplacer:
    """Decides replacements for the standalone ``slots`` (see the module docstring)."""

    def __init__(self, slots: Sequence[str], max_replacements: int,
                 state: Mapping[str, Any] | None = None) -> None:
        if max_replacements < 0:
            raise ValueError(f"max_replacements must be >= 0, got {max_replacements}")
        self.max_replacements = int(max_replacements)
        self._slot_of = {rid: rid for rid in slots}  # every id ever used -> its slot
        state = state or {}
        spent_before = state.get("spent", {})
        self._spent = {rid: int(spent_before.get(rid, 0)) for rid in slots}
        self._joined_before = int(state.get("joined", 0))
        self._records: list[ReplacementRecord] = []
        self._record_of: dict[str, ReplacementRecord] = {}  # replacement id -> its record
        self._handled: set[str] = set()

    def slot_of(self, replica_id: str) -> str | None:
        """The slot of a standalone replica (original or replacement); None for any other id."""
        return self._slot_of.get(replica_id)

    def spent(self, slot: str) -> int:
        """Replacements started for ``slot`` so far."""
        return self._spent[slot]

    def on_failure(self, replica_id: str, now: float) -> str | None:
        """``replica_id``'s actor died: the id of the replacement to start, or None (not a
        standalone replica, already handled, or its slot's budget is spent)."""
        slot = self._slot_of.get(replica_id)
        if slot is None or replica_id in self._handled:
            return None
        self._handled.add(replica_id)
        if self._spent[slot] >= self.max_replacements:
            log.warning("standalone replica %s died; slot %s was replaced %d time(s) already "
                        "(rollout.max_replacements=%d): it stays out for the rest of the run",
                        replica_id, slot, self._spent[slot], self.max_replacements)
            self._records.append(ReplacementRecord(slot, replica_id, None, now))
            return None
        self._spent[slot] += 1
        new_id = f"{slot}.r{self._spent[slot]}"
        self._slot_of[new_id] = slot
        record = ReplacementRecord(slot, replica_id, new_id, now)
        self._records.append(record)
        self._record_of[new_id] = record
        return new_id

    def joined(self, replacement: str, now: float, version: int | None) -> ReplacementRecord:
        """``replacement`` holds the current weights and is routable."""
        record = self._record_of[replacement]
        record.joined_at, record.version = now, version
        return record

    def start_failed(self, replacement: str, error: str) -> ReplacementRecord:
        """``replacement`` never joined; the caller may then report it with ``on_failure`` to
        try again within the budget."""
        record = self._record_of[replacement]
        record.error = error
        return record

    def records(self) -> list[dict[str, Any]]:
        """Every death so far, oldest first, as plain dicts (with ``status``)."""
        return [r.as_dict() for r in self._records]

    @property
    def replaced(self) -> int:
        """Replacements that joined, over the whole run (earlier driver processes included)."""
        return self._joined_before + sum(r.joined_at is not None for r in self._records)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run's replacer starts from: replacements started per slot, and joined."""
        return {"spent": dict(self._spent), "joined": self.replaced}
