"""The torch rollout engine: a model runner on a KV cache, batched by ``batching.Batcher``.

Owns sampling, the worker thread that runs every touch of the model, and the sleep / wake /
weight-load sequence. The model and its cache sit behind a ``ModelRunner``: ``TinyRunner``
(``TinyLM`` on a preallocated slot cache, here) or ``hf_runner.HFRunner`` (any Hugging Face
causal LM, one forward per iteration over an in-place KV buffer cache). One iteration = the runner's logits for the admitted
prompts (prefilled) and the running sequences (one decode), then one batched sampling. It keeps
no request lists: admission, finish, abort and version stamping are the core's. The full
description is in ``docs/engines.md``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from cluster import weight_sync as ws
from models.model import KVCache, TinyLM, TinyLMConfig
from cluster.engines.base import EngineState, check_request, check_state_dict
from cluster.engines.batching import Batcher, SequenceState, StepOutput
from data.types import GenerationRequest, GenerationResult


class ModelRunner(Protocol):
    """A model and its KV cache, driven by ``TorchEngine`` from its worker thread only."""

    name: str
    vocab_size: int
    max_seq_len: int | None
    shapes: Mapping[str, Sequence[int]]
    """Names and shapes of the state dict ``load`` accepts."""

    @property
    def cache_bytes(self) -> int: ...

    @property
    def weight_bytes(self) -> int: ...

    def logits(self, admitted: list[SequenceState], decoding: list[SequenceState]) -> torch.Tensor:
        """(len(admitted) + len(decoding), V): next-token logits, admitted (prefilled) first."""
        ...

    def load(self, state: Mapping[str, Any]) -> None:
        """Copy a checked state dict into the weights (memory must be allocated)."""
        ...

    def allocate(self) -> None:
        """Reserve weight (uninitialised) and cache memory again after ``release``."""
        ...

    def release(self) -> None:
        """Free the weights and the cache."""
        ...


class TinyRunner:
    """``TinyLM`` on a preallocated ``max_batch``-slot cache; prompts are prefilled one by one."""

    name = "TinyLM"

    def __init__(self, cfg: TinyLMConfig, max_batch: int, device: torch.device):
        self.cfg, self.max_batch, self.device = cfg, max_batch, device
        self.vocab_size, self.max_seq_len = cfg.vocab_size, cfg.max_seq_len
        # The module stays for the engine's life; release swaps its tensors for empty ones.
        self.model = TinyLM(cfg).to(device).eval().requires_grad_(False)
        self.shapes = {name: t.shape for name, t in self.model.state_dict().items()}
        self.cache: KVCache | None = KVCache(cfg, max_batch, device=device)

    @property
    def cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    @property
    def weight_bytes(self) -> int:
        return state_bytes(self.model)

    def logits(self, admitted: list[SequenceState], decoding: list[SequenceState]) -> torch.Tensor:
        model, cache, device = self.model, self.cache, self.device
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
        return torch.cat(rows)  # (N, V)

    def load(self, state: Mapping[str, Any]) -> None:
        copy_state(self.model, state)

    def allocate(self) -> None:
        allocate_weights(self.model, self.shapes, self.device)
        self.cache = KVCache(self.cfg, self.max_batch, device=self.device)

    def release(self) -> None:
        release_weights(self.model, self.shapes, self.device)
        self.cache = None


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of a module's parameters and persistent buffers (tied tensors counted once)."""
    seen = {t.data_ptr(): t for t in model.state_dict().values()}  # state_dict() detaches: same memory, new tensors
    return sum(t.element_size() * t.numel() for t in seen.values())


def _state_tensors(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """The parameters and the persistent buffers (those named in ``shapes``), tied ones once."""
    buffers = [(name, b) for name, b in model.named_buffers() if name in shapes]
    return [*model.named_parameters(), *buffers]


def allocate_weights(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]], device: torch.device) -> None:
    # Uninitialised weight memory: load fills it before any use.
    for name, tensor in _state_tensors(model, shapes):
        tensor.data = torch.empty(shapes[name], dtype=tensor.dtype, device=device)


def release_weights(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]], device: torch.device) -> None:
    for _, tensor in _state_tensors(model, shapes):
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_state(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Copy ``state`` (any device/dtype) into the module's state dict: copies, never shares; a
    tied tensor (an embedding shared with the LM head) is copied once."""
    copied: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() not in copied:
                tensor.copy_(state[name])
                copied.add(tensor.data_ptr())


class TorchEngine(EngineState):
    """One replica's torch engine: a model runner's weights + its KV cache for ``max_batch`` sequences.

    ``model`` is a ``TinyLMConfig`` (the built-in LM) or a ``ModelRunner`` (e.g. an ``HFRunner``).
    The engine starts awake with memory allocated but *no weights*: ``load_weights`` must run
    before the first ``generate`` (and again after every ``wake_up``); generating without
    weights raises ``RuntimeError``. ``threads`` sets ``torch.set_num_threads`` (process-wide:
    one emulated GPU = one core); ``None`` leaves torch's setting alone. ``eos_id`` finishes a
    response with ``stop``; so do ``extra_eos_ids`` and, for requests that name stop strings, any
    of them in the decoded text (``detokenize`` turns token ids into text; without it stop
    strings are ignored).
    """

    def __init__(
        self,
        model: TinyLMConfig | ModelRunner,
        *,
        max_batch: int,
        device: str | torch.device = "cpu",
        threads: int | None = 1,
        eos_id: int,
        seed: int = 0,
        extra_eos_ids: Sequence[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        start_asleep: bool = False,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        runner = TinyRunner(model, max_batch, self.device) if isinstance(model, TinyLMConfig) else model
        if not 0 <= eos_id < runner.vocab_size:
            raise ValueError(f"eos_id={eos_id} is outside the vocabulary of {runner.vocab_size}")
        self._runner = runner
        self.max_batch = max_batch
        self.eos_id = eos_id
        self._extra_eos = frozenset(extra_eos_ids) - {eos_id}
        self._detokenize = detokenize
        self._generator = torch.Generator().manual_seed(seed)  # draws for unseeded requests
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self._memory = True
        self._weights_loaded = False
        self._version = 0
        self._sleeping = False
        self._paused = False
        self._closed = False
        stops = self._stops if self._extra_eos or detokenize is not None else None
        self._batch = Batcher(max_batch=max_batch, eos_id=eos_id, step=self._iterate,
                              version=lambda: self._version, name="torch-engine", stops=stops)
        self._stats = {"decode_steps": 0, "busy_s": 0.0}
        self.receiver = ws.Receiver(self.device)
        """Its standing membership in the collective weight-sync group (kept across syncs)."""
        self.weight_ranks = 1
        """Ranks this engine takes in a collective weight-sync group (one process, one rank)."""
        if start_asleep:  # a hybrid replica: no memory until it is lent (wake_up, load_weights)
            self._release()
            self._sleeping = True

    # ---------------------------------------------------------------- state

    @property
    def kv_cache_bytes(self) -> int:
        return self._runner.cache_bytes

    @property
    def weight_bytes(self) -> int:
        return self._runner.weight_bytes

    def stats(self) -> dict[str, float]:
        """Counters since construction, plus the current queue depths and memory."""
        return {
            **self._batch.counters,
            **self._stats,
            "running_requests": self._batch.running,
            "waiting_requests": self._batch.waiting,
            "kv_cache_bytes": self.kv_cache_bytes,
            "weight_bytes": self.weight_bytes,
            "param_version": float(self._version),
        }

    # ---------------------------------------------------------------- requests

    def _budget(self, request: GenerationRequest) -> int:
        return check_request(request, max_seq_len=self._runner.max_seq_len, vocab_size=self._runner.vocab_size)

    async def _generate(self, request: GenerationRequest, budget: int) -> GenerationResult:
        seed = request.sampling.seed
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return await self._batch.submit(request, budget, generator)

    def _abort_where(self, match: Callable[[SequenceState], bool]) -> int:
        return self._batch.abort_where(match)

    def _stops(self, seq: SequenceState) -> bool:
        """True when the token just appended ends ``seq``: an extra EOS id or a stop string."""
        if seq.tokens[-1] in self._extra_eos:
            return True
        stop = seq.request.sampling.stop
        if not stop or self._detokenize is None:
            return False
        # Every token decodes to at least one character, so a stop string that the newest token
        # completes lies within the last len(longest) tokens; earlier hits were caught earlier.
        text = self._detokenize(seq.tokens[-max(map(len, stop)):])
        return any(s in text for s in stop)

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
        """Copy a state dict of the runner's model (any device/dtype) into the engine's weights.

        In-process callers (a hybrid replica inside the trainer) pass ``model.state_dict()``
        directly: the tensors are copied, never shared. A state dict with other names or shapes
        raises ``ValueError`` and leaves the current weights untouched.
        """
        self._check_awake()
        await self._on_worker(self._copy_weights, state, version)

    async def receive_weights(self, spec: ws.GroupSpec, rank: int, manifest: ws.Manifest, version: int) -> float:
        """The collective transport: join the weight-sync group ``spec`` at ``rank`` (or keep the
        membership of this generation) and load each bucket as it arrives. Names and shapes are
        checked against the model first (``ValueError``, nothing joined); a member lost mid-sync
        raises after ``spec.timeout_s`` and leaves the weights unloaded until the next sync."""
        self._check_awake()
        ws.check_manifest(manifest, self._runner.shapes, model=self._runner.name)
        return await self._on_worker(self._receive, spec, rank, manifest, version)

    async def shutdown(self) -> None:
        """Abort everything, stop the scheduler, free memory and the worker thread."""
        if self._closed:
            return
        self._closed = True
        await self._batch.close()
        await self._on_worker(self._release)
        self.receiver.leave()
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
        """The runner's logits for ``admitted`` then ``decoding``, sampled as one batch."""
        if not self._memory or not self._weights_loaded:
            raise RuntimeError("engine has no weights or cache")
        device = self.device
        logits = self._runner.logits(admitted, decoding)  # (N, V)
        seqs = admitted + decoding
        temperature = torch.tensor([seq.request.sampling.temperature for seq in seqs], device=device)
        top_p = torch.tensor([seq.request.sampling.top_p for seq in seqs], device=device)
        uniforms = self._uniforms(seqs).to(device)
        tokens, logprobs = sample_tokens(logits, temperature, top_p, uniforms,
                                         sort_only_for_top_p=not isinstance(self._runner, TinyRunner))
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

    def _allocate(self) -> None:
        self._runner.allocate()
        self._memory = True
        self._weights_loaded = False

    def _release(self) -> None:
        self._runner.release()
        self._memory = False
        self._weights_loaded = False

    def _receive(self, spec: ws.GroupSpec, rank: int, manifest: ws.Manifest, version: int) -> float:
        if not self._memory:
            raise RuntimeError("engine is asleep: call wake_up() before receive_weights()")
        t0 = time.perf_counter()
        group = self.receiver.join(spec, rank)
        self._weights_loaded = False
        targets = self._runner.model.state_dict()  # detached views of the live weights
        for bucket in ws.receive(group, manifest):
            ws.copy_into(targets, bucket)
        self._version = version
        self._weights_loaded = True
        return time.perf_counter() - t0

    def _copy_weights(self, state: Mapping[str, Any], version: int) -> None:
        if not self._memory:
            raise RuntimeError("engine is asleep: call wake_up() before load_weights()")
        check_state_dict(state, self._runner.shapes, model=self._runner.name)
        self._runner.load(state)
        self._version = version
        self._weights_loaded = True


@torch.no_grad()
def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
    *, sort_only_for_top_p: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return (tokens (N,), untempered log-probs (N,)).

    logits: (N, V); temperature, top_p, uniforms: (N,). Row n is greedy (argmax) when
    ``temperature[n] == 0``; otherwise it is an inverse-CDF draw with ``uniforms[n]`` from
    ``softmax(logits[n] / temperature[n])`` restricted to its top-p nucleus (the smallest set of
    most likely tokens whose mass reaches ``top_p``). Fully batched: per-request randomness lives
    only in ``uniforms``, so each row's draw is independent of the batch it shares.

    The draw walks the tokens from the most likely down. With ``sort_only_for_top_p`` and no row
    truncated (every ``top_p >= 1``) it walks them in vocabulary order instead and skips the sort
    (on CPU the sort of a (32, 384) batch costs more than the rest of the draw): the same
    distribution, another map from ``uniforms`` to tokens. The torch engine uses it for HF models
    and keeps the sorted walk for TinyLM, whose seeded draws stay what they were.
    """
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if sort_only_for_top_p and not bool((top_p < 1).any()):
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)  # (N, V), non-decreasing
        pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]  # (N,)
        pick = torch.minimum(pick, torch.full_like(pick, logits.shape[-1] - 1))
        tokens = torch.where(greedy, logits.argmax(dim=-1), pick)  # (N,)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
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
