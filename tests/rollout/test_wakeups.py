"""A wake-up returns when its condition holds, re-checks at every notify, and forgets cancelled waiters."""

from __future__ import annotations

import asyncio

from rollout.wakeups import Wakeup


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_wait_until_returns_at_once_when_the_condition_already_holds():
    async def scenario():
        wake = Wakeup()
        await wake.wait_until(lambda: True)
        return wake.waiting

    assert asyncio.run(scenario()) == 0


def test_a_waiter_sleeps_through_notifies_until_its_condition_holds():
    async def scenario():
        wake, box, seen = Wakeup(), {"n": 0}, []
        waiter = asyncio.ensure_future(wake.wait_until(lambda: box["n"] >= 2))
        for n in (1, 2):
            await settle()
            seen.append((waiter.done(), wake.waiting))
            box["n"] = n
            wake.notify()
        await settle()
        seen.append((waiter.done(), wake.waiting))
        return seen

    assert asyncio.run(scenario()) == [(False, 1), (False, 1), (True, 0)]


def test_one_notify_wakes_every_waiter_whose_condition_holds():
    async def scenario():
        wake, box = Wakeup(), {"open": False}
        waiters = [asyncio.ensure_future(wake.wait_until(lambda: box["open"])) for _ in range(3)]
        await settle()
        box["open"] = True
        wake.notify()
        await settle()
        return [w.done() for w in waiters], wake.waiting

    assert asyncio.run(scenario()) == ([True, True, True], 0)


def test_a_waiter_that_times_out_leaves_nothing_behind():
    async def scenario():
        wake = Wakeup()
        try:
            async with asyncio.timeout(0.01):
                await wake.wait_until(lambda: False)
        except TimeoutError:
            timed_out = True
        return timed_out, wake.waiting

    assert asyncio.run(scenario()) == (True, 0)
