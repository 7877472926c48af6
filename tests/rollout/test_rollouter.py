"""The rollouter keeps the replicas busy within the staleness bounds and loses no sample.

Two in-test engines stand in for real ones:

- ``FakeEngine`` generates one token per ``await asyncio.sleep(delay)``; token values are the
  absolute position in the sequence (prompt length + index), so a response continued across
  retries is exactly ``range(len(prompt), len(prompt) + budget)``. It can hold a request after
  ``hold_after`` tokens until it is aborted, turn requests away while ``paused``, or raise.
- ``ManualEngine`` holds every request until the test finishes it, so counts can be checked at
  exact moments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from data.types import GenerationRequest, GenerationResult, SamplingSpec
from metrics import ROLLOUT_RESOURCE_UTILIZATION, STEP_GENERATED_SAMPLES, STEP_GENERATED_TOKENS
from rollout.load_balancer import LoadBalancer
from rollout.message_queue import MessageQueue
from rollout.rollouter import Rollouter

PROMPT_LEN = 5


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeEngine:
    def __init__(self, name: str, *, version: int = 0, delay: float = 0.0,
                 hold_after: int | None = None, fail: bool = False) -> None:
        self.name = name
        self.param_version = version
        self.delay = delay
        self.hold_after = hold_after
        self.fail = fail
        self.paused = False
        self.reject_s = 0.0  # how long a paused replica takes to turn a request away
        self.calls: list[GenerationRequest] = []
        self.held: set[str] = set()
        self._aborts: dict[str, asyncio.Event] = {}

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls.append(request)
        if self.fail:
            raise ConnectionError(f"replica {self.name} is gone")
        if self.paused:
            await asyncio.sleep(self.reject_s)
            return GenerationResult(request.request_id, [], [], "abort", self.param_version, 0)
        abort = self._aborts[request.request_id] = asyncio.Event()
        start = len(request.prompt_tokens)
        tokens: list[int] = []
        try:
            while len(tokens) < request.sampling.max_new_tokens and not abort.is_set():
                if self.hold_after is not None and len(tokens) >= self.hold_after:
                    self.held.add(request.request_id)
                    await abort.wait()
                    break
                await asyncio.sleep(self.delay)
                if not abort.is_set():
                    tokens.append(start + len(tokens))
        finally:
            self._aborts.pop(request.request_id, None)
            self.held.discard(request.request_id)
        reason = "abort" if abort.is_set() else "length"
        return GenerationResult(request.request_id, tokens, [-1.0] * len(tokens), reason,
                                self.param_version, prefill_tokens=start)

    def abort_all(self) -> int:
        for event in self._aborts.values():
            event.set()
        return len(self._aborts)


class ManualEngine:
    """Every request waits until ``finish`` completes it with its whole budget."""

    def __init__(self, version: int = 0) -> None:
        self.param_version = version
        self.pending: list[tuple[GenerationRequest, asyncio.Future[None]]] = []
        self.calls: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls.append(request)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((request, fut))
        await fut
        start = len(request.prompt_tokens)
        tokens = list(range(start, start + request.sampling.max_new_tokens))
        return GenerationResult(request.request_id, tokens, [0.0] * len(tokens), "length",
                                self.param_version, prefill_tokens=start)

    def finish(self, k: int) -> None:
        for _, fut in self.pending[:k]:
            fut.set_result(None)
        del self.pending[:k]


def prompts(count: int, epoch: int = 0) -> Iterator[tuple[int, int, list[int]]]:
    return ((epoch, i, [100 + i] * PROMPT_LEN) for i in range(count))


def make(lb, engines, queue, *, count=10, n=1, max_new_tokens=8, max_required=12,
         per_replica=4, partial_rollout=True, clock=None, **kw) -> Rollouter:
    return Rollouter(
        prompts(count),
        n=n,
        sampling=SamplingSpec(max_new_tokens=max_new_tokens),
        lb=lb,
        engine_for=engines.__getitem__,
        queue=queue,
        max_required_samples=max_required,
        concurrent_samples_per_replica=per_replica,
        partial_rollout=partial_rollout,
        clock=clock or FakeClock(),
        retry_backoff_s=0.001,
        max_retry_backoff_s=0.004,
        **kw,
    )


async def settle(rounds: int = 30) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def until(predicate, timeout_s: float = 2.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


# --------------------------------------------------------------------------- staleness


def test_staleness_pauses_after_max_required_starts_and_a_sync_lets_exactly_the_headroom_start():
    # required 4, trigger 2, staleness 0.5 -> max_required = 4 * (1 + 0.5) * 2 = 12.
    max_required = int(4 * (1 + 0.5) * 2)
    assert max_required == 12

    async def scenario():
        engine = ManualEngine()
        lb = LoadBalancer(["r"])
        queue = MessageQueue(max_required)
        ro = make(lb, {"r": engine}, queue, count=40, max_required=max_required, per_replica=100)
        ro.start()
        await settle()
        first = (ro.in_flight_samples, ro.started_this_version, ro.max_concurrent_samples)
        engine.finish(9)  # 9 queued, 3 in flight
        await settle()
        after_finish = (ro.in_flight_samples, queue.size(), ro.stats()["total_started_samples"])
        await queue.get_batch(4)  # the trainer takes 4: 5 queued
        await settle()
        metrics = ro.on_weight_sync(1)  # started = 3 in flight + 5 queued = 8 -> 4 more may start
        await settle()
        should_activate = (ro.in_flight_samples, ro.started_this_version,
                      ro.stats()["total_started_samples"], ro.param_version)
        stamped = sorted(s.started_version for s in queue.drain())
        await ro.stop()
        return first, after_finish, metrics, should_activate, stamped

    first, after_finish, metrics, should_activate, stamped = asyncio.run(scenario())
    assert first == (12, 12, 12)
    assert after_finish == (3, 9, 12)
    assert (metrics[STEP_GENERATED_SAMPLES], metrics[STEP_GENERATED_TOKENS]) == (9, 72)  # 9 × n 1 × 8 tokens
    assert should_activate == (7, 12, 16, 1)
    assert stamped == [0] * 5


def test_a_full_queue_stops_new_samples_until_the_trainer_pulls():
    async def scenario():
        lb = LoadBalancer(["r"])
        queue = MessageQueue(2)
        ro = make(lb, {"r": FakeEngine("r")}, queue, count=10, max_required=10, per_replica=1)
        ro.start()
        await until(lambda: queue.size() == 2)
        await settle()
        stalled = ro.stats()["total_started_samples"]
        await queue.get_batch(1)
        await until(lambda: queue.size() == 2)
        await settle()
        resumed = ro.stats()["total_started_samples"]
        await ro.stop()
        return stalled, resumed

    assert asyncio.run(scenario()) == (2, 3)


def test_capacity_follows_the_routable_replicas_and_is_capped_by_max_required():
    clock = FakeClock(0.0)

    async def scenario():
        engines = {rid: ManualEngine() for rid in ("a", "b", "c")}
        lb = LoadBalancer(["a"])
        queue = MessageQueue(5)
        ro = make(lb, engines, queue, count=20, max_required=5, per_replica=2, clock=clock)
        ro.start()
        await settle()
        one = (ro.max_concurrent_samples, ro.in_flight_samples)
        clock.t = 1.0
        lb.add_replicas(["b", "c"])  # min(3 * 2, 5) = 5
        await settle()
        three = (ro.max_concurrent_samples, ro.in_flight_samples)
        clock.t = 2.0
        lb.remove_replicas(["b", "c"])  # back to 2; the 5 in flight stay
        await settle()
        back = (ro.max_concurrent_samples, ro.in_flight_samples)
        clock.t = 3.0
        engines["a"].finish(2)
        await settle()
        after = (ro.in_flight_samples, ro.started_this_version)
        history = ro.history()
        await ro.stop()
        return one, three, back, after, history

    one, three, back, after, history = asyncio.run(scenario())
    assert one == (2, 2)
    assert three == (5, 5)
    assert back == (2, 5)
    assert after == (3, 5)  # still above capacity 2: nothing new starts
    assert history == [(0.0, 2, 2), (1.0, 5, 5), (2.0, 5, 2), (3.0, 3, 2)]


# --------------------------------------------------------------------------- abort and retry


def _abort_mid_request(partial_rollout: bool):
    """One response of budget 8 is aborted on `a` (version 0) after 3 tokens, while no replica is
    routable, then finishes on `b` (version 1)."""

    async def scenario():
        a = FakeEngine("a", version=0, hold_after=3)
        b = FakeEngine("b", version=1)
        lb = LoadBalancer(["a"])
        queue = MessageQueue(4)
        ro = make(lb, {"a": a, "b": b}, queue, count=1, max_new_tokens=8, max_required=4,
                  partial_rollout=partial_rollout)
        ro.start()
        await until(lambda: a.held)
        lb.remove_replicas(["a"])  # deactivate order: remove, then abort
        assert a.abort_all() == 1
        await settle()
        waited_for_a_replica = not b.calls and ro.in_flight_samples == 1
        lb.add_replicas(["b"])
        await ro.wait_exhausted()
        [sample] = await queue.get_batch(1)
        metrics = ro.on_weight_sync(1)
        quiet = ro.on_weight_sync(2)  # nothing happened in this window
        assert quiet["waste/aborted_requests"] == quiet["waste/reprefilled_tokens"] == 0
        assert quiet[STEP_GENERATED_SAMPLES] == 0
        return sample, b.calls, ro.stats(), metrics, waited_for_a_replica, lb.in_flight()

    return asyncio.run(scenario())


def test_partial_rollout_resumes_an_aborted_request_elsewhere_within_the_same_budget():
    sample, b_calls, stats, metrics, waited, in_flight = _abort_mid_request(partial_rollout=True)
    prompt = [100] * PROMPT_LEN
    [retry] = b_calls
    assert retry.prompt_tokens == prompt + [5, 6, 7]
    assert retry.sampling.max_new_tokens == 5
    [response] = sample.responses
    assert response.tokens == list(range(5, 13))  # 3 from a + 5 from b, contiguous
    assert len(response.tokens) == 8 and response.finish_reason == "length"
    assert (response.min_version, response.max_version, response.aborts) == (0, 1, 1)
    assert (sample.min_version, sample.max_version) == (0, 1)
    assert (stats["aborted_requests"], stats["aborted_tokens"]) == (1, 3)
    assert stats["reprefilled_tokens"] == PROMPT_LEN + 3
    assert stats["resumed_tokens"] == 3
    assert metrics["waste/reprefilled_tokens"] == 8 and metrics["waste/aborted_requests"] == 1
    assert waited and in_flight == 0


def test_without_partial_rollout_an_aborted_request_restarts_from_scratch():
    sample, b_calls, stats, metrics, waited, _ = _abort_mid_request(partial_rollout=False)
    [retry] = b_calls
    assert retry.prompt_tokens == [100] * PROMPT_LEN
    assert retry.sampling.max_new_tokens == 8
    [response] = sample.responses
    assert response.tokens == list(range(5, 13))  # all from b
    assert (response.min_version, response.max_version) == (1, 1)
    assert (stats["aborted_tokens"], stats["discarded_tokens"]) == (3, 3)
    assert stats["reprefilled_tokens"] == PROMPT_LEN
    assert metrics["waste/aborted_tokens"] == 3
    assert waited


def test_an_aborted_request_returns_to_its_still_routable_replica_unless_sticky_was_cleared():
    async def scenario(clear: bool):
        held, other = FakeEngine("b", hold_after=2), FakeEngine("a")
        lb = LoadBalancer(["b"])
        queue = MessageQueue(4)
        ro = make(lb, {"a": other, "b": held}, queue, count=1, max_required=4)
        ro.start()
        await until(lambda: held.held)
        lb.add_replicas(["a"])  # idle, and first in id order
        if clear:
            lb.clear_sticky()
        held.hold_after = None
        held.abort_all()
        await ro.wait_exhausted()
        return len(held.calls), len(other.calls)

    assert asyncio.run(scenario(clear=False)) == (2, 0)
    assert asyncio.run(scenario(clear=True)) == (1, 1)


def test_a_paused_replica_turning_requests_away_is_retried_with_backoff_and_not_counted_as_abort():
    async def scenario():
        engine = FakeEngine("r")
        engine.paused = True
        lb = LoadBalancer(["r"])
        queue = MessageQueue(4)
        ro = make(lb, {"r": engine}, queue, count=1, max_required=4)
        ro.start()
        await until(lambda: len(engine.calls) >= 3)
        engine.paused = False
        await ro.wait_exhausted()
        [sample] = await queue.get_batch(1)
        return sample, ro.stats()

    sample, stats = asyncio.run(scenario())
    assert stats["rejected_requests"] >= 3
    assert (stats["aborted_requests"], stats["reprefilled_tokens"]) == (0, 0)
    assert sample.responses[0].tokens == list(range(5, 13))


def test_a_rebalance_drain_reaches_zero_and_stays_there_while_routing_is_held_then_the_retries_spread():
    """The controller's rebalance: hold routing, pause + abort every active replica, wait until
    nothing is in flight, resume, unhold. Without the hold, the aborted requests' retries go
    straight back to the paused replicas (turned away, backing off, retried...); with hundreds of
    requests and Ray round trips the balancer then always counts some in flight and the drain
    never completes (seen at 32 emulated GPUs: 6–44 s drains, then the 60 s timeout). Held, the
    retries wait in ``wait_routable``: the count drops to zero and stays there."""

    async def scenario(hold: bool):
        engines = {r: FakeEngine(r, hold_after=2) for r in ("a", "b")}
        for e in engines.values():
            e.reject_s = 0.005  # a round trip to a remote replica
        lb = LoadBalancer(["a"])
        queue = MessageQueue(32)
        ro = make(lb, engines, queue, count=16, max_required=32, per_replica=16)
        ro.start()
        await until(lambda: len(engines["a"].held) == 16)
        lb.add_replicas(["b"])  # the fresh hybrid
        lb.clear_sticky()
        if hold:
            lb.hold()
        for e in engines.values():  # pool.abort: pause, then abort what runs
            e.paused = True
            e.abort_all()
        seen = []
        for _ in range(100):  # the drain poll, kept going for ~0.1 s after it first reads 0
            seen.append(lb.in_flight(["a", "b"]))
            await asyncio.sleep(0.001)
        held_calls = {r: len(e.calls) for r, e in engines.items()}
        for e in engines.values():  # resume
            e.paused = False
            e.hold_after = None
        lb.unhold()
        await ro.wait_exhausted()
        samples = await queue.get_batch(16)
        return seen, samples, held_calls, {r: len(e.calls) for r, e in engines.items()}

    seen, samples, held_calls, calls = asyncio.run(scenario(hold=True))
    first_zero = seen.index(0)
    assert set(seen[first_zero:]) == {0}  # drained, and nothing bounces back while held
    assert held_calls == {"a": 16, "b": 0}  # no retry was sent to a paused replica
    assert len(samples) == 16
    assert all(s.responses[0].tokens == list(range(5, 13)) for s in samples)  # nothing lost
    assert calls["b"] > 0  # the retries spread onto the fresh replica


def test_a_held_balancer_routes_nothing_and_unhold_wakes_the_waiters():
    async def scenario():
        lb = LoadBalancer(["a"])
        lb.hold()
        assert lb.acquire("k") is None and lb.in_flight() == 0
        waiter = asyncio.ensure_future(lb.wait_routable())
        await settle()
        assert not waiter.done()
        lb.unhold()
        await asyncio.wait_for(waiter, 1.0)
        assert lb.acquire("k") == "a"
        return lb.stats()

    assert asyncio.run(scenario())["held"] == 0


def test_a_replica_whose_engine_raises_is_taken_out_and_its_requests_finish_elsewhere():
    async def scenario():
        bad, good = FakeEngine("a", fail=True), FakeEngine("b")
        lb = LoadBalancer(["a", "b"])
        queue = MessageQueue(8)
        ro = make(lb, {"a": bad, "b": good}, queue, count=6, n=2, max_required=8)
        ro.start()
        await ro.wait_exhausted()
        samples = await queue.get_batch(6)
        return samples, ro.stats(), ro.failed_replicas, lb.active_ids()

    samples, stats, failed, active = asyncio.run(scenario())
    assert failed == ["a"] and active == ("b",)
    assert stats["failed_requests"] >= 1
    assert sorted(s.uid for s in samples) == [f"e0-p{i}" for i in range(6)]
    assert all(r.tokens == list(range(5, 13)) for s in samples for r in s.responses)


# --------------------------------------------------------------------------- accounting


def test_every_sample_is_accounted_for_when_a_replica_is_removed_and_aborted_mid_generation():
    count, n, budget = 24, 2, 6

    async def scenario():
        engines = {"s": FakeEngine("s", delay=0.0005),
                   "h": FakeEngine("h", version=1, delay=0.0005)}
        lb = LoadBalancer(["s", "h"])
        queue = MessageQueue(8)
        ro = make(lb, engines, queue, count=count, n=n, max_new_tokens=budget, max_required=8,
                  per_replica=3)
        consumed: list = []
        checks: list[tuple[int, int, int]] = []

        async def trainer():
            while True:
                batch = await queue.get_batch(4)
                if not batch:
                    return
                consumed.extend(batch)
                checks.append((ro.total_generated_samples, len(consumed), queue.size()))
                ro.on_weight_sync(ro.param_version + 1)

        ro.start()
        trainer_task = asyncio.ensure_future(trainer())
        await until(lambda: ro.total_generated_samples >= 4 and engines["h"]._aborts)
        lb.remove_replicas(["h"])
        aborted = engines["h"].abort_all()
        await ro.wait_exhausted()
        await asyncio.wait_for(trainer_task, 5.0)
        return consumed, checks, ro.stats(), aborted, lb.in_flight()

    consumed, checks, stats, aborted, in_flight = asyncio.run(scenario())
    uids = [s.uid for s in consumed]
    assert sorted(uids) == sorted(f"e0-p{i}" for i in range(count))  # none lost, none twice
    assert all(generated == taken + queued for generated, taken, queued in checks)
    assert stats["total_generated_samples"] == count and stats["in_flight_samples"] == 0
    assert aborted >= 1 and stats["aborted_requests"] == aborted
    assert all(r.tokens == list(range(PROMPT_LEN, PROMPT_LEN + budget))
               for s in consumed for r in s.responses)
    assert in_flight == 0


def test_when_the_prompts_run_out_the_rollouter_is_exhausted_and_the_queue_closed():
    async def scenario():
        lb = LoadBalancer(["r"])
        queue = MessageQueue(8)
        ro = make(lb, {"r": FakeEngine("r")}, queue, count=3, n=2, max_required=8)
        ro.start()
        await ro.wait_exhausted()
        return queue.closed, await queue.get_batch(4), ro.stats()

    closed, rest, stats = asyncio.run(scenario())
    assert closed and len(rest) == 3
    assert [len(s.responses) for s in rest] == [2, 2, 2]
    assert stats["exhausted"] and stats["step_generated_samples"] == 3


def test_an_unexpected_error_stops_feeding_and_is_raised_to_whoever_waits():
    async def scenario():
        twice = [(0, 0, [1] * PROMPT_LEN), (0, 0, [1] * PROMPT_LEN)]  # the same prompt twice
        ro = Rollouter(twice, n=1, sampling=SamplingSpec(max_new_tokens=4),
                       lb=LoadBalancer(["r"]), engine_for={"r": ManualEngine()}.__getitem__,
                       queue=MessageQueue(4), max_required_samples=4,
                       concurrent_samples_per_replica=2)
        ro.start()
        with pytest.raises(RuntimeError, match="failed") as caught:
            await asyncio.wait_for(ro.wait_exhausted(), 1.0)
        await ro.stop()
        return caught.value.__cause__, ro.paused

    cause, paused = asyncio.run(scenario())
    assert isinstance(cause, ValueError) and "e0-p0" in str(cause)
    assert paused


def test_stop_cancels_everything_in_flight_releases_the_balancer_and_lists_the_interrupted():
    async def scenario():
        engine = ManualEngine()
        lb = LoadBalancer(["r"])
        queue = MessageQueue(8)
        ro = make(lb, {"r": engine}, queue, count=10, n=2, max_required=8, per_replica=3)
        ro.start()
        await settle()
        engine.finish(2)  # both responses of the first sample
        await settle()
        busy = lb.in_flight()
        waiter = asyncio.ensure_future(ro.wait_exhausted())
        await ro.stop()
        with pytest.raises(RuntimeError, match="stopped"):
            await asyncio.wait_for(waiter, 1.0)
        return busy, lb.in_flight(), ro.in_flight_uids(), queue.size(), ro.in_flight_samples

    busy, after, interrupted, queued, running = asyncio.run(scenario())
    assert busy == 6  # 3 samples x 2 responses
    assert after == 0 and running == 0
    assert queued == 1
    # the 3 running samples, then the prompt the feeder had looked ahead at
    assert interrupted == ["e0-p1", "e0-p2", "e0-p3", "e0-p4"]


def test_pause_starts_nothing_new_and_wait_idle_returns_once_the_in_flight_samples_finish():
    async def scenario():
        engine = ManualEngine()
        lb = LoadBalancer(["r"])
        queue = MessageQueue(12)
        ro = make(lb, {"r": engine}, queue, count=10, max_required=12, per_replica=2)
        ro.start()
        await settle()
        ro.pause()
        idle = asyncio.ensure_future(ro.wait_idle())
        engine.finish(2)
        await asyncio.wait_for(idle, 1.0)
        paused_started = ro.stats()["total_started_samples"]
        ro.resume()
        await settle()
        resumed_started = ro.stats()["total_started_samples"]
        await ro.stop()
        return paused_started, resumed_started

    assert asyncio.run(scenario()) == (2, 4)


def test_each_request_gets_its_own_reproducible_seed():
    async def scenario(seed):
        engine = FakeEngine("r")
        lb = LoadBalancer(["r"])
        ro = make(lb, {"r": engine}, MessageQueue(4), count=2, n=2, max_required=4, seed=seed)
        ro.start()
        await ro.wait_exhausted()
        return {c.request_id: c.sampling.seed for c in engine.calls}

    first, again, other = (asyncio.run(scenario(seed)) for seed in (7, 7, 8))
    assert set(first) == {"e0-p0-r0", "e0-p0-r1", "e0-p1-r0", "e0-p1-r1"}
    assert len(set(first.values())) == 4
    assert first == again and first != other


# --------------------------------------------------------------------------- utilization


def test_rollout_utilization_integrates_in_flight_over_capacity_between_weight_syncs():
    clock = FakeClock(0.0)

    async def scenario():
        engines = {"a": ManualEngine(), "b": ManualEngine()}
        lb = LoadBalancer(["a"])
        queue = MessageQueue(4)
        ro = make(lb, engines, queue, count=2, max_required=4, per_replica=2, clock=clock)
        ro.start()  # t=0: both samples start on a (capacity 2)
        await settle()
        clock.t = 10.0
        engines["a"].finish(1)  # t=10: one done
        await settle()
        clock.t = 20.0
        lb.add_replicas(["b"])  # t=20: capacity min(2*2, 4) = 4
        await settle()
        clock.t = 30.0
        engines["a"].finish(1)  # t=30: the other done
        await settle()
        clock.t = 40.0
        history = ro.history()
        metrics = ro.on_weight_sync(1)
        return history, metrics, ro.history(), ro.last_window()

    history, metrics, new_window, last = asyncio.run(scenario())
    assert history == [(0.0, 2, 2), (10.0, 1, 2), (20.0, 1, 4), (30.0, 0, 4)]
    # (10*2 + 10*1 + 10*1 + 10*0) / (10*2 + 10*2 + 10*4 + 10*4) = 40 / 120
    assert metrics[ROLLOUT_RESOURCE_UTILIZATION] == pytest.approx(1 / 3)
    assert metrics[STEP_GENERATED_SAMPLES] == 2
    assert new_window == [(40.0, 0, 4)]
    assert last == (history, 40.0)


def test_a_weight_sync_never_moves_the_version_back():
    async def scenario():
        ro = make(LoadBalancer(["r"]), {"r": ManualEngine()}, MessageQueue(4), max_required=4)
        ro.on_weight_sync(3)
        with pytest.raises(ValueError):
            ro.on_weight_sync(2)
        return ro.param_version

    assert asyncio.run(scenario()) == 3


def test_a_removed_replica_is_reported_once_and_results_older_than_their_request_count_as_behind():
    """``on_replica_removed`` hears of a dead replica once; ``replica_versions`` flags a replica
    that returns tokens of an older version than the one in force when the request was sent."""

    async def scenario():
        dead, current, stale = FakeEngine("a", fail=True), FakeEngine("b", version=3), FakeEngine("c", version=2)
        lb = LoadBalancer(["a", "b", "c"])
        queue = MessageQueue(8)
        removed: list[str] = []
        ro = make(lb, {"a": dead, "b": current, "c": stale}, queue, count=6, n=2, max_required=8,
                  param_version=3, on_replica_removed=removed.append)
        ro.start()
        await ro.wait_exhausted()
        return removed, ro.replica_versions(), ro.stats()

    removed, versions, stats = asyncio.run(scenario())
    assert removed == ["a"] and stats["failed_requests"] >= 1
    assert set(versions) == {"b", "c"}  # a failed call returns no result
    assert versions["b"]["results"] + versions["c"]["results"] == 12  # 6 samples x 2 responses
    assert versions["b"] == {"results": versions["b"]["results"], "min_version": 3, "max_version": 3, "behind": 0}
    assert versions["c"] == {"results": versions["c"]["results"], "min_version": 2, "max_version": 2,
                             "behind": versions["c"]["results"]}
    assert versions["c"]["results"] > 0
