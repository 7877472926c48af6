"""The abort guards of a lent hybrid (issue 38 item 6): ``SimSpec.abort_*``, ``loop.abort_rules``.

Each test scripts a small run where the guard must act, and compares it with the same run
without the guard, so it fails if the mechanism is taken out.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from loop import abort_rules
from policies import DynamicScheduleContext, DynamicSchedulePolicyBase
from sim.events import EventLoop
from sim.rollouter import SimRollouter
from sim.simulator import Simulator
from sim.spec import SimSpec


class _FixedLengths:
    """Every response is ``tokens`` long (the twin's ``LengthModel.draw`` signature)."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def draw(self, rng: random.Random, n: int, version: int) -> list[int]:
        return [self.tokens] * n


SMALL = SimSpec(
    steps=4, prompts=64, required_samples=4, trigger_parameter_sync_step=1, max_required_samples=16,
    n=1, concurrent_samples_per_replica=4, standalone_replicas=1, hybrid_replicas=1,
)
"""One standalone and one hybrid, four samples each, one response per sample."""


def _lent_rollouter(spec: SimSpec) -> tuple[SimRollouter, list[tuple]]:
    """Lend the hybrid, let the first eight samples (four per replica) finish without starting
    more, then leave the rollouter accepting again; returns it and its trace."""
    loop, trace = EventLoop(), []
    r = SimRollouter(spec, _FixedLengths(100), random.Random(0), clock=lambda: loop.now,
                     trace=lambda kind, *detail: trace.append((kind, *detail)))
    r.add(r.hybrids)
    r.accepting = False
    loop.push(r.flush())
    loop.run(until=lambda: len(r.queue) == 8)
    r.accepting = True
    trace.clear()
    return r, trace


def _routes(trace: list[tuple]) -> list[str]:
    return [detail[2] for detail in trace if detail[0] == "route"]


def test_route_keeps_new_samples_off_a_hybrid_whose_take_back_is_due():
    guarded, trace = _lent_rollouter(dataclasses.replace(SMALL, abort_route_min_share=0.5))
    guarded.takeback_samples = 8  # the queue already holds the plan's wait_samples
    guarded.try_start()
    assert _routes(trace) == ["standalone-0"] * 8

    plain, trace = _lent_rollouter(SMALL)
    plain.takeback_samples = 8
    plain.try_start()
    assert _routes(trace) == ["standalone-0", "hybrid-0"] * 4


def test_route_still_uses_the_hybrid_while_its_take_back_is_far():
    r, trace = _lent_rollouter(dataclasses.replace(SMALL, abort_route_min_share=0.5))
    r.takeback_samples = None  # no plan yet: no evidence, no guard
    r.try_start()
    assert _routes(trace) == ["standalone-0", "hybrid-0"] * 4


def test_cap_shrinks_the_hybrids_concurrency_and_the_starts_near_the_take_back():
    r, trace = _lent_rollouter(dataclasses.replace(SMALL, abort_cap=True))
    assert r.hybrid_cap() == 4  # no plan yet
    r.takeback_samples = 8
    assert r.hybrid_cap() == 0
    r.try_start()
    assert _routes(trace) == ["standalone-0"] * 4  # the hybrid's four slots are given up
    assert r.in_flight == 4

    plain, trace = _lent_rollouter(SMALL)
    plain.takeback_samples = 8
    assert plain.hybrid_cap() == 4
    plain.try_start()
    assert plain.in_flight == 8


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


def test_the_take_back_eta_comes_from_the_plan_the_queue_and_the_finish_rate():
    rate = abort_rules.completion_rate([10.0, 11.0, 12.0, 14.0])
    assert rate == pytest.approx(0.75)
    assert abort_rules.takeback_eta_s(12, 9, rate) == pytest.approx(4.0)
    assert abort_rules.takeback_eta_s(12, 12, rate) == 0.0
    assert abort_rules.takeback_eta_s(None, 0, rate) is None
    assert abort_rules.takeback_eta_s(12, 9, abort_rules.completion_rate([3.0])) is None


def test_the_finish_share_sets_the_route_and_the_cap():
    durations = [2.0, 4.0, 6.0, 8.0]
    assert abort_rules.finish_share(5.0, durations) == 0.5
    assert abort_rules.finish_share(None, durations) == 1.0
    assert abort_rules.finish_share(5.0, []) == 1.0
    assert abort_rules.may_route(0.5, 0.5) and not abort_rules.may_route(0.25, 0.5)
    assert [abort_rules.shrunk_cap(16, s) for s in (1.0, 0.5, 0.3, 0.0)] == [16, 8, 5, 0]
