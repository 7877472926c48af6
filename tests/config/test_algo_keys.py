"""`algorithm.*` and `actor_rollout_ref.actor.*` under verl's names, today's spellings as aliases,
and the newer verl scheduling spellings of `async_training`."""

from __future__ import annotations

import pytest

from cluster.backends import warmup_steps
from config import ConfigError, load_config
from config.loader import validate


def actor(**keys):
    return validate({"actor_rollout_ref": {"actor": keys}}).actor_rollout_ref.actor


def test_todays_lr_and_weight_decay_spellings_land_in_optim():
    a = actor(lr=0.02, weight_decay=0.1)
    assert (a.optim.lr, a.optim.weight_decay, a.lr, a.weight_decay) == (0.02, 0.1, 0.02, 0.1)


def test_setting_both_spellings_of_the_learning_rate_is_an_error():
    with pytest.raises(ConfigError) as err:
        actor(lr=0.02, optim={"lr": 0.01})
    assert str(err.value) == "actor_rollout_ref.actor: both lr and optim.lr are set; they are one key, set only one"


def test_clip_ratio_low_and_high_default_to_clip_ratio():
    assert (actor(clip_ratio=0.3).clip_low, actor(clip_ratio=0.3).clip_high) == (0.3, 0.3)
    a = actor(clip_ratio=0.3, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert (a.clip_low, a.clip_high) == (0.2, 0.28)


@pytest.mark.parametrize(
    ("alias", "key", "value"),
    [
        ("use_dynamic_resource_scaling", "use_dynamic_resource_scheduling", True),
        ("dynamic_scaling_policy", "dynamic_schedule_policy", "fixed_ratio"),
        ("dynamic_scaling_deactivate_ratio", "dynamic_schedule_deactivate_ratio", 0.7),
        ("dynamic_scaling_enable_rebalance", "dynamic_schedule_enable_rebalance", False),
    ],
)
def test_newer_verl_scheduling_spellings_are_aliases(alias, key, value):
    cfg = validate({"async_training": {alias: value}})
    assert getattr(cfg.async_training, key) == value
    with pytest.raises(ConfigError, match=f"async_training: both {alias} and {key} are set"):
        validate({"async_training": {alias: value, key: value}})


def test_a_verl_grpo_actor_section_parses_whole():
    cfg = validate({
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False,
                      "rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 3.0}},
        "actor_rollout_ref": {"actor": {
            "optim": {"lr": 1e-6, "lr_warmup_steps": 10, "weight_decay": 0.01},
            "ppo_micro_batch_size_per_gpu": 2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0,
            "loss_agg_mode": "seq-mean-token-mean", "entropy_coeff": 0.001, "use_kl_loss": True,
            "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "grad_clip": 1.0,
        }},
    })
    a = cfg.actor_rollout_ref.actor
    assert (a.optim.lr, a.optim.lr_warmup_steps, a.optim.weight_decay) == (1e-6, 10, 0.01)
    assert (a.ppo_micro_batch_size_per_gpu, a.clip_low, a.clip_high, a.clip_ratio_c) == (2, 0.2, 0.28, 10.0)
    assert (a.loss_agg_mode, a.entropy_coeff, a.kl_loss_type) == ("seq-mean-token-mean", 0.001, "low_var_kl")
    rc = cfg.algorithm.rollout_correction
    assert (cfg.algorithm.norm_adv_by_std_in_grpo, rc.rollout_is, rc.rollout_is_threshold) == (False, "sequence", 3.0)


def test_warmup_steps_come_from_the_count_or_from_the_ratio_of_the_runs_updates():
    assert warmup_steps(load_config("tiny-cpu", ["actor_rollout_ref.actor.optim.lr_warmup_steps=5"])) == 5
    # tiny-cpu: 100 steps × trigger 2 × 1 epoch = 200 updates; 10 % → 20
    assert warmup_steps(load_config("tiny-cpu", ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"])) == 20
    assert warmup_steps(load_config("tiny-cpu")) == 0
