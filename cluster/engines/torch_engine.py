"""The torch rollout engine: continuous batching of ``TinyLM`` on a preallocated KV cache.

Top-down: the engine (the ``RolloutEngine`` contract) → its scheduler loop → one compute step →
sampling. One request = one ``_Sequence``; the cache has ``max_batch`` slots and each running
sequence owns one.

Scheduler. A background asyncio task repeats: drop finished sequences and free their slots →
admit waiting requests into free slots → run one *step* → append each sequence's new token and
finish those that hit EOS (``stop``, EOS included in the tokens) or their budget (``length``).
A step prefills the newly admitted prompts one by one (each samples its first token) and runs
one batched ``decode`` over the sequences that were already running, so every running sequence
gains exactly one token per step and new requests join between steps.

Threading. Every touch of the weights or the cache (steps, ``load_weights``, ``sleep``,
``wake_up``) is a job on one dedicated worker thread per engine, awaited from the event loop
with ``run_in_executor``. Jobs never overlap (one worker, FIFO), and the event loop stays free
between and during steps, so ``abort``/``pause``/``sleep`` calls are served within one step.
``abort`` resolves the request at once with the tokens appended so far; a token the in-flight
step produces for it afterwards is dropped.

Log-probs. Each token's log-prob is ``log_softmax(logits)`` of the *untempered*, untruncated
model distribution (temperature 1, no top-p) at the sampled token: what GRPO's importance ratio
compares against the trainer's recomputed log-probs. Temperature and top-p only change which
token is drawn.

Budget clamping. A sequence never outgrows the position table: the budget of a request is
``min(max_new_tokens, max_seq_len - len(prompt))``; a response stopped by that clamp finishes
with ``length``. A prompt longer than ``max_seq_len`` is refused with ``ValueError``.

Param version. A result carries the weights version its *first* token was generated with; if
``load_weights`` lands while a request is running, its later tokens come from the new weights
but the result still reports the older version (the conservative choice for staleness).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.model import KVCache, TinyLM, TinyLMConfig
from cluster.engines.base import EngineState
from cluster.types import FinishReason, GenerationRequest, GenerationResult


class TorchEngine(EngineState):
    """One replica's torch engine: ``TinyLM`` weights + a ``max_batch``-slot KV cache.

    The engine starts awake with memory allocated but *no weights*: ``load_weights`` must run
    before the first ``generate`` (and again after every ``wake_up``); generating without
    weights raises ``RuntimeError``. ``threads`` sets ``torch.set_num_threads`` (process-wide:
    one emulated GPU = one core); ``None`` leaves torch's setting alone.
    """

    def __init__(
        self,
        model_cfg: TinyLMConfig,
        *,
        max_batch: int,
        device: str | torch.device = "cpu",
        threads: int | None = 1,
        eos_id: int,
        seed: int = 0,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not 0 <= eos_id < model_cfg.vocab_size:
            raise ValueError(f"eos_id={eos_id} is outside the vocabulary of {model_cfg.vocab_size}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.cfg = model_cfg
        self.max_batch = max_batch
        self.device = torch.device(device)
        self.eos_id = eos_id
        self._generator = torch.Generator().manual_seed(seed)  # draws for unseeded requests
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        # The module stays for the engine's life; sleep swaps its tensors for empty ones.
        self._model = TinyLM(model_cfg).to(self.device).eval().requires_grad_(False)
        self._shapes = {name: t.shape for name, t in self._model.state_dict().items()}
        self._cache: KVCache | None = KVCache(model_cfg, max_batch, device=self.device)
        self._weights_loaded = False
        self._version = 0
        self._sleeping = False
        self._paused = False
        self._closed = False
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # slot → sequence
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._work: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None
        self._stats = {
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "finished_requests": 0,
            "aborted_requests": 0,
            "decode_steps": 0,
            "busy_s": 0.0,
        }

    # ---------------------------------------------------------------- state

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self._cache is None else self._cache.nbytes

    @property
    def weight_bytes(self) -> int:
        return sum(t.element_size() * t.numel() for t in self._model.state_dict().values())

    def stats(self) -> dict[str, float]:
        """Counters since construction, plus the current queue depths and memory."""
        return {
            **self._stats,
            "running_requests": len(self._running),
            "waiting_requests": len(self._waiting),
            "kv_cache_bytes": self.kv_cache_bytes,
            "weight_bytes": self.weight_bytes,
        }

    # ---------------------------------------------------------------- requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one response; returns when it stops, hits its budget or is aborted."""
        self._check_ready()
        if self._paused:
            return self._result(request, [], [], "abort", self._version, 0)
        budget = self._budget(request)
        if budget == 0:
            return self._result(request, [], [], "length", self._version, 0)
        seed = request.sampling.seed
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        seq = _Sequence(request, budget, asyncio.get_running_loop().create_future(), generator)
        self._ensure_scheduler()
        self._waiting.append(seq)
        self._work.set()
        return await seq.future

    # ---------------------------------------------------------------- memory and weights

    async def sleep(self) -> None:
        """Abort everything in flight, then free the KV cache and the weights."""
        if self._sleeping:
            return
        self._sleeping = True
        self._abort_where(lambda seq: True)
        await self._on_worker(self._release)

    async def wake_up(self) -> None:
        """Reallocate the KV cache and the weights; ``load_weights`` must follow."""
        if not self._sleeping:
            return
        await self._on_worker(self._allocate)
        self._sleeping = False

    async def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Copy a ``TinyLM`` state dict (any device/dtype) into the engine's weights.

        In-process callers (a hybrid replica inside the trainer) pass ``model.state_dict()``
        directly: the tensors are copied, never shared. A state dict with other names or shapes
        raises ``ValueError`` and leaves the current weights untouched.
        """
        if self._sleeping or self._closed:
            raise RuntimeError("engine is asleep: call wake_up() before load_weights()")
        await self._on_worker(self._copy_weights, state, version)

    async def shutdown(self) -> None:
        """Abort everything, stop the scheduler, free memory and the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._abort_where(lambda seq: True)
        if self._scheduler is not None and self._scheduler.get_loop() is asyncio.get_running_loop():
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError:
                pass
        await self._on_worker(self._release)
        self._worker.shutdown(wait=False)

    # ---------------------------------------------------------------- scheduler (event loop)

    def _ensure_scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._scheduler is not None and not self._scheduler.done() and self._scheduler.get_loop() is loop:
            return
        if self._scheduler is not None and self._scheduler.get_loop() is not loop:
            # Requests of an earlier event loop can never be answered: forget them.
            self._waiting.clear()
            self._running.clear()
            self._free_slots = list(range(self.max_batch - 1, -1, -1))
        self._work = asyncio.Event()
        self._scheduler = loop.create_task(self._schedule(), name="torch-engine-scheduler")

    async def _schedule(self) -> None:
        while True:
            self._drop_finished()
            admitted = self._admit()
            decoding = [seq for seq in self._running.values() if seq not in admitted]
            if not admitted and not decoding:
                self._work.clear()
                await self._work.wait()
                continue
            started = time.perf_counter()
            try:
                tokens, logprobs, version = await self._on_worker(self._step, admitted, decoding)
            except Exception as exc:  # a failed step fails its requests, not the engine
                for seq in admitted + decoding:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
                continue
            finally:
                self._stats["busy_s"] += time.perf_counter() - started
            self._stats["decode_steps"] += bool(decoding)
            for seq, token, logprob in zip(admitted + decoding, tokens, logprobs):
                self._append(seq, token, logprob, version)

    def _drop_finished(self) -> None:
        self._waiting = deque(seq for seq in self._waiting if not seq.future.done())
        for slot, seq in list(self._running.items()):
            if seq.future.done():
                del self._running[slot]
                self._free_slots.append(slot)

    def _admit(self) -> list[_Sequence]:
        admitted = []
        while self._waiting and self._free_slots:
            seq = self._waiting.popleft()
            seq.slot = self._free_slots.pop()
            seq.prefilled = len(seq.request.prompt_tokens)
            self._running[seq.slot] = seq
            self._stats["prefill_tokens"] += seq.prefilled
            admitted.append(seq)
        return admitted

    def _append(self, seq: _Sequence, token: int, logprob: float, version: int) -> None:
        if seq.future.done():  # aborted while the step ran: its token is dropped
            return
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        if seq.version is None:
            seq.version = version
        self._stats["generated_tokens"] += 1
        if token == self.eos_id and not seq.request.sampling.ignore_eos:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.budget:
            self._finish(seq, "length")

    def _abort_where(self, match: Callable[[_Sequence], bool]) -> int:
        hits = [seq for seq in (*self._waiting, *self._running.values()) if not seq.future.done() and match(seq)]
        for seq in hits:
            self._finish(seq, "abort")
        return len(hits)

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        version = self._version if seq.version is None else seq.version
        seq.future.set_result(self._result(seq.request, seq.tokens, seq.logprobs, reason, version, seq.prefilled))
        self._stats["aborted_requests" if reason == "abort" else "finished_requests"] += 1

    @staticmethod
    def _result(request, tokens, logprobs, reason, version, prefilled) -> GenerationResult:
        return GenerationResult(request.request_id, list(tokens), list(logprobs), reason, version, prefilled)

    def _check_ready(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._sleeping:
            raise RuntimeError("engine is asleep: call wake_up() and load_weights() first")
        if not self._weights_loaded:
            raise RuntimeError("no weights loaded: call load_weights() first")

    def _budget(self, request: GenerationRequest) -> int:
        prompt, spec = request.prompt_tokens, request.sampling
        if not prompt:
            raise ValueError(f"{request.request_id}: empty prompt")
        if len(prompt) > self.cfg.max_seq_len:
            raise ValueError(
                f"{request.request_id}: prompt of {len(prompt)} tokens exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            raise ValueError(f"{request.request_id}: token id outside the vocabulary of {self.cfg.vocab_size}")
        if spec.max_new_tokens < 0 or spec.temperature < 0 or not 0 < spec.top_p <= 1:
            raise ValueError(f"{request.request_id}: bad sampling {spec}")
        return min(spec.max_new_tokens, self.cfg.max_seq_len - len(prompt))

    async def _on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # ---------------------------------------------------------------- compute (worker thread)

    @torch.inference_mode()  # ~25 % less per-op overhead than no_grad on this small model
    def _step(self, admitted: list[_Sequence], decoding: list[_Sequence]) -> tuple[list[int], list[float], int]:
        """Prefill ``admitted`` one by one, decode ``decoding`` as one batch, sample all."""
        model, cache, device = self._model, self._cache, self.device
        if cache is None or not self._weights_loaded:
            raise RuntimeError("engine has no weights or cache")
        rows = []
        for seq in admitted:
            prompt = torch.tensor([seq.request.prompt_tokens], device=device)  # (1, T)
            rows.append(model.prefill(prompt, cache, seq.slot)[None])  # (1, V)
        if decoding:
            last = torch.tensor([seq.tokens[-1] for seq in decoding], device=device)  # (B,)
            slots = torch.tensor([seq.slot for seq in decoding], device=device)  # (B,)
            # The prompt fills positions 0..P-1; generated token i sits at position P + i.
            positions = [len(seq.request.prompt_tokens) + len(seq.tokens) - 1 for seq in decoding]
            positions = torch.tensor(positions, device=device)  # (B,)
            rows.append(model.decode(last, cache, slots, positions))  # (B, V)
        seqs = admitted + decoding
        logits = torch.cat(rows)  # (N, V)
        temperature = torch.tensor([seq.request.sampling.temperature for seq in seqs], device=device)
        top_p = torch.tensor([seq.request.sampling.top_p for seq in seqs], device=device)
        uniforms = self._uniforms(seqs).to(device)
        tokens, logprobs = sample_tokens(logits, temperature, top_p, uniforms)
        return tokens.tolist(), logprobs.tolist(), self._version

    def _uniforms(self, seqs: list[_Sequence]) -> torch.Tensor:
        """One U[0, 1) draw per sampled row: from the request's own generator when seeded."""
        out = torch.zeros(len(seqs))
        shared = [i for i, seq in enumerate(seqs) if seq.generator is None and seq.request.sampling.temperature > 0]
        if shared:
            out[shared] = torch.rand(len(shared), generator=self._generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None and seq.request.sampling.temperature > 0:
                out[i] = torch.rand((), generator=seq.generator)
        return out

    def _module_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [*self._model.named_parameters(), *self._model.named_buffers()]

    def _allocate(self) -> None:
        # Uninitialised weight memory: load_weights fills it before any use.
        for name, tensor in self._module_tensors():
            tensor.data = torch.empty(self._shapes[name], dtype=tensor.dtype, device=self.device)
        self._cache = KVCache(self.cfg, self.max_batch, device=self.device)
        self._weights_loaded = False

    def _release(self) -> None:
        for _, tensor in self._module_tensors():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=self.device)
        self._cache = None
        self._weights_loaded = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _copy_weights(self, state: Mapping[str, Any], version: int) -> None:
        if self._cache is None:
            raise RuntimeError("engine is asleep: call wake_up() before load_weights()")
        missing, unexpected = self._shapes.keys() - state.keys(), state.keys() - self._shapes.keys()
        if missing or unexpected:
            raise ValueError(f"state dict does not match TinyLM: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        for name, shape in self._shapes.items():
            if tuple(state[name].shape) != tuple(shape):
                raise ValueError(f"state dict {name!r} has shape {tuple(state[name].shape)}, expected {tuple(shape)}")
        target = self._model.state_dict()
        with torch.no_grad():
            for name, tensor in target.items():
                tensor.copy_(state[name])
        self._version = version
        self._weights_loaded = True


@dataclass(eq=False)
class _Sequence:
    """One request in the engine: waiting (slot -1) or running in a cache slot."""

    request: GenerationRequest
    budget: int
    """Tokens this call may generate (``max_new_tokens`` clamped to the free positions)."""
    future: asyncio.Future
    generator: torch.Generator | None
    slot: int = -1
    prefilled: int = 0
    version: int | None = None
    """Weights version of the first generated token."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@torch.no_grad()
def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return (tokens (N,), untempered log-probs (N,)).

    logits: (N, V); temperature, top_p, uniforms: (N,). Row n is greedy (argmax) when
    ``temperature[n] == 0``; otherwise it is an inverse-CDF draw with ``uniforms[n]`` from
    ``softmax(logits[n] / temperature[n])`` restricted to its top-p nucleus (the smallest set of
    most likely tokens whose mass reaches ``top_p``). Fully batched: per-request randomness lives
    only in ``uniforms``, so each row's draw is independent of the batch it shares.
    """
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    probs, order = scaled.softmax(dim=-1).sort(dim=-1, descending=True)  # (N, V)
    mass_before = probs.cumsum(dim=-1) - probs  # (N, V); the first entry always has 0 < top_p
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    probs = probs.masked_fill(outside, 0.0)
    cdf = probs.cumsum(dim=-1)  # (N, V), non-decreasing
    pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)  # (N, 1)
    pick = torch.minimum(pick, (probs > 0).sum(dim=-1, keepdim=True) - 1)  # never a zero-mass token
    tokens = torch.where(greedy, logits.argmax(dim=-1), order.gather(-1, pick)[:, 0])  # (N,)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]  # (N,)
    return tokens, logprobs
