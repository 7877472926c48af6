"""The emulated benchmark's faithful (TP 8) setups run the real data plane's shape: the trainer as a
rank group (one rank actor per emulated GPU, a gloo group, the hybrids on their ranks) and the
standalones' weights through the collective transport, which the simulated engines join."""

from __future__ import annotations

import pytest

from benchmarks.bench_emulated import OVERRIDES, PRESET, PRESETS, SETUPS
from cluster.actors.trainer_rank import hybrid_hosts
from cluster.placement import Demand
from config import load_config

TP8 = [key for key in SETUPS if key.startswith("tp8-")]


@pytest.mark.parametrize("key", TP8)
def test_a_tp8_setup_trains_on_a_rank_group_and_syncs_standalones_by_the_collective(key):
    cfg = load_config(PRESET.format(PRESETS.get(key, key)), OVERRIDES.get(key, []))
    assert (cfg.engines.train, cfg.engines.rollout) == ("simulated", "simulated")
    assert Demand.of(cfg).trainer_ranks == cfg.trainer_gpus > 1
    assert cfg.standalone_transport == "collective"
    assert cfg.actor_rollout_ref.rollout.weight_sync.hybrid_transport == "in_rank"
    hosts = hybrid_hosts([f"hybrid-{i}" for i in range(cfg.hybrid_replicas)], cfg.trainer_gpus,
                         cfg.trainer.n_gpus_per_node, cfg.gpus_per_replica)
    assert all(len(ranks) == 8 for ranks in hosts.values())
