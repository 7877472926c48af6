"""The continuous-batching core (``cluster.engines.batching.Batcher``) driven by a recording step.

The step is a fake engine iteration: it records what the core handed it and answers token
``100 + len(tokens so far)`` with log-prob ``-1.0`` for every sequence (or EOS where a test asks).
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.engines.batching import Batcher, SequenceState
from data.types import GenerationRequest, GenerationResult, SamplingSpec

pytestmark = pytest.mark.timeout(10)

EOS = 2


class RecordingStep:
    """An engine iteration that records ``(admitted ids, decoding ids, after_idle)`` per call."""

    def __init__(self, *, eos_at: dict[str, int] | None = None, version: int = 1):
        self.calls: list[tuple[list[str], list[str], bool]] = []
        self.eos_at = eos_at or {}
        """request id → the token index that is EOS."""
        self.version = version
        self.gate: asyncio.Event | None = None
        """When set by a test, each iteration waits for it (and clears it) before answering."""
        self.fail: Exception | None = None

    async def __call__(self, admitted: list[SequenceState], decoding: list[SequenceState], after_idle: bool):
        self.calls.append(([s.request.request_id for s in admitted], [s.request.request_id for s in decoding], after_idle))
        if self.gate is not None:
            await self.gate.wait()
            self.gate.clear()
        if self.fail is not None:
            raise self.fail
        seqs = admitted + decoding
        tokens = [EOS if self.eos_at.get(s.request.request_id) == len(s.tokens) else 100 + len(s.tokens) for s in seqs]
        return tokens, [-1.0] * len(seqs), self.version


def request(rid: str, budget: int, *, ignore_eos: bool = False) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6, 7], SamplingSpec(max_new_tokens=budget, ignore_eos=ignore_eos))


def batcher(step: RecordingStep, *, max_batch: int = 2, version: int = 0) -> Batcher:
    return Batcher(max_batch=max_batch, eos_id=EOS, step=step, version=lambda: version, name="test")


def test_at_most_max_batch_sequences_run_and_a_waiting_one_joins_when_a_slot_frees():
    step = RecordingStep()
    core = batcher(step, max_batch=2)

    async def scenario():
        return await asyncio.gather(core.submit(request("a", 1), 1), core.submit(request("b", 3), 3),
                                    core.submit(request("c", 2), 2))

    results = asyncio.run(scenario())
    assert step.calls == [
        (["a", "b"], [], True),
        (["c"], ["b"], False),
        ([], ["b", "c"], False),
    ]
    assert results == [
        GenerationResult("a", [100], [-1.0], "length", 1, 3),
        GenerationResult("b", [100, 101, 102], [-1.0] * 3, "length", 1, 3),
        GenerationResult("c", [100, 101], [-1.0] * 2, "length", 1, 3),
    ]
    assert core.counters == {"generated_tokens": 6, "prefill_tokens": 9, "finished_requests": 3, "aborted_requests": 0}


def test_eos_finishes_with_stop_unless_eos_is_ignored():
    step = RecordingStep(eos_at={"a": 1, "b": 1})
    core = batcher(step)

    async def scenario():
        return await asyncio.gather(core.submit(request("a", 5), 5), core.submit(request("b", 3, ignore_eos=True), 3))

    assert asyncio.run(scenario()) == [
        GenerationResult("a", [100, EOS], [-1.0] * 2, "stop", 1, 3),
        GenerationResult("b", [100, EOS, 102], [-1.0] * 3, "length", 1, 3),
    ]


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0)


def test_an_abort_during_a_step_returns_the_partial_tokens_and_drops_the_steps_token():
    step = RecordingStep()
    core = batcher(step)

    async def scenario():
        step.gate = asyncio.Event()
        task = asyncio.ensure_future(core.submit(request("a", 10), 10))
        for answered in range(2):  # two iterations answer, the third stays in flight
            await until(lambda: len(step.calls) == answered + 1)
            step.gate.set()
        await until(lambda: len(step.calls) == 3)
        aborted = core.abort_where(lambda seq: seq.request.request_id == "a")
        step.gate.set()
        result = await task
        await asyncio.sleep(0.01)  # the in-flight iteration answers; its token is dropped
        await core.close()
        return aborted, result

    aborted, result = asyncio.run(scenario())
    assert aborted == 1
    assert result == GenerationResult("a", [100, 101], [-1.0, -1.0], "abort", 1, 3)
    assert core.counters == {"generated_tokens": 2, "prefill_tokens": 3, "finished_requests": 0, "aborted_requests": 1}


def test_a_result_carries_the_version_of_its_first_token_or_the_current_one_without_tokens():
    step = RecordingStep(version=4)
    core = batcher(step, max_batch=1, version=7)

    async def scenario():
        step.gate = asyncio.Event()
        running = asyncio.ensure_future(core.submit(request("a", 3), 3))
        waiting = asyncio.ensure_future(core.submit(request("b", 3), 3))
        await until(lambda: len(step.calls) == 1)
        step.gate.set()
        await until(lambda: len(step.calls) == 2)  # "a" has its first token (version 4)
        step.version = 5
        core.abort_where(lambda seq: True)
        results = await running, await waiting
        await core.close()
        return results

    assert asyncio.run(scenario()) == (
        GenerationResult("a", [100], [-1.0], "abort", 4, 3),
        GenerationResult("b", [], [], "abort", 7, 0),
    )


def test_a_failed_step_fails_its_requests_frees_their_slots_and_the_core_keeps_serving():
    step = RecordingStep()
    core = batcher(step, max_batch=1)

    async def scenario():
        step.fail = RuntimeError("device lost")
        with pytest.raises(RuntimeError, match="device lost"):
            await core.submit(request("a", 2), 2)
        step.fail = None
        return await core.submit(request("b", 1), 1)

    assert asyncio.run(scenario()) == GenerationResult("b", [100], [-1.0], "length", 1, 3)
    assert step.calls == [(["a"], [], True), (["b"], [], True)]  # idle again after the failure


def test_close_aborts_waiting_and_running_requests():
    step = RecordingStep()
    core = batcher(step, max_batch=1)

    async def scenario():
        step.gate = asyncio.Event()
        tasks = [asyncio.ensure_future(core.submit(request(rid, 5), 5)) for rid in ("a", "b")]
        await until(lambda: len(step.calls) == 1)
        await core.close()
        return [await t for t in tasks]

    assert [(r.request_id, r.finish_reason, r.tokens) for r in asyncio.run(scenario())] == [
        ("a", "abort", []), ("b", "abort", [])]
    assert step.calls == [(["a"], [], True)]


def test_a_cancelled_caller_frees_its_slot_for_the_next_request():
    step = RecordingStep()
    core = batcher(step, max_batch=1)

    async def scenario():
        step.gate = asyncio.Event()
        first = asyncio.ensure_future(core.submit(request("a", 5), 5))
        await until(lambda: len(step.calls) == 1)
        first.cancel()
        second = asyncio.ensure_future(core.submit(request("b", 1), 1))
        step.gate.set()  # the in-flight iteration answers; "a"'s token is dropped
        await until(lambda: len(step.calls) == 2)
        step.gate.set()
        return first.cancelled(), await second

    assert asyncio.run(scenario()) == (True, GenerationResult("b", [100], [-1.0], "length", 1, 3))
    assert step.calls == [(["a"], [], True), (["b"], [], False)]
