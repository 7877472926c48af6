"""The rules of the fully-async loop that production and the simulator share.

Owns: the step as a sequence of phase intents (``loop.step``), the typed plans and reports that
pass between a step's phases (``loop.plans``), the switches no policy asks for (the guarded
starts and the stranded refill, ``loop.guards``), and the policy questions of a step with their
decision records and the per-cycle switch durations (``loop.decisions``), the switches as
operations with the hybrids' state machine (``loop.switches``), and the controller that executes
them through its protocols (``loop.controller``, with the standalone membership it acts on).

Must not: import Ray, torch, Prefect or a clock, do I/O but through the protocols the controller is
given, or know what an operation costs. Production executes the intents and operations against
its actors; the simulator against its event heap.
"""

from loop.context import Snapshot, micro_summaries, policy_context
from loop.decisions import DecisionRecord, Decider, SwitchBook, SwitchDurations, lend_count, step_switch_seconds
from loop.guards import (
    ONLY_HYBRID_START,
    RELEND_AFTER_RESUME,
    STRANDED_POLL_S,
    STRANDED_REFILL,
    Guard,
    only_hybrid_start,
    refill_sequence,
    relend_after_resume,
    stranded_refill,
)
from loop.plans import (
    BroadcastReport,
    DeactivatePlan,
    LendPlan,
    MicroSummary,
    RunSizes,
    StepOutcome,
    SwitchReport,
    WaitReport,
)
from loop.step import (
    Activate,
    BroadcastSync,
    Commit,
    GuardedStart,
    HybridSync,
    Intent,
    ShouldActivate,
    ShouldDeactivate,
    Train,
    UpdateAfterStep,
    WaitForSamples,
    WarmUp,
    run_start,
    Skipped,
    step_sequence,
)

__all__ = [
    "ONLY_HYBRID_START",
    "RELEND_AFTER_RESUME",
    "STRANDED_POLL_S",
    "STRANDED_REFILL",
    "Guard",
    "only_hybrid_start",
    "refill_sequence",
    "relend_after_resume",
    "stranded_refill",
    "Activate",
    "BroadcastReport",
    "BroadcastSync",
    "Commit",
    "GuardedStart",
    "DeactivatePlan",
    "Decider",
    "DecisionRecord",
    "HybridSync",
    "Intent",
    "LendPlan",
    "MicroSummary",
    "RunSizes",
    "ShouldActivate",
    "ShouldDeactivate",
    "Snapshot",
    "StepOutcome",
    "SwitchBook",
    "SwitchDurations",
    "SwitchReport",
    "Train",
    "UpdateAfterStep",
    "WaitForSamples",
    "WaitReport",
    "WarmUp",
    "lend_count",
    "micro_summaries",
    "policy_context",
    "run_start",
    "Skipped",
    "step_sequence",
    "step_switch_seconds",
]
