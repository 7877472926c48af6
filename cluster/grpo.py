"""GRPO maths: group-normalised advantages and the PPO-clip policy loss, as pure torch functions.

No model, no optimizer, no I/O: the train backends call these on tensors they have prepared.

Shapes: ``B`` sequences (every response of every sample), ``T`` token positions. Log-prob and
mask tensors are aligned with ``cluster.model.sequence_logprobs``: entry ``t`` scores the token at
position ``t + 1``, and ``mask`` is 1 exactly on response tokens (prompt and padding are 0).
"""

from __future__ import annotations

import torch

ADV_EPS = 1e-6
"""Added to the group's standard deviation so an all-equal group gives zero advantages."""

KL_CLAMP = 10.0
"""Bound on the per-token k3 KL estimate (keeps a single wild token from dominating the loss)."""


def group_advantages(rewards: torch.Tensor, *, eps: float = ADV_EPS, unbiased: bool = True) -> torch.Tensor:
    """Group-normalised advantages: ``(r - mean(group)) / (std(group) + eps)``, one row per group.

    rewards: (G, n), one row per sample (prompt), one column per response. ``unbiased`` picks the
    Bessel-corrected standard deviation (verl's GRPO choice). A group of one response has no spread
    and gets advantage 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (groups, responses), got shape {tuple(rewards.shape)}")
    r = rewards.float()
    if r.shape[1] < 2:
        return torch.zeros_like(r)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=unbiased)
    return (r - mean) / (std + eps)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy ‖ reference): ``exp(d) − d − 1`` with ``d = ref − logp``.

    Non-negative, zero exactly where the two log-probs agree; clamped to ``[0, KL_CLAMP]``.
    """
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(0.0, KL_CLAMP)


def grpo_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip loss, averaged over response tokens, plus optional k3 KL to a reference.

    new_logp, old_logp, mask: (B, T); advantages: (B,) per sequence or (B, T) per token.
    Per token: ``max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))`` with ``ρ = exp(new − old)``.
    Returns ``(loss, stats)``; stats are floats: ``pg_loss``, ``kl`` (to the reference; 0 without
    one), ``clip_frac`` (share of response tokens where the clipped term was the active one),
    ``approx_kl`` (old → new, k3), ``ratio_mean``.
    """
    if new_logp.shape != old_logp.shape or new_logp.shape != mask.shape:
        raise ValueError(
            f"new_logp {tuple(new_logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same shape"
        )
    if clip_ratio <= 0:
        raise ValueError(f"clip_ratio must be > 0, got {clip_ratio}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    mask = mask.to(new_logp.dtype)
    adv = advantages.to(new_logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(new_logp)
    old_logp = old_logp.detach()

    log_ratio = (new_logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    pg_loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    loss = pg_loss

    kl_value = torch.zeros((), dtype=new_logp.dtype)
    if ref_logp is not None:
        kl_value = masked_mean(k3_kl(new_logp, ref_logp.detach()), mask)
        if kl_coef > 0:
            loss = loss + kl_coef * kl_value

    with torch.no_grad():
        stats = {
            "pg_loss": float(pg_loss.detach()),
            "kl": float(kl_value.detach()),
            "clip_frac": float(masked_mean((clipped > unclipped).to(new_logp.dtype), mask)),
            "approx_kl": float(masked_mean(k3_kl(new_logp, old_logp), mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
        }
    return loss, stats
