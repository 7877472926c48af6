"""A scenario small enough to compute by hand, matched event for event.

Two standalone replicas, one sample each at a time (``concurrent_samples_per_replica = 1``,
``n = 1``), every response exactly 4 tokens, a 2-token prompt. A decode iteration takes 1 s
whatever the batch, a prefill 1 s per 2 tokens. Two samples per step (one micro-step), staleness
1.0 so the rollouter may start 4 per version. Training: (2 + 4) tokens × 2 samples / 4 tokens/s
= 3 s; weight sync 1 s.

    t=0   s0 → standalone-0, s1 → standalone-1; prefill until 1, 4 tokens until 5
    t=5   s0, s1 done; s2, s3 start (same replicas, prefill until 6); the trainer takes s0, s1
    t=8   training done; the sync aborts s2, s3 after 2 tokens each (partial rollout)
    t=9   sync done: s2, s3 resume where they stopped, prefilling prompt + 2 tokens (2 s)
    t=13  s2, s3 done (2 tokens left after the prefill); the trainer takes them
    t=16  training done, sync until 17: wall clock 17 s
"""

from __future__ import annotations

import pytest

from policies import build_policy
from sim import SimSpec, simulate_spec

SPEC = SimSpec(
    steps=2,
    required_samples=2,
    trigger_parameter_sync_step=1,
    max_required_samples=4,
    buffer_samples=2,
    n=1,
    concurrent_samples_per_replica=1,
    standalone_replicas=2,
    hybrid_replicas=0,
    gpus_per_replica=1,
    trainer_gpus=1,
    standalone_gpus=2,
    prompt_tokens=2,
    response_length=100,
    response_len_mean_start=4,
    response_len_mean_end=4,
    response_len_sigma=0.0,
    prompt_len_sigma=0.0,
    decode_step_base_s=1.0,
    decode_step_per_seq_s=0.0,
    max_num_seqs=8,
    prefill_tokens_per_s=2.0,
    hybrid_throughput_factor=1.0,
    train_tokens_per_gpu_s=4.0,
    broadcast_sync_s=1.0,
)


@pytest.fixture(scope="module")
def result():
    return simulate_spec(SPEC, build_policy("static_fully_async"), trace=True)


def test_the_hand_computed_scenario_happens_event_for_event(result):
    assert result.trace == [
        (0.0, "route", 0, "standalone-0"),
        (0.0, "route", 1, "standalone-1"),
        (5.0, "generated", 0),
        (5.0, "route", 2, "standalone-0"),
        (5.0, "generated", 1),
        (5.0, "route", 3, "standalone-1"),
        (5.0, "train", 1, 1, [0, 1]),
        (8.0, "abort", 2, "standalone-0"),
        (8.0, "abort", 3, "standalone-1"),
        (9.0, "route", 2, "standalone-0"),
        (9.0, "route", 3, "standalone-1"),
        (9.0, "sync", 1),
        (9.0, "commit", 1),
        (13.0, "generated", 2),
        (13.0, "generated", 3),
        (13.0, "train", 2, 1, [2, 3]),
        (17.0, "sync", 2),
        (17.0, "commit", 2),
    ]
    assert result.wall_clock_s == 17.0


def test_the_scenario_waits_and_wastes_what_the_hand_computation_says(result):
    assert [(s.micro_wait_s, s.micro_wait_samples) for s in result.steps] == [([5.0], [2]), ([4.0], [2])]
    # the sync at t=8 aborts 2 requests holding 2 tokens each; each retry prefills prompt 2 + 2
    assert (result.waste.aborted_requests, result.waste.aborted_tokens, result.waste.reprefilled_tokens) == (2, 4, 8)
    # bound: decode 16 tokens at 1/8 s (a full batch of 8), prefill 4 prompts × 2 tokens at 2/s,
    # train 6 s, all over 3 GPUs: (2 + 4 + 6) / 3
    assert result.fluid_bound_s == 4.0


def test_the_scenario_utilizations_follow_the_reference_formulas(result):
    one, two = result.steps
    # step 1: compute 3 s of an allocated 8 s (pull at 0 → trained at 8) + 1 s sync;
    # 2 in flight of capacity 2 during the whole window [0, 9]
    assert one.train_util == pytest.approx(3 / 9)
    assert one.rollout_util == 1.0
    assert one.cluster_util == pytest.approx((1 * 3 / 9 + 2 * 1.0) / 3)
    # step 2: 3 of 8 s; 2 in flight during [9, 13], none during [13, 17]
    assert two.train_util == pytest.approx(3 / 8)
    assert two.rollout_util == 0.5
