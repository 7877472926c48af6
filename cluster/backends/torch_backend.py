"""The torch train backend: TinyLM or an HF causal LM + AdamW + the GRPO loss (``cluster.backends.grpo``),
on CPU or one CUDA device.

One ``train_step`` = rewards (``sample.scores``, else the built-in task's rule) → old log-probs
(from the rollout, or recomputed) → reference log-probs (only with a KL loss) → group advantages
and rollout IS weights → ``ppo_epochs`` updates, each accumulating gradients over micro-batches of
``ppo_micro_batch_size_per_gpu`` responses, with LR warmup and gradient clipping. Each phase is
timed under the reference's timing key.

``DeepSpeedBackend`` subclasses this class and replaces only the optimizer and the weight /
optimizer-state plumbing (the ``_`` hooks at the bottom), so both compute the same loss.
"""

from __future__ import annotations

import concurrent.futures
import copy
import math
import os
import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.backends.base import StepResult
from cluster.backends import distributed as dp
from cluster.backends.grpo import (
    ISWeights,
    agg_loss,
    compute_advantages,
    count_seqs,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
    rollout_is_weights,
)
from cluster.checkpoint_file import (
    CHECKPOINT_FORMAT,
    HF_DIRNAME,
    CheckpointError,
    CheckpointInfo,
    UnsafeCheckpointError,
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
    write_hf_folder,
)
from models.model import TinyLM, TinyLMConfig
from data.problems import Problem, reward
from data.types import Sample

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


def idle_batch(pad_id: int) -> TrainBatch:
    """The batch of a rank whose share of a micro-step is empty: one padding row with nothing on the
    mask, so the rank still runs the group's forward/backward passes with zero weight."""
    return TrainBatch(tokens=torch.full((1, 2), pad_id, dtype=torch.long), prompt_lens=torch.tensor([1]),
                      total_lens=torch.tensor([1]), mask=torch.zeros((1, 1)), rollout_logp=torch.zeros((1, 1)),
                      group_sizes=[])


def _pad_id(tokenizer: Any) -> int:
    """The padding id of a Tidal ``CharTokenizer`` (``pad_id``) or an HF tokenizer (``pad_token_id``,
    else ``eos_token_id``, else 0). Padding is masked out, so any valid id serves."""
    for attr in ("pad_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0


def warmup_factor(updates: int, warmup_steps: int) -> float:
    """LR multiplier before optimizer update number ``updates`` (0-based): linear from 0 over
    ``warmup_steps`` updates, then 1 (verl's and transformers' constant-with-warmup schedule)."""
    if warmup_steps <= 0 or updates >= warmup_steps:
        return 1.0
    return updates / warmup_steps


class TorchBackend:
    """GRPO (verl's loss keys) on TinyLM or a Hugging Face causal LM with torch's AdamW.
    Deterministic for a seed on CPU.

    ``model_cfg`` builds the tiny LM; pass ``model`` instead (an ``AutoModelForCausalLM``) to train
    an HF model, with ``tokenizer`` its HF tokenizer (saved beside each HF export)."""

    name = "torch"
    shards_with_fsdp = True
    """Whether this backend shards with FSDP2 when it is one rank of many (DeepSpeed uses ZeRO)."""

    def __init__(
        self,
        model_cfg: TinyLMConfig | None,
        tokenizer: Any,
        problems: Sequence[Problem],
        *,
        model: torch.nn.Module | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        lr_warmup_steps: int = 0,
        clip_ratio: float = 0.2,
        clip_ratio_low: float | None = None,
        clip_ratio_high: float | None = None,
        clip_ratio_c: float = 3.0,
        loss_agg_mode: str = "token-mean",
        entropy_coeff: float = 0.0,
        grad_clip: float | None = 1.0,
        ppo_epochs: int = 1,
        ppo_micro_batch_size_per_gpu: int | None = None,
        use_kl_loss: bool = False,
        kl_loss_coef: float = 0.001,
        kl_loss_type: str = "low_var_kl",
        adv_estimator: str = "grpo",
        norm_adv_by_std_in_grpo: bool = True,
        rollout_is: str | None = None,
        rollout_is_threshold: float = 2.0,
        use_rollout_log_probs: bool = True,
        gradient_checkpointing: bool = False,
        device: str | torch.device = "cpu",
        threads: int | None = 1,
        seed: int = 0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        param_dtype: str = "bf16",
        reshard_after_forward: bool = True,
        param_offload: bool = False,
        optimizer_offload: bool = True,
    ):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {ppo_epochs}")
        if ppo_micro_batch_size_per_gpu is not None and ppo_micro_batch_size_per_gpu < 1:
            raise ValueError(f"ppo_micro_batch_size_per_gpu must be >= 1, got {ppo_micro_batch_size_per_gpu}")
        if kl_loss_coef < 0:
            raise ValueError(f"kl_loss_coef must be >= 0, got {kl_loss_coef}")
        if (model_cfg is None) == (model is None):
            raise ValueError("give exactly one of model_cfg (the tiny LM) and model (an HF causal LM)")
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.pad_id = _pad_id(tokenizer)
        self._problems: dict[int, Problem] = {p.index: p for p in problems}
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, tuple(betas), eps
        self.lr_warmup_steps = max(0, lr_warmup_steps)
        self.clip_ratio_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
        self.clip_ratio_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
        self.clip_ratio_c = clip_ratio_c
        # fail at construction on a bad loss setting, not at the first step
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1),
                    clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                    clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode)
        kl_penalty(torch.zeros(1), torch.zeros(1), kl_loss_type)
        compute_advantages(adv_estimator, [])
        if rollout_is is not None:
            rollout_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                               level=rollout_is, threshold=rollout_is_threshold)
        self.loss_agg_mode = loss_agg_mode
        self.entropy_coeff = entropy_coeff
        self.grad_clip = grad_clip if grad_clip is not None and grad_clip > 0 else None
        self.ppo_epochs = ppo_epochs
        self.micro_batch = ppo_micro_batch_size_per_gpu
        self.use_kl_loss = use_kl_loss
        self.kl_loss_coef = kl_loss_coef
        self.kl_loss_type = kl_loss_type
        self.adv_estimator = adv_estimator
        self.norm_adv_by_std_in_grpo = norm_adv_by_std_in_grpo
        self.rollout_is = rollout_is
        self.rollout_is_threshold = rollout_is_threshold
        self.use_rollout_log_probs = use_rollout_log_probs
        self.device = resolve_device(device)
        self.seed = seed
        self._updates = 0
        self.rank = dp.RankInfo.current()
        self.compute_dtype = dp.param_dtype_of(param_dtype, self.device)
        self.param_offload, self.optimizer_offload = param_offload, optimizer_offload
        self._offloaded = False
        self._parked: dict[str, torch.Tensor] | None = None
        self._saver: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[CheckpointInfo] | None = None

        if model is None:
            assert model_cfg is not None
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = TinyLM(model_cfg)
            self.is_hf = False
            self.max_seq_len = model_cfg.max_seq_len
        else:
            self.is_hf = True
            self.max_seq_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
            if gradient_checkpointing:  # transformers 5 renamed it; 4.x has only the old name
                enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
                enable()
                model.config.use_cache = False
        self.model = model.to(self.device)
        self.ref_model: torch.nn.Module | None = None
        if use_kl_loss:
            self.ref_model = copy.deepcopy(self.model).eval()
            self.ref_model.requires_grad_(False)
        self._param_names = list(self.model.state_dict().keys())
        self._tied = tied_names(self.model)
        if self.rank.sharded and self.shards_with_fsdp:
            dp.shard(self.model, device=self.device, param_dtype=self.compute_dtype,
                     reshard_after_forward=reshard_after_forward)
        self._setup_optimizer()

    # -- public API ----------------------------------------------------------------------------

    @property
    def updates(self) -> int:
        return self._updates

    def train_step(self, samples: Sequence[Sample]) -> StepResult:
        """One micro-step on ``samples``; when this backend is one rank of many, on this rank's
        share, with every loss normaliser and reported metric taken over all the ranks' shares."""
        timing: dict[str, float] = {}
        if self._offloaded:  # lent and not yet taken back (the trainer reloads at the take-back)
            self.reload()
        if samples or not self.rank.sharded:
            batch = build_batch(samples, pad_id=self.pad_id, max_seq_len=self.max_seq_len)
        else:
            batch = idle_batch(self.pad_id)
        tokens, mask = batch.tokens.to(self.device), batch.mask.to(self.device)
        chunks = self._chunks(batch)

        t0 = time.perf_counter()
        rewards = self._rewards(samples)
        timing["reward"] = time.perf_counter() - t0

        rollout_logp = batch.rollout_logp.to(self.device) if batch.rollout_logp is not None else None
        if self.use_rollout_log_probs:
            if rollout_logp is None:
                raise ValueError(
                    "use_rollout_log_probs=True but a response has no log-prob per token; "
                    "the engine must return them (or set use_rollout_log_probs=False)"
                )
            old_logp = rollout_logp
        else:
            t0 = time.perf_counter()
            old_logp = self._logprobs_no_grad(self._forward_module(), tokens, chunks)
            timing["old_log_prob"] = time.perf_counter() - t0

        ref_logp = None
        if self.use_kl_loss:
            assert self.ref_model is not None
            t0 = time.perf_counter()
            ref_logp = self._logprobs_no_grad(self.ref_model, tokens, chunks)
            timing["ref"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        seq_adv = compute_advantages(
            self.adv_estimator, rewards, norm_adv_by_std_in_grpo=self.norm_adv_by_std_in_grpo
        ).to(self.device)
        if not rewards:  # an idle rank's padding row
            seq_adv = torch.zeros(tokens.shape[0], device=self.device)
        is_w: ISWeights | None = None
        if self.rollout_is is not None and rollout_logp is not None:
            is_w = rollout_is_weights(old_logp, rollout_logp, mask, level=self.rollout_is,
                                      threshold=self.rollout_is_threshold)
        timing["adv"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        for _ in range(self.ppo_epochs):
            for k, v in self._update(tokens, mask, chunks, old_logp, ref_logp, seq_adv, is_w).items():
                sums[k] = sums.get(k, 0.0) + v
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timing["update_actor"] = time.perf_counter() - t0

        flat = [r for group in rewards for r in group]
        n_resp, r_sum, r_sq, n_tokens, n_resp_tokens, n_samples = dp.all_reduce([
            len(flat), sum(flat), sum(r * r for r in flat), batch.tokens_total if rewards else 0,
            batch.response_tokens if rewards else 0, len(samples)])
        metrics = {k: v / self.ppo_epochs for k, v in sums.items()}
        reward_mean = r_sum / max(n_resp, 1.0)
        metrics.update(
            reward_mean=reward_mean,
            reward_std=math.sqrt(max(0.0, r_sq / n_resp - reward_mean**2)) if n_resp > 1 else 0.0,
            response_length_mean=n_resp_tokens / max(n_resp, 1.0),
            tokens=n_tokens,
            response_tokens=n_resp_tokens,
            samples=n_samples,
            responses=n_resp,
            updates=float(self._updates),
        )
        metrics["response_length/mean"] = metrics["response_length_mean"]
        metrics["critic/score/mean"] = reward_mean
        if is_w is not None:
            metrics.update({f"rollout_corr/{k}": v for k, v in self._is_stats(is_w, float(mask.sum())).items()})
        return StepResult(metrics=metrics, timing_s=timing)

    def _is_stats(self, is_w: ISWeights, tokens: float) -> dict[str, float]:
        """The rollout IS statistics over every rank's response tokens (this rank's alone when it is
        the only one): token-weighted means, the extreme max and min."""
        stats = is_w.stats
        if not self.rank.sharded:
            return dict(stats)
        total, mean, clip = dp.all_reduce([tokens, tokens * stats["rollout_is_mean"],
                                           tokens * stats["rollout_is_clipfrac"]])
        big = 1e300
        hi, neg_lo = dp.all_reduce([stats["rollout_is_max"] if tokens else -big,
                                    -stats["rollout_is_min"] if tokens else -big], op="max")
        if total <= 0:
            return dict(stats)
        return {"rollout_is_mean": mean / total, "rollout_is_max": hi, "rollout_is_min": -neg_lo,
                "rollout_is_clipfrac": clip / total}

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        """Detached fp32 CPU copies of the whole weights. One rank of many: every rank must call it
        (the shards are gathered); rank 0 gets the weights, the others ``{}``."""
        if self._parked is not None:  # the parameters are in host memory while lent: as they were
            return dict(self._parked)
        if self.rank.sharded and self.shards_with_fsdp:
            return dp.full_weights(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self._export_weights().items()}

    def rollout_tensors(self) -> dict[str, torch.Tensor] | None:
        """The weights a sync reads one tensor at a time, without copying them first: the live
        parameters and buffers (FSDP2 shards as ``DTensor``s: each is gathered where it is read,
        on every rank in the same order). None where no per-tensor view exists: a ZeRO group, or
        parameters parked in host memory while lent (``state_dict_for_rollout`` has the whole
        model on rank 0 then)."""
        if self._parked is not None or (self.rank.sharded and not self.shards_with_fsdp):
            return None
        return {k: v.detach() for k, v in self._export_weights().items()}

    def save_checkpoint(self, path: str | os.PathLike[str], *, export_hf: bool = True,
                        async_save: bool = False) -> CheckpointInfo:
        """Write the checkpoint of this step; for an HF model (and ``export_hf``) also its Hugging
        Face folder ``huggingface/`` beside it (gathered on rank 0 when sharded).

        One rank: the single file at ``path``. One rank of many: a DCP folder beside it (``path``
        without its suffix: ``actor/``, a shard per rank and rank 0's commit marker); the returned
        path is the marker's. ``async_save``: the state is copied to host memory now and written
        in the background; the returned ``sha256`` is empty (the marker or the atomic rename says
        when it is complete) and ``wait_checkpoint`` waits for it. A save first waits for the one
        before it."""
        self.wait_checkpoint()
        if self.is_hf and export_hf:
            self._export_hf(Path(path).parent / HF_DIRNAME)
        if self.rank.sharded and self.shards_with_fsdp:
            return self._save_sharded(Path(path).with_suffix(""), async_save=async_save)
        payload = self._checkpoint_payload()  # every rank of a ZeRO group takes part in the gather
        if self.rank.rank != 0:  # ZeRO: rank 0 writes the whole state (one file, as for one rank)
            return CheckpointInfo(str(path), "", 0)
        if not async_save:
            return write_checkpoint(payload, path)
        size = dp.tensor_bytes(_tensors(payload))
        info = CheckpointInfo(str(path), "", size)
        self._pending = self._background().submit(write_checkpoint, payload, path)
        return info

    def wait_checkpoint(self) -> CheckpointInfo | None:
        """Wait for the save in flight (if any) to be on disk; returns its info, raises its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def load_checkpoint(self, path: str | os.PathLike[str], *, expected_sha256: str | None = None) -> None:
        """Restore a checkpoint: the single file (``expected_sha256`` checked unless empty) or a
        sharded one's commit marker (its files checked against the marker). Either loads at any
        rank count: DCP reshards a sharded checkpoint, and a single file is read whole by each rank."""
        self.wait_checkpoint()
        if Path(path).name == dp.COMMIT_MARKER or Path(path).is_dir():
            self._load_sharded(Path(path))
            return
        payload = read_checkpoint(path, expected_sha256=expected_sha256 or None)
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

    def offload(self) -> dict[str, float]:
        """Make room for the hybrid replicas lent on this trainer's device: move the optimizer state
        and the gradients (and the parameters, with ``param_offload``) to host memory. Returns
        the seconds and GB of each move; nothing moves on CPU, where the state already is."""
        return self._move("cpu", offload=True)

    def reload(self) -> dict[str, float]:
        """Bring back what ``offload`` moved, before the next update."""
        return self._move(self.device, offload=False)

    def close(self) -> None:
        """Finish the save in flight and stop the saver thread."""
        try:
            self.wait_checkpoint()
        finally:
            if self._saver is not None:
                self._saver.shutdown(wait=True)
                self._saver = None

    # -- checkpoint, export and offload pieces -------------------------------------------------

    def _checkpoint_payload(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.ref_model is not None:
            extra["ref_model"] = {k: v.detach().to("cpu", copy=True) for k, v in self.ref_model.state_dict().items()}
        return {
            "format": CHECKPOINT_FORMAT,
            "backend": self.name,
            "updates": self._updates,
            "model": self.state_dict_for_rollout(),
            "optim": {
                "hparams": {"lr": self.lr, "weight_decay": self.weight_decay, "betas": list(self.betas), "eps": self.eps},
                "state": self._export_optim_state(),
            },
            "rng": rng_state(),
            "extra": extra,
        }

    def _background(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._saver is None:
            self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tidal-ckpt")
        return self._saver

    def _export_hf(self, folder: Path) -> None:
        if not self.rank.sharded:
            write_hf_folder(self.model, self.tokenizer, folder)
            return
        weights = self.state_dict_for_rollout()  # every rank gathers (FSDP2 or ZeRO); rank 0 writes
        if self.rank.rank == 0:
            write_hf_folder(_Unsharded(self.model, weights), self.tokenizer, folder)

    def _save_sharded(self, folder: Path, *, async_save: bool) -> CheckpointInfo:
        import torch.distributed.checkpoint as dcp

        if self.rank.rank == 0 and folder.exists():
            import shutil

            shutil.rmtree(folder)  # a save of this step cut off before (a resumed run redoes it)
        dp.barrier()
        folder.mkdir(parents=True, exist_ok=True)
        state = dp.sharded_state(self.model, self.optimizer)
        marker = {"format": dp.SHARDED_FORMAT, "backend": self.name, "world": self.rank.world,
                  "updates": self._updates}
        size = dp.tensor_bytes(_tensors(state))
        info = CheckpointInfo(str(folder / dp.COMMIT_MARKER), "", size)

        def finish(_: Any = None) -> CheckpointInfo:
            if self.rank.rank != 0:
                return info
            files = dp.shard_sizes(folder)
            dp.write_marker(folder, {**marker, "files": files})
            return CheckpointInfo(info.path, "", sum(files.values()))

        if not async_save:
            dcp.save(state, checkpoint_id=str(folder), process_group=dp.checkpoint_group())
            return finish()
        future = dcp.async_save(state, checkpoint_id=str(folder), process_group=dp.checkpoint_group())
        self._pending = self._background().submit(lambda: (future.result(), finish())[1])
        return info

    def _load_sharded(self, path: Path) -> None:
        folder = path if path.is_dir() else path.parent
        try:
            marker = dp.read_marker(folder)
            dp.verify_shards(folder, marker)
            dp.check_metadata(folder)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"refused to load: the checkpoint's DCP metadata holds pickled objects besides its index "
                f"(they could run code when loaded): {exc}") from None
        except FileNotFoundError:
            raise CheckpointError(f"{folder}: incomplete checkpoint (no {dp.COMMIT_MARKER}: its save was cut off)") from None
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        if marker.get("backend") not in (self.name, "torch") and self.shards_with_fsdp:
            raise CheckpointError(f"{folder}: written by the {marker.get('backend')} backend, not {self.name}")
        dp.load_sharded_state(self.model, self.optimizer, folder)
        self._updates = int(marker["updates"])

    def _move(self, device: torch.device | str, *, offload: bool) -> dict[str, float]:
        """Move optimizer state and gradients (and the parameters, with ``param_offload``) to
        ``device``; the seconds and GB of each move, by name."""
        kind = "offload" if offload else "reload"
        report: dict[str, float] = {}
        if self.device.type == "cpu" or offload == self._offloaded:
            return report
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        if offload and self.param_offload:
            # the lent hybrids load these weights next, and the group's gather runs on the device:
            # take them now (they do not change until the take-back)
            self._parked = self.state_dict_for_rollout()
        elif not offload:
            self._parked = None
        moves = [("optimizer", self.optimizer_offload, lambda: dp.move_optimizer_state(self.optimizer, device)),
                 ("grads", self.optimizer_offload, lambda: dp.move_grads(self.model.parameters(), device)),
                 ("params", self.param_offload, lambda: _move_params(self.model, device))]
        for name, wanted, move in moves:
            if not wanted:
                continue
            t0 = time.perf_counter()
            moved = move()
            sync()
            report[f"{kind}_{name}_s"] = time.perf_counter() - t0
            report[f"{kind}_{name}_gb"] = moved / 2**30
        self._offloaded = offload
        if offload and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return report

    # -- GRPO pieces ---------------------------------------------------------------------------

    def _rewards(self, samples: Sequence[Sample]) -> list[list[float]]:
        """One score per response: ``sample.scores`` when the rollout scored it, else the
        built-in task's rule."""
        out = []
        for s in samples:
            scores = getattr(s, "scores", None)
            if scores is not None:
                if len(scores) != len(s.responses):
                    raise ValueError(f"sample {s.uid}: {len(scores)} scores for {len(s.responses)} responses")
                out.append([float(x) for x in scores])
                continue
            problem = self._problems.get(s.prompt_index)
            if problem is None:
                raise ValueError(f"sample {s.uid}: no problem with index {s.prompt_index}")
            out.append([reward(problem, r.tokens, self.tokenizer) for r in s.responses])
        return out

    def _chunks(self, batch: TrainBatch) -> list[tuple[int, int, int]]:
        """(first row, end row, width) of each micro-batch; width trims the padding."""
        rows = batch.tokens.shape[0]
        size = self.micro_batch or rows
        out = []
        for lo in range(0, rows, size):
            hi = min(rows, lo + size)
            out.append((lo, hi, max(2, int(batch.total_lens[lo:hi].max()))))
        return out

    def _logits(self, module: Any, tokens: torch.Tensor) -> torch.Tensor:
        """(b, w) tokens → (b, w-1, V) fp32 logits predicting tokens[:, 1:]. An unsharded model on
        CUDA computes in ``param_dtype`` under autocast (FSDP2 casts a sharded one itself)."""
        inputs = tokens[:, :-1]  # right padding: causal attention never sees it from a real token
        autocast = self.compute_dtype is not None and not dp.is_sharded(self.model)
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            out = module(input_ids=inputs, use_cache=False).logits if self.is_hf else module(inputs)
        return out.float()

    def _passes(self, chunks: list[tuple[int, int, int]], *, trained: bool = True) -> list[tuple[int, int, int] | None]:
        """The micro-batches to run: this rank's, then ``None`` (a zero-weight pass) until every rank
        has run as many as the rank with the most. The trained model's passes pair up across the
        ranks (FSDP2 and ZeRO gather and reduce in them); the frozen reference model's do not."""
        if not (trained and self.rank.sharded):
            return list(chunks)
        return [*chunks, *([None] * (dp.agree_max(len(chunks)) - len(chunks)))]

    @torch.no_grad()
    def _logprobs_no_grad(self, module: Any, tokens: torch.Tensor, chunks: list[tuple[int, int, int]]) -> torch.Tensor:
        out = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, device=tokens.device)
        for chunk in self._passes(chunks, trained=module is not self.ref_model):
            if chunk is None:
                self._logits(module, tokens[:1, :2])
                continue
            lo, hi, w = chunk
            part = tokens[lo:hi, :w]
            out[lo:hi, : w - 1] = logprobs_from_logits(self._logits(module, part), part[:, 1:])
        return out

    def _update(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        chunks: list[tuple[int, int, int]],
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        seq_adv: torch.Tensor,
        is_w: ISWeights | None,
    ) -> dict[str, float]:
        """One optimizer update over the mini-batch, accumulating gradients micro-batch by
        micro-batch; every loss is normalised by the whole mini-batch's counts (over every rank's
        share when this is one rank of many: the ranks' losses add up to the one-rank loss)."""
        self._train_mode(True)
        n_tok, n_seq = dp.global_counts(float(mask.sum()), float(count_seqs(mask, self.loss_agg_mode)))
        agg = dict(global_tokens=n_tok, global_seqs=n_seq)
        scale = dp.loss_scale()
        stats = dict.fromkeys(("loss", "pg_loss", "kl", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy"), 0.0)
        passes = self._passes(chunks)
        for i, chunk in enumerate(passes):
            last = i == len(passes) - 1
            if chunk is None:  # this rank's share ran out: a pass that adds nothing to any gradient
                self._backward(self._logits(self._forward_module(), tokens[:1, :2]).sum() * 0.0, last=last)
                continue
            lo, hi, w = chunk
            part, m = tokens[lo:hi, :w], mask[lo:hi, : w - 1]
            share = float(m.sum()) / max(n_tok, 1.0)  # token weight of this micro-batch's means
            logits = self._logits(self._forward_module(), part)
            logp = logprobs_from_logits(logits, part[:, 1:])
            pl = policy_loss(
                logp, old_logp[lo:hi, : w - 1], seq_adv[lo:hi], m,
                clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
                clip_ratio_c=self.clip_ratio_c, loss_agg_mode=self.loss_agg_mode,
                is_weights=None if is_w is None else is_w.weights[lo:hi, : w - 1], **agg,
            )
            loss = pl.pg_loss
            if self.entropy_coeff > 0:
                entropy = entropy_from_logits(logits)
                loss = loss - self.entropy_coeff * agg_loss(entropy, m, self.loss_agg_mode, **agg)
            else:
                with torch.no_grad():
                    entropy = entropy_from_logits(logits)
            kl = torch.zeros(())
            if ref_logp is not None:
                kl = agg_loss(kl_penalty(logp, ref_logp[lo:hi, : w - 1], self.kl_loss_type), m,
                              self.loss_agg_mode, **agg)
                loss = loss + self.kl_loss_coef * kl
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite GRPO loss {float(loss)} at update {self._updates}")
            self._backward(loss * scale if scale != 1.0 else loss, last=last)
            stats["loss"] += float(loss.detach())
            stats["pg_loss"] += float(pl.pg_loss.detach())
            stats["kl"] += float(kl.detach())
            stats["pg_clipfrac"] += share * float(pl.pg_clipfrac)
            stats["pg_clipfrac_lower"] += share * float(pl.pg_clipfrac_lower)
            stats["ppo_kl"] += share * float(pl.ppo_kl)
            stats["entropy"] += share * float(masked_mean(entropy.detach(), m))
        stats = dict(zip(stats, dp.all_reduce(list(stats.values())), strict=True))
        lr = self.lr * warmup_factor(self._updates, self.lr_warmup_steps)
        for group in self._param_groups():
            group["lr"] = lr
        grad_norm = self._step()
        self._updates += 1
        out = {f"actor/{k}": v for k, v in stats.items() if k not in ("loss", "kl")}
        out.update({"actor/kl_loss": stats["kl"], "actor/grad_norm": grad_norm, "actor/lr": lr})
        # today's names (train/* in the store; the reports and benchmarks read these)
        out.update(loss=stats["loss"], pg_loss=stats["pg_loss"], kl=stats["kl"], grad_norm=grad_norm,
                   clip_frac=stats["pg_clipfrac"], approx_kl=stats["ppo_kl"])
        return out

    # -- hooks the DeepSpeed backend replaces --------------------------------------------------

    def _setup_optimizer(self) -> None:
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )

    def _forward_module(self) -> Any:
        return self.model

    def _train_mode(self, on: bool) -> None:
        self.model.train(on)

    def _backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Accumulate one micro-batch's gradients (``last``: the mini-batch's final one)."""
        loss.backward()

    def _step(self) -> float:
        """Clip, apply the accumulated gradients, clear them; returns the pre-clip grad norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return dp.full_norm(norm)

    def _param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _param_shape(self, name: str) -> torch.Size:
        return self.model.state_dict()[name].shape

    def _export_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def _import_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        if dp.is_sharded(self.model):  # each rank keeps its shard of the whole weights
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, dict(weights), options=StateDictOptions(full_state_dict=True))
            return
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
        if dp.is_sharded(self.model):
            unknown = sorted(set(state) - set(params))
            if unknown:
                raise CheckpointError(f"optimizer state for unknown parameters {unknown}")
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(params)}
                      for g in self.optimizer.param_groups]
            full = {"state": {name: {"step": st["step"].detach().to(torch.float32).cpu().clone(),
                                     **{k: st[k].detach().float() for k in _ADAM_KEYS}} for name, st in state.items()},
                    "param_groups": groups}
            set_optimizer_state_dict(self.model, self.optimizer, full, options=StateDictOptions(full_state_dict=True))
            return
        self.optimizer.state.clear()
        for name, st in state.items():
            if name not in params:
                raise CheckpointError(f"optimizer state for unknown parameter {name}")
            p = params[name]
            self.optimizer.state[p] = {
                "step": st["step"].detach().to(torch.float32).cpu().clone(),
                **{k: st[k].detach().to(p.device, p.dtype).clone() for k in _ADAM_KEYS},
            }


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that shares its tensor with an earlier one (an HF ``lm_head.weight``
    tied to the embedding) → that one's name: the state dict lists both, ``named_parameters`` the
    first only."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists (the local shard of a DTensor)."""
    if isinstance(tree, torch.Tensor):
        local = getattr(tree, "to_local", None)
        return [local() if local is not None else tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _move_params(model: torch.nn.Module, device: torch.device | str) -> int:
    moved = dp.tensor_bytes(model.parameters())
    model.to(device)
    return moved


class _Unsharded:
    """A sharded HF model seen with its gathered weights, for ``save_pretrained`` on rank 0."""

    def __init__(self, model: torch.nn.Module, weights: Mapping[str, torch.Tensor]):
        self._model, self._weights = model, dict(weights)

    def save_pretrained(self, folder: Any, **kwargs: Any) -> None:
        self._model.save_pretrained(folder, state_dict=self._weights, **kwargs)
