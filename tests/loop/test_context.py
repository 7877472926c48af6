"""`loop.policy_context`: the one place a policy's context is built, for production and the twin."""

from __future__ import annotations

from loop import MicroSummary, RunSizes, Snapshot, micro_summaries, policy_context

SIZES = RunSizes(required_samples=8, trigger_parameter_sync_step=2, buffer_samples=4, only_hybrid=False,
                 standalone_replicas=3, hybrid_replicas=2, consumed_before=0, generated_before=100,
                 max_required_samples=24)


def test_every_field_comes_from_the_run_sizes_or_the_snapshot():
    snap = Snapshot(generated_total=50, queue_size=7, in_flight=9, consumed=160,
                    micro=(MicroSummary(8, 0.5, 3), MicroSummary(8, 0.25, 1)), activate_s=1.5, deactivate_s=0.5,
                    now=42.0, last_switch_at=40.0, standalone_lost=True, lent_replicas=1)
    ctx = policy_context(SIZES, snap)
    assert (ctx.required_samples, ctx.trigger_parameter_sync_step, ctx.buffer_samples, ctx.only_hybrid,
            ctx.standalone_replicas, ctx.hybrid_replicas, ctx.max_required_samples) == (8, 2, 4, False, 3, 2, 24)
    assert ctx.total_generated_samples == 150  # an earlier process's samples count too (a resume)
    assert ctx.expected_samples == 176  # consumed before the step + this step's micro-steps
    assert (ctx.step_wait_times, ctx.step_wait_samples) == ([0.5, 0.25], [3, 1])
    assert (ctx.last_activate_duration_s, ctx.last_deactivate_duration_s, ctx.now, ctx.last_switch_at) == (
        1.5, 0.5, 42.0, 40.0)
    assert (ctx.mq_size, ctx.in_flight_samples, ctx.standalone_lost, ctx.lent_replicas) == (7, 9, True, 1)


def test_before_training_a_step_expects_what_was_consumed_before_it():
    snap = Snapshot(generated_total=0, queue_size=0, in_flight=0, consumed=32, micro=(), activate_s=0.0,
                    deactivate_s=0.0, now=0.0, last_switch_at=None, standalone_lost=False, lent_replicas=0)
    ctx = policy_context(SIZES, snap)
    assert (ctx.expected_samples, ctx.step_wait_times) == (32, [])


def test_the_twins_micro_step_lists_become_summaries():
    assert micro_summaries([0.5, 1.0], [2, 0], 8) == [MicroSummary(8, 0.5, 2), MicroSummary(8, 1.0, 0)]
