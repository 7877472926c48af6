"""The RL core (cluster/backends/grpo.py) on hand-computed numbers: advantages, aggregation, the clipped
and dual-clipped policy loss, entropy, each KL estimator and the rollout IS correction."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.backends.grpo import (
    agg_loss,
    compute_advantages,
    count_seqs,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    rollout_is_weights,
)


def close(t: torch.Tensor, expected: list, tol: float = 1e-5) -> bool:
    return torch.allclose(t.float(), torch.tensor(expected, dtype=torch.float32), atol=tol, rtol=0)


# -- advantages -----------------------------------------------------------------------------


def test_grpo_divides_by_the_groups_bessel_corrected_std():
    # mean 0.5, std = sqrt(4 × 0.25 / 3) = 0.57735, 0.5 / 0.57735 = 0.86603
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert close(adv, [[0.86603, -0.86603, -0.86603, 0.86603]])


def test_without_the_std_grpo_only_centres_each_group():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]), norm_by_std=False)
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]]


def test_an_all_equal_group_gets_zero_advantages():
    assert grpo_advantages(torch.tensor([[0.4, 0.4, 0.4]])).tolist() == [[0.0, 0.0, 0.0]]


def test_a_group_of_one_response_keeps_its_reward_as_advantage():
    # verl's rule: mean 0, std 1 for a lone response
    assert close(grpo_advantages(torch.tensor([[0.9], [0.1]])), [[0.9], [0.1]])
    assert grpo_advantages(torch.tensor([[0.9]]), norm_by_std=False).tolist() == [[pytest.approx(0.9)]]


def test_groups_of_different_sizes_are_normalised_each_on_its_own():
    # [1, 0]: mean 0.5, std sqrt(0.5) = 0.70711 → ±0.70711; [2]: alone → 2
    assert close(compute_advantages("grpo", [[1.0, 0.0], [2.0]]), [0.70711, -0.70711, 2.0])


def test_an_unknown_estimator_or_a_flat_reward_vector_is_rejected():
    with pytest.raises(ValueError, match="unknown adv_estimator 'gae'; known: grpo"):
        compute_advantages("gae", [[1.0]])
    with pytest.raises(ValueError, match="groups, responses"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


# -- aggregation ----------------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-sum", 10.0 / 3.0),  # (6 + 4 + 0) / 3 sequences
        ("seq-mean-token-mean", 3.0),  # (2 + 4) / 2 sequences with response tokens
    ],
)
def test_each_loss_agg_mode_reduces_the_masked_tokens_as_named(mode, expected):
    assert float(agg_loss(VALUES, MASK, mode)) == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_losses_with_the_mini_batch_counts_sum_to_the_mini_batch_loss(mode):
    whole = float(agg_loss(VALUES, MASK, mode))
    counts = dict(global_tokens=float(MASK.sum()), global_seqs=float(count_seqs(MASK, mode)))
    parts = sum(float(agg_loss(VALUES[i : i + 1], MASK[i : i + 1], mode, **counts)) for i in range(3))
    assert parts == pytest.approx(whole)


def test_an_unknown_loss_agg_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token-sum'"):
        agg_loss(VALUES, MASK, "token-sum")


# -- policy loss ----------------------------------------------------------------------------


def one_token(ratio: float, adv: float, **kwargs):
    new = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = policy_loss(new, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kwargs)
    return new, out


def test_a_positive_advantage_is_clipped_at_one_plus_clip_ratio_high():
    _, out = one_token(1.5, 1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert float(out.pg_loss.detach()) == pytest.approx(-1.28)
    assert float(out.pg_clipfrac) == 1.0
    _, wide = one_token(1.5, 1.0, clip_ratio_low=0.2, clip_ratio_high=0.6)
    assert float(wide.pg_loss.detach()) == pytest.approx(-1.5)
    assert float(wide.pg_clipfrac) == 0.0


def test_a_negative_advantage_is_clipped_at_one_minus_clip_ratio_low():
    _, out = one_token(0.5, -1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert float(out.pg_loss.detach()) == pytest.approx(0.8)  # −A × clip(0.5, 0.8, 1.28)
    assert float(out.pg_clipfrac) == 1.0
    _, wide = one_token(0.5, -1.0, clip_ratio_low=0.6, clip_ratio_high=0.28)
    assert float(wide.pg_loss.detach()) == pytest.approx(0.5)
    assert float(wide.pg_clipfrac) == 0.0


def test_the_dual_clip_caps_a_negative_advantages_loss_at_clip_ratio_c_and_stops_its_gradient():
    new, out = one_token(5.0, -1.0, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    assert float(out.pg_loss.detach()) == pytest.approx(3.0)  # min(max(5, 1.28), 3)
    assert float(out.pg_clipfrac_lower) == 1.0
    out.pg_loss.backward()
    assert float(new.grad) == 0.0
    _, loose = one_token(5.0, -1.0, clip_ratio_c=10.0)
    assert float(loose.pg_loss.detach()) == pytest.approx(5.0)
    assert float(loose.pg_clipfrac_lower) == 0.0


def test_ppo_kl_is_the_mean_old_minus_new_log_prob():
    _, out = one_token(1.5, 1.0)
    assert float(out.ppo_kl) == pytest.approx(-math.log(1.5))


def test_policy_loss_rejects_bad_clip_ratios_and_mismatched_shapes():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        one_token(1.0, 1.0, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip ratios must be > 0"):
        one_token(1.0, 1.0, clip_ratio_low=0.0)
    with pytest.raises(ValueError, match="same shape"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 2))


# -- entropy and KL -------------------------------------------------------------------------


def test_entropy_of_uniform_and_skewed_two_way_logits():
    # uniform: ln 2; p = (1/4, 3/4): −(¼ ln ¼ + ¾ ln ¾) = 0.56234
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    assert close(entropy_from_logits(logits), [[math.log(2.0), 0.56234]])


@pytest.mark.parametrize(
    ("names", "d", "expected"),
    [
        (("kl", "k1"), 0.5, 0.5),
        (("kl", "k1"), -0.5, -0.5),
        (("abs",), -0.5, 0.5),
        (("mse", "k2"), 0.5, 0.125),  # d² / 2
        (("low_var_kl", "k3"), 0.5, math.exp(-0.5) + 0.5 - 1.0),  # 0.10653
        (("low_var_kl", "k3"), -0.5, math.exp(0.5) - 0.5 - 1.0),  # 0.14872
    ],
)
def test_each_kl_estimator_on_a_log_ratio_by_hand(names, d, expected):
    logp, ref = torch.tensor([-1.0 + d]), torch.tensor([-1.0])
    for name in names:
        assert float(kl_penalty(logp, ref, name)) == pytest.approx(expected, abs=1e-6)


def test_k3_is_clamped_and_an_unknown_kl_type_is_rejected():
    assert float(kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")) == 10.0
    with pytest.raises(ValueError, match="unknown kl_loss_type 'full'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


# -- rollout importance sampling ------------------------------------------------------------

OLD = torch.tensor([[-1.0, -2.0, -4.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, 0.0]])
IS_MASK = torch.tensor([[1.0, 1.0, 0.0]])  # third position is padding


def test_token_level_is_weights_are_truncated_at_the_threshold():
    # log ratios 0.5 and −1.0 → e^0.5 = 1.64872 (truncated to 1.5) and e^−1 = 0.36788
    w = rollout_is_weights(OLD, ROLLOUT, IS_MASK, level="token", threshold=1.5)
    assert close(w.weights, [[1.5, 0.36788, 1.0]])
    assert w.stats == {
        "rollout_is_mean": pytest.approx((1.64872 + 0.36788) / 2, abs=1e-5),
        "rollout_is_max": pytest.approx(1.64872, abs=1e-5),
        "rollout_is_min": pytest.approx(0.36788, abs=1e-5),
        "rollout_is_clipfrac": 0.5,
    }


def test_sequence_level_is_weights_use_the_summed_log_ratio_for_every_token():
    # Σ = 0.5 − 1.0 = −0.5 → e^−0.5 = 0.60653 on both response tokens
    w = rollout_is_weights(OLD, ROLLOUT, IS_MASK, level="sequence", threshold=2.0)
    assert close(w.weights, [[0.60653, 0.60653, 1.0]])
    assert w.stats["rollout_is_clipfrac"] == 0.0
    cut = rollout_is_weights(OLD, ROLLOUT, IS_MASK, level="sequence", threshold=0.5)
    assert close(cut.weights, [[0.5, 0.5, 1.0]])
    assert cut.stats["rollout_is_clipfrac"] == 1.0


def test_is_weights_scale_the_per_token_policy_loss():
    w = rollout_is_weights(OLD, ROLLOUT, IS_MASK, level="token", threshold=1.5)
    out = policy_loss(OLD, OLD, torch.tensor([1.0]), IS_MASK, is_weights=w.weights)
    assert float(out.pg_loss.detach()) == pytest.approx(-(1.5 + math.exp(-1.0)) / 2, abs=1e-5)


def test_an_unknown_is_level_or_a_non_positive_threshold_is_rejected():
    with pytest.raises(ValueError, match="unknown rollout_is level 'geometric'"):
        rollout_is_weights(OLD, ROLLOUT, IS_MASK, level="geometric", threshold=2.0)
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0"):
        rollout_is_weights(OLD, ROLLOUT, IS_MASK, level="token", threshold=0.0)
