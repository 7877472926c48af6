"""The simulated rollout engine: the engine contract with time spent by a cost model, no compute.

It lets the real replicas, load balancer, rollouter and controller run with many emulated GPUs
on two cores. It imports neither torch nor Ray.

Scheduler: the same continuous batching as the torch engine. Each iteration admits waiting
requests while fewer than ``max_batch`` run, then holds the emulated device for

    prefill_s_per_token × (prompt tokens admitted this iteration) + decode_step_s(running)

where ``decode_step_s(b)`` defaults to ``base_s + per_seq_s × b``, and every running request
gains one token. ``sleep``, ``wake_up`` and ``load_weights`` hold it for their configured seconds,
and so does ``resume`` of a paused engine (``resume_s``). Iterations and those calls take turns on
one emulated device (an asyncio lock), like the torch engine's single worker thread.
``stats()["busy_s"]`` sums modelled seconds, not wall time.

Device timeline. The device keeps a due time: each hold ends ``cost`` seconds after the previous
one ended (or after now, when the device was idle), and the engine sleeps until then. The event
loop's own work between iterations (appending tokens, finishing requests, Ray messages) is
therefore absorbed instead of added, as long as the process keeps up on average. When it falls
more than ``max_lag_s`` behind (a starved process), the rest is given up and counted in
``stats()["stretch_s"]``: the modelled seconds by which this engine's clock ran slow.

Tokens: a response is a pure function of ``(seed, request_id)`` and, through its length, of the
param version it is generated at. Its length L comes from ``lengths(request_id, version)`` when
given (e.g. ``LogNormalLengths``, the simulator's workload), else from ``length_sampler(rng)``
(or a fixed int) with ``rng`` seeded by both; the tokens are L − 1 pseudo-random non-EOS ids
(their own stream, independent of L) followed by EOS (``ignore_eos`` keeps drawing non-EOS ids
instead); temperature, top-p and the request seed are ignored. A re-submitted request (same id,
prompt = prompt + partial tokens, remaining budget) finds its partial tokens at the end of the
prompt and continues the *same* response, on any engine with the same seed, so aborts and retries
leave the length distribution unchanged (a response already at or past its length when resumed
ends with EOS at once). (A fresh prompt whose tail happens to equal the response's first tokens
is read as a partial one; with the default 32768 ids that costs a token about once in 30k
requests.) Each token's log-prob is ``-log(vocab_size)``, that of a uniform policy. There is no
context limit, so budgets are never clamped; pause, abort, sleep and version semantics are the
torch engine's.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.engines.base import EngineState
from cluster.types import FinishReason, GenerationRequest, GenerationResult

LengthModel = Callable[[str, int], int]
"""``lengths(request_id, version) -> tokens``: the response length of a request at a version."""


def sample_key(request_id: str) -> str:
    """The sample a request belongs to: the rollouter names response ``j`` of sample ``uid``
    ``{uid}-r{j}``, so the part before the last ``-r<digits>``; any other id is its own sample."""
    head, sep, tail = request_id.rpartition("-r")
    return head if sep and tail.isdigit() else request_id


@dataclass(frozen=True)
class LogNormalLengths:
    """Response lengths drawn like the simulator's workload (``sim/workload.py``), per request.

    Length = ``round(exp(mu + z_prompt + z_response))`` clipped to ``[1, max_len]``, with
    ``mu = log(mean(version)) − (prompt_sigma² + response_sigma²) / 2`` (so the unclipped mean is
    ``mean(version)``), ``z_prompt ~ N(0, prompt_sigma)`` shared by the responses of one sample
    (``sample_key``: hard prompts make all responses long) and ``z_response ~ N(0,
    response_sigma)`` per response. The mean moves linearly from ``mean_start`` (version 0) to
    ``mean_end`` (``last_version``, the run's last step). With both sigmas 0 every length is
    ``round(mean)``. A pure function of ``(seed, request_id, version)``; picklable.
    """

    mean_start: float
    mean_end: float
    response_sigma: float
    prompt_sigma: float
    max_len: int
    last_version: int
    seed: int = 0

    def mean(self, version: int) -> float:
        frac = min(1.0, version / self.last_version) if self.last_version > 0 else 1.0
        return self.mean_start + (self.mean_end - self.mean_start) * frac

    def __call__(self, request_id: str, version: int) -> int:
        mean, sp, sr = self.mean(version), self.prompt_sigma, self.response_sigma
        if sp == 0.0 and sr == 0.0:
            return min(self.max_len, max(1, round(mean)))
        mu = math.log(mean) - (sp * sp + sr * sr) / 2
        if sp:
            mu += random.Random(f"{self.seed}:{sample_key(request_id)}:prompt").gauss(0.0, sp)
        if sr:
            mu += random.Random(f"{self.seed}:{request_id}:response").gauss(0.0, sr)
        return min(self.max_len, max(1, round(math.exp(mu))))


class SimulatedEngine(EngineState):
    """A rollout engine that sleeps instead of computing (see the module docstring).

    Like the torch engine it starts awake without weights: ``load_weights`` (any mapping; the
    content is ignored) must run before the first ``generate`` and after every ``wake_up``.
    """

    def __init__(
        self,
        *,
        decode_step_s: Callable[[int], float] | tuple[float, float] = (0.02, 1e-4),
        prefill_s_per_token: float = 0.0,
        max_batch: int = 256,
        length_sampler: Callable[[random.Random], int] | int = 16,
        lengths: LengthModel | None = None,
        eos_id: int = 2,
        seed: int = 0,
        vocab_size: int = 32768,
        sleep_s: float = 0.0,
        wake_up_s: float = 0.0,
        load_weights_s: float = 0.0,
        resume_s: float = 0.0,
        start_asleep: bool = False,
        max_lag_s: float = 0.1,
    ):
        """``lengths`` (when given) replaces ``length_sampler``; ``start_asleep`` makes the first
        ``wake_up`` cost ``wake_up_s`` too (a hybrid replica starts asleep on the trainer);
        ``resume_s`` is spent by ``resume`` of a paused engine before it accepts work again."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if min(sleep_s, wake_up_s, load_weights_s, resume_s, max_lag_s) < 0:
            raise ValueError("switch costs and max_lag_s must be >= 0")
        if vocab_size < 2 or not 0 <= eos_id < vocab_size:
            raise ValueError(f"need vocab_size >= 2 and 0 <= eos_id < vocab_size, got {vocab_size=} {eos_id=}")
        if isinstance(decode_step_s, tuple):
            base_s, per_seq_s = decode_step_s
            decode_step_s = lambda batch: base_s + per_seq_s * batch  # noqa: E731
        if isinstance(length_sampler, int):
            fixed = length_sampler
            length_sampler = lambda rng: fixed  # noqa: E731
        self._decode_step_s = decode_step_s
        self._length_sampler = length_sampler
        self._lengths = lengths
        self.prefill_s_per_token = prefill_s_per_token
        self.max_batch = max_batch
        self.eos_id = eos_id
        self.seed = seed
        self.vocab_size = vocab_size
        self.sleep_s, self.wake_up_s, self.load_weights_s = sleep_s, wake_up_s, load_weights_s
        self.resume_s, self.max_lag_s = resume_s, max_lag_s
        self._logprob = -math.log(vocab_size)
        self._weights_loaded = False
        self._version = 0
        self._sleeping = start_asleep
        self._due = 0.0
        """When the emulated device's current hold ends (event-loop time)."""
        self._paused = False
        self._closed = False
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._work: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._stats = {
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "finished_requests": 0,
            "aborted_requests": 0,
            "decode_steps": 0,
            "busy_s": 0.0,
            "stretch_s": 0.0,
        }

    # ---------------------------------------------------------------- state

    def stats(self) -> dict[str, float]:
        return {**self._stats, "running_requests": len(self._running), "waiting_requests": len(self._waiting)}

    def response_length(self, request_id: str) -> int:
        """Tokens (EOS included) of ``request_id``'s response at the current param version."""
        if self._lengths is not None:
            return max(1, int(self._lengths(request_id, self._version)))
        return max(1, int(self._length_sampler(random.Random(f"{self.seed}:{request_id}:length"))))

    def response_tokens(self, request_id: str, count: int, *, ignore_eos: bool = False) -> list[int]:
        """The first ``count`` tokens of request ``request_id``'s response (ends early at EOS)."""
        ids = self._ids(request_id, count)
        if ignore_eos:
            return ids
        length = self.response_length(request_id)
        return ids if count < length else [*ids[: length - 1], self.eos_id]

    def _ids(self, request_id: str, count: int) -> list[int]:
        """The response's stream of non-EOS ids (independent of its length)."""
        rng, span, eos = random.Random(f"{self.seed}:{request_id}").random, self.vocab_size - 1, self.eos_id
        ids = [int(rng() * span) for _ in range(count)]
        return [i + (i >= eos) for i in ids]  # every id but EOS

    # ---------------------------------------------------------------- requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._sleeping:
            raise RuntimeError("engine is asleep: call wake_up() and load_weights() first")
        if not self._weights_loaded:
            raise RuntimeError("no weights loaded: call load_weights() first")
        if self._paused:
            return _result(request, [], "abort", self._version, 0, self._logprob)
        spec = request.sampling
        if not request.prompt_tokens or spec.max_new_tokens < 0:
            raise ValueError(f"{request.request_id}: empty prompt or negative budget")
        plan = self._plan(request)
        if not plan:
            return _result(request, [], "length", self._version, 0, self._logprob)
        seq = _Sequence(request, plan, asyncio.get_running_loop().create_future())
        self._ensure_scheduler()
        self._waiting.append(seq)
        self._work.set()
        return await seq.future

    # ---------------------------------------------------------------- memory and weights

    async def sleep(self) -> None:
        """Abort everything in flight, then spend ``sleep_s``; weights are gone afterwards."""
        if self._sleeping:
            return
        self._sleeping = True
        self._abort_where(lambda seq: True)
        async with self._device():
            await self._hold(self.sleep_s, fresh=True)
            self._weights_loaded = False

    async def wake_up(self) -> None:
        if not self._sleeping:
            return
        async with self._device():
            await self._hold(self.wake_up_s, fresh=True)
        self._sleeping = False

    async def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        if self._sleeping or self._closed:
            raise RuntimeError("engine is asleep: call wake_up() before load_weights()")
        async with self._device():
            await self._hold(self.load_weights_s, fresh=not self._running)
            self._version = version
            self._weights_loaded = True

    async def resume(self) -> None:
        """Accept work again; a paused engine first spends ``resume_s``."""
        if self._paused and self.resume_s > 0 and not self._closed:
            async with self._device():
                await self._hold(self.resume_s, fresh=not self._running)
        self._paused = False

    async def shutdown(self) -> None:
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

    # ---------------------------------------------------------------- scheduler

    def _plan(self, request: GenerationRequest) -> list[int]:
        """The tokens this call will produce: the response's continuation after the partial
        tokens found at the end of the prompt, cut to the budget."""
        prompt, spec, rid = request.prompt_tokens, request.sampling, request.request_id
        length = None if spec.ignore_eos else self.response_length(rid)
        longest = len(prompt) - 1 + spec.max_new_tokens if length is None else max(len(prompt) - 1, length - 1)
        stream = self._ids(rid, longest)
        done = 0
        for k in range(min(len(prompt) - 1, len(stream)), 0, -1):  # longest partial response first
            if prompt[-k] == stream[0] and prompt[-k:] == stream[:k]:
                done = k
                break
        if length is None:
            return stream[done : done + spec.max_new_tokens]
        plan = [*stream[done : max(done, length - 1)], self.eos_id]
        return plan[: spec.max_new_tokens]

    async def _hold(self, cost: float, *, fresh: bool) -> None:
        """Hold the emulated device for ``cost`` modelled seconds on the device timeline (see the
        module docstring); ``fresh`` = the device was idle until now. Call with the lock held."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if fresh:
            self._due = max(self._due, now)
        elif self._due < now - self.max_lag_s:
            self._stats["stretch_s"] += now - self.max_lag_s - self._due
            self._due = now - self.max_lag_s
        self._due += cost
        await asyncio.sleep(max(0.0, self._due - loop.time()))

    def _device(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    def _ensure_scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._scheduler is not None and not self._scheduler.done() and self._scheduler.get_loop() is loop:
            return
        if self._scheduler is not None and self._scheduler.get_loop() is not loop:
            self._waiting.clear()
            self._running.clear()
        self._work = asyncio.Event()
        self._scheduler = loop.create_task(self._schedule(), name="simulated-engine-scheduler")

    async def _schedule(self) -> None:
        fresh = True
        while True:
            self._waiting = deque(seq for seq in self._waiting if not seq.future.done())
            self._running = [seq for seq in self._running if not seq.future.done()]
            admitted = []
            while self._waiting and len(self._running) < self.max_batch:
                seq = self._waiting.popleft()
                seq.prefilled = len(seq.request.prompt_tokens)
                self._running.append(seq)
                admitted.append(seq)
            if not self._running:
                self._work.clear()
                await self._work.wait()
                fresh = True
                continue
            prefill = sum(seq.prefilled for seq in admitted)
            self._stats["prefill_tokens"] += prefill
            cost = self.prefill_s_per_token * prefill + self._decode_step_s(len(self._running))
            stepping = list(self._running)
            async with self._device():
                await self._hold(cost, fresh=fresh)
            fresh = False
            self._stats["busy_s"] += cost
            self._stats["decode_steps"] += 1
            for seq in stepping:
                self._append(seq)

    def _append(self, seq: _Sequence) -> None:
        if seq.future.done():  # aborted during the iteration: its token is dropped
            return
        seq.generated += 1
        if seq.version is None:
            seq.version = self._version
        self._stats["generated_tokens"] += 1
        if seq.generated == len(seq.plan):
            last = seq.plan[-1]
            self._finish(seq, "stop" if last == self.eos_id and not seq.request.sampling.ignore_eos else "length")

    def _abort_where(self, match: Callable[[_Sequence], bool]) -> int:
        hits = [seq for seq in (*self._waiting, *self._running) if not seq.future.done() and match(seq)]
        for seq in hits:
            self._finish(seq, "abort")
        return len(hits)

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        version = self._version if seq.version is None else seq.version
        seq.future.set_result(_result(seq.request, seq.plan[: seq.generated], reason, version, seq.prefilled, self._logprob))
        self._stats["aborted_requests" if reason == "abort" else "finished_requests"] += 1


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    plan: list[int]
    """Every token this call would produce if not aborted."""
    future: asyncio.Future
    generated: int = 0
    prefilled: int = 0
    version: int | None = None


def _result(request, tokens, reason: FinishReason, version: int, prefilled: int, logprob: float) -> GenerationResult:
    return GenerationResult(request.request_id, list(tokens), [logprob] * len(tokens), reason, version, prefilled)
