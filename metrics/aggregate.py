"""Per-cycle aggregation of micro-step metrics and the cycle's utilization metrics.

Owns: the rule table (``EXACT_RULES``, ``PREFIX_RULES``, mean by default), ``aggregate_cycle`` and
``cycle_utilizations``. Must not: know where the metrics come from. The table explained:
``docs/metrics.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType

from .utilization import (
    cluster_resource_utilization,
    rollout_resource_utilization,
    train_resource_utilization,
)
from .waste import WASTE_SWITCH_S

__all__ = [
    "fold_step",
    "TRAIN_COMPUTE_TIME_S",
    "TRAIN_ALLOCATED_TIME_S",
    "MQ_SIZE",
    "TRAIN_RESOURCE_UTILIZATION",
    "ROLLOUT_RESOURCE_UTILIZATION",
    "RESOURCE_UTILIZATION",
    "WAIT_FOR_ENOUGH_SAMPLES_S",
    "STEP_S",
    "STEP_GENERATED_SAMPLES",
    "Rule",
    "EXACT_RULES",
    "PREFIX_RULES",
    "DEFAULT_RULE",
    "rule_for",
    "aggregate_cycle",
    "cycle_utilizations",
]

TRAIN_COMPUTE_TIME_S = "dynamic_resource/train_compute_time_s"
TRAIN_ALLOCATED_TIME_S = "dynamic_resource/train_allocated_time_s"
MQ_SIZE = "dynamic_resource/mq_size"
TRAIN_RESOURCE_UTILIZATION = "dynamic_resource/train_resource_utilization"
ROLLOUT_RESOURCE_UTILIZATION = "dynamic_resource/rollout_resource_utilization"
RESOURCE_UTILIZATION = "dynamic_resource/resource_utilization"
WAIT_FOR_ENOUGH_SAMPLES_S = "timing_s/wait_for_enough_samples"
STEP_S = "timing_s/step"
STEP_GENERATED_SAMPLES = "fully_async/rollouter/step_generated_samples"
STEP_GENERATED_TOKENS = "fully_async/rollouter/step_generated_tokens"


class Rule(StrEnum):
    """How the values one name takes over a cycle's micro-steps become one value."""

    SUM = "sum"
    LAST = "last"
    MEAN = "mean"
    MAX = "max"


EXACT_RULES: Mapping[str, Rule] = MappingProxyType(
    {
        TRAIN_COMPUTE_TIME_S: Rule.SUM,
        TRAIN_ALLOCATED_TIME_S: Rule.SUM,
        MQ_SIZE: Rule.LAST,
        STEP_GENERATED_SAMPLES: Rule.LAST,
        STEP_GENERATED_TOKENS: Rule.LAST,
    }
)
PREFIX_RULES: Sequence[tuple[str, Rule]] = (
    ("timing_s/", Rule.SUM),
    ("waste/", Rule.SUM),
)
DEFAULT_RULE = Rule.MEAN


def rule_for(name: str, extra_rules: Mapping[str, Rule] | None = None) -> Rule:
    """The rule for ``name``: ``extra_rules``, then ``EXACT_RULES``, then ``PREFIX_RULES``, else mean."""
    if extra_rules and name in extra_rules:
        return Rule(extra_rules[name])
    if name in EXACT_RULES:
        return EXACT_RULES[name]
    for prefix, rule in PREFIX_RULES:
        if name.startswith(prefix):
            return rule
    return DEFAULT_RULE


def _apply(rule: Rule, values: list[float]) -> float:
    if rule is Rule.SUM:
        return math.fsum(values)
    if rule is Rule.LAST:
        return values[-1]
    if rule is Rule.MAX:
        return max(values)
    return math.fsum(values) / len(values)


def aggregate_cycle(
    micro_steps: Sequence[Mapping[str, float]],
    *,
    extra_rules: Mapping[str, Rule] | None = None,
) -> dict[str, float]:
    """Fold one cycle's micro-step metric dicts into one dict, name by name (see the table above).

    ``extra_rules`` maps exact names to rules that take precedence over the table. Names appear
    in the order they were first seen; an empty ``micro_steps`` gives an empty dict.
    """
    series: dict[str, list[float]] = {}
    for step in micro_steps:
        for name, value in step.items():
            series.setdefault(name, []).append(float(value))
    return {name: _apply(rule_for(name, extra_rules), values) for name, values in series.items()}


def cycle_utilizations(
    aggregated: Mapping[str, float],
    *,
    rollout_history: Sequence[tuple[float, int, int]],
    window_end_t: float,
    hybrid_gpus: int,
    standalone_gpus: int,
) -> dict[str, float]:
    """The cycle's three utilization metrics from its aggregated metrics and rollout history.

    - ``TRAIN_RESOURCE_UTILIZATION``: summed compute time / summed allocated time.
    - ``ROLLOUT_RESOURCE_UTILIZATION``: ``rollout_resource_utilization(rollout_history,
      window_end_t)``.
    - ``RESOURCE_UTILIZATION``: the cluster formula, with wait = summed
      ``timing_s/wait_for_enough_samples`` and step = summed ``timing_s/step``.

    ``aggregated`` is the output of ``aggregate_cycle``; missing names count as 0.
    """
    u_train = train_resource_utilization(
        [aggregated.get(TRAIN_COMPUTE_TIME_S, 0.0)],
        [aggregated.get(TRAIN_ALLOCATED_TIME_S, 0.0)],
    )
    u_rollout = rollout_resource_utilization(rollout_history, window_end_t)
    u_cluster = cluster_resource_utilization(
        u_train,
        u_rollout,
        wait_s=aggregated.get(WAIT_FOR_ENOUGH_SAMPLES_S, 0.0),
        step_s=aggregated.get(STEP_S, 0.0),
        hybrid_gpus=hybrid_gpus,
        standalone_gpus=standalone_gpus,
    )
    return {
        TRAIN_RESOURCE_UTILIZATION: u_train,
        ROLLOUT_RESOURCE_UTILIZATION: u_rollout,
        RESOURCE_UTILIZATION: u_cluster,
    }


def fold_step(
    per_micro: Sequence[Mapping[str, float]],
    *,
    compute_s: Sequence[float],
    allocated_s: Sequence[float],
    deactivate_s: float,
    after_train_s: float,
    wait_s: float,
    step_s: float,
    switch_s: float,
    window: Mapping[str, float],
    trainer_gpus: int,
    standalone_gpus: int,
) -> dict[str, float]:
    """One step's metrics, by the one rule production and the twin both fold with (reference §4).

    ``per_micro``: each micro-step's own metrics (folded by ``aggregate_cycle``); ``compute_s`` and
    ``allocated_s``: each micro-step's update seconds and its seconds from the start of its pull to
    the end of its update. The first micro-step's allocation also holds the take-back before it
    (``deactivate_s``), the last one's what runs after training until the policy adapts: the
    weight syncs, the activation and the rebalance (``after_train_s``). ``window``: the rollout
    window's metrics at the broadcast (its ``ROLLOUT_RESOURCE_UTILIZATION`` among them), kept
    as they are. ``wait_s``: the hybrids' generation before the take-back (the cluster formula's
    wait); ``switch_s``: the step's switch seconds (``loop.step_switch_seconds``).
    """
    allocated = list(allocated_s)
    if allocated:
        allocated[0] += deactivate_s
        allocated[-1] += after_train_s
    out = aggregate_cycle(per_micro)
    out.update(window)
    u_train = train_resource_utilization(list(compute_s), allocated)
    out.update({
        TRAIN_COMPUTE_TIME_S: math.fsum(compute_s),
        TRAIN_ALLOCATED_TIME_S: math.fsum(allocated),
        TRAIN_RESOURCE_UTILIZATION: u_train,
        WAIT_FOR_ENOUGH_SAMPLES_S: wait_s,
        STEP_S: step_s,
        RESOURCE_UTILIZATION: cluster_resource_utilization(
            u_train, window.get(ROLLOUT_RESOURCE_UTILIZATION, 0.0), wait_s=wait_s, step_s=step_s,
            hybrid_gpus=trainer_gpus, standalone_gpus=standalone_gpus),
        WASTE_SWITCH_S: switch_s,
    })
    return out

