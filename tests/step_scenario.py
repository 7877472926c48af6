"""One scripted scenario that production and the simulator both run (the step parity tests).

Five steps of the seed preset's shape: a lend with a rebalance (step 1), a skipped lend (step 2),
a lend without one (step 3), and every standalone replica dying right after step 3's activation,
before its rebalance question: from then on ``LostStandaloneGuard`` lends after each sync and a
deactivation waits for a whole cycle. The two sides must record the same policy hook calls
(step, hook, answer, reason) and the same controller transitions (step, kind).
"""

from __future__ import annotations

import dataclasses

from config import load_config
from policies import DynamicSchedulePolicyBase
from sim import SimResult, Simulator, spec_from_config

PRESET = "sim/qwen35-35b-tp4-dynamic"  # the seed's old TP-4 shape: 4 hybrid and 4 standalone replicas
STEPS = 5
LENDS = {1, 3}
REBALANCES = {1}
DEATHS_AFTER_ACTIVATION_OF_STEP = 3
GUARD = "guard: no standalone replica alive"


class ScriptedPolicy(DynamicSchedulePolicyBase):
    """Answers from the script: lend after the steps in ``LENDS``, rebalance after ``REBALANCES``."""

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx):
        return 16

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return global_steps in LENDS

    def request_rebalance(self, global_steps, ctx):
        return global_steps in REBALANCES

    def update_after_step(self, global_steps, ctx):
        pass


def config():
    return load_config(PRESET, [f"trainer.total_training_steps={STEPS}"])


def run_scenario(overlap: bool = False) -> SimResult:
    """The scenario in the simulator: the deaths land 0.1 s before the end of step 3 (during its
    activation, which ends the step's virtual time), found by a run without them. ``overlap``:
    the hybrid sync runs during the broadcast (``dynamic_schedule_overlap_hybrid_sync``), which
    moves the lend question, not the hooks' or the transitions' order."""
    spec = dataclasses.replace(spec_from_config(config(), steps=STEPS), overlap_hybrid_sync=overlap)
    dies_at = Simulator(spec, ScriptedPolicy()).run().steps[DEATHS_AFTER_ACTIVATION_OF_STEP - 1].end_s - 0.1
    deaths = tuple((dies_at, number) for number in range(spec.standalone_replicas))
    return Simulator(dataclasses.replace(spec, standalone_deaths=deaths), ScriptedPolicy()).run()


EXPECTED_HOOKS = [
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
"""The hook calls both sides must record (4 hybrids, 64 samples a cycle in the preset)."""

EXPECTED_TRANSITIONS = [
    (1, "hybrid_sync"), (1, "activate"), (1, "rebalance"),
    (2, "deactivate"),
    (3, "hybrid_sync"), (3, "activate"),
    (4, "deactivate"), (4, "hybrid_sync"), (4, "activate"),
    (5, "deactivate"),
]
