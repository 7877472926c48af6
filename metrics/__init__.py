"""Tidal's metrics: utilization formulas, per-cycle aggregation and wasted-work counters.

Owns: the reference's section 4 formulas, folding a sync cycle's micro-step metrics into one,
``WastedWork``, and the split of a step's time with the lent steps (``step_split``). Must not:
import Ray, torch or anything else of ours, read the clock, log, or do I/O (every function is
pure, so cluster, simulator and tests agree). More: ``docs/metrics.md``.
"""

from .aggregate import (
    DEFAULT_RULE,
    EXACT_RULES,
    MQ_SIZE,
    PREFIX_RULES,
    RESOURCE_UTILIZATION,
    ROLLOUT_RESOURCE_UTILIZATION,
    STEP_GENERATED_SAMPLES,
    STEP_GENERATED_TOKENS,
    STEP_S,
    TRAIN_ALLOCATED_TIME_S,
    TRAIN_COMPUTE_TIME_S,
    TRAIN_RESOURCE_UTILIZATION,
    WAIT_FOR_ENOUGH_SAMPLES_S,
    Rule,
    aggregate_cycle,
    cycle_utilizations,
    fold_step,
    rule_for,
)
from .step_split import (
    SPLIT_PARTS,
    LendingGain,
    StepSplit,
    lending_gain,
    lent_spans,
    lent_steps,
    step_split,
    tracked_scalars,
)
from .utilization import (
    cluster_resource_utilization,
    rollout_resource_utilization,
    train_resource_utilization,
)
from .waste import (
    WASTE_ABORTED_REQUESTS,
    WASTE_ABORTED_TOKENS,
    WASTE_REPREFILLED_TOKENS,
    WASTE_SWITCH_S,
    WastedWork,
)

__all__ = [
    # utilization formulas
    "train_resource_utilization",
    "rollout_resource_utilization",
    "cluster_resource_utilization",
    # per-cycle aggregation
    "fold_step",
    "Rule",
    "EXACT_RULES",
    "PREFIX_RULES",
    "DEFAULT_RULE",
    "rule_for",
    "aggregate_cycle",
    "cycle_utilizations",
    # metric names
    "TRAIN_COMPUTE_TIME_S",
    "TRAIN_ALLOCATED_TIME_S",
    "MQ_SIZE",
    "TRAIN_RESOURCE_UTILIZATION",
    "ROLLOUT_RESOURCE_UTILIZATION",
    "RESOURCE_UTILIZATION",
    "WAIT_FOR_ENOUGH_SAMPLES_S",
    "STEP_S",
    "STEP_GENERATED_SAMPLES",
    "STEP_GENERATED_TOKENS",
    "WASTE_ABORTED_REQUESTS",
    "WASTE_ABORTED_TOKENS",
    "WASTE_REPREFILLED_TOKENS",
    "WASTE_SWITCH_S",
    # wasted work
    "WastedWork",
    # what the report plots and the trackers log
    "SPLIT_PARTS",
    "StepSplit",
    "step_split",
    "lent_steps",
    "tracked_scalars",
]
