"""The simulator asks the real policy objects the documented hooks, in the documented order."""

from __future__ import annotations

import dataclasses

import pytest

from config import load_config
from policies import DynamicScheduleContext, DynamicSchedulePolicyBase, build_policy
from sim import Simulator, simulate, spec_from_config


class RecordingPolicy(DynamicSchedulePolicyBase):
    """Delegates to a real policy and records (hook, step, is_hybrid_active, ctx) per call."""

    def __init__(self, inner: DynamicSchedulePolicyBase):
        self.inner = inner
        self.calls: list[tuple[str, int | None, bool | None]] = []
        self.contexts: list[DynamicScheduleContext] = []

    def __getattr__(self, name):  # e.g. deactivate_ratio, read through like GuardedPolicy
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _note(self, hook, step, active, ctx):
        self.calls.append((hook, step, active))
        self.contexts.append(dataclasses.replace(ctx))

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        self._note("should_deactivate", global_steps, is_hybrid_active, ctx)
        return self.inner.should_deactivate(global_steps, is_hybrid_active, ctx)

    def deactivate_wait_samples(self, ctx):
        self._note("deactivate_wait_samples", None, None, ctx)
        return self.inner.deactivate_wait_samples(ctx)

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        self._note("should_activate_after_step", global_steps, is_hybrid_active, ctx)
        return self.inner.should_activate_after_step(global_steps, is_hybrid_active, ctx)

    def request_rebalance(self, global_steps, ctx):
        self._note("request_rebalance", global_steps, None, ctx)
        return self.inner.request_rebalance(global_steps, ctx)

    def update_after_step(self, global_steps, ctx):
        self._note("update_after_step", global_steps, None, ctx)
        self.inner.update_after_step(global_steps, ctx)


def run_recorded(policy_name: str, steps: int = 3, **spec_changes):
    cfg = load_config("sim/qwen35-35b-tp4-dynamic")
    spec = dataclasses.replace(spec_from_config(cfg, steps=steps), **spec_changes)
    policy = RecordingPolicy(build_policy(policy_name, deactivate_ratio=0.6))
    result = Simulator(spec, policy).run()
    return policy, result


def test_hooks_follow_productions_step_sequence_while_lending_and_reclaiming():
    """loop.step_sequence through loop.Decider: nothing is asked at step 0, should_deactivate only
    while the hybrids are lent, update_after_step every step."""
    policy, result = run_recorded("fixed_ratio")
    assert policy.calls == [
        ("should_activate_after_step", 1, False),  # step 1 ran on the standalones alone
        ("request_rebalance", 1, None),
        ("update_after_step", 1, None),
        ("should_deactivate", 2, True),
        ("deactivate_wait_samples", None, None),
        ("should_activate_after_step", 2, False),
        ("request_rebalance", 2, None),
        ("update_after_step", 2, None),
        ("should_deactivate", 3, True),
        ("deactivate_wait_samples", None, None),
        ("update_after_step", 3, None),  # the last step: no lend, nothing trains after it
    ]
    assert [(s.deactivated, s.activated, s.rebalanced) for s in result.steps] == [
        (False, True, True), (True, True, True), (True, False, False)]
    assert result.steps[0].start_s == 0.0
    assert [(step, hook) for step, hook, _ in result.hooks()] == [
        (1, "should_activate_after_step"), (1, "request_rebalance"), (1, "update_after_step"),
        (2, "should_deactivate"), (2, "deactivate_wait_samples"), (2, "should_activate_after_step"),
        (2, "request_rebalance"), (2, "update_after_step"),
        (3, "should_deactivate"), (3, "deactivate_wait_samples"), (3, "update_after_step"),
    ]


def test_the_result_records_every_controller_transition_in_order_with_its_replicas():
    _, result = run_recorded("fixed_ratio")
    assert result.transition_kinds() == [
        (1, "hybrid_sync"), (1, "activate"), (1, "rebalance"),
        (2, "deactivate"), (2, "hybrid_sync"), (2, "activate"), (2, "rebalance"),
        (3, "deactivate"),
    ]
    hybrids = ("hybrid-0", "hybrid-1", "hybrid-2", "hybrid-3")
    assert [t.report.replicas for t in result.transitions[:2]] == [hybrids, hybrids]
    assert [t.report.duration_s for t in result.transitions[:4]] == [3.0, 0.5, 0.5, 3.0]
    assert result.switches == 4  # activations and deactivations


def test_rebalance_is_not_asked_when_it_is_disabled_and_update_after_step_is_asked_without_hybrids():
    policy, _ = run_recorded("fixed_ratio", steps=2, enable_rebalance=False)
    assert "request_rebalance" not in [hook for hook, _, _ in policy.calls]
    policy, result = run_recorded("default", steps=2, hybrid_replicas=0)
    assert policy.calls == [("update_after_step", 1, None), ("update_after_step", 2, None)]
    assert (result.switches, result.transitions) == (0, [])


def test_the_policy_sees_the_switch_seconds_of_the_current_cycle_reset_after_update_after_step():
    """loop.SwitchDurations: the deactivation adds to deactivate_s; hybrid sync (3 s), activate
    (0.5 s) and rebalance (0.5 s) add to activate_s; both are 0 again after update_after_step."""
    policy, _ = run_recorded("fixed_ratio")
    seen = [(hook, step, ctx.last_activate_duration_s, ctx.last_deactivate_duration_s)
            for (hook, step, _), ctx in zip(policy.calls, policy.contexts)]
    assert seen == [
        ("should_activate_after_step", 1, 0.0, 0.0),
        ("request_rebalance", 1, 3.5, 0.0),
        ("update_after_step", 1, 4.0, 0.0),
        ("should_deactivate", 2, 0.0, 0.0),
        ("deactivate_wait_samples", None, 0.0, 0.0),
        ("should_activate_after_step", 2, 0.0, 3.0),
        ("request_rebalance", 2, 3.5, 3.0),
        ("update_after_step", 2, 4.0, 3.0),
        ("should_deactivate", 3, 0.0, 0.0),
        ("deactivate_wait_samples", None, 0.0, 0.0),
        ("update_after_step", 3, 0.0, 3.0),
    ]


def test_the_context_carries_the_step_the_waits_and_the_clock():
    policy, result = run_recorded("fixed_ratio")
    by_hook = {}
    for (hook, step, _), ctx in zip(policy.calls, policy.contexts):
        by_hook.setdefault(hook, []).append((step, ctx))
    after_steps = by_hook["should_activate_after_step"]
    for step, ctx in after_steps:
        record = result.steps[step - 1]
        assert ctx.expected_samples == step * 64
        assert ctx.step_wait_times == record.micro_wait_s and len(ctx.step_wait_times) == 4
        assert ctx.step_wait_samples == record.micro_wait_samples
        assert all(w == max(0, w) for w in ctx.step_wait_samples)
        assert ctx.total_generated_samples >= ctx.expected_samples
        assert (ctx.standalone_replicas, ctx.hybrid_replicas, ctx.buffer_samples) == (4, 4, 32)
        assert ctx.standalone_lost is False  # the simulator models no replica death
    nows = [ctx.now for ctx in policy.contexts]
    assert nows == sorted(nows) and nows[-1] > 0
    assert [step for step, _ in after_steps] == [1, 2]  # not after the last step (3)
    assert after_steps[0][1].last_switch_at is None and after_steps[1][1].last_switch_at is not None


def test_the_default_policy_state_evolves_exactly_as_when_fed_the_recorded_contexts():
    policy, result = run_recorded("default", steps=6)
    replay = build_policy("default", deactivate_ratio=0.6)
    ratios = []
    for (hook, step, active), ctx in zip(policy.calls, policy.contexts):
        if hook == "update_after_step":
            replay.update_after_step(step, ctx)
            ratios.append(replay.deactivate_ratio)
    assert ratios == [s.deactivate_ratio for s in result.steps]
    assert replay.state_dict() == policy.inner.state_dict()


def test_simulate_accepts_a_policy_object_in_place_of_the_configured_one():
    recording = RecordingPolicy(build_policy("static_fully_async"))
    result = simulate(load_config("sim/qwen35-35b-tp4-dynamic"), steps=2, policy=recording)
    assert result.policy == "RecordingPolicy"
    assert [hook for hook, _, _ in recording.calls] == [
        "should_activate_after_step", "update_after_step",
        "update_after_step",  # the last step asks no lend
    ]


class WarmUpLender(RecordingPolicy):
    """A policy that asks for the hybrids from the start (``warm_up_lend``)."""

    warm_up_lend = True


def test_only_a_policy_with_warm_up_lend_is_asked_before_step_1_and_its_lend_is_a_recorded_decision():
    """No question at step 0 by default (step 1 starts at 0 on the standalones); a warm_up_lend
    policy is asked should_activate_after_step(0) and a yes lends before step 1: three tasks, hybrid
    sync 3 s, activate 0.5 s, then the rebalance it asks for, 0.5 s."""
    cfg = load_config("sim/qwen35-35b-tp4-dynamic")
    spec = dataclasses.replace(spec_from_config(cfg, steps=1), task_overhead_s=0.25)
    plain = RecordingPolicy(build_policy("fixed_ratio", deactivate_ratio=0.6))
    result = Simulator(spec, plain).run()
    assert (plain.calls[0], result.steps[0].start_s) == (("update_after_step", 1, None), 0.0)
    eager = WarmUpLender(build_policy("fixed_ratio", deactivate_ratio=0.6))
    result = Simulator(spec, eager).run()
    assert eager.calls[:4] == [("should_activate_after_step", 0, False), ("request_rebalance", 0, None),
                               ("should_deactivate", 1, True), ("deactivate_wait_samples", None, None)]
    assert result.hooks()[0] == (0, "should_activate_after_step", 4)
    assert result.transition_kinds()[:3] == [(0, "hybrid_sync"), (0, "activate"), (0, "rebalance")]
    assert result.steps[0].start_s == 3 * 0.25 + 3.0 + 0.5 + 0.5  # WarmUp, HybridSync, Activate tasks + switches
    lent, result = run_recorded("fixed_ratio", steps=1, initial_hybrid_active=True)
    assert lent.calls[0] == ("should_deactivate", 1, True) and result.steps[0].start_s == 0.0


def test_when_every_standalone_died_the_guard_lends_after_each_sync_and_waits_a_whole_cycle():
    """SimSpec.standalone_deaths: all four die at t=50 s (step 1 has what it needs by then); from
    there the context says standalone_lost and LostStandaloneGuard's answers are recorded decisions,
    so a policy that never lends (static_fully_async) lends, and takes back after 64 samples."""
    policy, result = run_recorded("static_fully_async", steps=3,
                                  standalone_deaths=tuple((50.0, number) for number in range(4)))
    assert [(d.step, d.hook, d.answer, d.reason) for d in result.decisions] == [
        (1, "should_activate_after_step", 4, "guard: no standalone replica alive"),
        (1, "request_rebalance", False, ""),
        (1, "update_after_step", None, ""),
        (2, "should_deactivate", True, ""),
        (2, "deactivate_wait_samples", 64, "guard: no standalone replica alive"),
        (2, "should_activate_after_step", 4, "guard: no standalone replica alive"),
        (2, "request_rebalance", False, ""),
        (2, "update_after_step", None, ""),
        (3, "should_deactivate", True, ""),
        (3, "deactivate_wait_samples", 64, "guard: no standalone replica alive"),
        (3, "update_after_step", None, ""),
    ]
    assert all(d.inputs["standalone_lost"] for d in result.decisions)
    assert policy.calls[0] == ("should_activate_after_step", 1, False)  # the policy itself was asked too
    assert result.transition_kinds() == [(1, "hybrid_sync"), (1, "activate"), (2, "deactivate"),
                                         (2, "hybrid_sync"), (2, "activate"), (3, "deactivate")]


def test_a_trainer_stranded_by_the_last_standalones_death_gets_productions_refill_after_each_poll():
    """Every standalone dies at t=1 s with the hybrids asleep (a policy that never lends): each
    micro-step's pull ends its first 5 s slice short, then ``loop.guards.stranded_refill`` lends the
    hybrids until a micro-step is queued (a guard decision, then hybrid_sync, activate, deactivate);
    the refill is not the trainer's wait, as in production's train task."""
    policy, result = run_recorded("static_fully_async", steps=1,
                                  standalone_deaths=tuple((1.0, number) for number in range(4)))
    refills = [d for d in result.decisions if d.hook == "refill_if_stranded"]
    assert [(d.step, d.answer, d.inputs["mq_size"], d.inputs["expected_samples"]) for d in refills] == [
        (1, True, 0, 0)] * 4
    assert refills[0].reason == ("no standalone replica alive and 0 of 16 samples queued: lend the hybrids at "
                                 "version 0 until a micro-step is queued")
    assert refills[0].inputs["now"] == 5.0
    assert result.transition_kinds() == [(1, "hybrid_sync"), (1, "activate"), (1, "deactivate")] * 4
    assert result.steps[0].micro_wait_s == [5.0] * 4
    assert policy.calls == [("update_after_step", 1, None)]  # a refill asks the policy nothing


def test_an_only_hybrid_run_starts_with_productions_guarded_lend():
    """No standalone replica: before step 1 the twin records ``loop.guards.only_hybrid_start`` and
    lends every hybrid through a hybrid sync and an activation (with its rebalance question), as
    production's run start does."""
    cfg = load_config("sim/qwen35-35b-tp4-dynamic")
    spec = dataclasses.replace(spec_from_config(cfg, steps=1), only_hybrid=True, standalone_replicas=0)
    policy = RecordingPolicy(build_policy("fixed_ratio", only_hybrid=True))
    result = Simulator(spec, policy).run()
    assert [(d.step, d.hook, d.answer, d.reason) for d in result.decisions][:2] == [
        (0, "only_hybrid_start", 4,
         "only-hybrid mode: no standalone replica, so the hybrids generate from the start (param version 0)"),
        (0, "request_rebalance", True, ""),
    ]
    assert result.transition_kinds()[:3] == [(0, "hybrid_sync"), (0, "activate"), (0, "rebalance")]
    assert policy.calls[:2] == [("request_rebalance", 0, None), ("should_deactivate", 1, True)]


def test_one_dead_standalone_is_not_a_lost_standalone_and_gets_no_more_work():
    cfg = load_config("sim/qwen35-35b-tp4-dynamic")
    spec = dataclasses.replace(spec_from_config(cfg, steps=2), standalone_deaths=((10.0, 1),))
    result = Simulator(spec, build_policy("static_fully_async"), trace=True).run()
    deaths = [event for event in result.trace if event[1] == "death"]
    routed_after = {event[3] for event in result.trace if event[1] == "route" and event[0] > 10.0}
    assert deaths == [(10.0, "death", "standalone-1")]
    assert routed_after == {"standalone-0", "standalone-2", "standalone-3"}
    assert not any(d.inputs["standalone_lost"] for d in result.decisions)


def test_with_overlap_the_twin_syncs_the_hybrids_inside_the_broadcast_and_activates_after_it():
    """``dynamic_schedule_overlap_hybrid_sync``: each hybrid sync starts with its step's broadcast
    and ends within it, and the activation comes after the broadcast; off, the hybrid sync starts
    one task after the broadcast ends."""
    cfg = load_config("sim/qwen35-35b-tp4-dynamic")
    for overlap in (False, True):
        spec = dataclasses.replace(spec_from_config(cfg, steps=4), overlap_hybrid_sync=overlap, task_overhead_s=0.25)
        sim = Simulator(spec, build_policy("fixed_ratio", deactivate_ratio=0.6), trace=True)
        result = sim.run()
        syncs = [t for t, kind, *_ in sim.trace if kind == "sync"]  # each broadcast's end
        hybrid = [t.report for t in result.transitions if t.kind == "hybrid_sync" and t.step > 0]
        activate = [t.report for t in result.transitions if t.kind == "activate" and t.step > 0]
        assert hybrid and len(hybrid) == len(activate)
        for sync, act in zip(hybrid, activate):
            if overlap:
                end = min(t for t in syncs if t > sync.started_at)
                assert sync.started_at == pytest.approx(end - spec.broadcast_sync_s)
                assert sync.started_at + sync.duration_s <= end + 1e-9 and end <= act.started_at
            else:
                broadcast_end = max(t for t in syncs if t <= sync.started_at)
                assert sync.started_at == pytest.approx(broadcast_end + 2 * spec.task_overhead_s)
