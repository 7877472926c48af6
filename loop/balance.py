"""The load balancer's choice of a replica for a new request, shared by production and the simulator.

Rule: the fewest requests in flight; a tie goes to the replica first in *replica order*:
standalones before hybrids (a hybrid is taken back at the next deactivation, so work that could
go either way is safer on a standalone), then by the number in the id, compared as a number
(``standalone-2`` before ``standalone-10``). Ids that do not end in a number compare as strings
after the numbered ones of their prefix. Must not know about stickiness or membership (the callers own them).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


@functools.lru_cache(maxsize=4096)
def replica_order(replica_id: str) -> tuple[int, str, int, str]:
    """The sort key of ``replica_id`` in replica order (see the module docstring)."""
    match = _NUMBERED.match(replica_id)
    prefix, number = (match.group(1), int(match.group(2))) if match else (replica_id, -1)
    return (int(replica_id.startswith("hybrid")), prefix, number, replica_id)


def least_loaded(candidates: Iterable[T], load: Callable[[T], int],
                 replica_id: Callable[[T], str] = str) -> T | None:
    """The candidate with the fewest in flight, ties in replica order; None when there is none."""
    best: T | None = None
    best_key: tuple[int, tuple[int, str, int, str]] | None = None
    for candidate in candidates:
        key = (load(candidate), replica_order(replica_id(candidate)))
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    return best
