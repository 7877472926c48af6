"""Where a step's time went, and which steps had the hybrid lent: what the report plots (pure).

Owns: ``StepSplit`` (train / wait / switch / sync / other seconds of one step, from its metrics)
and ``lent_steps`` (the steps that began with the hybrid replicas lent to rollout). Must not: read
the store, plot, or import anything of ours (callers pass plain metric dicts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["SPLIT_PARTS", "LendingGain", "StepSplit", "lending_gain", "lent_spans", "lent_steps", "step_split",
           "tracked_scalars"]

SPLIT_PARTS = ("train", "wait", "switch", "sync", "other")
"""The parts of a step's time, in plotting order."""


@dataclass(frozen=True)
class StepSplit:
    """One step's wall time in parts that add up to ``total`` (seconds).

    - ``train``: the trainer's compute (``dynamic_resource/train_compute_time_s``).
    - ``wait``: waiting for samples before and inside the micro-steps
      (``timing_s/wait_for_enough_samples`` + ``timing_s/wait_for_samples_in_train``).
    - ``switch``: deactivate, hybrid sync, activate and rebalance (``waste/switch_s``).
    - ``sync``: the weight broadcast to the standalone replicas (``timing_s/param_sync``).
    - ``other``: the rest of ``timing_s/step`` (control plane, commit); never negative.
    """

    train: float
    wait: float
    switch: float
    sync: float
    other: float

    @property
    def total(self) -> float:
        return self.train + self.wait + self.switch + self.sync + self.other


def _num(metrics: Mapping[str, float], name: str) -> float:
    value = metrics.get(name, 0.0)
    return float(value) if value is not None and math.isfinite(float(value)) else 0.0


def step_split(metrics: Mapping[str, float]) -> StepSplit:
    """The split of one step from its stored metrics; a missing or NaN metric counts as 0."""
    train = _num(metrics, "dynamic_resource/train_compute_time_s")
    wait = _num(metrics, "timing_s/wait_for_enough_samples") + _num(metrics, "timing_s/wait_for_samples_in_train")
    switch = _num(metrics, "waste/switch_s")
    sync = _num(metrics, "timing_s/param_sync")
    other = max(0.0, _num(metrics, "timing_s/step") - (train + wait + switch + sync))
    return StepSplit(train=train, wait=wait, switch=switch, sync=sync, other=other)


def lent_steps(rows: Sequence[Mapping[str, object]]) -> list[int]:
    """The steps during which the hybrid replicas were lent: a step is lent when the step before
    it ended with them active (``hybrid_active_after``), so they generated while it waited.
    ``rows`` are in step order."""
    out, before = [], False
    for row in rows:
        if before:
            out.append(int(row["step"]))  # type: ignore[call-overload]
        before = bool(row.get("hybrid_active_after", False))
    return out


def lent_spans(steps: Sequence[int]) -> list[tuple[float, float]]:
    """The x spans a plot shades as "lent": consecutive lent ``steps`` (ascending) merged into one
    span, from half a step before the first to half a step after the last."""
    spans: list[tuple[float, float]] = []
    for step in steps:
        if spans and spans[-1][1] == step - 0.5:
            spans[-1] = (spans[-1][0], step + 0.5)
        else:
            spans.append((step - 0.5, step + 0.5))
    return spans


@dataclass(frozen=True)
class LendingGain:
    """What lending bought in one run, estimated from that run's own steps (``lending_gain``).

    ``lent_idle_s`` and ``unlent_idle_s``: the mean seconds per step that the trainer neither
    trained nor synced (its wait for samples plus the control plane's share, ``StepSplit.wait +
    other``: a lend cycle's extra tasks count against it), over the steps with the hybrids lent
    and over those without; the run's first step (its start-up) is in neither. ``switch_s``: every
    switch of the run, all of it lending's cost. ``bought_s = lent × (unlent_idle_s −
    lent_idle_s) − switch_s``. An estimate: the steps without a lend ran at other moments of the
    run (often its start, where the policy had not lent yet); ``tidal compare`` measures the same
    job side by side. None where there is no lent step or no step without one to compare with.
    """

    steps: int
    lent: int
    lent_idle_s: float
    unlent_idle_s: float
    switch_s: float

    BASIS = ("the trainer's wait and the control plane's time per lent step against the same per step "
             "without a lend, both from this run's steps after its first")

    @property
    def bought_s(self) -> float:
        return self.lent * (self.unlent_idle_s - self.lent_idle_s) - self.switch_s

    def sentence(self) -> str:
        """``lent on 57 of 64 steps: a lent step waited and ran control-plane tasks 0.60 s against
        0.83 s for a step without a lend; switches cost 5.2 s in all: lending bought ≈ 7.9 s
        (estimated from this run's steps)``."""
        verb = "bought" if self.bought_s >= 0 else "cost"
        return (f"lent on {self.lent} of {self.steps} steps: a lent step waited and ran control-plane tasks "
                f"{self.lent_idle_s:.2f} s against {self.unlent_idle_s:.2f} s for a step without a lend; switches "
                f"cost {self.switch_s:.1f} s in all: lending {verb} ≈ {abs(self.bought_s):.1f} s (estimated from "
                f"this run's steps)")


def lending_gain(rows: Sequence[Mapping[str, object]]) -> LendingGain | None:
    """``LendingGain`` of a run's step rows (in step order, each with ``hybrid_active_after``)."""
    lent = set(lent_steps(rows))
    splits = [(int(r["step"]) in lent, step_split(r)) for r in rows]  # type: ignore[arg-type, call-overload]
    after_first = splits[1:]
    with_lend = [s.wait + s.other for is_lent, s in after_first if is_lent]
    without = [s.wait + s.other for is_lent, s in after_first if not is_lent]
    if not with_lend or not without:
        return None
    return LendingGain(steps=len(rows), lent=len(lent), lent_idle_s=sum(with_lend) / len(with_lend),
                       unlent_idle_s=sum(without) / len(without), switch_s=sum(s.switch for _, s in splits))


def tracked_scalars(metrics: Mapping[str, object]) -> dict[str, float]:
    """The metrics a tracker logs: every finite number, by name, in name order (NaN, None and
    non-numbers are left out: a tracker plots a gap there)."""
    out: dict[str, float] = {}
    for name in sorted(metrics):
        value = metrics[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[name] = float(value)
    return out
