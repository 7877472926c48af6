"""The take-back drain, the last twin-only abort guard (``SimSpec.abort_drain_s``).

Issue 46 deleted the others (``abort_route_min_share``, ``abort_cap``, ``loop/abort_rules.py``):
none paid (docs/simulator.md "Abort waste"). This test goes with ``abort_drain_s`` once
``sim/simulator.py``'s take-back stops reading it.
"""

from __future__ import annotations

import dataclasses

from policies import DynamicScheduleContext, DynamicSchedulePolicyBase
from sim.simulator import Simulator
from sim.spec import SimSpec


class _AlwaysLend(DynamicSchedulePolicyBase):
    """Lend after every step; take the hybrids back once ``wait`` samples are queued."""

    def __init__(self, wait: int):
        self.wait = wait

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return self.wait

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        return True

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        return False


def _lending_run(drain_s: float) -> Simulator:
    spec = dataclasses.replace(
        SimSpec(steps=3, required_samples=4, trigger_parameter_sync_step=1, max_required_samples=16, n=2,
                concurrent_samples_per_replica=4, standalone_replicas=1, hybrid_replicas=1,
                response_len_sigma=0.0, prompt_len_sigma=0.0, response_len_mean_start=2000.0,
                response_len_mean_end=2000.0),
        abort_drain_s=drain_s,
    )
    sim = Simulator(spec, _AlwaysLend(wait=1), seed=0, trace=True)
    sim.run()
    return sim


def _hybrid_aborts(sim: Simulator) -> list[int]:
    return [t[2] for t in sim.trace if t[1] == "abort" and t[3].startswith("hybrid")]


def test_drain_lets_what_finishes_within_the_window_finish_instead_of_aborting_it():
    aborting = _lending_run(0.0)
    assert _hybrid_aborts(aborting)  # the take-back catches the hybrid mid-sample
    draining = _lending_run(1000.0)  # a window longer than any sample: everything finishes
    assert _hybrid_aborts(draining) == []
    assert draining.rollouter.kind_aborted_tokens[True] == 0 < aborting.rollouter.kind_aborted_tokens[True]
    assert draining.rollouter.delivered_tokens[True] > aborting.rollouter.delivered_tokens[True]
