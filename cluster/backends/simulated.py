"""The simulated train backend: spends time by the cost model instead of computing.

``train_step`` sleeps ``fixed_s + per_token_s × tokens`` (tokens = prompt + response tokens of
every response, the same count the real backends train on), split across the reference's timing
keys by ``phase_fractions``, and returns plausible, deterministic metrics. It lets the real actors,
queue, controller and flows run with many emulated GPUs on a couple of cores.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from cluster.backends import distributed as dp
from cluster.backends.base import TIMING_KEYS, StepResult
from cluster.checkpoint_file import CHECKPOINT_FORMAT, CheckpointError, CheckpointInfo, read_checkpoint, write_checkpoint
from data.problems import CharTokenizer, Problem, reward
from data.types import Sample

DEFAULT_PHASE_FRACTIONS: dict[str, float] = {
    "reward": 0.05,
    "old_log_prob": 0.2,
    "ref": 0.2,
    "adv": 0.01,
    "update_actor": 0.54,
}
"""Relative weights of the phases; phases that do not run (``old_log_prob`` with rollout
log-probs, ``ref`` without KL) are dropped and the rest renormalised to sum to 1."""


class SimulatedBackend:
    """Cost-model twin of a train backend (no model, no optimizer)."""

    name = "simulated"
    device = torch.device("cpu")
    """Where its fake state lives (a rank's weight-sync group is gloo from it)."""
    replicated_state = True
    """In a group every rank holds the whole (tiny) state: any one rank answers a read of the
    weights without a collective (``trainer_rank.RankGroup`` calls only the ranks it needs)."""

    def __init__(
        self,
        *,
        per_token_s: float,
        fixed_s: float = 0.0,
        phase_fractions: Mapping[str, float] | None = None,
        use_rollout_log_probs: bool = True,
        use_kl_loss: bool = False,
        problems: Sequence[Problem] | None = None,
        tokenizer: CharTokenizer | None = None,
        state_numel: int = 16,
        seed: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if per_token_s < 0 or fixed_s < 0:
            raise ValueError(f"per_token_s and fixed_s must be >= 0, got {per_token_s}, {fixed_s}")
        fractions = dict(DEFAULT_PHASE_FRACTIONS if phase_fractions is None else phase_fractions)
        unknown = sorted(set(fractions) - set(TIMING_KEYS))
        if unknown:
            raise ValueError(f"unknown timing keys {unknown}; known: {', '.join(TIMING_KEYS)}")
        if any(v < 0 for v in fractions.values()):
            raise ValueError("phase fractions must be >= 0")
        if use_rollout_log_probs:
            fractions.pop("old_log_prob", None)
        if not use_kl_loss:
            fractions.pop("ref", None)
        total = sum(fractions.values())
        if total <= 0:
            raise ValueError("the phase fractions of the phases that run must sum to > 0")
        self.phase_fractions = {k: v / total for k, v in fractions.items()}
        self.per_token_s, self.fixed_s = per_token_s, fixed_s
        self.use_kl_loss = use_kl_loss
        self.seed = seed
        self._problems = {p.index: p for p in problems} if problems is not None else None
        self._tokenizer = tokenizer or (CharTokenizer() if problems is not None else None)
        self._sleep = sleep
        self._updates = 0
        self._state_numel = state_numel

    @property
    def updates(self) -> int:
        return self._updates

    @staticmethod
    def tokens_of(samples: Sequence[Sample]) -> int:
        return sum((len(s.prompt_tokens) + len(r.tokens)) for s in samples for r in s.responses)

    def cost_s(self, samples: Sequence[Sample]) -> float:
        """Seconds one ``train_step`` on ``samples`` is meant to take."""
        return self.fixed_s + self.per_token_s * self.tokens_of(samples)

    def train_step(self, samples: Sequence[Sample]) -> StepResult:
        """One update on ``samples``. As one rank of a trainer's group (``distributed.RankInfo``)
        they are this rank's share: the counts are summed over the group first (one all-reduce,
        as a real backend's token-mean normalisers are), so every rank spends the whole
        micro-step's cost (``per_token_s`` is the whole trainer's) and reports the group's metrics."""
        group = dp.RankInfo.current().sharded
        if not samples and not group:
            raise ValueError("train_step needs at least one sample")
        rewards = [self._reward(s, i) for s in samples for i in range(len(s.responses))]
        response_tokens = sum(len(r.tokens) for s in samples for r in s.responses)
        counts = [self.tokens_of(samples), response_tokens, len(samples), len(rewards), sum(rewards),
                  sum(r * r for r in rewards)]
        tokens, response_tokens, n_samples, n, reward_sum, reward_sq = dp.all_reduce(counts) if group else counts
        if not n_samples:
            raise ValueError("train_step needs at least one sample")
        cost = self.fixed_s + self.per_token_s * tokens
        timing = {}
        for key in TIMING_KEYS:  # in the order a real step runs them
            if key in self.phase_fractions:
                t0 = time.perf_counter()
                self._sleep(cost * self.phase_fractions[key])
                timing[key] = time.perf_counter() - t0
        self._updates += 1

        n = max(1.0, n)
        mean = reward_sum / n
        std = math.sqrt(max(0.0, reward_sq / n - mean * mean))
        decay = 1.0 / (1.0 + 0.05 * self._updates)
        metrics = {
            "loss": 0.1 * decay,
            "pg_loss": 0.1 * decay,
            "kl": 0.01 * (1.0 - decay) if self.use_kl_loss else 0.0,
            "approx_kl": 0.001,
            "grad_norm": 1.0 * decay,
            "clip_frac": 0.05 * decay,
            "ratio_mean": 1.0,
            "reward_mean": mean,
            "reward_std": std,
            "response_length_mean": response_tokens / n,
            "tokens": float(tokens),
            "response_tokens": float(response_tokens),
            "samples": float(n_samples),
            "responses": float(n),
            "updates": float(self._updates),
        }
        return StepResult(metrics=metrics, timing_s=timing)

    def close(self) -> None:
        """Nothing to release."""

    def _reward(self, sample: Sample, i: int) -> float:
        tokens = sample.responses[i].tokens
        if self._problems is not None and sample.prompt_index in self._problems:
            assert self._tokenizer is not None
            return reward(self._problems[sample.prompt_index], tokens, self._tokenizer)
        digest = hashlib.sha256(f"{self.seed}:{sample.uid}:{i}:{tokens}".encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        """A tiny fake state: one vector filled with the update count (so syncs are checkable)."""
        return {"weight": torch.full((self._state_numel,), float(self._updates))}

    def save_checkpoint(self, path: str | os.PathLike[str], *, export_hf: bool = True,
                        async_save: bool = False) -> CheckpointInfo:
        """The tiny state in the shared file format, written at once (``async_save`` changes nothing:
        there is nothing worth moving off the step's path). In a group every rank holds the same
        state: rank 0 writes it, the others only name the file."""
        if dp.RankInfo.current().rank > 0:
            return CheckpointInfo(str(path), "", 0)
        payload = {
            "format": CHECKPOINT_FORMAT,
            "backend": self.name,
            "updates": self._updates,
            "model": self.state_dict_for_rollout(),
            "optim": {"hparams": {}, "state": {}},
            "rng": {},
            "extra": {},
        }
        return write_checkpoint(payload, path)

    def load_checkpoint(self, path: str | os.PathLike[str], *, expected_sha256: str | None = None) -> None:
        payload = read_checkpoint(path, expected_sha256=expected_sha256 or None)
        if payload.get("backend") != self.name:
            raise CheckpointError(f"{path}: written by the {payload.get('backend')!r} backend, not the simulated one")
        self._updates = int(payload["updates"])
