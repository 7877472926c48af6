"""`loop.guards`: the switches no policy asks for, decided once for production and the twin."""

from __future__ import annotations

import dataclasses

from loop import (
    ONLY_HYBRID_START,
    RELEND_AFTER_RESUME,
    STRANDED_REFILL,
    Activate,
    DeactivatePlan,
    Guard,
    HybridSync,
    LendPlan,
    WaitForSamples,
    only_hybrid_start,
    refill_sequence,
    relend_after_resume,
    stranded_refill,
)
from policies import DynamicScheduleContext

STRANDED = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4, mq_size=6, standalone_lost=True)


def test_a_trainer_with_nothing_left_to_generate_its_samples_gets_every_hybrid_at_the_last_version():
    assert stranded_refill(4, STRANDED, hybrids=2, active=False, version=3) == Guard(
        STRANDED_REFILL, True,
        "no standalone replica alive and 6 of 16 samples queued: lend the hybrids at version 3 until a "
        "micro-step is queued", LendPlan(step=4, count=2, of=2))


def test_no_refill_while_anything_can_still_generate_or_a_micro_step_is_queued():
    assert stranded_refill(4, dataclasses.replace(STRANDED, standalone_lost=False), hybrids=2, active=False,
                           version=3) is None
    assert stranded_refill(4, STRANDED, hybrids=2, active=True, version=3) is None
    assert stranded_refill(4, STRANDED, hybrids=0, active=False, version=3) is None
    assert stranded_refill(4, dataclasses.replace(STRANDED, mq_size=16), hybrids=2, active=False,
                           version=3) is None


def test_the_refill_syncs_lends_without_a_question_then_takes_back_after_one_micro_step():
    guard = stranded_refill(4, STRANDED, hybrids=2, active=False, version=3)
    assert list(refill_sequence(guard, 3, 16)) == [
        HybridSync(LendPlan(4, 2, 2), 3),
        Activate(LendPlan(4, 2, 2), rebalance=False),
        WaitForSamples(DeactivatePlan(step=4, deactivate=True, wait_samples=16, hybrid_active=True), refill=True),
    ]


def test_the_guarded_starts_lend_before_step_1_and_say_why():
    assert only_hybrid_start(0, 3) == Guard(
        ONLY_HYBRID_START, 3, "only-hybrid mode: no standalone replica, so the hybrids generate from the start "
        "(param version 0)", LendPlan(0, 3, 3))
    assert relend_after_resume(4, 1, 2) == Guard(
        RELEND_AFTER_RESUME, 1, "the hybrids were lent when the run stopped (param version 4)", LendPlan(0, 1, 2))
