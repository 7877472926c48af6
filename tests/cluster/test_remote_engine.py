"""The rollout service's engine proxy sends a sample's requests of one event-loop turn as one Ray call.

``RemoteEngine`` is tested against an in-test handle that records each ``generate_batch`` (or
``hybrid_generate_batch``) call and answers it with what the test scripted; the real actor side,
``generate_each``, is tested against an in-test engine. The whole path over a real Ray cluster is
exercised by ``tests/integration/test_dataplane.py`` and the replica-kill fault tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from cluster.actors import RemoteEngine, generate_each
from data.types import GenerationRequest, GenerationResult, SamplingSpec
from rollout.rollouter import response_request_id


def _request(i: int, sample: str = "s") -> GenerationRequest:
    return GenerationRequest(response_request_id(sample, i), [1, 2, 3], SamplingSpec(4, seed=i))


def _result(request: GenerationRequest) -> GenerationResult:
    return GenerationResult(request.request_id, [7], [-0.5], "stop", 3, 3)


class _Method:
    def __init__(self, answer: Callable[..., object]):
        self.answer = answer
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)

        async def reply():
            await asyncio.sleep(0)
            return self.answer(*args)

        return reply()


class FakeHandle:
    """Stands in for a replica actor handle (and the trainer's, for hybrids)."""

    def __init__(self, answer: Callable[[Sequence[GenerationRequest]], object] | None = None):
        answer = answer or (lambda requests: [_result(r) for r in requests])
        self.generate_batch = _Method(answer)
        self.hybrid_generate_batch = _Method(lambda rid, requests: answer(requests))


def test_requests_of_one_turn_travel_in_one_call_and_each_caller_gets_its_own_result():
    handle = FakeHandle()
    engine = RemoteEngine("standalone-0", handle, hybrid=False)

    async def main():
        return await asyncio.gather(*(engine.generate(_request(i)) for i in range(16)))

    results = asyncio.run(main())
    assert [r.request_id for r in results] == [f"s-r{i}" for i in range(16)]
    assert len(handle.generate_batch.calls) == 1 and engine.calls == 1
    (requests,) = handle.generate_batch.calls[0]
    assert [r.request_id for r in requests] == [f"s-r{i}" for i in range(16)]


def test_samples_never_share_a_call_so_none_waits_for_another():
    release_long = asyncio.Event()

    class SlowForB(FakeHandle):
        def __init__(self):
            super().__init__()
            self.generate_batch = self

        def remote(self, requests):
            self.calls = getattr(self, "calls", []) + [[r.request_id for r in requests]]

            async def reply():
                if requests[0].request_id.startswith("b-"):
                    await release_long.wait()  # sample b's long response
                return [_result(r) for r in requests]

            return reply()

    handle = SlowForB()
    engine = RemoteEngine("standalone-0", handle, hybrid=False)

    async def main():
        a = [asyncio.ensure_future(engine.generate(_request(i, "a"))) for i in range(3)]
        b = [asyncio.ensure_future(engine.generate(_request(i, "b"))) for i in range(3)]
        done_a = await asyncio.wait_for(asyncio.gather(*a), timeout=5)  # b is still generating
        still_running = not any(f.done() for f in b)
        release_long.set()
        return done_a, still_running, await asyncio.gather(*b)

    done_a, b_was_running, done_b = asyncio.run(main())
    assert [r.request_id for r in done_a] == ["a-r0", "a-r1", "a-r2"] and b_was_running
    assert [r.request_id for r in done_b] == ["b-r0", "b-r1", "b-r2"]
    assert sorted(handle.calls) == [["a-r0", "a-r1", "a-r2"], ["b-r0", "b-r1", "b-r2"]]


def test_requests_of_different_turns_travel_separately():
    handle = FakeHandle()
    engine = RemoteEngine("standalone-0", handle, hybrid=False)

    async def main():
        first = asyncio.ensure_future(engine.generate(_request(0)))
        await asyncio.sleep(0.01)  # the first call has gone out
        second = await engine.generate(_request(1))
        return await first, second

    first, second = asyncio.run(main())
    assert (first.request_id, second.request_id) == ("s-r0", "s-r1")
    assert [len(c[0]) for c in handle.generate_batch.calls] == [1, 1]


def test_hybrid_requests_go_to_the_trainer_with_the_replica_id():
    handle = FakeHandle()
    engine = RemoteEngine("hybrid-0", handle, hybrid=True)

    async def main():
        return await asyncio.gather(*(engine.generate(_request(i)) for i in range(3)))

    assert len(asyncio.run(main())) == 3
    assert handle.generate_batch.calls == []
    ((rid, requests),) = handle.hybrid_generate_batch.calls
    assert rid == "hybrid-0" and len(requests) == 3


def test_a_failed_request_fails_alone():
    def answer(requests):
        return [ValueError("prompt too long") if r.request_id == "s-r1" else _result(r) for r in requests]

    engine = RemoteEngine("standalone-0", FakeHandle(answer), hybrid=False)

    async def main():
        return await asyncio.gather(*(engine.generate(_request(i)) for i in range(3)), return_exceptions=True)

    ok0, failed, ok2 = asyncio.run(main())
    assert isinstance(failed, ValueError) and str(failed) == "prompt too long"
    assert (ok0.request_id, ok2.request_id) == ("s-r0", "s-r2")


def test_a_request_cancelled_on_the_replica_fails_that_caller_without_cancelling_it():
    def answer(requests):
        return [asyncio.CancelledError() if r.request_id == "s-r0" else _result(r) for r in requests]

    engine = RemoteEngine("standalone-0", FakeHandle(answer), hybrid=False)

    async def main():
        return await asyncio.gather(*(engine.generate(_request(i)) for i in range(2)), return_exceptions=True)

    failed, ok = asyncio.run(main())
    assert isinstance(failed, RuntimeError) and "s-r0 was cancelled on standalone-0" in str(failed)
    assert ok.request_id == "s-r1"


def test_a_failed_call_fails_every_request_in_it():
    class ActorDied(Exception):
        pass

    def answer(requests):
        raise ActorDied("the actor died")

    engine = RemoteEngine("standalone-0", FakeHandle(answer), hybrid=False)

    async def main():
        return await asyncio.gather(*(engine.generate(_request(i)) for i in range(4)), return_exceptions=True)

    errors = asyncio.run(main())
    assert all(isinstance(e, ActorDied) for e in errors)


def test_a_caller_that_gives_up_does_not_disturb_the_others():
    engine = RemoteEngine("standalone-0", FakeHandle(), hybrid=False)

    async def main():
        calls = [asyncio.ensure_future(engine.generate(_request(i))) for i in range(3)]
        await asyncio.sleep(0)  # all three are waiting on the same call
        calls[1].cancel()
        return await asyncio.gather(*calls, return_exceptions=True)

    first, cancelled, third = asyncio.run(main())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert (first.request_id, third.request_id) == ("s-r0", "s-r2")


class _Engine:
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await asyncio.sleep(0.01 * (3 - int(request.request_id[-1])))  # later requests end first
        if request.request_id.endswith("2"):
            raise ValueError("bad request")
        return _result(request)


def test_generate_each_keeps_the_order_and_returns_exceptions_in_place():
    out = asyncio.run(generate_each(_Engine(), [_request(i) for i in range(3)]))
    assert [o.request_id for o in out[:2]] == ["s-r0", "s-r1"]
    assert isinstance(out[2], ValueError)


@pytest.mark.parametrize("n", [1, 5])
def test_nothing_is_left_pending_after_a_batch(n):
    engine = RemoteEngine("standalone-0", FakeHandle(), hybrid=False)

    async def main():
        await asyncio.gather(*(engine.generate(_request(i)) for i in range(n)))
        await asyncio.sleep(0)
        return engine._pending, engine._sending

    pending, sending = asyncio.run(main())
    assert not pending and not sending
