"""Who the standalone replicas of a run are: alive, dead, being replaced, routable.

Owns the one view of standalone membership the control plane acts on (the controller actor owns
the one instance): a replica is *routable* from its start (or, for a replacement, from when it
joined the load balancer) until its death is reported; a replacement is *replacing* from its
start until it joins or fails. Slots keep their order: a replacement takes the place of the
replica it replaces, so every switch and broadcast lists the replicas in the same order.

Must not: import Ray, call a replica, or decide anything. The rollout service and the controller
report what they saw (a failed call, a failed ping, a replacement started, joined or failed).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Membership"]


class Membership:
    """The standalone replicas of one run and what became of each (hybrids are listed for ids)."""

    def __init__(self, standalone_ids: Sequence[str], hybrid_ids: Sequence[str] = ()) -> None:
        self._slots: list[str] = list(dict.fromkeys(standalone_ids))
        self._hybrids = tuple(dict.fromkeys(hybrid_ids))
        overlap = set(self._slots) & set(self._hybrids)
        if overlap:
            raise ValueError(f"replica ids both standalone and hybrid: {sorted(overlap)}")
        self._had_standalone = bool(self._slots)
        self._dead: list[str] = []
        self._replacing: dict[str, str] = {}  # new id -> the id it replaces

    # ------------------------------------------------------------------ reports

    def died(self, replica_id: str) -> bool:
        """A standalone replica's actor died (or its replacement never started); True when news.

        An unknown id (a hybrid, or a replica of no slot) is ignored and gives False.
        """
        if replica_id in self._dead or replica_id in self._hybrids:
            return False
        if replica_id in self._replacing:
            del self._replacing[replica_id]
        elif replica_id not in self._slots:
            return False
        self._dead.append(replica_id)
        return True

    def replacing(self, old: str, new: str) -> None:
        """``new`` was started to take ``old``'s place; not routable until ``joined``."""
        if new in self._slots or new in self._hybrids or new in self._replacing or new in self._dead:
            raise ValueError(f"replica id {new!r} is already in use")
        self._replacing[new] = old

    def joined(self, old: str, new: str) -> None:
        """``new`` loaded the weights and joined: it takes ``old``'s slot (or comes last)."""
        self._replacing.pop(new, None)
        if new in self._slots or new in self._hybrids or new in self._dead:
            raise ValueError(f"replica id {new!r} is already in use")
        if old in self._slots:
            self._slots[self._slots.index(old)] = new
        else:
            self._slots.append(new)
        if old not in self._dead and old not in self._hybrids:
            self._dead.append(old)  # a replica is only replaced once it died

    def replacement_failed(self, new: str) -> None:
        """``new`` did not start (it counts as a death of its own)."""
        self.died(new)

    # ------------------------------------------------------------------ views

    @property
    def hybrid_ids(self) -> tuple[str, ...]:
        return self._hybrids

    def routable(self) -> tuple[str, ...]:
        """Standalone replicas that serve (alive and joined), in slot order."""
        return tuple(rid for rid in self._slots if rid not in self._dead)

    def dead(self) -> tuple[str, ...]:
        """Every standalone replica whose death was reported, in the order reported."""
        return tuple(self._dead)

    def replacing_ids(self) -> tuple[str, ...]:
        """Replacements started but not yet joined, in the order started."""
        return tuple(self._replacing)

    def alive(self) -> tuple[str, ...]:
        """Routable replicas plus the replacements still starting."""
        return self.routable() + self.replacing_ids()

    def is_dead(self, replica_id: str) -> bool:
        return replica_id in self._dead

    @property
    def standalone_lost(self) -> bool:
        """The run had standalone replicas and none is routable: only the hybrids can generate."""
        return self._had_standalone and not self.routable()
