"""The three utilization formulas of the reference's section 4, as pure functions.

Owns: train, rollout and cluster utilization from plain numbers, validated, each a ratio in [0, 1].
Must not: aggregate over steps (``metrics.aggregate`` does). What each measures: ``docs/metrics.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "train_resource_utilization",
    "rollout_resource_utilization",
    "cluster_resource_utilization",
]


def _clip01(value: float) -> float:
    """Clamp ``value`` into [0, 1] (guards the last ulp of floating-point rounding)."""
    return min(1.0, max(0.0, value))


def _check_time(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def train_resource_utilization(compute_s: Sequence[float], allocated_s: Sequence[float]) -> float:
    """Fraction of the trainer's allocated wall-clock time spent on training compute.

    ``compute_s[i]`` and ``allocated_s[i]`` belong to micro-step ``i`` of one sync cycle::

        U_train = sum_i compute_i / sum_i alloc_i

    The ratio is taken once from the totals, never as a mean of per-micro-step ratios.
    Returns 0.0 when the total allocated time is 0; the result is clipped to [0, 1].

    Raises:
        ValueError: the sequences differ in length, or a value is negative or not finite.
    """
    if len(compute_s) != len(allocated_s):
        raise ValueError(
            f"compute_s and allocated_s must have the same length, "
            f"got {len(compute_s)} and {len(allocated_s)}"
        )
    for name, values in (("compute_s", compute_s), ("allocated_s", allocated_s)):
        for i, value in enumerate(values):
            _check_time(f"{name}[{i}]", value)
            if value < 0:
                raise ValueError(f"{name}[{i}] must be >= 0, got {value!r}")
    total_allocated = math.fsum(allocated_s)
    if total_allocated <= 0:
        return 0.0
    return _clip01(math.fsum(compute_s) / total_allocated)


def rollout_resource_utilization(history: Sequence[tuple[float, int, int]], end_t: float) -> float:
    """Capacity-time-weighted share of rollout concurrency that was actually used.

    ``history`` holds change points ``(t_k, active_k, cap_k)``: from ``t_k`` until the next
    change point (the last one until ``end_t``) there were ``active_k`` samples in flight and room
    for ``cap_k``. With ``dt_k = t_{k+1} - t_k``::

        U_rollout = sum_k dt_k * min(cap_k, active_k) / sum_k dt_k * cap_k

    Every interval uses its own capacity; intervals with ``cap_k == 0`` carry no weight.
    Returns 0.0 when the total weight is 0 (empty history, zero-length window, no capacity).

    Raises:
        ValueError: times decrease, ``end_t`` precedes the last change point, a time is not
            finite, or a count is negative.
    """
    if not history:
        return 0.0
    _check_time("end_t", end_t)
    for k, (t, active, cap) in enumerate(history):
        _check_time(f"history[{k}] time", t)
        if active < 0 or cap < 0:
            raise ValueError(
                f"history[{k}] counts must be >= 0, got active={active!r}, cap={cap!r}"
            )
        if k > 0 and t < history[k - 1][0]:
            raise ValueError(
                f"history times must not decrease: history[{k}] at t={t!r} comes after "
                f"t={history[k - 1][0]!r}"
            )
    if end_t < history[-1][0]:
        raise ValueError(
            f"end_t={end_t!r} is before the last change point t={history[-1][0]!r}"
        )

    ends = [t for t, _, _ in history[1:]] + [end_t]
    used: list[float] = []
    weight: list[float] = []
    for (t, active, cap), t_next in zip(history, ends):
        if cap == 0:
            continue
        dt = t_next - t
        used.append(dt * min(cap, active))
        weight.append(dt * cap)
    total_weight = math.fsum(weight)
    if total_weight <= 0:
        return 0.0
    return _clip01(math.fsum(used) / total_weight)


def cluster_resource_utilization(
    u_train: float,
    u_rollout: float,
    wait_s: float,
    step_s: float,
    hybrid_gpus: int,
    standalone_gpus: int,
) -> float:
    """Cluster-wide GPU utilization for one sync cycle.

    ``x`` is the share of the cycle the ``a = hybrid_gpus`` spent generating, estimated from the
    summed wait-for-samples time over the summed step time; ``b = standalone_gpus`` generate all
    the time::

        x         = clip(wait_s / step_s, 0, 1)          (x = 0 when step_s <= 0)
        U_cluster = ((1 - x)*a*U_train + (x*a + b)*U_rollout) / (a + b)

    Returns 0.0 when ``a + b == 0``; the result is clipped to [0, 1].

    Raises:
        ValueError: a GPU count is negative, a utilization lies outside [0, 1], or a time is not
            finite.
    """
    if hybrid_gpus < 0 or standalone_gpus < 0:
        raise ValueError(
            f"GPU counts must be >= 0, got hybrid_gpus={hybrid_gpus!r}, "
            f"standalone_gpus={standalone_gpus!r}"
        )
    for name, u in (("u_train", u_train), ("u_rollout", u_rollout)):
        if not 0.0 <= u <= 1.0:  # also rejects NaN
            raise ValueError(f"{name} must lie in [0, 1], got {u!r}")
    _check_time("wait_s", wait_s)
    _check_time("step_s", step_s)

    a, b = hybrid_gpus, standalone_gpus
    if a + b == 0:
        return 0.0
    x = _clip01(wait_s / step_s) if step_s > 0 else 0.0
    return _clip01(((1.0 - x) * a * u_train + (x * a + b) * u_rollout) / (a + b))
