"""The lower bound that counts the staleness rule (``sim.bound``): hand-computed on small specs,
and never above any simulated policy's wall clock."""

from __future__ import annotations

import dataclasses
import json

import pytest

from config import load_config
from flows.simulate import simulate_main
from policies import build_policy, registered_policies
from sim import SimSpec, simulate_spec, spec_from_config
from sim.bound import best_iteration_s, best_token_gpu_s, lower_bound, sample_latency_s

# One replica, one sample per step, every response exactly 100 tokens at 10 ms a token; the prompt
# (100 tokens at 1000 tokens/s) prefills in 0.1 s, so a sample takes 1.1 s; 200 trained tokens at
# 100 tokens/s = 2 s per micro-step; a 0.5 s broadcast.
TINY = SimSpec(
    steps=2, required_samples=1, trigger_parameter_sync_step=1, max_required_samples=1, buffer_samples=0, n=1,
    concurrent_samples_per_replica=1, standalone_replicas=1, trainer_gpus=1, standalone_gpus=1,
    prompt_tokens=100, response_length=1000, response_len_mean_start=100.0, response_len_mean_end=100.0,
    response_len_sigma=0.0, prompt_len_sigma=0.0, decode_step_base_s=0.01, decode_step_per_seq_s=0.0,
    max_num_seqs=4, prefill_tokens_per_s=1000.0, train_tokens_per_gpu_s=100.0, broadcast_sync_s=0.5,
)


def run(spec: SimSpec, policy: str = "static_fully_async", seed: int = 0):
    return simulate_spec(spec, build_policy(policy, deactivate_ratio=0.6, only_hybrid=spec.only_hybrid), seed=seed)


def test_the_per_sample_costs_are_the_fastest_replica_kinds():
    spec = dataclasses.replace(TINY, hybrid_replicas=1, hybrid_throughput_factor=0.5, decode_step_per_seq_s=0.002,
                               hybrid_max_num_seqs=2, speculative_speedup=2.0)
    assert best_iteration_s(spec) == pytest.approx((0.01 + 0.002) / 2)  # the standalone, one sequence
    assert best_token_gpu_s(spec) == pytest.approx((0.005 + 0.001 * 4) / 4)  # standalone at its 4 sequences
    assert sample_latency_s(spec, 100) == pytest.approx(0.1 + 100 * 0.006)


def test_with_staleness_0_each_sample_waits_for_the_previous_sync_and_the_bound_is_the_wall_clock():
    # step 1: sample 0 runs 0 → 1.1, trains to 3.1, sync to 3.6; sample 1 may start only then:
    # 3.6 → 4.7, trains to 6.7, sync to 7.2.
    result = run(TINY)
    bound = lower_bound(TINY, result)
    assert bound.chain_s == pytest.approx(7.2)
    assert result.wall_clock_s == pytest.approx(7.2)
    assert bound.binding == "staleness"
    per_sample = 100 * 0.01 / 4 + 0.1  # 100 tokens at the full-batch cost of 4 sequences, one prefill
    assert bound.rollout_s == pytest.approx(2 * per_sample)
    assert bound.fluid_s == pytest.approx((2 * per_sample + 4.0) / 2)


def test_with_staleness_1_the_second_sample_overlaps_the_first_step():
    # M = 2: both samples start at 0 (no prompt to prefill: 1.0 s each, decoded together), so
    # step 2 never waits: 1.0 → 2.0 train, 2.5 sync, 3.5 train, 4.0 sync.
    spec = dataclasses.replace(TINY, max_required_samples=2, buffer_samples=1, concurrent_samples_per_replica=2,
                               prompt_tokens=0)
    result = run(spec)
    assert lower_bound(spec, result).chain_s == pytest.approx(4.0)
    assert result.wall_clock_s == pytest.approx(4.0)


def test_task_and_step_overheads_are_paid_by_every_schedule():
    spec = dataclasses.replace(TINY, task_overhead_s=0.25, step_overhead_s=1.0)
    # per step: a train task before the micro-step (no hybrids: no take-back question, no begin
    # task), broadcast task, update task, commit 1 s.
    # step 1: 0.25 → ready 1.1 → 3.1, sync 3.35 → 3.85; update 4.1, commit 5.1;
    # step 2: task to 5.35, ready 3.85 + 1.1 → 5.35 → 7.35, sync 7.6 → 8.1; update 8.35, commit 9.35.
    result = run(spec)
    assert lower_bound(spec, result).chain_s == pytest.approx(9.35)
    assert result.wall_clock_s == pytest.approx(9.35)


SPECS = {
    "seed dynamic": spec_from_config(load_config("sim/qwen35-35b-dynamic"), steps=8),
    "seed dynamic, staleness 0, trigger 1": spec_from_config(
        load_config("sim/qwen35-35b-dynamic", ["async_training.staleness_threshold=0",
                                               "async_training.trigger_parameter_sync_step=1"]), steps=12),
    "old shape, staleness 1, lengths falling": spec_from_config(
        load_config("sim/qwen35-35b-tp4-dynamic", ["async_training.staleness_threshold=1.0", "trainer.nnodes=1",
                                                   "rollout.nnodes=3", "sim.response_len_mean_start=6000",
                                                   "sim.response_len_mean_end=2000"]), steps=8),
    "tiny-cpu": spec_from_config(load_config("tiny-cpu"), steps=6),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("policy", registered_policies())
def test_no_simulated_policy_finishes_before_the_lower_bound(name, policy):
    spec = SPECS[name]
    for seed in (0, 1):
        result = run(spec, policy, seed)
        bound = lower_bound(spec, result)
        assert result.wall_clock_s >= bound.lower_bound_s * (1 - 1e-9) > 0, (name, policy, seed, bound)


def test_tidal_simulate_reports_the_lower_bound_beside_the_fluid_bound(tmp_path):
    out = tmp_path / "sim.json"
    simulate_main("sim/qwen35-35b-static-8-24", [], None, 6, 0, str(out), None, compare=False)
    data = json.loads(out.read_text())
    bounds = data["bounds_s"]
    assert data["lower_bound_s"] == max(bounds.values())
    assert bounds["fluid"] == data["fluid_bound_s"]
    assert data["ratio_to_lower_bound"] == data["wall_clock_s"] / data["lower_bound_s"]
    assert data["lower_bound_binding"] == "staleness"  # 8 trainer GPUs: the trainer's chain binds
