"""Counters of work thrown away by switching GPUs between training and rollout.

Deactivating or rebalancing aborts in-flight requests; with partial rollout their prompt plus the
tokens generated so far must be prefilled again on another replica; every switch also costs
wall-clock seconds. ``WastedWork`` adds these up and converts to and from ``waste/*`` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = [
    "WASTE_ABORTED_REQUESTS",
    "WASTE_ABORTED_TOKENS",
    "WASTE_REPREFILLED_TOKENS",
    "WASTE_SWITCH_S",
    "WastedWork",
]

WASTE_ABORTED_REQUESTS = "waste/aborted_requests"
WASTE_ABORTED_TOKENS = "waste/aborted_tokens"
WASTE_REPREFILLED_TOKENS = "waste/reprefilled_tokens"
WASTE_SWITCH_S = "waste/switch_s"

# field name -> metric name
_METRIC_NAMES = {
    "aborted_requests": WASTE_ABORTED_REQUESTS,
    "aborted_tokens": WASTE_ABORTED_TOKENS,
    "reprefilled_tokens": WASTE_REPREFILLED_TOKENS,
    "switch_s": WASTE_SWITCH_S,
}


@dataclass(frozen=True)
class WastedWork:
    """Wasted work over some span (a switch, a step, a run). Immutable; combine with ``add``.

    Attributes:
        aborted_requests: requests aborted while in flight.
        aborted_tokens: tokens those requests had generated when they were aborted.
        reprefilled_tokens: tokens prefilled again when aborted requests were resubmitted.
        switch_s: wall-clock seconds spent deactivating, activating and rebalancing.
    """

    aborted_requests: int = 0
    aborted_tokens: int = 0
    reprefilled_tokens: int = 0
    switch_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")

    def add(self, other: WastedWork) -> WastedWork:
        """Return a new ``WastedWork`` holding the field-wise sum of ``self`` and ``other``."""
        return WastedWork(
            aborted_requests=self.aborted_requests + other.aborted_requests,
            aborted_tokens=self.aborted_tokens + other.aborted_tokens,
            reprefilled_tokens=self.reprefilled_tokens + other.reprefilled_tokens,
            switch_s=self.switch_s + other.switch_s,
        )

    def as_metrics(self) -> dict[str, float]:
        """The counters as ``waste/*`` metrics (all four names, always present)."""
        return {metric: float(getattr(self, name)) for name, metric in _METRIC_NAMES.items()}

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> WastedWork:
        """Read the ``waste/*`` names out of ``metrics``; missing names count as 0.

        Counts are rounded to the nearest integer (metrics travel as floats).
        """
        return cls(
            aborted_requests=round(metrics.get(WASTE_ABORTED_REQUESTS, 0)),
            aborted_tokens=round(metrics.get(WASTE_ABORTED_TOKENS, 0)),
            reprefilled_tokens=round(metrics.get(WASTE_REPREFILLED_TOKENS, 0)),
            switch_s=float(metrics.get(WASTE_SWITCH_S, 0.0)),
        )
