"""The train-backend interface (torch, DeepSpeed, simulated).

A backend is a plain object that the trainer actor drives: one ``train_step`` per micro-step on
``required_samples`` samples, ``state_dict_for_rollout`` for weight sync, checkpoints for resume.
It knows nothing of Ray, the queue or param versions (the caller owns the version).

The checkpoint file every backend writes, and its helpers, are ``cluster.checkpoint_file``'s
(torch-free to import, for the driver).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from cluster.checkpoint_file import CheckpointInfo
from data.types import Sample

TIMING_KEYS = ("reward", "old_log_prob", "ref", "adv", "update_actor")
"""The reference's training-compute timing keys a backend may report (§4.1 of the reference);
``values``/``update_critic`` never occur (no critic). ``old_log_prob`` is absent when the rollout
log-probs are used, ``ref`` is absent without a KL loss: missing keys count as 0."""


@dataclass
class StepResult:
    """What one ``train_step`` did."""

    metrics: dict[str, float]
    """At least: loss, pg_loss, reward_mean, reward_std, kl, approx_kl, grad_norm, clip_frac,
    response_length_mean, tokens (prompt + response tokens trained on), response_tokens,
    samples, responses, updates (optimizer updates so far)."""
    timing_s: dict[str, float] = field(default_factory=dict)
    """Seconds per phase, keys from ``TIMING_KEYS``; their sum is the step's training compute."""

    @property
    def compute_s(self) -> float:
        return float(sum(self.timing_s.get(k, 0.0) for k in TIMING_KEYS))


@runtime_checkable
class TrainBackend(Protocol):
    """One trainer's model, optimizer and GRPO update."""

    @property
    def updates(self) -> int:
        """Optimizer updates applied so far (restored by ``load_checkpoint``)."""
        ...

    def train_step(self, samples: Sequence[Sample]) -> StepResult: ...

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the current weights (never aliased with the live ones)."""
        ...

    def save_checkpoint(self, path: str | os.PathLike[str], *, export_hf: bool = True) -> CheckpointInfo:
        """Write the checkpoint file; an HF model also its ``huggingface/`` export unless not ``export_hf``."""
        ...

    def load_checkpoint(self, path: str | os.PathLike[str], *, expected_sha256: str | None = None) -> None: ...

    def close(self) -> None:
        """Release what the backend holds (engine buffers); it is unusable afterwards."""
        ...
