"""The load balancer's choice of a replica for a new request, shared by production and the simulator.

Rule: the fewest requests in flight; a tie goes to the replica first in *replica order*:
standalones before hybrids (a hybrid is taken back at the next deactivation, so work that could
go either way is safer on a standalone), then by id in natural order: the numbers in it compared
as numbers (``standalone-2`` before ``standalone-10``, a replacement ``standalone-0.r1`` next to
its slot 0). Must not know about stickiness or membership (the callers own them).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

_DIGITS = re.compile(r"(\d+)")


@functools.lru_cache(maxsize=4096)
def replica_order(replica_id: str) -> tuple[int, tuple[str | int, ...]]:
    """The sort key of ``replica_id`` in replica order (see the module docstring).

    The id is split into text and number runs (text at even places, numbers at odd ones, so two
    keys never compare a number with a text)."""
    runs = _DIGITS.split(replica_id)
    natural = tuple(int(run) if i % 2 else run for i, run in enumerate(runs))
    return (int(replica_id.startswith("hybrid")), natural)


def least_loaded(candidates: Iterable[T], load: Callable[[T], int],
                 replica_id: Callable[[T], str] = str) -> T | None:
    """The candidate with the fewest in flight, ties in replica order; None when there is none."""
    best: T | None = None
    best_key: tuple[int, tuple[int, tuple[str | int, ...]]] | None = None
    for candidate in candidates:
        key = (load(candidate), replica_order(replica_id(candidate)))
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    return best
