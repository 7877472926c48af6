"""The simulator asks the real policy objects the documented hooks, in the documented order."""

from __future__ import annotations

import dataclasses

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
    cfg = load_config("sim/qwen35-35b-dynamic")
    spec = dataclasses.replace(spec_from_config(cfg, steps=steps), **spec_changes)
    policy = RecordingPolicy(build_policy(policy_name, deactivate_ratio=0.6))
    result = Simulator(spec, policy).run()
    return policy, result


def test_hooks_follow_the_documented_order_while_lending_and_reclaiming():
    policy, result = run_recorded("fixed_ratio")
    assert policy.calls == [
        ("should_activate_after_step", 0, False),  # tidal run's warm-up: starts STANDALONE_ONLY, lends at once
        ("should_deactivate", 1, True),
        ("deactivate_wait_samples", None, None),
        ("should_activate_after_step", 1, False),
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
    assert [(s.deactivated, s.activated, s.rebalanced) for s in result.steps] == [(True, True, True)] * 2 + [
        (True, False, False)]
    assert result.steps[0].start_s == 3.5  # the warm-up's hybrid sync 3 s + activate 0.5 s
    assert [hook for _, hook, _ in result.decisions] == [hook for hook, _, _ in policy.calls]


def test_rebalance_is_not_asked_when_it_is_disabled_and_nothing_is_asked_without_hybrids():
    policy, _ = run_recorded("fixed_ratio", steps=2, enable_rebalance=False)
    assert "request_rebalance" not in [hook for hook, _, _ in policy.calls]
    policy, result = run_recorded("default", steps=2, hybrid_replicas=0)
    assert policy.calls == [] and result.switches == 0


def test_the_context_carries_the_step_the_waits_and_the_clock():
    policy, result = run_recorded("fixed_ratio")
    by_hook = {}
    for (hook, step, _), ctx in zip(policy.calls, policy.contexts):
        by_hook.setdefault(hook, []).append((step, ctx))
    warm_up, *after_steps = by_hook["should_activate_after_step"]
    assert warm_up[0] == 0 and (warm_up[1].expected_samples, warm_up[1].step_wait_times) == (0, [])
    for step, ctx in after_steps:
        record = result.steps[step - 1]
        assert ctx.expected_samples == step * 64
        assert ctx.step_wait_times == record.micro_wait_s and len(ctx.step_wait_times) == 4
        assert ctx.step_wait_samples == record.micro_wait_samples
        assert all(w == max(0, w) for w in ctx.step_wait_samples)
        assert ctx.total_generated_samples >= ctx.expected_samples
        assert (ctx.standalone_replicas, ctx.hybrid_replicas, ctx.buffer_samples) == (4, 4, 32)
    nows = [ctx.now for ctx in policy.contexts]
    assert nows == sorted(nows) and nows[-1] > 0
    assert [step for step, _ in after_steps] == [1, 2]  # not after the last step (3)
    _, step2_activate = after_steps[1]
    assert step2_activate.last_switch_at is not None
    assert step2_activate.last_activate_duration_s == 3.5  # hybrid sync 3 s + activate 0.5 s
    assert step2_activate.last_deactivate_duration_s == 3.0


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
    result = simulate(load_config("sim/qwen35-35b-dynamic"), steps=2, policy=recording)
    assert result.policy == "RecordingPolicy"
    assert [hook for hook, _, _ in recording.calls] == [
        "should_activate_after_step",
        "should_deactivate", "should_activate_after_step", "update_after_step",
        "should_deactivate", "update_after_step",  # the last step asks no lend
    ]


def test_the_warm_up_asks_once_before_step_1_and_only_when_the_hybrids_start_asleep():
    """Like `tidal run`: a policy that declines leaves step 1 to the standalones (no switch, step 1
    starts at 0); hybrids already lent at the start (`initial_hybrid_active`) are not asked about."""
    declined, result = run_recorded("static_fully_async", steps=1)
    assert declined.calls[0] == ("should_activate_after_step", 0, False)
    assert (result.steps[0].start_s, result.switches) == (0.0, 0)
    lent, result = run_recorded("fixed_ratio", steps=1, initial_hybrid_active=True)
    assert lent.calls[0] == ("should_deactivate", 1, True) and result.steps[0].start_s == 0.0
