"""One scripted scenario in the simulator, recorded as the production parity test records it.

A lend with a rebalance (step 1), a skipped lend (step 2), a lend without one (step 3), a resume
(the hybrids lent again at the restart), and every standalone dying right after step 4's
take-back: step 4's later micro-steps each get the stranded refill, then ``LostStandaloneGuard``
lends after each sync and waits a whole cycle. ``SimResult.decisions`` (the ``loop.Decider``
records) and ``SimResult.transitions`` are the two lists to compare.
"""

from __future__ import annotations

import pytest
from step_scenario import EXPECTED_TRANSITIONS, expected_hooks, run_scenario


@pytest.mark.parametrize("overlap", [False, True], ids=["reference-order", "overlap-hybrid-sync"])
def test_a_scripted_run_with_a_lend_a_skipped_lend_a_rebalance_a_resume_a_standalone_death_and_a_refill(overlap):
    result = run_scenario(overlap)
    assert [(d.step, d.hook, d.answer, d.reason) for d in result.decisions] == expected_hooks(overlap)
    assert result.transition_kinds() == EXPECTED_TRANSITIONS
    # the deaths land after step 4's take-back: its refills are the first decisions to see them
    assert [d.inputs["standalone_lost"] for d in result.decisions] == [False] * 14 + [True] * 9
    # a refill's context has no micro-step summaries (production's train task carries none)
    refills = [d for d in result.decisions if d.hook == "refill_if_stranded"]
    assert [(d.inputs["expected_samples"], d.inputs["sum_step_wait_samples"]) for d in refills] == [(192, 0)] * 3
