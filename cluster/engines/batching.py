"""The continuous-batching core shared by the torch and simulated engines.

Owns one engine's waiting queue and running slots, admission, appending tokens, finish (with its
reason), abort with the partial tokens and log-probs, the first-token version stamp and the
scheduler task. It never computes: the engine supplies one iteration (``StepFn``). Imports
neither torch nor Ray; how an iteration runs is described in ``docs/engines.md``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.engines.base import build_result
from data.types import FinishReason, GenerationRequest, GenerationResult


@dataclass(eq=False)
class SequenceState:
    """One request in the engine: waiting (slot -1) or running in a slot."""

    request: GenerationRequest
    budget: int
    """Tokens this call may generate."""
    future: asyncio.Future
    extra: Any = None
    """What the engine keeps per request (the torch engine: its generator; the simulated one: its plan)."""
    slot: int = -1
    prefilled: int = 0
    version: int | None = None
    """Weights version of the first generated token."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


StepOutput = tuple[list[int], list[float], int]
"""One iteration's answer: a token and its log-prob per sequence (admitted first), and the
weights version they were generated with."""

StepFn = Callable[[list[SequenceState], list[SequenceState], bool], Awaitable[StepOutput]]
"""``step(admitted, decoding, after_idle)``: run one iteration; ``admitted`` were just given a
slot (their prompts need a prefill), ``decoding`` were running already; ``after_idle`` = the
engine had nothing to do until now."""


class Batcher:
    """Waiting and running sequences of one engine and the scheduler loop that steps them.

    Each iteration drops finished sequences (freeing their slots), admits waiting ones into free
    slots (at most ``max_batch`` run), awaits ``step`` and appends each sequence's token: EOS
    finishes it with ``stop`` (unless ``ignore_eos``), so does ``stops(seq)`` returning True (the
    engine's other stop conditions: more EOS ids, stop strings), its budget with ``length``. ``version()``
    is the engine's current weights version, stamped on results that got no token.
    """

    def __init__(self, *, max_batch: int, eos_id: int, step: StepFn, version: Callable[[], int], name: str,
                 stops: Callable[[SequenceState], bool] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.eos_id = eos_id
        self._stops = stops
        self._step = step
        self._version = version
        self._name = name
        self._waiting: deque[SequenceState] = deque()
        self._running: dict[int, SequenceState] = {}  # slot → sequence, in admission order
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._finished_running: list[SequenceState] = []  # running sequences finished since the last drop
        self._finished_waiting = 0  # waiting sequences finished (aborted) since the last drop
        self._work: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None
        self.counters = {"generated_tokens": 0, "prefill_tokens": 0, "finished_requests": 0, "aborted_requests": 0}

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def submit(self, request: GenerationRequest, budget: int, extra: Any = None) -> GenerationResult:
        """Queue ``request`` (``budget`` >= 1 tokens) and return its result when it finishes."""
        seq = SequenceState(request, budget, asyncio.get_running_loop().create_future(), extra)
        self._ensure_scheduler()
        self._waiting.append(seq)
        self._work.set()
        try:
            return await seq.future
        except asyncio.CancelledError:  # the caller gave up: the sequence leaves at the next drop
            if seq.future.cancelled():
                self._forget(seq)
            raise

    def abort_where(self, match: Callable[[SequenceState], bool]) -> int:
        """Finish the matching waiting or running sequences with ``abort``; returns how many."""
        hits = [seq for seq in (*self._waiting, *self._running.values()) if not seq.future.done() and match(seq)]
        for seq in hits:
            self._finish(seq, "abort")
        return len(hits)

    async def close(self) -> None:
        """Abort everything and stop the scheduler (when it runs on this event loop)."""
        self.abort_where(lambda seq: True)
        if self._scheduler is not None and self._scheduler.get_loop() is asyncio.get_running_loop():
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError:
                pass

    # ---------------------------------------------------------------- scheduler

    def _ensure_scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._scheduler is not None and not self._scheduler.done() and self._scheduler.get_loop() is loop:
            return
        if self._scheduler is not None and self._scheduler.get_loop() is not loop:
            # Requests of an earlier event loop can never be answered: forget them.
            self._waiting.clear()
            self._running.clear()
            self._free_slots = list(range(self.max_batch - 1, -1, -1))
            self._finished_running.clear()
            self._finished_waiting = 0
        self._work = asyncio.Event()
        self._scheduler = loop.create_task(self._schedule(), name=f"{self._name}-scheduler")

    async def _schedule(self) -> None:
        after_idle = True
        while True:
            self._drop_finished()
            decoding = list(self._running.values())
            admitted = self._admit()
            if not admitted and not decoding:
                self._work.clear()
                await self._work.wait()
                after_idle = True
                continue
            try:
                tokens, logprobs, version = await self._step(admitted, decoding, after_idle)
            except Exception as exc:  # a failed step fails its requests, not the engine
                for seq in admitted + decoding:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
                        self._forget(seq)
                continue
            after_idle = False
            self._append(admitted + decoding, tokens, logprobs, version)

    def _drop_finished(self) -> None:
        if self._finished_waiting:
            self._waiting = deque(seq for seq in self._waiting if not seq.future.done())
            self._finished_waiting = 0
        for seq in self._finished_running:
            if self._running.get(seq.slot) is seq:
                del self._running[seq.slot]
                self._free_slots.append(seq.slot)
        self._finished_running.clear()

    def _admit(self) -> list[SequenceState]:
        admitted = []
        while self._waiting and self._free_slots:
            seq = self._waiting.popleft()
            seq.slot = self._free_slots.pop()
            seq.prefilled = len(seq.request.prompt_tokens)
            self._running[seq.slot] = seq
            self.counters["prefill_tokens"] += seq.prefilled
            admitted.append(seq)
        return admitted

    def _append(self, seqs: list[SequenceState], tokens: list[int], logprobs: list[float], version: int) -> None:
        """Give each sequence its token; finish those at EOS (``stop``) or at their budget (``length``).
        (The hot loop of every engine iteration: kept flat on purpose.)"""
        eos, stops, appended = self.eos_id, self._stops, 0
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if seq.future.done():  # aborted while the step ran: its token is dropped
                continue
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            appended += 1
            if seq.version is None:
                seq.version = version
            if token == eos and not seq.request.sampling.ignore_eos:
                self._finish(seq, "stop")
            elif stops is not None and not seq.request.sampling.ignore_eos and stops(seq):
                self._finish(seq, "stop")
            elif len(seq.tokens) >= seq.budget:
                self._finish(seq, "length")
        self.counters["generated_tokens"] += appended

    def _finish(self, seq: SequenceState, reason: FinishReason) -> None:
        version = self._version() if seq.version is None else seq.version
        seq.future.set_result(build_result(seq.request, seq.tokens, seq.logprobs, reason, version, seq.prefilled))
        self.counters["aborted_requests" if reason == "abort" else "finished_requests"] += 1
        self._forget(seq)

    def _forget(self, seq: SequenceState) -> None:
        """Mark a sequence whose future just completed, so the next drop removes it (frees its slot).
        Every way a future completes (finish, a failed step, a cancelled caller) comes through here."""
        if seq.slot >= 0:
            self._finished_running.append(seq)
        else:
            self._finished_waiting += 1
