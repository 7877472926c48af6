"""Train backends: torch (AdamW + GRPO), DeepSpeed ZeRO (optional extra) and the simulated twin.

Owns: the GRPO update on a batch of samples, phase timing under the reference's keys, weights
for rollout sync, and the checkpoint file. Must not: import Ray, talk to the queue or the store,
or own the param version (the trainer actor that wraps a backend does all that).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cluster.backends.base import TIMING_KEYS, StepResult, TrainBackend
from cluster.backends.deepspeed_backend import DeepSpeedBackend, deepspeed_available, shutdown_distributed
from cluster.backends.simulated import SimulatedBackend
from cluster.backends.torch_backend import TorchBackend, TrainBatch, build_batch
from cluster.checkpoint_file import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    CheckpointInfo,
    UnsafeCheckpointError,
    checkpoint_complete,
    read_checkpoint,
    write_checkpoint,
)

if TYPE_CHECKING:
    from config import TidalConfig

    from data.problems import CharTokenizer, Problem

__all__ = [
    "CHECKPOINT_FORMAT",
    "TIMING_KEYS",
    "CheckpointError",
    "CheckpointInfo",
    "DeepSpeedBackend",
    "SimulatedBackend",
    "StepResult",
    "TorchBackend",
    "TrainBackend",
    "UnsafeCheckpointError",
    "TrainBatch",
    "backend_kwargs",
    "build_backend",
    "build_batch",
    "checkpoint_complete",
    "deepspeed_available",
    "warmup_steps",
    "read_checkpoint",
    "shutdown_distributed",
    "write_checkpoint",
]


def warmup_steps(cfg: TidalConfig) -> int:
    """``optim.lr_warmup_steps`` in optimizer updates; -1 = ``lr_warmup_steps_ratio`` of the run's
    updates (``total_training_steps × trigger_parameter_sync_step × ppo_epochs``; 0 when the run
    has no step budget)."""
    optim = cfg.actor_rollout_ref.actor.optim
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    total = cfg.trainer.total_training_steps
    if total is None:
        return 0
    updates = total * cfg.async_training.trigger_parameter_sync_step * cfg.actor_rollout_ref.actor.ppo_epochs
    return int(optim.lr_warmup_steps_ratio * updates)


# Backend keyword arguments that are config keys of the same name, by the section that holds them.
_SAME_NAMED_KEYS = {
    "actor_rollout_ref.actor.optim": ("lr", "weight_decay", "betas"),
    "actor_rollout_ref.actor": (
        "clip_ratio_c", "loss_agg_mode", "entropy_coeff", "grad_clip", "ppo_epochs",
        "ppo_micro_batch_size_per_gpu", "use_kl_loss", "kl_loss_coef", "kl_loss_type",
    ),
    "algorithm": ("adv_estimator", "norm_adv_by_std_in_grpo"),
    "algorithm.rollout_correction": ("rollout_is", "rollout_is_threshold"),
    "async_training": ("use_rollout_log_probs",),
}


def backend_kwargs(cfg: TidalConfig) -> dict[str, Any]:
    """The torch / DeepSpeed backend's keyword arguments from the run's config (algorithm,
    actor, device, threads, seed): everything but the model."""
    kwargs: dict[str, Any] = {}
    for path, names in _SAME_NAMED_KEYS.items():
        section = functools.reduce(getattr, path.split("."), cfg)
        kwargs.update((name, getattr(section, name)) for name in names)
    actor = cfg.actor_rollout_ref.actor
    fsdp = actor.fsdp_config
    kwargs.update(
        param_dtype=fsdp.mixed_precision.param_dtype,
        reshard_after_forward=fsdp.reshard_after_forward,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        lr_warmup_steps=warmup_steps(cfg),
        clip_ratio_low=actor.clip_low,
        clip_ratio_high=actor.clip_high,
        device=cfg.engines.device,
        threads=cfg.engines.torch_threads_per_actor,
        seed=cfg.trainer.seed,
    )
    return kwargs


def build_backend(
    cfg: TidalConfig, tokenizer: CharTokenizer | Any, problems: Sequence[Problem], *, model: Any = None
) -> TrainBackend:
    """The backend ``cfg.engines.train`` names, configured from the run's config. ``model``: a
    built HF causal LM to train (with ``tokenizer`` its HF tokenizer); None = the tiny LM."""
    kind = cfg.engines.train
    actor = cfg.actor_rollout_ref.actor
    use_rollout_log_probs = cfg.async_training.use_rollout_log_probs
    if kind == "simulated":
        s = cfg.sim
        return SimulatedBackend(
            per_token_s=1.0 / (cfg.trainer_gpus * s.train_tokens_per_gpu_s),
            fixed_s=s.train_step_overhead_s,
            use_rollout_log_probs=use_rollout_log_probs,
            use_kl_loss=actor.use_kl_loss,
            problems=problems,
            tokenizer=tokenizer,
            seed=cfg.trainer.seed,
        )
    from models.model import TinyLMConfig

    model_cfg = None if model is not None else TinyLMConfig(
        vocab_size=tokenizer.vocab_size,
        n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head,
        n_embd=cfg.model.n_embd,
        max_seq_len=cfg.model.max_seq_len,
    )
    hf_keys = getattr(cfg.actor_rollout_ref, "model", None)  # `actor_rollout_ref.model.*` (another section)
    kwargs = backend_kwargs(cfg)
    kwargs.update(
        model=model,
        gradient_checkpointing=bool(getattr(hf_keys, "enable_gradient_checkpointing", False)),
    )
    if kind == "deepspeed":
        return DeepSpeedBackend(
            model_cfg, tokenizer, problems, zero_stage=cfg.engines.deepspeed_zero_stage, **kwargs
        )
    if kind == "torch":
        return TorchBackend(model_cfg, tokenizer, problems, **kwargs)
    raise ValueError(f"unknown train backend {kind!r}; known: torch, deepspeed, simulated")
