"""The shared loop rules: the step's intent order, the Decider's questions, switch durations."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest

from loop import (
    Activate,
    BroadcastSync,
    Commit,
    DeactivatePlan,
    Decider,
    GuardedStart,
    HybridSync,
    LendPlan,
    ShouldActivate,
    ShouldDeactivate,
    SwitchDurations,
    Train,
    UpdateAfterStep,
    WaitForSamples,
    WarmUp,
    lend_count,
    Skipped,
    run_start,
    step_sequence,
)
from policies import DynamicScheduleContext, DynamicSchedulePolicyBase

CTX = DynamicScheduleContext(required_samples=4, trigger_parameter_sync_step=2)


def drive(gen, answers, skipped=None):
    """Run an intent generator, answering each intent with ``answers(intent)``; the intents seen
    that run something (the ``Skipped`` ones go to ``skipped``, when given)."""
    seen, reply = [], None
    try:
        while True:
            intent = gen.send(reply)
            if isinstance(intent, Skipped):
                if skipped is not None:
                    skipped.append((intent.phase, intent.why))
                reply = None
                continue
            seen.append(intent)
            reply = answers(intent)
    except StopIteration:
        return seen


def answers_for(deactivate=False, wait=0, lend=0, exhausted_at=None):
    def answer(intent):
        if isinstance(intent, ShouldDeactivate):
            return DeactivatePlan(intent.step, deactivate, wait, deactivate)
        if isinstance(intent, (ShouldActivate, WarmUp)):
            return LendPlan(getattr(intent, "step", 0), lend, 1)
        if isinstance(intent, Train):
            return SimpleNamespace(exhausted=intent.micro == exhausted_at)
        return None
    return answer


def test_a_step_that_deactivates_and_lends_runs_every_phase_in_design_order():
    plan = DeactivatePlan(3, True, 5, True)
    seen = drive(step_sequence(3, micro_steps=2, final=False, has_hybrids=True),
                 answers_for(deactivate=True, wait=5, lend=1))
    lend = LendPlan(3, 1, 1)
    assert seen == [ShouldDeactivate(3), WaitForSamples(plan), Train(3, 0), Train(3, 1), BroadcastSync(3, 3),
                    ShouldActivate(3, 3), HybridSync(lend, 3), Activate(lend), UpdateAfterStep(3), Commit(3, 3)]


def test_a_skipped_lend_skips_the_hybrid_sync_and_the_activation():
    seen = drive(step_sequence(2, micro_steps=1, final=False, has_hybrids=True), answers_for())
    assert seen == [ShouldDeactivate(2), Train(2, 0), BroadcastSync(2, 2), ShouldActivate(2, 2), UpdateAfterStep(2), Commit(2, 2)]


def test_a_step_that_begins_with_the_hybrids_asleep_has_no_take_back_question():
    seen = drive(step_sequence(4, micro_steps=2, final=False, has_hybrids=True, lent=False), answers_for(lend=1))
    lend = LendPlan(4, 1, 1)
    assert seen == [Train(4, 0), Train(4, 1), BroadcastSync(4, 4), ShouldActivate(4, 4), HybridSync(lend, 4), Activate(lend),
                    UpdateAfterStep(4), Commit(4, 4)]


def test_the_last_step_and_a_run_without_hybrids_never_ask_to_lend():
    seen = drive(step_sequence(1, micro_steps=1, final=True, has_hybrids=True), answers_for(lend=1))
    assert seen == [ShouldDeactivate(1), Train(1, 0), BroadcastSync(1, 1), UpdateAfterStep(1), Commit(1, 1)]
    # without hybrids there is nothing to take back either, whatever the caller says was lent
    seen = drive(step_sequence(1, micro_steps=1, final=False, has_hybrids=False), answers_for(lend=1))
    assert seen == [Train(1, 0), BroadcastSync(1, 1), UpdateAfterStep(1), Commit(1, 1)]


def test_an_exhausted_micro_step_ends_training_early():
    seen = drive(step_sequence(1, micro_steps=3, final=True, has_hybrids=False), answers_for(exhausted_at=0))
    assert seen == [Train(1, 0), BroadcastSync(1, 1), UpdateAfterStep(1), Commit(1, 1)]


def test_overlap_sync_asks_before_the_broadcast_and_syncs_the_hybrids_during_it():
    seen = drive(step_sequence(3, micro_steps=1, final=False, has_hybrids=True, overlap_sync=True),
                 answers_for(lend=1))
    lend = LendPlan(3, 1, 1)
    assert seen == [ShouldDeactivate(3), Train(3, 0), ShouldActivate(3, 3), BroadcastSync(3, 3, lend), Activate(lend),
                    UpdateAfterStep(3), Commit(3, 3)]
    skipped = drive(step_sequence(3, micro_steps=1, final=False, has_hybrids=True, overlap_sync=True),
                    answers_for())
    assert skipped == [ShouldDeactivate(3), Train(3, 0), ShouldActivate(3, 3), BroadcastSync(3, 3), UpdateAfterStep(3), Commit(3, 3)]


def test_overlap_sync_changes_nothing_on_steps_that_cannot_lend():
    for kwargs in ({"final": True, "has_hybrids": True}, {"final": False, "has_hybrids": False}):
        seen = drive(step_sequence(1, micro_steps=1, overlap_sync=True, **kwargs), answers_for(lend=1))
        asks = [ShouldDeactivate(1)] if kwargs["has_hybrids"] else []
        assert seen == [*asks, Train(1, 0), BroadcastSync(1, 1), UpdateAfterStep(1), Commit(1, 1)]


TASK_OF = {ShouldDeactivate: "should_deactivate", WaitForSamples: "wait_for_samples", Train: "train",
           BroadcastSync: "broadcast_sync", ShouldActivate: "should_activate", HybridSync: "hybrid_sync",
           Activate: "activate", UpdateAfterStep: "update_after_step", Commit: "commit"}


@pytest.mark.parametrize("has_hybrids,final,lent,deactivate,lends,overlap",
                         list(itertools.product([True, False], repeat=6)))
def test_every_phase_a_step_does_not_run_is_named_once_with_why(has_hybrids, final, lent, deactivate, lends, overlap):
    skipped: list[tuple[str, str]] = []
    seen = drive(step_sequence(5, micro_steps=1, final=final, has_hybrids=has_hybrids, overlap_sync=overlap,
                               lent=lent), answers_for(deactivate=deactivate, wait=2, lend=int(lends)), skipped)
    ran = {TASK_OF[type(i)] for i in seen}
    names = [task for task, _ in skipped]
    assert len(names) == len(set(names)) and all(why for _, why in skipped)
    assert ran.isdisjoint(names) and ran | set(names) == set(TASK_OF.values())


def test_the_run_start_asks_nothing_unless_the_policy_wants_a_warm_up_lend():
    assert drive(run_start(0, has_hybrids=True, asks_warm_up=False), answers_for(lend=1)) == []
    assert drive(run_start(0, has_hybrids=False, asks_warm_up=True), answers_for(lend=1)) == []
    lend = LendPlan(0, 1, 1)
    assert drive(run_start(0, has_hybrids=True, asks_warm_up=True), answers_for(lend=1)) == [
        WarmUp(0), HybridSync(lend, 0), Activate(lend)]


def test_a_resume_that_relends_and_an_only_hybrid_run_start_with_a_guarded_lend_not_a_question():
    lend = LendPlan(0, 2, 2)

    def guard(intent):
        assert isinstance(intent, GuardedStart), intent  # no policy question: WarmUp never comes
        return lend

    for kwargs, relend in (({"relend": True}, True), ({"only_hybrid": True}, False)):
        seen = drive(run_start(4, has_hybrids=True, asks_warm_up=True, **kwargs),
                     lambda i: guard(i) if not isinstance(i, (HybridSync, Activate)) else None)
        assert seen == [GuardedStart(4, relend), HybridSync(lend, 4), Activate(lend)]
    assert drive(run_start(4, has_hybrids=False, asks_warm_up=True, relend=True), guard) == []


class Scripted(DynamicSchedulePolicyBase):
    """Answers from a table and logs every hook it is asked, with the step."""

    def __init__(self, deactivate=True, wait=3, activate=True, rebalance=True):
        self.script = {"should_deactivate": deactivate, "deactivate_wait_samples": wait,
                       "should_activate_after_step": activate, "request_rebalance": rebalance}
        self.asked: list[tuple[str, int | None]] = []

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        self.asked.append(("should_deactivate", global_steps))
        return self.script["should_deactivate"]

    def deactivate_wait_samples(self, ctx):
        self.asked.append(("deactivate_wait_samples", None))
        return self.script["deactivate_wait_samples"]

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        self.asked.append(("should_activate_after_step", global_steps))
        return self.script["should_activate_after_step"]

    def request_rebalance(self, global_steps, ctx):
        self.asked.append(("request_rebalance", global_steps))
        return self.script["request_rebalance"]

    def update_after_step(self, global_steps, ctx):
        self.asked.append(("update_after_step", global_steps))

    def explain(self, hook, global_steps, is_hybrid_active, ctx):
        return f"scripted {hook}"


def test_should_deactivate_is_asked_only_while_the_hybrids_are_active():
    policy = Scripted()
    decider = Decider(policy)
    assert decider.should_deactivate(1, False, CTX) == DeactivatePlan(1, False, 0, False)
    assert policy.asked == []
    assert decider.should_deactivate(2, True, CTX) == DeactivatePlan(2, True, 3, True)
    assert policy.asked == [("should_deactivate", 2), ("deactivate_wait_samples", None)]


def test_every_question_is_recorded_with_its_answer_reason_and_inputs():
    decider = Decider(Scripted(rebalance=False))
    decider.should_deactivate(1, True, CTX)
    decider.should_activate(1, False, CTX, of=2)
    decider.wants_rebalance(1, CTX)
    decider.update_after_step(1, True, CTX)
    records = decider.drain()
    assert [(r.step, r.hook, r.answer, r.reason) for r in records] == [
        (1, "should_deactivate", True, "scripted should_deactivate"),
        (1, "deactivate_wait_samples", 3, "scripted deactivate_wait_samples"),
        (1, "should_activate_after_step", 2, "scripted should_activate_after_step"),
        (1, "request_rebalance", False, "scripted request_rebalance"),
        (1, "update_after_step", None, "scripted update_after_step"),
    ]
    assert records[0].inputs["is_hybrid_active"] is True and records[2].inputs["is_hybrid_active"] is False
    assert decider.drain() == []


def test_rebalance_is_not_asked_when_it_is_disabled():
    policy = Scripted()
    assert Decider(policy, enable_rebalance=False).wants_rebalance(1, CTX) is False
    assert policy.asked == []


def test_a_lend_answer_is_a_count_of_the_hybrids_and_active_hybrids_are_not_lent_again():
    assert [lend_count(a, 3) for a in (True, False, None, 0, 2, 7, -1)] == [3, 0, 0, 0, 2, 3, 0]
    decider = Decider(Scripted(activate=2))
    assert decider.should_activate(1, False, CTX, of=3) == LendPlan(1, 2, 3)
    assert decider.should_activate(2, True, CTX, of=3) == LendPlan(2, 0, 3)


def test_the_warm_up_question_is_asked_only_of_a_policy_that_wants_it():
    policy = Scripted()
    assert Decider(policy).warm_up(CTX, of=1) == LendPlan(0, 0, 1)
    assert policy.asked == []
    policy.warm_up_lend = True
    decider = Decider(policy)
    assert decider.warm_up(CTX, of=1) == LendPlan(0, 1, 1)
    assert [(r.step, r.hook) for r in decider.records] == [(0, "should_activate_after_step")]


def test_with_every_standalone_lost_the_guard_lends_and_waits_for_a_whole_cycle_and_says_why():
    decider = Decider(Scripted(wait=1, activate=False))
    lost = dataclasses.replace(CTX, standalone_lost=True)
    assert decider.should_deactivate(4, True, lost).wait_samples == lost.step_required_samples == 8
    assert decider.should_activate(4, False, lost, of=1) == LendPlan(4, 1, 1)
    reasons = [r.reason for r in decider.records]
    assert reasons[1:] == ["guard: no standalone replica alive; scripted deactivate_wait_samples",
                           "guard: no standalone replica alive; scripted should_activate_after_step"]


def test_a_guard_decision_is_recorded_beside_the_policy_answers():
    decider = Decider(Scripted())
    decider.record_guard(5, "stranded_refill", True, "no standalone alive and 0 queued", False, CTX)
    assert [(r.step, r.hook, r.answer, r.reason) for r in decider.records] == [
        (5, "stranded_refill", True, "no standalone alive and 0 queued")]


def test_policy_calls_are_timed_by_the_callers_timer():
    ticks = iter(range(100))
    decider = Decider(Scripted(), timer=lambda: float(next(ticks)))
    decider.update_after_step(1, False, CTX)
    assert decider.records[0].duration_s == 1.0


def test_switch_durations_add_up_over_a_cycle_with_the_rebalance_in_the_activation_and_reset():
    d = SwitchDurations()
    for kind, s in (("deactivate", 1.0), ("deactivate", 0.5), ("hybrid_sync", 2.0), ("activate", 0.25),
                    ("rebalance", 0.75)):
        d.add(kind, s)
    assert (d.activate_s, d.deactivate_s) == (3.0, 1.5)
    restored = SwitchDurations()
    restored.load_state_dict(d.state_dict())
    assert restored == d
    d.reset()
    assert (d.activate_s, d.deactivate_s) == (0.0, 0.0)
    with pytest.raises(ValueError, match="unknown switch kind"):
        d.add("broadcast", 1.0)


def test_the_switch_book_counts_lends_and_take_backs_and_keeps_what_a_resume_needs():
    from loop import SwitchBook, SwitchReport

    book = SwitchBook()
    for kind, start, seconds in [("hybrid_sync", 0.0, 2.0), ("activate", 2.0, 1.0), ("rebalance", 3.0, 0.5),
                                 ("deactivate", 10.0, 0.25)]:
        book.book(SwitchReport(kind, start, seconds))
    assert (book.count, book.last_switch_at) == (2, 10.25)  # activate and deactivate only; the last one's end
    assert (book.durations.activate_s, book.durations.deactivate_s) == (3.5, 0.25)
    assert [r.kind for r in book.drain()] == ["hybrid_sync", "activate", "rebalance", "deactivate"]
    assert book.log == [] and book.count == 2  # drained once; the count is the run's
    again = SwitchBook()
    again.load_state_dict(book.state_dict())
    assert again.state_dict() == book.state_dict()
    with pytest.raises(ValueError, match="missing 'switch_count'"):
        SwitchBook().load_state_dict({"last_switch_at": None})
