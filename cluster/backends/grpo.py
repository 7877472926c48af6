"""The RL core: GRPO advantages, the PPO-clip policy loss, loss aggregation, entropy, KL
estimators and the rollout importance-sampling correction, as small pure torch functions.

Owns the maths under verl's key names (``algorithm.adv_estimator``, ``norm_adv_by_std_in_grpo``,
``actor.clip_ratio_low/high/c``, ``loss_agg_mode``, ``entropy_coeff``, ``kl_loss_type``,
``algorithm.rollout_correction.rollout_is``). Must not hold a model, an optimizer or any state:
the train backends call these on tensors they have prepared.

Shapes: ``B`` sequences (every response of every sample), ``T`` token positions. Log-prob and
mask tensors are aligned: entry ``t`` scores the token at position ``t + 1``, and ``mask`` is 1
exactly on response tokens (prompt and padding are 0).

Gradient accumulation: every aggregation takes the normaliser of the whole mini-batch
(``global_tokens`` / ``global_seqs``), so the sum of the micro-batches' losses is exactly the
mini-batch's loss and their gradients add up to the big batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADV_EPS = 1e-6
"""Added to the group's standard deviation so an all-equal group gives zero advantages."""

LOG_RATIO_CLAMP = 20.0
"""Bound on a log importance ratio before ``exp`` (verl's safety bound)."""

KL_CLAMP = 10.0
"""Bound on the per-token k3 (``low_var_kl``) estimate."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
ADV_ESTIMATORS = ("grpo",)
ROLLOUT_IS_LEVELS = ("token", "sequence")

KL_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
"""``actor.kl_loss_type`` spellings (verl's) → the estimator they name."""


# ---------------------------------------------------------------------------------------------
# Advantages


def grpo_advantages(rewards: torch.Tensor, *, norm_by_std: bool = True, eps: float = ADV_EPS) -> torch.Tensor:
    """GRPO outcome advantages of one group or many: ``(r − mean) / (std + eps)``, or ``r − mean``
    without ``norm_by_std`` (Dr. GRPO). rewards: (G, n), one row per prompt. std is Bessel-corrected
    (torch's default, as verl). A group of one response has mean 0 and std 1 (verl's rule), so its
    advantage is its own reward."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (groups, responses), got shape {tuple(rewards.shape)}")
    r = rewards.float()
    if r.shape[1] < 2:
        mean, std = torch.zeros_like(r), torch.ones_like(r)
    else:
        mean, std = r.mean(dim=1, keepdim=True), r.std(dim=1, keepdim=True)
    centred = r - mean
    return centred / (std + eps) if norm_by_std else centred


def compute_advantages(
    estimator: str, groups: list[list[float]], *, norm_adv_by_std_in_grpo: bool = True
) -> torch.Tensor:
    """Per-response advantages, flattened in group order, by ``algorithm.adv_estimator`` name.
    Groups may have different sizes."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {estimator!r}; known: {', '.join(ADV_ESTIMATORS)}")
    if not groups:
        return torch.zeros(0)
    if len({len(g) for g in groups}) == 1:
        return grpo_advantages(torch.tensor(groups), norm_by_std=norm_adv_by_std_in_grpo).reshape(-1)
    return torch.cat([grpo_advantages(torch.tensor([g]), norm_by_std=norm_adv_by_std_in_grpo)[0] for g in groups])


# ---------------------------------------------------------------------------------------------
# Aggregation


def agg_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar by ``actor.loss_agg_mode``.

    ``token-mean``: sum over all response tokens / their count. ``seq-mean-token-sum``: each
    sequence's token sum, averaged over sequences. ``seq-mean-token-mean``: each sequence's token
    mean, averaged over sequences (a sequence without response tokens counts as none). The counts
    default to this batch's; pass the mini-batch's when this is one micro-batch of it."""
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token-mean":
        denom = float(mask.sum()) if global_tokens is None else float(global_tokens)
        return masked.sum() / max(denom, 1.0)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")
    tokens_per_seq = mask.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = masked.sum(dim=-1)
        live = float(values.shape[0])
    else:
        per_seq = masked.sum(dim=-1) / tokens_per_seq.clamp_min(1.0)
        live = float((tokens_per_seq > 0).sum())
    denom = live if global_seqs is None else float(global_seqs)
    return per_seq.sum() / max(denom, 1.0)


def count_seqs(mask: torch.Tensor, mode: str) -> int:
    """The sequences ``agg_loss`` averages over in ``mode`` (the ``global_seqs`` of a mini-batch)."""
    if mode == "seq-mean-token-mean":
        return int((mask.sum(dim=-1) > 0).sum())
    return int(mask.shape[0])


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


# ---------------------------------------------------------------------------------------------
# Per-token quantities


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position: logits (B, T, V), labels (B, T) → (B, T), in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None])[..., 0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical each position's logits define: (B, T, V) → (B, T), in fp32."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(policy ‖ reference) by ``actor.kl_loss_type``, with ``d = logp − ref``:
    ``kl``/``k1`` = d; ``abs`` = |d|; ``mse``/``k2`` = d²/2; ``low_var_kl``/``k3`` =
    ``exp(−d) + d − 1`` clamped to [−KL_CLAMP, KL_CLAMP]."""
    kind = KL_TYPES.get(kl_type)
    if kind is None:
        raise ValueError(f"unknown kl_loss_type {kl_type!r}; known: {', '.join(KL_TYPES)}")
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    neg = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(neg) - neg - 1.0).clamp(-KL_CLAMP, KL_CLAMP)


# ---------------------------------------------------------------------------------------------
# Rollout importance sampling (the trainer's old policy vs the engine that generated the tokens)


@dataclass(frozen=True)
class ISWeights:
    weights: torch.Tensor
    """(B, T) detached weights, 1 off the mask."""
    stats: dict[str, float]
    """``rollout_is_mean``/``_max``/``_min`` (over response tokens, before truncation) and
    ``rollout_is_clipfrac`` (share of response tokens whose weight was truncated)."""


def rollout_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, level: str, threshold: float
) -> ISWeights:
    """Truncated importance weights ``min(π_old / π_rollout, threshold)`` for stale samples.

    ``token``: one weight per token, ``exp(old − rollout)``. ``sequence``: one weight per sequence,
    ``exp(Σ_t (old − rollout))``, broadcast over its tokens. Log ratios are clamped to ±20 first."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; known: {', '.join(ROLLOUT_IS_LEVELS)}")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    m = mask.to(old_logp.dtype)
    log_ratio = (old_logp - rollout_logp).detach() * m
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(old_logp)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = torch.where(m > 0, raw.clamp(max=threshold), torch.ones_like(raw))
    on = m > 0
    if bool(on.any()):
        vals = raw[on]
        stats = {
            "rollout_is_mean": float(vals.mean()),
            "rollout_is_max": float(vals.max()),
            "rollout_is_min": float(vals.min()),
            "rollout_is_clipfrac": float((vals > threshold).float().mean()),
        }
    else:
        stats = {"rollout_is_mean": 1.0, "rollout_is_max": 1.0, "rollout_is_min": 1.0, "rollout_is_clipfrac": 0.0}
    return ISWeights(weights, stats)


# ---------------------------------------------------------------------------------------------
# Policy loss


@dataclass(frozen=True)
class PolicyLoss:
    pg_loss: torch.Tensor
    """Aggregated scalar (carries the gradient)."""
    pg_clipfrac: torch.Tensor
    """Share of response tokens where the clipped ratio was the active term."""
    pg_clipfrac_lower: torch.Tensor
    """Share of response tokens (negative advantage) where the dual clip ``clip_ratio_c`` bound."""
    ppo_kl: torch.Tensor
    """Mean ``old − new`` log-prob over response tokens (k1 estimate of KL(old ‖ new))."""


def policy_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> PolicyLoss:
    """PPO-clip with dual clip, per token, aggregated by ``loss_agg_mode``.

    ``ρ = exp(new − old)``; clipped = ``max(−A·ρ, −A·clip(ρ, 1 − low, 1 + high))``; where A < 0 the
    loss is further capped at ``−A·clip_ratio_c``. ``is_weights`` (rollout IS) multiply the per-token
    loss. new_logp, old_logp, mask: (B, T); advantages: (B,) per sequence or (B, T) per token."""
    if new_logp.shape != old_logp.shape or new_logp.shape != mask.shape:
        raise ValueError(
            f"new_logp {tuple(new_logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same shape"
        )
    if clip_ratio_low <= 0 or clip_ratio_high <= 0:
        raise ValueError(f"clip ratios must be > 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    m = mask.to(new_logp.dtype)
    adv = advantages.to(new_logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(new_logp)
    log_ratio = (new_logp - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    per_token = torch.where(adv < 0, dual, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    pg_loss = agg_loss(per_token, m, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).to(m.dtype), m)
        clipfrac_lower = masked_mean(((clipped > loss3) & (adv < 0)).to(m.dtype), m)
        ppo_kl = masked_mean(-log_ratio, m)
    return PolicyLoss(pg_loss, clipfrac, clipfrac_lower, ppo_kl)
