"""`engine_factory` builds the simulated engine the simulator describes (tests/sim model the same).

The factory is the picklable callable a replica actor runs; calling it here builds the engine in
this process. What must hold for an emulated run to be comparable with `tidal simulate`:

- the replica: the simulator's decode and prefill costs (÷ the hybrid factor on a hybrid), up to
  ``sim.max_num_seqs`` sequences running;
- the workload: the simulator's response lengths (drifting mean, prompt factor), with one token
  seed for every replica so a retry elsewhere continues its response;
- the switch costs of a fully emulated cluster, phase by phase as the simulator charges them, and
  none when the trainer is real.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest

from cluster.builders import engine_factory, simulated_engine_costs, tokenizer_and_problems
from cluster.engines.base import request_sample_uid
from cluster.engines.simulated import SimulatedEngine
from config import load_config
from loop.workload import SeededLengths

PRESET = "sim/qwen35-35b-emulated-dynamic"


def build(cfg, *, hybrid: bool, seed: int = 0) -> SimulatedEngine:
    tokenizer, _ = tokenizer_and_problems(cfg)
    factory = engine_factory(cfg, tokenizer, hybrid=hybrid, seed=seed)
    return pickle.loads(pickle.dumps(factory))()  # a Ray actor receives it pickled


def test_the_emulated_presets_engines_charge_the_simulators_switch_costs_phase_by_phase():
    cfg = load_config(PRESET)
    s = cfg.sim
    standalone, hybrid = build(cfg, hybrid=False), build(cfg, hybrid=True)
    assert (standalone.load_weights_s, standalone.resume_s) == (s.broadcast_sync_s, s.rebalance_s)
    assert (standalone.sleep_s, standalone.wake_up_s, standalone.is_sleeping) == (0.0, 0.0, False)
    assert (hybrid.sleep_s, hybrid.wake_up_s) == (s.deactivate_s, s.hybrid_sync_s + s.activate_s)
    assert (hybrid.load_weights_s, hybrid.resume_s, hybrid.is_sleeping) == (0.0, 0.0, True)
    with_real_trainer = cfg.model_copy(update={"engines": cfg.engines.model_copy(update={"train": "torch"})})
    assert simulated_engine_costs(with_real_trainer, hybrid=True) == {}
    real = build(with_real_trainer, hybrid=True)
    assert (real.sleep_s, real.wake_up_s, real.load_weights_s, real.is_sleeping) == (0.0, 0.0, 0.0, False)


def test_the_engine_decodes_and_draws_lengths_like_the_simulator_replica():
    cfg = load_config(PRESET)
    s, r = cfg.sim, cfg.actor_rollout_ref.rollout
    standalone, hybrid = build(cfg, hybrid=False, seed=0), build(cfg, hybrid=True, seed=1500)
    assert standalone.max_batch == hybrid.max_batch == s.max_num_seqs
    for batch in (1, 128, 256):
        base = s.decode_step_base_s + s.decode_step_per_seq_s * batch
        assert standalone._decode_step_s(batch) == pytest.approx(base)
        assert hybrid._decode_step_s(batch) == pytest.approx(base / s.hybrid_throughput_factor)
    assert standalone.prefill_s_per_token == pytest.approx(1 / s.prefill_tokens_per_s)
    assert hybrid.prefill_s_per_token == pytest.approx(1 / (s.prefill_tokens_per_s * s.hybrid_throughput_factor))
    assert standalone._lengths == SeededLengths(
        mean_start=s.response_len_mean_start, mean_end=s.response_len_mean_end, response_sigma=s.response_len_sigma,
        prompt_sigma=s.prompt_len_sigma, max_len=r.response_length,
        last_version=cfg.trainer.total_training_steps - 1, seed=cfg.trainer.seed, prompt_key=request_sample_uid)
    # replicas built with different seeds serve the same response for the same request
    assert standalone.response_tokens("e0-p3-r1", 50) == hybrid.response_tokens("e0-p3-r1", 50)


def test_a_fully_emulated_hybrid_pays_the_simulators_sync_and_deactivation_seconds():
    """The controller's hybrid_sync (wake → load) and deactivate (abort → sleep) on one engine take
    hybrid_sync_s + activate_s and deactivate_s of the preset (scaled down: tenths of a second)."""
    cfg = load_config(PRESET)
    s = cfg.sim
    engine = build(cfg, hybrid=True)

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await engine.wake_up()
        await engine.load_weights({}, 1)
        await engine.resume()
        synced = loop.time() - t0
        t0 = loop.time()
        await engine.pause()
        await engine.abort_all()
        await engine.sleep()
        slept = loop.time() - t0
        await engine.shutdown()
        return synced, slept

    synced, slept = asyncio.run(main())
    assert s.hybrid_sync_s + s.activate_s <= synced < s.hybrid_sync_s + s.activate_s + 0.15
    assert s.deactivate_s <= slept < s.deactivate_s + 0.15


def test_the_faithful_shapes_engines_decode_with_mtp_and_the_hybrid_batch_cap_like_the_simulators_replicas():
    """The TP 8 shape sets ``speculative_speedup`` 2 and ``hybrid_max_num_seqs``: the emulated
    engine divides both iteration terms by the speed-up and caps a hybrid's batch at its own
    maximum, as the simulator's replica does (one rule, ``loop.workload.replica_costs``)."""
    from sim import Simulator, spec_from_config
    from policies import policy_from_config

    overrides = ["sim.speculative_speedup=2.5", "sim.hybrid_max_num_seqs=96", "sim.hybrid_throughput_factor=0.8"]
    cfg = load_config("sim/qwen35-35b-emulated-tp8-dynamic", overrides)
    s = cfg.sim
    standalone, hybrid = build(cfg, hybrid=False), build(cfg, hybrid=True)
    assert (standalone.max_batch, hybrid.max_batch) == (s.max_num_seqs, 96)
    replicas = Simulator(spec_from_config(cfg), policy_from_config(cfg)).rollouter.replicas
    twin = {r.hybrid: r for r in replicas}
    for engine, replica in ((standalone, twin[False]), (hybrid, twin[True])):
        assert engine.max_batch == replica.max_num_seqs
        for batch in (1, 64, 128):
            iteration = (s.decode_step_base_s + s.decode_step_per_seq_s * batch) / 2.5
            assert engine._decode_step_s(batch) == pytest.approx(iteration / replica.speed)
            twin_iteration = (replica.base_s + replica.per_seq_s * batch) / replica.speed
            assert engine._decode_step_s(batch) == pytest.approx(twin_iteration)
