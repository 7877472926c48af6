"""The step's artifact names each phase the step skipped with why, the policy's reason included:
the UI's timeline shows only the task runs that happened."""

from __future__ import annotations

import re

from loop import DeactivatePlan, LendPlan, ShouldActivate, ShouldDeactivate, Skipped, step_sequence
from tasks.artifact import step_markdown

DECISIONS = [
    {"hook": "should_deactivate", "answer": False, "reason": "queue 12 < 16 | keep", "duration_s": 0.001},
    {"hook": "should_activate_after_step", "answer": 0, "reason": "wait 0.1 s < switch 0.3 s", "duration_s": 0.0},
]


def skipped_phases(*, has_hybrids, final, lent, deactivate, lends, overlap_sync) -> tuple[tuple[str, str], ...]:
    """What a step of ``loop.step_sequence`` said it skipped, given the policy's two answers."""
    steps, out, reply = step_sequence(3, micro_steps=1, final=final, has_hybrids=has_hybrids,
                                      overlap_sync=overlap_sync, lent=lent), [], None
    for intent in iter(lambda: steps.send(reply), None):
        if isinstance(intent, Skipped):
            out.append((intent.phase, intent.why))
        reply = (DeactivatePlan(3, deactivate, 4, True) if isinstance(intent, ShouldDeactivate)
                 else LendPlan(3, int(lends), 1) if isinstance(intent, ShouldActivate) else None)
        if type(intent).__name__ == "Commit":
            return tuple(out)
    return tuple(out)


def _skipped_rows(markdown: str) -> dict[str, str]:
    table = markdown.split("| skipped task | why |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    return dict(re.fullmatch(r"\| (\w+) \| (.*) \|", line).groups() for line in table.splitlines())


def test_a_step_that_kept_the_hybrids_and_did_not_lend_says_why_with_the_policy_reasons():
    skipped = skipped_phases(has_hybrids=True, final=False, lent=True, deactivate=False, lends=False,
                             overlap_sync=False)
    rows = _skipped_rows(step_markdown(3, DECISIONS, [], {}, skipped))
    assert rows == {
        "wait_for_samples": "should_deactivate kept the hybrids lent through this step: queue 12 < 16 \\| keep",
        "hybrid_sync": "should_activate did not lend: wait 0.1 s < switch 0.3 s",
        "activate": "should_activate did not lend: wait 0.1 s < switch 0.3 s",
    }


def test_a_step_that_began_without_a_lend_and_the_last_step_say_why_without_a_policy_reason():
    skipped = skipped_phases(has_hybrids=True, final=True, lent=False, deactivate=False, lends=False,
                             overlap_sync=True)
    rows = _skipped_rows(step_markdown(9, [], [], {}, skipped))
    assert set(rows) == {"should_deactivate", "wait_for_samples", "should_activate", "hybrid_sync", "activate"}
    assert rows["should_deactivate"].startswith("the hybrids were not lent as the step began")
    assert rows["activate"].startswith("the run's last step")


def test_a_step_that_ran_every_phase_has_no_skipped_table():
    skipped = skipped_phases(has_hybrids=True, final=False, lent=True, deactivate=True, lends=True,
                             overlap_sync=False)
    assert skipped == () and "skipped task" not in step_markdown(4, DECISIONS, [], {}, skipped)
