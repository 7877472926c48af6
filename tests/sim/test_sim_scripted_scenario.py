"""One scripted scenario in the simulator, recorded as the production parity test records it.

A lend with a rebalance (step 1), a skipped lend (step 2), a lend without one (step 3), and every
standalone dying while the hybrids are lent (during step 3's activation): from step 4 on
``LostStandaloneGuard`` lends after each sync and waits a whole cycle. ``SimResult.decisions``
(the ``loop.Decider`` records) and ``SimResult.transitions`` are the two lists to compare.
"""

from __future__ import annotations

import pytest
from step_scenario import EXPECTED_HOOKS, EXPECTED_TRANSITIONS, run_scenario


@pytest.mark.parametrize("overlap", [False, True], ids=["reference-order", "overlap-hybrid-sync"])
def test_a_scripted_run_with_a_lend_a_skipped_lend_a_rebalance_and_a_standalone_death(overlap):
    result = run_scenario(overlap)
    assert [(d.step, d.hook, d.answer, d.reason) for d in result.decisions] == EXPECTED_HOOKS
    assert result.transition_kinds() == EXPECTED_TRANSITIONS
    # the deaths land before step 3's rebalance question, which already sees them
    assert [d.inputs["standalone_lost"] for d in result.decisions] == [False] * 8 + [True] * 10
