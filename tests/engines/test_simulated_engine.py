"""The simulated engine spends exactly its cost model's time and replays the same responses.

Durations are checked on ``stats()["busy_s"]`` (the modelled seconds) and, loosely, on the event
loop's clock; costs are a few milliseconds so the whole file runs in well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest

from cluster.engines.simulated import SimulatedEngine
from data.types import GenerationRequest, SamplingSpec

pytestmark = pytest.mark.timeout(20)  # a scheduler bug hangs rather than fails

EOS = 2
PROMPT = [1, 5, 6, 7]


def request(rid: str, budget: int, prompt: list[int] = PROMPT, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingSpec(max_new_tokens=budget, **sampling))


def run(engine: SimulatedEngine, scenario) -> None:
    async def main() -> None:
        try:
            await engine.load_weights({}, 1)
            await scenario(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_iteration_costs_base_plus_per_sequence_times_batch_plus_prefill():
    engine = SimulatedEngine(decode_step_s=(0.004, 0.001), prefill_s_per_token=0.0005, max_batch=8, eos_id=EOS)

    async def scenario(engine):
        start = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(engine.generate(request(f"r{i}", 5, ignore_eos=True)) for i in range(3)))
        elapsed = asyncio.get_running_loop().time() - start
        assert [len(r.tokens) for r in results] == [5, 5, 5]
        modelled = 5 * (0.004 + 3 * 0.001) + 3 * len(PROMPT) * 0.0005
        assert engine.stats()["busy_s"] == pytest.approx(modelled)
        assert engine.stats()["decode_steps"] == 5
        assert modelled <= elapsed < modelled + 0.5

    run(engine, scenario)


def test_the_decode_cost_function_sees_each_iterations_batch_and_extra_requests_wait():
    batches: list[int] = []
    engine = SimulatedEngine(decode_step_s=lambda b: batches.append(b) or 0.0, max_batch=2, eos_id=EOS)

    async def scenario(engine):
        budgets = [3, 5, 4]
        await asyncio.gather(*(engine.generate(request(f"r{i}", b, ignore_eos=True)) for i, b in enumerate(budgets)))
        # r0 and r1 start together; r2 takes r0's place after r0's third token and ends alone.
        assert batches == [2, 2, 2, 2, 2, 1, 1]

    run(engine, scenario)


def test_a_response_ends_with_eos_at_its_sampled_length_and_never_earlier():
    engine = SimulatedEngine(
        decode_step_s=(0.0, 0.0), length_sampler=lambda rng: rng.choice([3, 9]), eos_id=EOS, vocab_size=5
    )

    async def scenario(engine):
        results = await asyncio.gather(*(engine.generate(request(f"r{i}", 20)) for i in range(20)))
        assert {len(r.tokens) for r in results} == {3, 9}
        for r in results:
            assert (r.finish_reason, r.tokens[-1]) == ("stop", EOS) and EOS not in r.tokens[:-1]
        cut = await engine.generate(request("r0", 2))
        assert (cut.finish_reason, cut.tokens) == ("length", results[0].tokens[:2])
        endless = await engine.generate(request("r0", 20, ignore_eos=True))
        assert (endless.finish_reason, len(endless.tokens), EOS in endless.tokens) == ("length", 20, False)

    run(engine, scenario)


def test_a_partial_response_continues_on_another_engine_with_the_same_seed():
    def make(seed: int) -> SimulatedEngine:
        return SimulatedEngine(decode_step_s=(0.001, 0.0), length_sampler=30, eos_id=EOS, seed=seed)

    async def scenario(first: SimulatedEngine) -> None:
        whole = await first.generate(request("r", 40))
        task = asyncio.create_task(first.generate(request("r", 40)))
        while first.stats()["generated_tokens"] < len(whole.tokens) + 4:
            await asyncio.sleep(0)
        await first.abort_all()
        partial = await task
        second, stranger = make(seed=0), make(seed=1)
        for engine in (second, stranger):
            await engine.load_weights({}, 1)
        rest = await second.generate(request("r", 40 - len(partial.tokens), PROMPT + partial.tokens))
        assert partial.finish_reason == "abort" and 0 < len(partial.tokens) < 30
        assert (rest.finish_reason, partial.tokens + rest.tokens) == ("stop", whole.tokens)
        assert (await stranger.generate(request("r", 40))).tokens != whole.tokens

    run(make(seed=0), scenario)


def test_sleep_wake_up_and_load_weights_take_their_configured_seconds():
    engine = SimulatedEngine(eos_id=EOS, sleep_s=0.03, wake_up_s=0.02, load_weights_s=0.01)

    async def timed(call) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await call
        return loop.time() - start

    async def scenario(engine):
        durations = [await timed(engine.sleep()), await timed(engine.wake_up()), await timed(engine.load_weights({}, 2))]
        for took, configured in zip(durations, (0.03, 0.02, 0.01)):
            assert configured <= took < configured + 0.2
        assert (engine.is_sleeping, engine.param_version) == (False, 2)

    run(engine, scenario)


def test_importing_the_engines_package_and_the_simulated_engine_does_not_load_torch():
    code = "import sys, cluster.engines, cluster.engines.simulated; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------ the emulated cluster's engine


def test_a_resumed_response_keeps_its_tokens_and_ends_at_its_length_for_the_version_it_is_served_at():
    """Lengths drift with the param version; a partial response re-submitted after the version
    moved keeps its tokens, and one already past its new length ends with EOS at once."""
    engine = SimulatedEngine(decode_step_s=(0.0, 0.0), lengths=lambda rid, version: 10 if version < 5 else 4,
                             eos_id=EOS)

    async def scenario(engine):
        whole = await engine.generate(request("r", 40))
        assert (len(whole.tokens), whole.tokens[-1]) == (10, EOS)
        partial = whole.tokens[:6]
        await engine.load_weights({}, 5)
        assert (await engine.generate(request("r", 34, PROMPT + partial))).tokens == [EOS]
        short = await engine.generate(request("r", 40, PROMPT + partial[:2]))
        assert partial[:2] + short.tokens == [*partial[:3], EOS]

    run(engine, scenario)


def test_the_device_timeline_absorbs_event_loop_stalls_up_to_max_lag_and_counts_the_rest_as_stretch():
    """Blocking the event loop between iterations does not lengthen the modelled run while the
    engine can catch up (≤ max_lag_s behind; a plain sleep per iteration would take ~0.6 s
    here); a longer stall is given up and reported as ``stretch_s``."""
    import time

    async def block(seconds: float, every: float, times: int | None = None) -> None:
        done = 0
        while times is None or done < times:  # until cancelled, or ``times`` times
            await asyncio.sleep(every)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:  # the loop is stuck, as under a busy CPU
                pass
            done += 1

    async def timed_generate(engine, rid: str, budget: int, blocker) -> float:
        """Seconds until the request is served (not until the blocker ends)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        task = asyncio.create_task(blocker)
        await engine.generate(request(rid, budget, ignore_eos=True))
        took = loop.time() - start
        task.cancel()  # a blocker that ended on its own just returns
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return took

    catching_up = SimulatedEngine(decode_step_s=(0.01, 0.0), eos_id=EOS, max_lag_s=0.25)

    async def absorbed(engine):
        took = await timed_generate(engine, "a", 40, block(0.012, 0.003))  # 40 iterations × 10 ms
        assert engine.stats()["busy_s"] == pytest.approx(0.4)
        assert 0.4 <= took < 0.5 and engine.stats()["stretch_s"] < 0.05

    run(catching_up, absorbed)
    strict = SimulatedEngine(decode_step_s=(0.01, 0.0), eos_id=EOS, max_lag_s=0.05)

    async def stretched(engine):
        took = await timed_generate(engine, "b", 30, block(0.3, 0.05, 1))  # 30 iterations × 10 ms
        # the 0.3 s stall beyond the 0.05 s catch-up window is reported, and never more than the
        # engine really finished late (a busy machine may stall it further)
        assert 0.3 - 0.05 - 0.02 < engine.stats()["stretch_s"] <= took - 0.3 + 0.01

    run(strict, stretched)


def test_resume_of_a_paused_engine_and_the_first_wake_up_of_one_started_asleep_cost_their_seconds():
    engine = SimulatedEngine(eos_id=EOS, resume_s=0.05, wake_up_s=0.03, start_asleep=True)

    async def timed(call) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await call
        return loop.time() - start

    async def main() -> None:
        assert engine.is_sleeping
        with pytest.raises(RuntimeError, match="asleep"):
            await engine.generate(request("r", 4))
        assert 0.03 <= await timed(engine.wake_up()) < 0.2
        await engine.load_weights({}, 1)
        assert await timed(engine.resume()) < 0.02  # not paused: nothing to spend
        await engine.pause()
        assert 0.05 <= await timed(engine.resume()) < 0.25 and not engine.is_paused
        assert engine.stats()["busy_s"] == 0.0  # switch seconds are not decode work
        await engine.shutdown()

    asyncio.run(main())
