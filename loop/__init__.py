"""The rules of the fully-async loop that production and the simulator share.

Owns: the step as a sequence of phase intents (``loop.step``), the typed plans and reports that
pass between a step's phases (``loop.plans``), and the policy questions of a step with their
decision records and the per-cycle switch durations (``loop.decisions``).

Must not: import Ray, torch, Prefect or a clock, do I/O, or know how a phase is carried out.
Production executes the intents against its actors; the simulator against its event heap.
"""

from loop.decisions import DecisionRecord, Decider, SwitchDurations, lend_count
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
    AfterSync,
    BeginStep,
    Broadcast,
    Commit,
    EndStep,
    HybridSync,
    Intent,
    Lend,
    Train,
    WaitAndDeactivate,
    WarmUp,
    run_start,
    step_sequence,
)

__all__ = [
    "AfterSync",
    "BeginStep",
    "Broadcast",
    "BroadcastReport",
    "Commit",
    "DeactivatePlan",
    "DecisionRecord",
    "Decider",
    "EndStep",
    "HybridSync",
    "Intent",
    "Lend",
    "LendPlan",
    "MicroSummary",
    "RunSizes",
    "SwitchDurations",
    "SwitchReport",
    "StepOutcome",
    "Train",
    "WaitAndDeactivate",
    "WaitReport",
    "WarmUp",
    "lend_count",
    "run_start",
    "step_sequence",
]
