"""The simulated rollout engine: the engine contract with time spent by a cost model, no compute.

Owns the cost model (one iteration holds an emulated device for ``prefill_s_per_token × admitted
prompt tokens + decode_step_s(running)``), the device timeline and the deterministic responses
(a pure function of ``(seed, request_id)`` and the version). Batching is ``batching.Batcher``'s.
Imports neither torch nor Ray at module import (``receive_weights``, the collective transport's
receiving end, needs torch and imports it then); the full description is in ``docs/engines.md``.
"""

from __future__ import annotations

import asyncio
import math
import time
import random
from collections.abc import Callable, Mapping
from typing import Any

from cluster.engines.base import EngineState, check_request
from cluster.engines.batching import Batcher, SequenceState, StepOutput
from data.types import GenerationRequest, GenerationResult

LengthModel = Callable[[str, int], int]
"""``lengths(request_id, version) -> tokens``: the response length of a request at a version."""


class SimulatedEngine(EngineState):
    """A rollout engine that sleeps instead of computing (see ``docs/engines.md``).

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
        self._batch = Batcher(max_batch=max_batch, eos_id=eos_id, step=self._iterate,
                              version=lambda: self._version, name="simulated-engine")
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
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._stats = {"decode_steps": 0, "busy_s": 0.0, "stretch_s": 0.0}
        self._receiver: Any = None  # weight_sync.Receiver, made by the first receive_weights
        self.weight_ranks = 1
        """Ranks this engine takes in a collective weight-sync group."""

    # ---------------------------------------------------------------- state

    def stats(self) -> dict[str, float]:
        return {**self._batch.counters, **self._stats, "running_requests": self._batch.running,
                "waiting_requests": self._batch.waiting}

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

    def _budget(self, request: GenerationRequest) -> int:
        return check_request(request)  # no context limit: budgets are never clamped

    async def _generate(self, request: GenerationRequest, budget: int) -> GenerationResult:
        plan = self._plan(request)
        return await self._batch.submit(request, len(plan), plan)

    def _abort_where(self, match: Callable[[SequenceState], bool]) -> int:
        return self._batch.abort_where(match)

    # ---------------------------------------------------------------- memory and weights

    async def sleep(self) -> None:
        """Abort everything in flight, then spend ``sleep_s``; weights are gone afterwards."""
        if self._sleeping:
            return
        self._sleeping = True
        self._batch.abort_where(lambda seq: True)
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
        self._check_awake()
        async with self._device():
            await self._hold(self.load_weights_s, fresh=not self._batch.running)
            self._version = version
            self._weights_loaded = True

    async def receive_weights(self, spec: Any, rank: int, manifest: Any, version: int) -> float:
        """The collective transport's receiving end without a model: join the weight-sync group
        ``spec`` at ``rank`` (kept across syncs of one generation), receive every bucket of
        ``manifest`` and drop it, then spend ``load_weights_s`` as ``load_weights`` does. Like
        ``load_weights`` it accepts any names (there is no model to check them against)."""
        from cluster import weight_sync as ws

        self._check_awake()
        t0 = time.perf_counter()

        def receive() -> None:
            if self._receiver is None:
                self._receiver = ws.Receiver()
            group = self._receiver.join(spec, rank)
            for _bucket in ws.receive(group, manifest):
                pass

        self._weights_loaded = False
        await asyncio.to_thread(receive)
        await self.load_weights({}, version)
        return time.perf_counter() - t0

    async def resume(self) -> None:
        """Accept work again; a paused engine first spends ``resume_s``."""
        if self._paused and self.resume_s > 0 and not self._closed:
            async with self._device():
                await self._hold(self.resume_s, fresh=not self._batch.running)
        self._paused = False

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._batch.close()
        if self._receiver is not None:
            self._receiver.leave()

    # ---------------------------------------------------------------- one iteration

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

    async def _iterate(self, admitted: list[SequenceState], decoding: list[SequenceState], after_idle: bool) -> StepOutput:
        """Hold the device for the iteration's modelled cost; each sequence's next token is its plan's."""
        prefill = sum(seq.prefilled for seq in admitted)
        cost = self.prefill_s_per_token * prefill + self._decode_step_s(len(admitted) + len(decoding))
        async with self._device():
            await self._hold(cost, fresh=after_idle)
        self._stats["busy_s"] += cost
        self._stats["decode_steps"] += 1
        seqs = admitted + decoding
        return [seq.extra[len(seq.tokens)] for seq in seqs], [self._logprob] * len(seqs), self._version

    async def _hold(self, cost: float, *, fresh: bool) -> None:
        """Hold the emulated device for ``cost`` modelled seconds on the device timeline (see
        ``docs/engines.md``); ``fresh`` = the device was idle until now. Call with the lock held."""
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
