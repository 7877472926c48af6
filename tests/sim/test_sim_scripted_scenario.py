"""One scripted scenario in the simulator, recorded as the production parity test records it.

A lend with a rebalance (step 1), a skipped lend (step 2), a lend without one (step 3), and every
standalone dying while the hybrids are lent (during step 3's activation): from step 4 on
``LostStandaloneGuard`` lends after each sync and waits a whole cycle. ``SimResult.decisions``
(the ``loop.Decider`` records) and ``SimResult.transitions`` are the two lists to compare.
"""

from __future__ import annotations

import dataclasses

from config import load_config
from policies import DynamicSchedulePolicyBase
from sim import Simulator, spec_from_config

GUARD = "guard: no standalone replica alive"


class ScriptedPolicy(DynamicSchedulePolicyBase):
    """Answers from a script: lend after the steps in ``lends``, rebalance after those in ``rebalances``."""

    def __init__(self, lends: set[int], rebalances: set[int]):
        self.lends, self.rebalances = lends, rebalances

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx):
        return 16

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return global_steps in self.lends

    def request_rebalance(self, global_steps, ctx):
        return global_steps in self.rebalances

    def update_after_step(self, global_steps, ctx):
        pass


def test_a_scripted_run_with_a_lend_a_skipped_lend_a_rebalance_and_a_standalone_death():
    spec = spec_from_config(load_config("sim/qwen35-35b-tp4-dynamic"), steps=5)

    def script() -> ScriptedPolicy:
        return ScriptedPolicy(lends={1, 3}, rebalances={1})

    dies_at = Simulator(spec, script()).run().steps[2].end_s - 0.1  # during step 3's activation
    deaths = tuple((dies_at, number) for number in range(spec.standalone_replicas))
    result = Simulator(dataclasses.replace(spec, standalone_deaths=deaths), script()).run()
    assert [(d.step, d.hook, d.answer, d.reason) for d in result.decisions] == [
        (1, "should_activate_after_step", 4, ""),
        (1, "request_rebalance", True, ""),
        (1, "update_after_step", None, ""),
        (2, "should_deactivate", True, ""),
        (2, "deactivate_wait_samples", 16, ""),
        (2, "should_activate_after_step", 0, ""),
        (2, "update_after_step", None, ""),
        (3, "should_activate_after_step", 4, ""),
        (3, "request_rebalance", False, ""),
        (3, "update_after_step", None, ""),
        (4, "should_deactivate", True, ""),
        (4, "deactivate_wait_samples", 64, GUARD),
        (4, "should_activate_after_step", 4, GUARD),
        (4, "request_rebalance", False, ""),
        (4, "update_after_step", None, ""),
        (5, "should_deactivate", True, ""),
        (5, "deactivate_wait_samples", 64, GUARD),
        (5, "update_after_step", None, ""),
    ]
    assert result.transition_kinds() == [
        (1, "hybrid_sync"), (1, "activate"), (1, "rebalance"),
        (2, "deactivate"),
        (3, "hybrid_sync"), (3, "activate"),
        (4, "deactivate"), (4, "hybrid_sync"), (4, "activate"),
        (5, "deactivate"),
    ]
    # the deaths land before step 3's rebalance question, which already sees them
    assert [d.inputs["standalone_lost"] for d in result.decisions] == [False] * 8 + [True] * 10
