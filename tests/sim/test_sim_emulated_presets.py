"""The emulated presets are the seed experiment scaled down in tokens, and the simulator can model
Tidal's weight sync (no aborts) as well as verl's (the calibrated default).

`benchmarks/bench_emulated.py` runs these presets through the real system and compares with the
simulator; these tests keep the presets what that comparison assumes.
"""

from __future__ import annotations

import dataclasses

import pytest

from config import load_config
from policies import build_policy, policy_from_config
from sim import Simulator, spec_from_config

S = 20
SETUPS = ("static-8-24", "static-16-16", "dynamic")


@pytest.mark.parametrize("setup", SETUPS)
def test_an_emulated_preset_is_the_old_seed_shape_with_tokens_and_fixed_costs_divided_by_20(setup):
    seed, emulated = load_config(f"sim/qwen35-35b-tp4-{setup}"), load_config(f"sim/qwen35-35b-emulated-{setup}")
    a, b = seed.sim, emulated.sim
    assert (emulated.trainer_gpus, emulated.standalone_gpus, emulated.hybrid_replicas) == (
        seed.trainer_gpus, seed.standalone_gpus, seed.hybrid_replicas)
    assert emulated.async_training == seed.async_training
    assert emulated.actor_rollout_ref.rollout.response_length == seed.actor_rollout_ref.rollout.response_length // S
    for key in ("response_len_mean_start", "response_len_mean_end", "train_step_overhead_s", "broadcast_sync_s",
                "hybrid_sync_s", "activate_s", "deactivate_s", "rebalance_s"):
        assert getattr(b, key) == pytest.approx(getattr(a, key) / S), key
    for key in ("decode_step_base_s", "decode_step_per_seq_s", "max_num_seqs", "prefill_tokens_per_s",
                "hybrid_throughput_factor", "train_tokens_per_gpu_s", "response_len_sigma", "prompt_len_sigma"):
        assert getattr(b, key) == getattr(a, key), key
    # the emulated engine serves the `count` task's prompts: BOS + letter + digit + "=" = 4 tokens
    assert (emulated.task.name, b.prompt_tokens) == ("count", 4)
    assert (emulated.engines.rollout, emulated.engines.train) == ("simulated", "simulated")
    steps = emulated.trainer.total_training_steps
    assert emulated.rollout.total_rollout_steps == steps * emulated.step_required_samples


def test_a_sync_without_aborts_stalls_the_standalones_and_re_prefills_nothing():
    """Tidal's engines keep their requests through a weight load (``sync_aborts=False``): a static
    run then has no aborted or re-prefilled work at all, while verl's abort-at-sync (the default)
    re-prefills at every sync; either way each sync holds generation for ``broadcast_sync_s``."""
    cfg = load_config("sim/qwen35-35b-emulated-static-16-16")
    spec = spec_from_config(cfg, steps=6)
    aborting = Simulator(spec, policy_from_config(cfg)).run()
    stalling = Simulator(dataclasses.replace(spec, sync_aborts=False), policy_from_config(cfg)).run()
    assert aborting.waste.reprefilled_tokens > 0 and aborting.waste.aborted_requests > 0
    assert (stalling.waste.reprefilled_tokens, stalling.waste.aborted_requests) == (0, 0)
    free = Simulator(dataclasses.replace(spec, sync_aborts=False, broadcast_sync_s=0.0), policy_from_config(cfg)).run()
    assert free.wall_clock_s < stalling.wall_clock_s  # the stall is real time on the rollout side


def test_task_overhead_delays_every_phase_but_not_the_switch_timings_the_policy_sees():
    """``task_overhead_s`` (Tidal's per-phase Prefect cost) is paid before each of a step's phases:
    a static, train-bound step has 6 of them (4 micro-steps, broadcast, update: no take-back or lend
    question without hybrids), so it costs what ``step_overhead_s`` = 6 × it costs; the switches the
    policy measures are still the hybrid sync and the activation alone, without the tasks between."""
    cfg = load_config("sim/qwen35-35b-emulated-static-8-24")
    spec = spec_from_config(cfg, steps=6)
    spread = Simulator(dataclasses.replace(spec, task_overhead_s=0.1), policy_from_config(cfg)).run()
    lumped = Simulator(dataclasses.replace(spec, step_overhead_s=0.6), policy_from_config(cfg)).run()
    bare = Simulator(spec, policy_from_config(cfg)).run()
    assert spread.wall_clock_s == pytest.approx(lumped.wall_clock_s, rel=0.02)
    assert spread.wall_clock_s > bare.wall_clock_s + 0.75 * 6 * 0.6  # (a little overlaps waits for samples)
    assert [s.train_compute_s for s in spread.steps] == pytest.approx([s.train_compute_s for s in bare.steps], rel=0.05)

    dyn = load_config("sim/qwen35-35b-emulated-dynamic")
    # fixed_ratio: ``default`` would not lend here before it measured a switch (10 s prior cost)
    sim = Simulator(dataclasses.replace(spec_from_config(dyn, steps=3), task_overhead_s=0.2),
                    build_policy("fixed_ratio", deactivate_ratio=0.6))
    result = sim.run()
    assert result.steps[0].start_s == 0.0  # no warm-up lend: nothing is asked at step 0
    assert any(s.activated for s in result.steps)
    lends = [t for t in result.transitions if t.kind in ("hybrid_sync", "activate")]
    assert [t.kind for t in lends] == ["hybrid_sync", "activate"] * (len(lends) // 2)
    assert [t.report.duration_s for t in lends] == pytest.approx(
        [dyn.sim.hybrid_sync_s, dyn.sim.activate_s] * (len(lends) // 2))


def test_the_task_overhead_and_the_sync_mode_are_config_keys():
    cfg = load_config("sim/qwen35-35b-emulated-static-16-16", ["sim.task_overhead_s=0.08", "sim.sync_aborts=false"])
    spec = spec_from_config(cfg, steps=6)
    assert (spec.task_overhead_s, spec.sync_aborts) == (0.08, False)
    default = spec_from_config(load_config("sim/qwen35-35b-emulated-static-16-16"), steps=6)
    assert (default.task_overhead_s, default.sync_aborts) == (0.0, True)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_tp8_emulated_preset_is_the_faithful_seed_shape_with_tokens_and_fixed_costs_divided_by_10(setup):
    s_tp8 = 10  # ÷ 10, not 20: the control plane's ~1 s per step would hide the trainer's wait
    seed, emulated = load_config(f"sim/qwen35-35b-{setup}"), load_config(f"sim/qwen35-35b-emulated-tp8-{setup}")
    a, b = seed.sim, emulated.sim
    assert (emulated.trainer_gpus, emulated.standalone_gpus, emulated.hybrid_replicas) == (
        seed.trainer_gpus, seed.standalone_gpus, seed.hybrid_replicas)
    rollout, emulated_rollout = seed.actor_rollout_ref.rollout, emulated.actor_rollout_ref.rollout
    shape = (emulated_rollout.n, emulated_rollout.tensor_model_parallel_size)
    assert shape == (rollout.n, rollout.tensor_model_parallel_size) == (16, 8)
    assert emulated_rollout.response_length == rollout.response_length // s_tp8
    # the seed's switch costs come from its calibration file, the emulated ones are written out
    assert (a.calibration, b.calibration) == ("qwen35-35b-judgement", None)
    for key in ("response_len_mean_start", "response_len_mean_end", "train_step_overhead_s", "broadcast_sync_s",
                "hybrid_sync_s", "activate_s", "deactivate_s", "rebalance_s"):
        assert getattr(b, key) == pytest.approx(getattr(a, key) / s_tp8), key
    for key in ("decode_step_base_s", "decode_step_per_seq_s", "speculative_speedup", "max_num_seqs",
                "hybrid_max_num_seqs", "prefill_tokens_per_s", "hybrid_throughput_factor", "train_tokens_per_gpu_s",
                "response_len_sigma", "prompt_len_sigma"):
        assert getattr(b, key) == getattr(a, key), key
    assert (emulated.task.name, b.prompt_tokens) == ("count", 4)
    if setup == "dynamic":  # the recommended policy, its switch-cost prior scaled like every fixed cost
        assert emulated.async_training.dynamic_schedule_policy == "predictive"
        assert emulated.async_training.dynamic_schedule_prior_switch_s == pytest.approx(6.0 / s_tp8)


def test_in_the_tp8_emulated_shape_predictive_lends_and_beats_both_static_splits_in_the_twin():
    walls = {}
    for setup in SETUPS:
        cfg = load_config(f"sim/qwen35-35b-emulated-tp8-{setup}",
                          ["async_training.dynamic_schedule_enable_rebalance=false"])
        walls[setup] = Simulator(spec_from_config(cfg), policy_from_config(cfg)).run()
    assert walls["dynamic"].switches > 0
    best_static = min(walls["static-8-24"].wall_clock_s, walls["static-16-16"].wall_clock_s)
    assert walls["dynamic"].wall_clock_s < 0.95 * best_static
