"""Config sections of the RL algorithm under verl's keys: `algorithm.*` and
`actor_rollout_ref.actor.*` (policy loss, KL, optimizer), and the key aliases they accept.

Owns the schema of these keys and the rule that a key and its alias are never both set. Must
not import Ray, torch or anything of Tidal's outside `config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def apply_aliases(data: Any, aliases: Mapping[str, str]) -> Any:
    """Rename each alias key of a raw section mapping to its canonical key. Setting both spellings
    of one key is an error (a ``ValueError`` naming both)."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    for alias, canonical in aliases.items():
        if alias not in out:
            continue
        if canonical in out:
            raise ValueError(f"both {alias} and {canonical} are set; they are one key, set only one")
        out[canonical] = out.pop(alias)
    return out


SCHEDULING_ALIASES = {
    "use_dynamic_resource_scaling": "use_dynamic_resource_scheduling",
    "dynamic_scaling_policy": "dynamic_schedule_policy",
    "dynamic_scaling_deactivate_ratio": "dynamic_schedule_deactivate_ratio",
    "dynamic_scaling_enable_rebalance": "dynamic_schedule_enable_rebalance",
}
"""Newer verl scripts' spellings of the `async_training` scheduling keys → today's keys."""


# --------------------------------------------------------------------------------------------
# algorithm.*


class RolloutCorrection(_Section):
    """`algorithm.rollout_correction.*`: importance sampling between the engine that generated a
    sample and the trainer's old policy (stale or mismatched rollouts). Applies when the old
    log-probs are recomputed (`async_training.use_rollout_log_probs=false`) and the engine
    reported its own."""

    rollout_is: Literal["token", "sequence"] | None = None
    """IS level: `token` (one weight per token), `sequence` (product over the response), or null (off)."""

    rollout_is_threshold: float = Field(2.0, gt=0.0, le=1e6)
    """Upper bound of an IS weight (truncated IS)."""


class AlgorithmSection(_Section):
    """`algorithm.*`: advantage estimation and the rollout correction."""

    adv_estimator: Literal["grpo"] = "grpo"
    """Advantage estimator (group-relative outcome advantages)."""

    norm_adv_by_std_in_grpo: bool = True
    """Divide a group's centred rewards by its standard deviation (false = Dr. GRPO)."""

    rollout_correction: RolloutCorrection = Field(default_factory=RolloutCorrection)
    """Rollout importance-sampling correction."""


# --------------------------------------------------------------------------------------------
# actor_rollout_ref.actor.*


class OptimSection(_Section):
    """`actor_rollout_ref.actor.optim.*`: AdamW and its warmup."""

    lr: float = Field(1e-3, gt=0.0, le=1.0)
    """Peak learning rate."""

    lr_warmup_steps: int = Field(-1, ge=-1)
    """Optimizer updates of linear warmup from 0 to `lr`; -1 = use `lr_warmup_steps_ratio`."""

    lr_warmup_steps_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Warmup as a fraction of the run's updates (needs `trainer.total_training_steps`)."""

    warmup_style: Literal["constant"] = "constant"
    """LR after warmup: constant."""

    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""


class MixedPrecisionSection(_Section):
    """`actor_rollout_ref.actor.fsdp_config.mixed_precision.*`."""

    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Dtype the trainer computes in on CUDA (FSDP2's `MixedPrecisionPolicy`, or autocast for a
    one-GPU trainer); the parameters and AdamW stay fp32 and gradients are reduced in fp32. On CPU
    the trainer always computes in fp32."""


class FsdpSection(_Section):
    """`actor_rollout_ref.actor.fsdp_config.*`: the trainer's ranks (verl's keys)."""

    param_offload: bool = False
    """While the trainer's GPUs are lent to rollout, also move the parameters to host memory
    (they come back at the take-back)."""

    optimizer_offload: bool = True
    """While the trainer's GPUs are lent, move the AdamW state and the gradients to host memory.
    On by default (verl's is off): lending is what Tidal is for, and the hybrids need the room."""

    reshard_after_forward: bool = True
    """FSDP2: free each layer's gathered parameters after its forward (less memory, one more
    all-gather in the backward)."""

    mixed_precision: MixedPrecisionSection = Field(default_factory=MixedPrecisionSection)
    """Compute dtype."""


class CheckpointSection(_Section):
    """`actor_rollout_ref.actor.checkpoint.*`."""

    async_save: bool = True
    """Write each step's checkpoint in the background: the step waits only for the copy to host
    memory, the next step's commit waits for the write. A run killed before the write completed
    resumes from the step before (nothing is lost: its prompts are trained again)."""


_LEGACY_OPTIM_KEYS = ("lr", "weight_decay")
"""Today's `actor.lr` / `actor.weight_decay`, aliases of `actor.optim.lr` / `.weight_decay`."""


class ActorSection(_Section):
    """`actor_rollout_ref.actor.*`: the policy update."""

    ppo_mini_batch_size: int = Field(16, ge=1, le=1_000_000)
    """Samples (prompts) per mini-batch."""

    ppo_micro_batch_size_per_gpu: int | None = Field(None, ge=1, le=1_000_000)
    """Responses per forward/backward pass (gradient accumulation over a mini-batch; memory is
    bounded by this, not by the mini-batch). null = the whole mini-batch in one pass."""

    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each micro-step's samples."""

    optim: OptimSection = Field(default_factory=OptimSection)
    """Optimizer."""

    clip_ratio: float = Field(0.2, gt=0.0, le=10.0)
    """PPO clip range; the default of `clip_ratio_low` and `clip_ratio_high`."""

    clip_ratio_low: float | None = Field(None, gt=0.0, le=10.0)
    """Lower clip: the ratio is clipped at `1 − clip_ratio_low` (null = `clip_ratio`)."""

    clip_ratio_high: float | None = Field(None, gt=0.0, le=10.0)
    """Upper clip: the ratio is clipped at `1 + clip_ratio_high` (null = `clip_ratio`)."""

    clip_ratio_c: float = Field(3.0, gt=1.0, le=1000.0)
    """Dual-clip bound: for negative advantages the loss is capped at `−A × clip_ratio_c`."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses reduce to one number."""

    entropy_coeff: float = Field(0.0, ge=0.0, le=10.0)
    """Entropy bonus weight (the loss subtracts `entropy_coeff × entropy`)."""

    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference model (kept only when this is on)."""

    kl_loss_coef: float = Field(0.001, ge=0.0, le=100.0)
    """KL penalty weight (used when `use_kl_loss`)."""

    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    """KL estimator: `kl`/`k1` (log ratio), `abs`, `mse`/`k2` (half squared), `low_var_kl`/`k3`."""

    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clip."""

    fsdp_config: FsdpSection = Field(default_factory=FsdpSection)
    """The trainer's sharding, offload while lent, and compute dtype."""

    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    """How each step's checkpoint is written."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_optim_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not any(k in data for k in _LEGACY_OPTIM_KEYS):
            return data
        out = dict(data)
        optim = out.get("optim", {})
        optim = dict(optim) if isinstance(optim, Mapping) else optim
        for key in _LEGACY_OPTIM_KEYS:
            if key not in out:
                continue
            if isinstance(optim, dict) and key in optim:
                raise ValueError(f"both {key} and optim.{key} are set; they are one key, set only one")
            if isinstance(optim, dict):
                optim[key] = out.pop(key)
        out["optim"] = optim
        return out

    @property
    def lr(self) -> float:
        """`optim.lr` (today's spelling)."""
        return self.optim.lr

    @property
    def weight_decay(self) -> float:
        """`optim.weight_decay` (today's spelling)."""
        return self.optim.weight_decay

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
