"""The torch rollout engine: ``TinyLM`` on a preallocated KV cache, batched by ``batching.Batcher``.

Owns the model, the cache (one slot per running sequence), sampling and the worker thread that
runs every touch of them; one iteration = prefill the admitted prompts one by one, then one batched
decode over the sequences already running. It keeps no request lists: admission, finish, abort
and version stamping are the core's. The full description is in ``docs/engines.md``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from cluster.model import KVCache, TinyLM, TinyLMConfig
from cluster.engines.base import EngineState, check_request, check_state_dict
from cluster.engines.batching import Batcher, SequenceState, StepOutput
from cluster.types import GenerationRequest, GenerationResult


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
        self._batch = Batcher(max_batch=max_batch, eos_id=eos_id, step=self._iterate,
                              version=lambda: self._version, name="torch-engine")
        self._stats = {"decode_steps": 0, "busy_s": 0.0}

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
            **self._batch.counters,
            **self._stats,
            "running_requests": self._batch.running,
            "waiting_requests": self._batch.waiting,
            "kv_cache_bytes": self.kv_cache_bytes,
            "weight_bytes": self.weight_bytes,
        }

    # ---------------------------------------------------------------- requests

    def _budget(self, request: GenerationRequest) -> int:
        return check_request(request, max_seq_len=self.cfg.max_seq_len, vocab_size=self.cfg.vocab_size)

    async def _generate(self, request: GenerationRequest, budget: int) -> GenerationResult:
        seed = request.sampling.seed
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return await self._batch.submit(request, budget, generator)

    def _abort_where(self, match: Callable[[SequenceState], bool]) -> int:
        return self._batch.abort_where(match)

    # ---------------------------------------------------------------- memory and weights

    async def sleep(self) -> None:
        """Abort everything in flight, then free the KV cache and the weights."""
        if self._sleeping:
            return
        self._sleeping = True
        self._batch.abort_where(lambda seq: True)
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
        self._check_awake()
        await self._on_worker(self._copy_weights, state, version)

    async def shutdown(self) -> None:
        """Abort everything, stop the scheduler, free memory and the worker thread."""
        if self._closed:
            return
        self._closed = True
        await self._batch.close()
        await self._on_worker(self._release)
        self._worker.shutdown(wait=False)

    # ---------------------------------------------------------------- one iteration (event loop)

    async def _iterate(self, admitted: list[SequenceState], decoding: list[SequenceState], after_idle: bool) -> StepOutput:
        started = time.perf_counter()
        try:
            out = await self._on_worker(self._step, admitted, decoding)
        finally:
            self._stats["busy_s"] += time.perf_counter() - started
        self._stats["decode_steps"] += bool(decoding)
        return out

    async def _on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # ---------------------------------------------------------------- compute (worker thread)

    @torch.inference_mode()  # ~25 % less per-op overhead than no_grad on this small model
    def _step(self, admitted: list[SequenceState], decoding: list[SequenceState]) -> StepOutput:
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

    def _uniforms(self, seqs: list[SequenceState]) -> torch.Tensor:
        """One U[0, 1) draw per sampled row: from the request's own generator (``seq.extra``) when seeded."""
        out = torch.zeros(len(seqs))
        shared = [i for i, seq in enumerate(seqs) if seq.extra is None and seq.request.sampling.temperature > 0]
        if shared:
            out[shared] = torch.rand(len(shared), generator=self._generator)
        for i, seq in enumerate(seqs):
            if seq.extra is not None and seq.request.sampling.temperature > 0:
                out[i] = torch.rand((), generator=seq.extra)
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
        check_state_dict(state, self._shapes)
        target = self._model.state_dict()
        with torch.no_grad():
            for name, tensor in target.items():
                tensor.copy_(state[name])
        self._version = version
        self._weights_loaded = True


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
