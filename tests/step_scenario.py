"""One scripted scenario that production and the simulator both run (the step parity tests).

Five steps of the seed preset's shape: a lend with a rebalance (step 1), a skipped lend (step 2),
a lend without one (step 3), then the run stops and is resumed (the policy and the controller
restored from what step 3's commit stored; the hybrids were lent, so the guard
``relend_after_resume`` lends them again), and every standalone replica dying right after step 4's
take-back (the hybrids asleep, one micro-step queued): the trainer is stranded, so each of step 4's
later micro-steps gets the stranded refill (``loop.guards``), and from then on
``LostStandaloneGuard`` lends after each sync and a deactivation waits for a whole cycle. The two
sides must record the same decisions (hook calls and guards, with their inputs) and the same
controller transitions.
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
DEATHS_AFTER_TAKE_BACK_OF_STEP = 4
RESUME_AFTER_STEP = 3
"""The run stops after this step's commit and is resumed (the hybrids are lent then)."""
GUARD = "guard: no standalone replica alive"
REFILL_QUEUED = {False: (9, 1, 0), True: (2, 0, 0)}
"""What was queued at each of step 4's refills (micro-steps 2-4: the first had its samples), by
``overlap``: the twin's generation decides it, and the parity test replays it to production."""
REFILL = ("refill_if_stranded", True, "no standalone replica alive and {} of 16 samples queued: lend the hybrids at "
          "version 3 until a micro-step is queued")


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
    """The scenario in the simulator (traced: the parity test replays its timing): the deaths land
    0.01 s after step 4's take-back, found by a run without them. ``overlap``: the hybrid sync runs
    during the broadcast (``dynamic_schedule_overlap_hybrid_sync``), which moves the lend question,
    not the hooks' or the transitions' order."""
    spec = dataclasses.replace(spec_from_config(config(), steps=STEPS), overlap_hybrid_sync=overlap)
    calm = Simulator(spec, ScriptedPolicy(), resume_after=RESUME_AFTER_STEP).run()
    [take_back] = [t for t in calm.transitions if (t.step, t.kind) == (DEATHS_AFTER_TAKE_BACK_OF_STEP, "deactivate")]
    dies_at = take_back.report.started_at + take_back.report.duration_s + 0.01
    deaths = tuple((dies_at, number) for number in range(spec.standalone_replicas))
    return Simulator(dataclasses.replace(spec, standalone_deaths=deaths), ScriptedPolicy(), trace=True,
                     resume_after=RESUME_AFTER_STEP).run()


def committed_step(step: int) -> int:
    """The step under which production's store keeps a decision or switch made at ``step``: the
    resumed process's start (step 0) goes with its first step's commit (the scenario's fresh
    start records none)."""
    return step or RESUME_AFTER_STEP + 1


def expected_hooks(overlap: bool, refill_queued: tuple[int, ...] | None = None) -> list[tuple]:
    """The decisions both sides must record, (step, hook, answer, reason) (4 hybrids, 16 samples a
    micro-step, 64 a cycle in the preset); ``refill_queued``: what each refill saw queued, when not
    the twin's (``REFILL_QUEUED``)."""
    queued = REFILL_QUEUED[overlap] if refill_queued is None else refill_queued
    refills = [(4, *REFILL[:2], REFILL[2].format(n)) for n in queued]
    return [*HOOKS_TO_RESUME, *HOOKS_OF_RESUME, *HOOKS_TO_DEATHS, *refills, *HOOKS_FROM_STEP_4]


HOOKS_TO_RESUME = [
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
]
HOOKS_OF_RESUME = [  # before the resumed process's first step: the hybrids were lent at the stop
    (0, "relend_after_resume", 4, "the hybrids were lent when the run stopped (param version 3)"),
    (0, "request_rebalance", False, ""),
]
HOOKS_TO_DEATHS = [
    (4, "should_deactivate", True, ""),
    (4, "deactivate_wait_samples", 16, ""),
]
HOOKS_FROM_STEP_4 = [
    (4, "should_activate_after_step", 4, GUARD),
    (4, "request_rebalance", False, ""),
    (4, "update_after_step", None, ""),
    (5, "should_deactivate", True, ""),
    (5, "deactivate_wait_samples", 64, GUARD),
    (5, "update_after_step", None, ""),
]

EXPECTED_TRANSITIONS = [
    (1, "hybrid_sync"), (1, "activate"), (1, "rebalance"),
    (2, "deactivate"),
    (3, "hybrid_sync"), (3, "activate"),
    (0, "hybrid_sync"), (0, "activate"),  # the resume's relend
    (4, "deactivate"),
    *[(4, "hybrid_sync"), (4, "activate"), (4, "deactivate")] * 3,  # the refills
    (4, "hybrid_sync"), (4, "activate"),
    (5, "deactivate"),
]
