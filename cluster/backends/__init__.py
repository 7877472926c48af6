"""Train backends: torch (AdamW + GRPO), DeepSpeed ZeRO (optional extra) and the simulated twin.

Owns: the GRPO update on a batch of samples, phase timing under the reference's keys, weights
for rollout sync, and the checkpoint file. Must not: import Ray, talk to the queue or the store,
or own the param version (the trainer actor that wraps a backend does all that).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cluster.backends.base import (
    CHECKPOINT_FORMAT,
    TIMING_KEYS,
    CheckpointError,
    CheckpointInfo,
    StepResult,
    TrainBackend,
    UnsafeCheckpointError,
    read_checkpoint,
    write_checkpoint,
)
from cluster.backends.deepspeed_backend import DeepSpeedBackend, deepspeed_available, shutdown_distributed
from cluster.backends.simulated import SimulatedBackend
from cluster.backends.torch_backend import TorchBackend, TrainBatch, build_batch

if TYPE_CHECKING:
    from config import TidalConfig

    from cluster.problems import CharTokenizer, Problem

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
    "build_backend",
    "build_batch",
    "deepspeed_available",
    "read_checkpoint",
    "shutdown_distributed",
    "write_checkpoint",
]


def build_backend(cfg: TidalConfig, tokenizer: CharTokenizer, problems: Sequence[Problem]) -> TrainBackend:
    """The backend ``cfg.engines.train`` names, configured from the run's config."""
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
    from cluster.model import TinyLMConfig

    model_cfg = TinyLMConfig(
        vocab_size=tokenizer.vocab_size,
        n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head,
        n_embd=cfg.model.n_embd,
        max_seq_len=cfg.model.max_seq_len,
    )
    kwargs = dict(
        lr=actor.lr,
        weight_decay=actor.weight_decay,
        clip_ratio=actor.clip_ratio,
        grad_clip=actor.grad_clip,
        ppo_epochs=actor.ppo_epochs,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        use_rollout_log_probs=use_rollout_log_probs,
        device=cfg.engines.device,
        threads=cfg.engines.torch_threads_per_actor,
        seed=cfg.trainer.seed,
    )
    if kind == "deepspeed":
        return DeepSpeedBackend(
            model_cfg, tokenizer, problems, zero_stage=cfg.engines.deepspeed_zero_stage, **kwargs
        )
    if kind == "torch":
        return TorchBackend(model_cfg, tokenizer, problems, **kwargs)
    raise ValueError(f"unknown train backend {kind!r}; known: torch, deepspeed, simulated")
