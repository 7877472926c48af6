"""The message queue is bounded, hands out whole batches, and remembers what each pull saw."""

from __future__ import annotations

import asyncio

import pytest

from rollout.message_queue import MessageQueue, PullRecord, QueueClosed, wait_samples


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def settle(rounds: int = 10) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_put_waits_while_the_queue_is_full_and_goes_through_after_a_get():
    async def scenario():
        q = MessageQueue(2)
        await q.put("a")
        await q.put("b")
        third = asyncio.ensure_future(q.put("c"))
        await settle()
        blocked = not third.done() and q.size() == 2
        got = await q.get_batch(1)
        await asyncio.wait_for(third, 1.0)
        return blocked, got, q.drain()

    blocked, got, rest = asyncio.run(scenario())
    assert blocked
    assert got == ["a"]
    assert rest == ["b", "c"]


def test_get_batch_waits_for_exactly_k_samples_and_returns_them_in_order():
    async def scenario():
        q = MessageQueue(8)
        getter = asyncio.ensure_future(q.get_batch(3))
        await q.put(1)
        await q.put(2)
        await settle()
        waiting_at_two = not getter.done()
        await q.put(3)
        await q.put(4)
        batch = await asyncio.wait_for(getter, 1.0)
        return waiting_at_two, batch, q.size()

    waiting_at_two, batch, left = asyncio.run(scenario())
    assert waiting_at_two
    assert batch == [1, 2, 3]
    assert left == 1


def test_a_timed_out_get_batch_raises_and_leaves_the_samples_queued():
    async def scenario():
        q = MessageQueue(4)
        await q.put("a")
        with pytest.raises(TimeoutError):
            await q.get_batch(2, timeout_s=0.02)
        return q.size(), q.last_pull()

    size, record = asyncio.run(scenario())
    assert size == 1
    assert record.timed_out and record.got == 0 and record.requested == 2
    assert record.queue_size_at_start == 1


def test_a_closed_queue_hands_out_what_remains_then_empty_batches_and_refuses_puts():
    async def scenario():
        q = MessageQueue(4)
        await q.put("a")
        getter = asyncio.ensure_future(q.get_batch(3))
        await settle()
        q.close()
        first = await asyncio.wait_for(getter, 1.0)
        second = await q.get_batch(3)
        with pytest.raises(QueueClosed):
            await q.put("late")
        return first, second, q.exhausted

    first, second, exhausted = asyncio.run(scenario())
    assert first == ["a"]
    assert second == []
    assert exhausted


def test_a_put_waiting_on_a_full_queue_fails_when_the_queue_is_closed():
    async def scenario():
        q = MessageQueue(1)
        await q.put("a")
        waiting = asyncio.ensure_future(q.put("b"))
        await settle()
        q.close()
        with pytest.raises(QueueClosed):
            await asyncio.wait_for(waiting, 1.0)
        return q.drain()

    assert asyncio.run(scenario()) == ["a"]


def test_every_pull_records_the_size_it_started_with_and_how_long_it_waited():
    clock = FakeClock(100.0)

    async def scenario():
        q = MessageQueue(8, clock=clock)
        for i in range(5):
            await q.put(i)
        await q.get_batch(4)  # enough at start: no wait
        getter = asyncio.ensure_future(q.get_batch(4))  # starts with 1 queued
        await settle()
        clock.t = 102.5
        for i in range(3):
            await q.put(10 + i)
        await asyncio.wait_for(getter, 1.0)
        return q.drain_pull_records(), q.pull_records

    records, after_drain = asyncio.run(scenario())
    assert records == [
        PullRecord(started_at=100.0, queue_size_at_start=5, wait_s=0.0, got=4, requested=4),
        PullRecord(started_at=100.0, queue_size_at_start=1, wait_s=2.5, got=4, requested=4),
    ]
    assert [r.wait_samples for r in records] == [0, 3]
    assert after_drain == []


def test_wait_samples_counts_only_the_samples_that_were_missing_when_pulling_began():
    async def scenario():
        q = MessageQueue(8)
        await q.put("a")
        return q.wait_samples(4), q.wait_samples(1)

    assert asyncio.run(scenario()) == (3, 0)
    assert wait_samples(4, 1) == 3
    assert wait_samples(4, 4) == 0
    assert wait_samples(4, 9) == 0
    assert wait_samples(16, 0) == 16


def test_a_batch_larger_than_the_capacity_or_negative_is_refused():
    async def scenario():
        q = MessageQueue(3)
        with pytest.raises(ValueError):
            await q.get_batch(4)
        with pytest.raises(ValueError):
            await q.get_batch(-1)
        return await q.get_batch(0)

    assert asyncio.run(scenario()) == []
    with pytest.raises(ValueError):
        MessageQueue(0)


def test_drain_empties_the_queue_and_releases_a_waiting_put():
    async def scenario():
        q = MessageQueue(2)
        await q.put("a")
        await q.put("b")
        waiting = asyncio.ensure_future(q.put("c"))
        await settle()
        drained = q.drain()
        await asyncio.wait_for(waiting, 1.0)
        return drained, q.drain(), q.stats()

    drained, rest, stats = asyncio.run(scenario())
    assert drained == ["a", "b"]
    assert rest == ["c"]
    assert (stats["total_put"], stats["total_drained"], stats["size"]) == (3, 3, 0)


def test_put_back_front_returns_samples_to_the_head_in_their_order():
    async def scenario():
        q = MessageQueue(4)
        await q.put("c")
        q.put_back_front(["a", "b"])
        return await q.get_batch(3)

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_concurrent_getters_are_served_first_come_first_served():
    async def scenario():
        q = MessageQueue(4)
        first = asyncio.ensure_future(q.get_batch(2))
        await settle()
        second = asyncio.ensure_future(q.get_batch(1))
        await settle()
        for i in range(3):
            await q.put(i)
            await settle()  # let the getters look after every put
        return await asyncio.wait_for(asyncio.gather(first, second), 1.0)

    assert asyncio.run(scenario()) == [[0, 1], [2]]


def test_listeners_hear_the_size_after_every_change():
    async def scenario():
        q = MessageQueue(4)
        heard: list[int] = []
        q.on_change(heard.append)
        await q.put("a")
        await q.put("b")
        await q.get_batch(1)
        q.drain()
        q.close()
        return heard

    assert asyncio.run(scenario()) == [1, 2, 1, 0, 0]
