"""The torch train backend: TinyLM + AdamW + the GRPO loss, on CPU or one CUDA device.

One ``train_step`` = rewards → old log-probs (from the rollout, or recomputed) → reference
log-probs (only with a KL loss) → group advantages → ``ppo_epochs`` full-batch updates with
gradient clipping. Each phase is timed under the reference's timing key.

``DeepSpeedBackend`` subclasses this class and replaces only the optimizer and the weight /
optimizer-state plumbing (the ``_`` hooks at the bottom), so both compute the same loss.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.backends.base import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    CheckpointInfo,
    StepResult,
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from cluster.grpo import group_advantages, grpo_loss
from cluster.model import TinyLM, TinyLMConfig, sequence_logprobs
from cluster.problems import CharTokenizer, Problem, reward
from cluster.types import Sample

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class TrainBatch:
    """Every response of every sample as one right-padded batch of prompt + response sequences."""

    tokens: torch.Tensor  # (B, T) long
    prompt_lens: torch.Tensor  # (B,) long
    total_lens: torch.Tensor  # (B,) long
    mask: torch.Tensor  # (B, T-1) float: 1 on response tokens (aligned with sequence_logprobs)
    rollout_logp: torch.Tensor | None  # (B, T-1) float, 0 off the mask; None if any is missing
    group_sizes: list[int]  # responses per sample, in order

    @property
    def response_tokens(self) -> int:
        return int((self.total_lens - self.prompt_lens).sum())

    @property
    def tokens_total(self) -> int:
        return int(self.total_lens.sum())


def build_batch(samples: Sequence[Sample], *, pad_id: int, max_seq_len: int) -> TrainBatch:
    rows: list[tuple[list[int], list[int], list[float]]] = []
    group_sizes = []
    for s in samples:
        if not s.responses:
            raise ValueError(f"sample {s.uid} has no responses")
        group_sizes.append(len(s.responses))
        for r in s.responses:
            rows.append((s.prompt_tokens, r.tokens, r.logprobs))
    if not rows:
        raise ValueError("train_step needs at least one sample")
    width = max(len(p) + len(t) for p, t, _ in rows)
    if width > max_seq_len:
        raise ValueError(f"a prompt + response of {width} tokens exceeds max_seq_len={max_seq_len}")
    width = max(width, 2)
    b = len(rows)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width - 1))
    rollout = torch.zeros((b, width - 1))
    have_logprobs = True
    prompt_lens, total_lens = [], []
    for i, (prompt, resp, logprobs) in enumerate(rows):
        if not prompt:
            raise ValueError("a sample has an empty prompt")
        p, n = len(prompt), len(resp)
        tokens[i, :p] = torch.tensor(prompt, dtype=torch.long)
        if n:
            tokens[i, p : p + n] = torch.tensor(resp, dtype=torch.long)
            mask[i, p - 1 : p - 1 + n] = 1.0
            if len(logprobs) == n:
                rollout[i, p - 1 : p - 1 + n] = torch.tensor(logprobs, dtype=torch.float32)
            else:
                have_logprobs = False
        prompt_lens.append(p)
        total_lens.append(p + n)
    return TrainBatch(
        tokens=tokens,
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
        total_lens=torch.tensor(total_lens, dtype=torch.long),
        mask=mask,
        rollout_logp=rollout if have_logprobs else None,
        group_sizes=group_sizes,
    )


class TorchBackend:
    """GRPO on TinyLM with torch's AdamW. Deterministic for a seed on CPU."""

    name = "torch"

    def __init__(
        self,
        model_cfg: TinyLMConfig,
        tokenizer: CharTokenizer,
        problems: Sequence[Problem],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        clip_ratio: float = 0.2,
        grad_clip: float | None = 1.0,
        ppo_epochs: int = 1,
        use_kl_loss: bool = False,
        kl_loss_coef: float = 0.001,
        use_rollout_log_probs: bool = True,
        device: str | torch.device = "cpu",
        threads: int | None = 1,
        seed: int = 0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {ppo_epochs}")
        if clip_ratio <= 0:
            raise ValueError(f"clip_ratio must be > 0, got {clip_ratio}")
        if kl_loss_coef < 0:
            raise ValueError(f"kl_loss_coef must be >= 0, got {kl_loss_coef}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self._problems: dict[int, Problem] = {p.index: p for p in problems}
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, tuple(betas), eps
        self.clip_ratio = clip_ratio
        self.grad_clip = grad_clip if grad_clip is not None and grad_clip > 0 else None
        self.ppo_epochs = ppo_epochs
        self.use_kl_loss = use_kl_loss
        self.kl_loss_coef = kl_loss_coef
        self.use_rollout_log_probs = use_rollout_log_probs
        self.device = resolve_device(device)
        self.seed = seed
        self._updates = 0

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = TinyLM(model_cfg)
        self.model = model.to(self.device)
        self.ref_model: TinyLM | None = None
        if use_kl_loss:
            self.ref_model = copy.deepcopy(self.model).eval()
            self.ref_model.requires_grad_(False)
        self._param_names = [n for n, _ in self.model.named_parameters()]
        self._setup_optimizer()

    # -- public API ----------------------------------------------------------------------------

    @property
    def updates(self) -> int:
        return self._updates

    def train_step(self, samples: Sequence[Sample]) -> StepResult:
        timing: dict[str, float] = {}
        batch = build_batch(samples, pad_id=self.tokenizer.pad_id, max_seq_len=self.model_cfg.max_seq_len)
        tokens = batch.tokens.to(self.device)
        prompt_lens, total_lens = batch.prompt_lens.to(self.device), batch.total_lens.to(self.device)
        mask = batch.mask.to(self.device)

        t0 = time.perf_counter()
        rewards = self._rewards(samples)
        timing["reward"] = time.perf_counter() - t0

        if self.use_rollout_log_probs:
            if batch.rollout_logp is None:
                raise ValueError(
                    "use_rollout_log_probs=True but a response has no log-prob per token; "
                    "the engine must return them (or set use_rollout_log_probs=False)"
                )
            old_logp = batch.rollout_logp.to(self.device)
        else:
            t0 = time.perf_counter()
            with torch.no_grad():
                old_logp = sequence_logprobs(self._forward_module(), tokens, prompt_lens, total_lens)
            timing["old_log_prob"] = time.perf_counter() - t0

        ref_logp = None
        if self.use_kl_loss:
            assert self.ref_model is not None
            t0 = time.perf_counter()
            with torch.no_grad():
                ref_logp = sequence_logprobs(self.ref_model, tokens, prompt_lens, total_lens)
            timing["ref"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        seq_adv = self._advantages(rewards, batch.group_sizes).to(self.device)
        timing["adv"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        for _ in range(self.ppo_epochs):
            self._train_mode(True)
            new_logp = sequence_logprobs(self._forward_module(), tokens, prompt_lens, total_lens)
            loss, stats = grpo_loss(
                new_logp,
                old_logp,
                seq_adv,
                mask,
                self.clip_ratio,
                kl_coef=self.kl_loss_coef if self.use_kl_loss else 0.0,
                ref_logp=ref_logp,
            )
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite GRPO loss {float(loss)} at update {self._updates}")
            grad_norm = self._backward_and_step(loss)
            self._updates += 1
            stats = {**stats, "loss": float(loss.detach()), "grad_norm": grad_norm}
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timing["update_actor"] = time.perf_counter() - t0

        flat = torch.tensor([r for group in rewards for r in group], dtype=torch.float64)
        n_resp = len(flat)
        metrics = {k: v / self.ppo_epochs for k, v in sums.items()}
        metrics.update(
            reward_mean=float(flat.mean()),
            reward_std=float(flat.std(unbiased=False)) if n_resp > 1 else 0.0,
            response_length_mean=batch.response_tokens / n_resp,
            tokens=float(batch.tokens_total),
            response_tokens=float(batch.response_tokens),
            samples=float(len(samples)),
            responses=float(n_resp),
            updates=float(self._updates),
        )
        return StepResult(metrics=metrics, timing_s=timing)

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self._export_weights().items()}

    def save_checkpoint(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        extra: dict[str, Any] = {}
        if self.ref_model is not None:
            extra["ref_model"] = {k: v.detach().to("cpu", copy=True) for k, v in self.ref_model.state_dict().items()}
        payload = {
            "format": CHECKPOINT_FORMAT,
            "backend": self.name,
            "updates": self._updates,
            "model": self.state_dict_for_rollout(),
            "optim": {
                "hparams": {
                    "lr": self.lr,
                    "weight_decay": self.weight_decay,
                    "betas": list(self.betas),
                    "eps": self.eps,
                },
                "state": self._export_optim_state(),
            },
            "rng": rng_state(),
            "extra": extra,
        }
        return write_checkpoint(payload, path)

    def load_checkpoint(self, path: str | os.PathLike[str], *, expected_sha256: str | None = None) -> None:
        payload = read_checkpoint(path, expected_sha256=expected_sha256)
        model = payload["model"]
        want = set(self._param_names)
        if set(model) != want:
            missing, unexpected = sorted(want - set(model)), sorted(set(model) - want)
            raise CheckpointError(
                f"{path}: weights do not match the model (missing {missing}, unexpected {unexpected})"
            )
        for name, tensor in model.items():
            shape = tuple(self._param_shape(name))
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, model has {shape}")
        self._import_weights(model)
        self._import_optim_state(payload["optim"]["state"])
        ref = payload.get("extra", {}).get("ref_model")
        if self.ref_model is not None and ref is not None:
            self.ref_model.load_state_dict(ref)
        self._updates = int(payload["updates"])
        set_rng_state(payload.get("rng", {}))

    def close(self) -> None:
        """Nothing to release (kept for symmetry with the DeepSpeed backend)."""

    # -- GRPO pieces ---------------------------------------------------------------------------

    def _rewards(self, samples: Sequence[Sample]) -> list[list[float]]:
        out = []
        for s in samples:
            problem = self._problems.get(s.prompt_index)
            if problem is None:
                raise ValueError(f"sample {s.uid}: no problem with index {s.prompt_index}")
            out.append([reward(problem, r.tokens, self.tokenizer) for r in s.responses])
        return out

    @staticmethod
    def _advantages(rewards: list[list[float]], group_sizes: list[int]) -> torch.Tensor:
        if len(set(group_sizes)) == 1:
            return group_advantages(torch.tensor(rewards, dtype=torch.float32)).reshape(-1)
        return torch.cat([group_advantages(torch.tensor([g], dtype=torch.float32))[0] for g in rewards])

    # -- hooks the DeepSpeed backend replaces --------------------------------------------------

    def _setup_optimizer(self) -> None:
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )

    def _forward_module(self) -> Any:
        return self.model

    def _train_mode(self, on: bool) -> None:
        self.model.train(on)

    def _backward_and_step(self, loss: torch.Tensor) -> float:
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _param_shape(self, name: str) -> torch.Size:
        return dict(self.model.named_parameters())[name].shape

    def _export_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def _import_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(weights))

    def _export_optim_state(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, p in self.model.named_parameters():
            st = self.optimizer.state.get(p)
            if st:
                out[name] = {k: st[k].detach().to("cpu", copy=True) for k in ("step", *_ADAM_KEYS)}
        return out

    def _import_optim_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        self.optimizer.state.clear()
        for name, st in state.items():
            if name not in params:
                raise CheckpointError(f"optimizer state for unknown parameter {name}")
            p = params[name]
            self.optimizer.state[p] = {
                "step": st["step"].detach().to(torch.float32).cpu().clone(),
                **{k: st[k].detach().to(p.device, p.dtype).clone() for k in _ADAM_KEYS},
            }
