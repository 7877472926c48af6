"""GRPO advantages and the PPO-clip loss on small hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.grpo import group_advantages, grpo_loss, k3_kl


def test_rewards_1_0_0_1_give_plus_minus_half_over_the_group_std():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    std = math.sqrt(1 / 3)  # Bessel-corrected std of [1, 0, 0, 1]
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-6)
    assert torch.allclose(adv, expected, atol=1e-6)


def test_the_population_std_option_gives_exactly_plus_minus_one():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), unbiased=False)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-5)


def test_each_group_is_normalised_by_its_own_mean_and_std():
    rewards = torch.tensor([[0.0, 1.0, 2.0, 3.0], [10.0, 10.0, 30.0, 30.0]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv.std(dim=1), torch.ones(2), atol=1e-4)
    # a shift and scale of one group leaves its advantages unchanged
    assert torch.allclose(group_advantages(rewards * 7 + 3), adv, atol=1e-4)


def test_a_group_whose_rewards_are_all_equal_gets_zero_advantages():
    adv = group_advantages(torch.tensor([[0.4, 0.4, 0.4], [1.0, 0.0, 0.5]]))
    assert torch.equal(adv[0], torch.zeros(3))
    assert adv[1].abs().sum() > 1.0


def test_a_group_of_one_response_gets_zero_advantage():
    assert torch.equal(group_advantages(torch.tensor([[0.9], [0.1]])), torch.zeros(2, 1))


def test_advantages_need_a_groups_by_responses_matrix():
    with pytest.raises(ValueError, match="groups, responses"):
        group_advantages(torch.tensor([1.0, 0.0]))


def _logp(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_at_ratio_one_the_loss_is_minus_the_mean_advantage_over_response_tokens():
    new = _logp([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = new.detach().clone()
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(new, old, adv, mask, clip_ratio=0.2)
    assert float(loss.detach()) == pytest.approx(-(2.0 + 2.0 - 1.0) / 3)
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    # d loss / d new_logp = -A / n_tokens on response tokens, 0 elsewhere
    assert torch.allclose(new.grad, torch.tensor([[0.0, -2 / 3, -2 / 3], [1 / 3, 0.0, 0.0]]))


def test_a_ratio_above_one_plus_clip_is_clipped_for_a_positive_advantage():
    old = torch.zeros(1, 2)
    new = _logp([[math.log(1.5), math.log(1.5)]])
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), torch.ones(1, 2), clip_ratio=0.2)
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert stats["clip_frac"] == 1.0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(1, 2))  # clipped tokens push no further


def test_a_ratio_below_one_minus_clip_is_clipped_for_a_negative_advantage():
    old = torch.zeros(1, 1)
    new = _logp([[math.log(0.5)]])
    loss, stats = grpo_loss(new, old, torch.tensor([-1.0]), torch.ones(1, 1), clip_ratio=0.2)
    assert float(loss.detach()) == pytest.approx(0.8)
    assert stats["clip_frac"] == 1.0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(1, 1))


def test_a_ratio_outside_the_range_on_the_worsening_side_is_not_clipped():
    # A > 0 but the ratio fell to 0.5: the unclipped term is the larger loss and keeps its gradient
    old = torch.zeros(1, 1)
    new = _logp([[math.log(0.5)]])
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), torch.ones(1, 1), clip_ratio=0.2)
    assert float(loss.detach()) == pytest.approx(-0.5)
    assert stats["clip_frac"] == 0.0
    loss.backward()
    assert float(new.grad) == pytest.approx(-0.5)


def test_masked_prompt_and_pad_positions_do_not_change_the_loss():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[0.0, -1.0, -1.0, 0.0]])
    adv = torch.tensor([1.5])
    a = _logp([[0.0, -0.9, -1.1, 0.0]])
    b = _logp([[-50.0, -0.9, -1.1, 30.0]])  # wild values only where the mask is 0
    loss_a, stats_a = grpo_loss(a, old, adv, mask, clip_ratio=0.2)
    loss_b, stats_b = grpo_loss(b, old, adv, mask, clip_ratio=0.2)
    assert float(loss_a.detach()) == pytest.approx(float(loss_b.detach()))
    assert stats_a == pytest.approx(stats_b)
    loss_b.backward()
    assert float(b.grad[0, 0]) == 0.0 and float(b.grad[0, 3]) == 0.0


def test_per_token_advantages_equal_broadcast_per_sequence_advantages():
    new, old = _logp([[-1.0, -0.5], [-2.0, -0.1]]), torch.tensor([[-1.2, -0.4], [-1.9, -0.3]])
    mask = torch.ones(2, 2)
    seq = torch.tensor([0.7, -1.3])
    loss_seq, _ = grpo_loss(new, old, seq, mask, clip_ratio=0.2)
    loss_tok, _ = grpo_loss(new, old, seq[:, None].expand(2, 2), mask, clip_ratio=0.2)
    assert float(loss_seq.detach()) == pytest.approx(float(loss_tok.detach()))


def test_kl_is_zero_when_the_reference_equals_the_policy():
    new = _logp([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    loss, stats = grpo_loss(new, new.detach(), torch.tensor([1.0]), mask, 0.2, kl_coef=0.5, ref_logp=new.detach())
    assert stats["kl"] == 0.0
    assert float(loss.detach()) == pytest.approx(stats["pg_loss"])


def test_the_kl_term_adds_coef_times_the_k3_estimate():
    new = _logp([[0.0]])
    ref = torch.tensor([[math.log(2.0)]])
    k3 = 2.0 - math.log(2.0) - 1.0
    assert float(k3_kl(new.detach(), ref)) == pytest.approx(k3)
    loss, stats = grpo_loss(new, new.detach(), torch.tensor([1.0]), torch.ones(1, 1), 0.2, kl_coef=0.5, ref_logp=ref)
    assert stats["kl"] == pytest.approx(k3)
    assert float(loss.detach()) == pytest.approx(-1.0 + 0.5 * k3)


def test_k3_is_never_negative():
    logp = torch.linspace(-5, 0, 21)[:, None].expand(21, 21)
    ref = torch.linspace(-5, 0, 21)[None, :].expand(21, 21)
    assert float(k3_kl(logp, ref).min()) >= 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kl_coef": 0.1}, "ref_logp"),
        ({"clip_ratio": 0.0}, "clip_ratio"),
        ({"kl_coef": -1.0}, "kl_coef"),
    ],
)
def test_bad_loss_arguments_are_rejected(kwargs, message):
    args = {"clip_ratio": 0.2, **kwargs}
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=message):
        grpo_loss(x, x, torch.zeros(1), torch.ones(1, 2), **args)


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="same shape"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 2), 0.2)
