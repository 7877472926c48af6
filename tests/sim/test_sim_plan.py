"""The setups a comparison runs: static splits in replica-size steps."""

from __future__ import annotations

import pytest

from config import ConfigError, load_config
from sim import static_splits, with_policy


def test_static_splits_cover_the_same_gpus_in_replica_size_steps():
    splits = static_splits(load_config("sim/qwen35-35b-tp4-dynamic"))
    assert [label for label, _ in splits] == [f"static {t}+{32 - t}" for t in range(4, 32, 4)]
    for label, cfg in splits:
        assert cfg.trainer_gpus + cfg.standalone_gpus == 32
        assert cfg.hybrid_replicas == 0
        assert cfg.async_training.dynamic_schedule_policy == "static_fully_async"
    assert dict(splits)["static 8+24"].trainer.nnodes == 1  # whole 8-GPU nodes where they fit


def test_with_policy_switches_dynamic_scheduling_on_and_validates():
    cfg = with_policy(load_config("sim/qwen35-35b-tp4-static-16-16"), "fixed_ratio", dynamic=True)
    assert (cfg.hybrid_replicas, cfg.async_training.dynamic_schedule_policy) == (4, "fixed_ratio")
    one_trainer_gpu_tp2 = load_config(
        "tiny-cpu",
        [
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "rollout.n_gpus_per_node=2",
            "async_training.use_dynamic_resource_scheduling=false",
        ],
    )
    with pytest.raises(ConfigError, match="tensor_model_parallel_size"):
        with_policy(one_trainer_gpu_tp2, "default", dynamic=True)
