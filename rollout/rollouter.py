"""The rollouter: feeds prompts to the rollout replicas and queues the finished samples.

One asyncio task (the feeder) starts samples; each sample runs as its own task with one
sub-task per response. A response is one ``GenerationRequest`` with id ``{uid}-r{j}``, routed by
``LoadBalancer.acquire(request_id)`` and retried until it finishes.

Staleness (DESIGN §5, ``loop.staleness.StalenessGate``, the simulator's rule too). With
``max_required_samples`` (= queue capacity) the feeder starts a new sample only while all of these hold:

- not paused (``pause()``), not stopped, prompts left;
- ``in flight < max_concurrent_samples = min(routable replicas × concurrent_samples_per_replica,
  max_required_samples)``, recomputed whenever the load balancer's routable set changes;
- ``started_this_version < max_required_samples``;
- the queue is not full.

``on_weight_sync(version)`` resets ``started_this_version`` to ``in flight + queued``, stamps the
new version on samples started from then on, resets ``step_generated_samples`` and returns the
closing window's metrics.

Abort and retry. When an engine returns ``finish_reason="abort"`` the slot is released and:

- with ``partial_rollout`` the request is re-submitted with prompt + the tokens generated so far
  and the remaining budget (``max_new_tokens − tokens so far``), so a finished response never
  exceeds the budget and a ``length`` finish uses it exactly;
- without it the tokens are discarded and the request restarts from scratch with the full budget
  (a truncated response is never returned).

A sticky request goes back to its replica while that one is routable; ``remove_replicas`` or
``clear_sticky`` on the balancer sends the retry to the least-loaded replica instead. With no
routable replica the request waits in ``lb.wait_routable()``. A retry that made no progress
(aborted with no token, or the engine raised) backs off exponentially (``retry_backoff_s`` up to
``max_retry_backoff_s``) so that a paused replica is not hammered; a retry after progress goes
out at once.

Counting (all cumulative, the metrics are per window):

- ``aborted_requests`` / ``aborted_tokens``: an engine call that came back aborted after doing
  work (it produced tokens or reports ``prefill_tokens > 0``) counts one aborted request and the
  tokens its response held at that moment (the same convention as the simulator). A call that
  came back aborted with no token and no prefill (a paused replica turning it away) is only
  counted in ``rejected_requests``.
- ``reprefilled_tokens``: every call after a response's first one prefills again; it counts the
  engine's ``prefill_tokens`` when reported, else the request's prompt length when the call did
  work, else 0.
- ``discarded_tokens`` (``partial_rollout=False`` only) and ``resumed_tokens`` (tokens carried
  into a re-submission) are informational.
- ``failed_requests``: ``generate`` raised. The replica is then taken out of the balancer (when
  ``remove_failed_replicas`` and ``replica_is_dead(exc)`` says the error means the replica is gone;
  other errors are retried with backoff), since a dead replica with nothing in flight would otherwise attract
  every retry, and the request is retried elsewhere; ``on_replica_removed(replica_id)`` is then
  called (the rollout service may start a replacement).
- ``replica_versions()``: per replica, the results with tokens it returned, the lowest and
  highest ``param_version`` on them, and how many were ``behind``: generated with weights older
  than the version in force when the request was sent. Every weight sync loads the new version
  into every replica before the rollouter hears of it, so ``behind`` stays 0 unless a replica
  serves stale weights (a replacement that missed a broadcast, say).

Rewards: with ``score`` (``data.reward.SampleScorer``) a sample whose responses all finished
is scored in a worker thread before it is queued (``Sample.scores``); a reward call that raises or
hangs past its timeout fails the rollouter with the scorer's one-line error.

A sample counts as in flight from its start until ``queue.put`` returns; then
``total_generated_samples`` and ``step_generated_samples`` go up, so at every moment
``generated == queued + consumed by the trainer``. The ``(t, in flight, capacity)`` history for
``rollout_resource_utilization`` gets a point on every start, completion and capacity change,
seeded at ``start()`` and at every ``on_weight_sync``.

The balancer and the queue are called directly (synchronous calls plus ``await lb.wait_routable()``
and ``await queue.put``), so they must live in the same process and event loop as the rollouter:
the Ray actor that wraps it should host all three. Nothing here blocks the loop except pulling the
next prompt from the ``prompts`` iterator, which must therefore be cheap (prompts built in memory).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from data.reward import RewardFailed
from data.types import GenerationRequest, GenerationResult, Response, Sample, SamplingSpec
from loop.readonly import ReadOnly
from loop.staleness import StalenessGate, record_change
from metrics import (
    ROLLOUT_RESOURCE_UTILIZATION,
    STEP_GENERATED_SAMPLES,
    STEP_GENERATED_TOKENS,
    WASTE_SWITCH_S,
    WastedWork,
    rollout_resource_utilization,
)
from rollout.message_queue import QueueClosed
from rollout.wakeups import Wakeup

__all__ = ["EngineLike", "Rollouter", "sample_uid"]

log = logging.getLogger(__name__)

Prompt = tuple[int, int, Sequence[int]]
"""(epoch, prompt_index, prompt_tokens)."""


class EngineLike(Protocol):
    async def generate(self, request: GenerationRequest) -> GenerationResult: ...


class _BalancerLike(Protocol):
    num_active: int

    def acquire(self, request_key: str) -> str | None: ...

    def release(self, replica_id: str) -> None: ...

    def forget(self, request_key: str) -> bool: ...

    def remove_replicas(self, ids: Sequence[str]) -> None: ...

    def is_routable(self, replica_id: str) -> bool: ...

    def on_change(self, callback: Callable[[int], None]) -> Callable[[], None]: ...

    def wait_routable(self) -> Awaitable[None]: ...


class _QueueLike(Protocol):
    capacity: int

    def size(self) -> int: ...

    async def put(self, sample: Any) -> None: ...

    def close(self) -> None: ...


def sample_uid(epoch: int, prompt_index: int) -> str:
    """The sample uid of ``data.types.Sample``: ``e{epoch}-p{index}``."""
    return f"e{epoch}-p{prompt_index}"


def response_request_id(uid: str, j: int) -> str:
    """The request id of response ``j`` of sample ``uid``; the same on every retry."""
    return f"{uid}-r{j}"


class Rollouter:
    """Keeps the rollout replicas busy within the staleness bounds (see the module docstring)."""

    def __init__(
        self,
        prompts: Iterable[Prompt],
        *,
        n: int,
        sampling: SamplingSpec,
        lb: _BalancerLike,
        engine_for: Callable[[str], EngineLike],
        queue: _QueueLike,
        max_required_samples: int,
        concurrent_samples_per_replica: int,
        partial_rollout: bool = True,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = 0,
        param_version: int = 0,
        retry_backoff_s: float = 0.005,
        max_retry_backoff_s: float = 0.1,
        remove_failed_replicas: bool = True,
        replica_is_dead: Callable[[BaseException], bool] | None = None,
        on_replica_removed: Callable[[str], None] | None = None,
        score: Callable[[Sample], Any] | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if sampling.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if max_required_samples < 1:
            raise ValueError(f"max_required_samples must be >= 1, got {max_required_samples}")
        if concurrent_samples_per_replica < 1:
            raise ValueError(
                f"concurrent_samples_per_replica must be >= 1, got {concurrent_samples_per_replica}"
            )
        if retry_backoff_s < 0 or max_retry_backoff_s < retry_backoff_s:
            raise ValueError("need 0 <= retry_backoff_s <= max_retry_backoff_s")

        self._prompts = iter(prompts)
        self._n = int(n)
        self._sampling = sampling
        self._lb = lb
        self._engine_for = engine_for
        self._queue = queue
        self._max_required = int(max_required_samples)
        self._per_replica = int(concurrent_samples_per_replica)
        self._partial = bool(partial_rollout)
        self._clock = clock
        self._seed = seed
        self._version = int(param_version)
        self._backoff_s = float(retry_backoff_s)
        self._max_backoff_s = float(max_retry_backoff_s)
        self._remove_failed = bool(remove_failed_replicas)
        self._replica_is_dead = replica_is_dead or (lambda exc: True)
        self._on_replica_removed = on_replica_removed
        self._score = score

        self._gate = StalenessGate(self._max_required, self._per_replica)
        self._gate.set_routable(lb.num_active)
        self._tasks: dict[str, asyncio.Task[None]] = {}  # running samples by uid
        self._undelivered: dict[str, Sample] = {}  # started, not yet in the queue
        self._total_started = 0
        self._total_generated = 0
        self._step_generated = 0
        self._step_generated_tokens = 0
        self._aborted_requests = 0
        self._aborted_tokens = 0
        self._reprefilled_tokens = 0
        self._rejected_requests = 0
        self._failed_requests = 0
        self._discarded_tokens = 0
        self._resumed_tokens = 0
        self._failed_replicas: list[str] = []
        self._served: dict[str, dict[str, int]] = {}  # replica id -> replica_versions() entry
        self._window_waste = WastedWork()
        self._history: list[tuple[float, int, int]] = []
        self._last_window: tuple[list[tuple[float, int, int]], float] | None = None

        self._paused = False
        self._stopped = False
        self._prompts_done = False
        self._exhausted = False
        self._error: BaseException | None = None
        self._feeder: asyncio.Task[None] | None = None
        self._lookahead: str | None = None  # prompt taken from the iterator, not started yet
        self._signal = Wakeup()

        self._unsubscribe = [lb.on_change(self._on_replicas_changed)]
        queue_on_change = getattr(queue, "on_change", None)
        if callable(queue_on_change):
            self._unsubscribe.append(queue_on_change(lambda _size: self._signal.notify()))

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start feeding (call from inside the running event loop); seeds the history."""
        if self._feeder is not None or self._stopped:
            raise RuntimeError("a Rollouter starts once")
        loop = asyncio.get_running_loop()
        self._history = [(self._clock(), len(self._tasks), self._gate.capacity)]
        self._feeder = loop.create_task(self._feed(), name="rollouter-feeder")

    async def stop(self) -> None:
        """Cancel the feeder and every sample in flight and wait until they have unwound.

        Their load-balancer slots are released; the interrupted samples stay listed in
        ``in_flight_uids()``. The queue is left open (the trainer may still drain it). Final.
        """
        self._stopped = True
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        tasks = [t for t in (self._feeder, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._signal.notify()

    def pause(self) -> None:
        """Start no new sample; those in flight go on."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._signal.notify()

    async def wait_idle(self) -> None:
        """Return when no sample is in flight (use after ``pause()`` to drain).

        Every ``wait_*`` raises ``RuntimeError`` when the rollouter fails or is stopped before
        its condition holds.
        """
        await self._wait(lambda: not self._tasks)

    async def wait_exhausted(self) -> None:
        """Return when every prompt was generated and queued (the queue is then closed)."""
        await self._wait(lambda: self._exhausted)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; re-checked after every state change here."""
        await self._wait(predicate)

    # ------------------------------------------------------------- staleness

    def on_weight_sync(self, new_version: int) -> dict[str, float]:
        """New weights everywhere: close the metrics window and reset the staleness counters.

        Returns ``dynamic_resource/rollout_resource_utilization`` over the window since the
        previous sync (or ``start()``), ``fully_async/rollouter/step_generated_samples`` (and
        ``step_generated_tokens``: response tokens of those samples) and the window's ``waste/*`` counters (without ``waste/switch_s``, which the controller owns).
        """
        new_version = int(new_version)
        if new_version < self._version:
            raise ValueError(f"param version must not go back: {self._version} -> {new_version}")
        now = self._clock()
        history = self._history
        utilization = rollout_resource_utilization(history, now) if history else 0.0
        total = self.waste()
        window = WastedWork(
            aborted_requests=total.aborted_requests - self._window_waste.aborted_requests,
            aborted_tokens=total.aborted_tokens - self._window_waste.aborted_tokens,
            reprefilled_tokens=total.reprefilled_tokens - self._window_waste.reprefilled_tokens,
        )
        metrics = {
            ROLLOUT_RESOURCE_UTILIZATION: utilization,
            STEP_GENERATED_SAMPLES: float(self._step_generated),
            STEP_GENERATED_TOKENS: float(self._step_generated_tokens),
            **window.as_metrics(),
        }
        metrics.pop(WASTE_SWITCH_S, None)

        self._last_window = (list(history), now)
        self._window_waste = total
        self._version = new_version
        self._gate.on_sync(len(self._tasks), self._queue.size())
        self._step_generated = 0
        self._step_generated_tokens = 0
        if history or self._feeder is not None:
            self._history = [(now, len(self._tasks), self._gate.capacity)]
        self._signal.notify()
        return metrics

    # ------------------------------------------------------------- reporting

    @property
    def param_version(self) -> int:
        return self._version

    @property
    def max_concurrent_samples(self) -> int:
        return self._gate.capacity

    @property
    def max_required_samples(self) -> int:
        return self._max_required

    @property
    def in_flight_samples(self) -> int:
        return len(self._tasks)

    @property
    def started_this_version(self) -> int:
        return self._gate.started_this_version

    total_generated_samples = ReadOnly[int]("_total_generated")
    step_generated_samples = ReadOnly[int]("_step_generated")
    paused = ReadOnly[bool]("_paused")
    exhausted = ReadOnly[bool](
        "_exhausted", "All prompts were started and every sample was queued; the queue is closed.")

    error = ReadOnly[BaseException | None]("_error", "The unexpected error that stopped feeding, if any.")

    @property
    def failed_replicas(self) -> list[str]:
        """Replicas taken out of the balancer because ``generate`` raised on them."""
        return list(self._failed_replicas)

    def replica_versions(self) -> dict[str, dict[str, int]]:
        """Per replica: ``results`` (with tokens), ``min_version``, ``max_version`` and ``behind``
        (results generated with weights older than the version in force at their request)."""
        return {rid: dict(entry) for rid, entry in self._served.items()}

    def in_flight_uids(self) -> list[str]:
        """Uids of the prompts taken from the iterator but not queued, in the order taken.

        These are the samples in flight (after ``stop()``: the interrupted ones) plus, last, the
        one prompt the feeder looked ahead at and has not started yet. A resumed run must
        generate them again.
        """
        uids = list(self._undelivered)
        if self._lookahead is not None and self._lookahead not in self._undelivered:
            uids.append(self._lookahead)
        return uids

    def history(self) -> list[tuple[float, int, int]]:
        """``(t, in flight, capacity)`` change points of the current window."""
        return list(self._history)

    def last_window(self) -> tuple[list[tuple[float, int, int]], float] | None:
        """The history and end time of the window closed by the last ``on_weight_sync``."""
        return self._last_window

    def waste(self) -> WastedWork:
        """Cumulative wasted work since construction (``switch_s`` is 0 here)."""
        return WastedWork(
            aborted_requests=self._aborted_requests,
            aborted_tokens=self._aborted_tokens,
            reprefilled_tokens=self._reprefilled_tokens,
        )

    def stats(self) -> dict[str, Any]:
        return {
            "total_started_samples": self._total_started,
            "total_generated_samples": self._total_generated,
            "in_flight_samples": len(self._tasks),
            "started_this_version": self._gate.started_this_version,
            "max_concurrent_samples": self._gate.capacity,
            "max_required_samples": self._max_required,
            "step_generated_samples": self._step_generated,
            "aborted_requests": self._aborted_requests,
            "aborted_tokens": self._aborted_tokens,
            "reprefilled_tokens": self._reprefilled_tokens,
            "rejected_requests": self._rejected_requests,
            "failed_requests": self._failed_requests,
            "discarded_tokens": self._discarded_tokens,
            "resumed_tokens": self._resumed_tokens,
            "param_version": self._version,
            "queue_size": self._queue.size(),
            "paused": self._paused,
            "exhausted": self._exhausted,
        }

    # ---------------------------------------------------------------- feeder

    def _can_start(self) -> bool:
        return (
            not self._paused
            and not self._stopped
            and self._gate.allows(len(self._tasks), self._queue.size(), self._queue.capacity)
        )

    async def _feed(self) -> None:
        try:
            # Look one prompt ahead so that running out is noticed as soon as the last prompt
            # started (not only when the staleness rules would allow one more).
            for epoch, index, prompt in self._prompts:
                self._lookahead = sample_uid(int(epoch), int(index))
                await self._signal.wait_until(self._can_start)
                self._lookahead = None
                self._start_sample(int(epoch), int(index), list(prompt))
            self._prompts_done = True
            self._maybe_finish()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced through error / wait_*
            self._fail(exc)

    def _start_sample(self, epoch: int, index: int, prompt: list[int]) -> None:
        uid = sample_uid(epoch, index)
        if uid in self._undelivered:
            raise ValueError(f"prompt {uid} is already being generated")
        sample = Sample(
            uid=uid,
            epoch=epoch,
            prompt_index=index,
            prompt_tokens=prompt,
            responses=[Response() for _ in range(self._n)],
            started_version=self._version,
        )
        self._undelivered[uid] = sample
        self._gate.started()
        self._total_started += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run_sample(sample), name=f"rollout-{uid}")
        self._tasks[uid] = task
        task.add_done_callback(self._sample_task_done)
        self._record()
        self._signal.notify()

    async def _run_sample(self, sample: Sample) -> None:
        async with asyncio.TaskGroup() as group:
            for j in range(self._n):
                group.create_task(self._run_response(sample, j))
        if self._score is not None:
            # Scored where it completes, off the trainer's path, in a worker thread (a reward
            # call may take seconds); a failure fails the rollouter, naming the sample.
            await asyncio.to_thread(self._score, sample)
        await self._queue.put(sample)
        # Delivered: from here on the sample is in the queue, not in flight (no await below).
        del self._undelivered[sample.uid]
        self._tasks.pop(sample.uid, None)
        self._total_generated += 1
        self._step_generated += 1
        self._step_generated_tokens += sample.generated_tokens
        self._record()
        self._maybe_finish()
        self._signal.notify()

    def _sample_task_done(self, task: asyncio.Task[None]) -> None:
        uid = task.get_name().removeprefix("rollout-")
        if self._tasks.get(uid) is task:
            del self._tasks[uid]  # ended without delivering (error or cancel)
            self._record()
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if self._stopped or isinstance(exc, QueueClosed):
                # Shutting down: the sample stays in in_flight_uids() to be generated again.
                log.warning("sample %s was not queued: %r", uid, exc)
            else:
                self._fail(exc)
        self._signal.notify()

    def _maybe_finish(self) -> None:
        if self._prompts_done and not self._tasks and not self._exhausted and not self._stopped:
            self._exhausted = True
            self._queue.close()
            self._signal.notify()

    def _fail(self, exc: BaseException) -> None:
        log.error("rollouter failed: %r", exc, exc_info=exc)
        if self._error is None:
            self._error = exc
        self._paused = True
        self._signal.notify()

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        """Wait for ``predicate``; raise when the rollouter failed or was stopped first."""

        def done() -> bool:
            return self._error is not None or self._stopped or predicate()

        await self._signal.wait_until(done)
        if predicate():
            return
        if isinstance(self._error, RewardFailed):  # its own one line (names function and sample)
            raise RewardFailed(str(self._error)) from self._error
        if self._error is not None:
            raise RuntimeError("the rollouter failed") from self._error
        raise RuntimeError("the rollouter was stopped")

    # -------------------------------------------------------------- requests

    async def _run_response(self, sample: Sample, j: int) -> None:
        response = sample.responses[j]
        request_id = response_request_id(sample.uid, j)
        budget = self._sampling.max_new_tokens
        calls = 0  # engine calls that returned a result
        idle_retries = 0  # consecutive retries without progress
        try:
            while True:
                remaining = budget - len(response.tokens)
                if remaining <= 0:  # the budget was used up by aborted calls
                    response.finish_reason = "length"
                    return
                replica = self._lb.acquire(request_id)
                if replica is None:
                    await self._lb.wait_routable()
                    continue
                prompt = sample.prompt_tokens + response.tokens
                spec = dataclasses.replace(
                    self._sampling,
                    max_new_tokens=remaining,
                    seed=self._request_seed(request_id, calls),
                )
                request = GenerationRequest(request_id, prompt, spec)
                sent_version = self._version
                failure: Exception | None = None
                try:
                    engine = self._engine_for(replica)
                    result: GenerationResult | None = await engine.generate(request)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a replica failure; retried elsewhere
                    result, failure = None, exc
                finally:
                    self._lb.release(replica)

                if result is None:
                    self._on_replica_failure(replica, request_id, failure)
                    idle_retries += 1
                    await self._back_off(idle_retries)
                    continue

                if result.tokens:
                    self._note_served(replica, result.param_version, sent_version)
                did_work = bool(result.tokens) or result.prefill_tokens > 0
                finished = result.finish_reason != "abort"
                if calls and (did_work or finished):
                    # Every call after the first prefills its prompt again.
                    self._reprefilled_tokens += result.prefill_tokens or len(prompt)
                    self._resumed_tokens += len(response.tokens)
                if did_work or finished:
                    calls += 1

                if result.finish_reason != "abort":
                    response.extend(result)
                    return

                if not did_work:
                    # Turned away (e.g. a paused replica): choose afresh next time.
                    self._rejected_requests += 1
                    self._lb.forget(request_id)
                    idle_retries += 1
                    await self._back_off(idle_retries)
                    continue

                self._aborted_requests += 1
                response.aborts += 1
                if self._partial:
                    response.extend(result)
                    self._aborted_tokens += len(response.tokens)
                else:
                    lost = len(response.tokens) + len(result.tokens)
                    self._aborted_tokens += lost
                    self._discarded_tokens += lost
                    response.tokens.clear()
                    response.logprobs.clear()
                    response.min_version = response.max_version = None
                    response.finish_reason = None
                if result.tokens:
                    idle_retries = 0
                    await asyncio.sleep(0)
                else:
                    idle_retries += 1
                    await self._back_off(idle_retries)
        finally:
            self._lb.forget(request_id)

    def _on_replica_failure(self, replica: str, request_id: str, exc: Exception | None) -> None:
        self._failed_requests += 1
        log.warning("generate(%s) failed on replica %s: %r", request_id, replica, exc)
        self._lb.forget(request_id)
        if exc is not None and self._replica_is_dead(exc):
            self.replica_lost(replica)

    def replica_lost(self, replica: str) -> bool:
        """``replica``'s actor died (a request on it failed, or its death was seen while it was
        idle): take it out of the load balancer and report it, once. Returns whether it did."""
        if not (self._remove_failed and self._lb.is_routable(replica)):
            return False
        log.warning("removing replica %s from the load balancer: its actor died", replica)
        self._failed_replicas.append(replica)
        self._lb.remove_replicas([replica])
        if self._on_replica_removed is not None:
            self._on_replica_removed(replica)
        return True

    def _note_served(self, replica: str, version: int, sent_version: int) -> None:
        entry = self._served.get(replica)
        if entry is None:
            entry = self._served[replica] = {"results": 0, "min_version": version, "max_version": version,
                                             "behind": 0}
        entry["results"] += 1
        entry["min_version"] = min(entry["min_version"], version)
        entry["max_version"] = max(entry["max_version"], version)
        entry["behind"] += version < sent_version

    async def _back_off(self, attempt: int) -> None:
        delay = min(self._backoff_s * (2 ** (attempt - 1)), self._max_backoff_s)
        await asyncio.sleep(delay)

    def _request_seed(self, request_id: str, attempt: int) -> int | None:
        if self._seed is None:
            return self._sampling.seed
        digest = hashlib.blake2b(f"{self._seed}:{request_id}:{attempt}".encode(), digest_size=4)
        return int.from_bytes(digest.digest(), "big") & 0x7FFFFFFF

    # --------------------------------------------------------------- history

    def _on_replicas_changed(self, num_active: int) -> None:
        if self._gate.set_routable(num_active):
            self._record()
        self._signal.notify()

    def _record(self) -> None:
        if not self._history:
            return  # not started: the window is seeded by start()
        record_change(self._history, self._clock(), len(self._tasks), self._gate.capacity)
