"""The event heap's total order (time, priority, seq) and its clock."""

from __future__ import annotations

import pytest

from sim import CONTROL_PLANE, DATA_PLANE, Event, EventLoop


def test_events_run_by_time_then_priority_then_scheduling_order():
    loop = EventLoop()
    seen: list[tuple[float, str]] = []

    def note(name: str) -> list[Event]:
        seen.append((loop.now, name))
        return []

    loop.push(
        [
            Event(2.0, DATA_PLANE, note, ("late",)),
            Event(1.0, CONTROL_PLANE, note, ("control",)),
            Event(1.0, DATA_PLANE, note, ("data-first",)),
            Event(1.0, DATA_PLANE, note, ("data-second",)),
        ]
    )
    loop.run(until=lambda: False)
    assert seen == [(1.0, "data-first"), (1.0, "data-second"), (1.0, "control"), (2.0, "late")]


def test_handlers_schedule_by_returning_events_and_the_loop_stops_when_asked():
    loop = EventLoop()
    ticks: list[float] = []

    def tick() -> list[Event]:
        ticks.append(loop.now)
        return [Event(loop.now + 0.5, DATA_PLANE, tick)]

    loop.push([Event(0.0, DATA_PLANE, tick)])
    loop.run(until=lambda: len(ticks) == 4)
    assert ticks == [0.0, 0.5, 1.0, 1.5]
    assert loop.handled == 4


def test_an_event_in_the_past_is_refused():
    loop = EventLoop()

    def back_in_time() -> list[Event]:
        return [Event(loop.now - 1.0, DATA_PLANE, back_in_time)]

    loop.push([Event(5.0, DATA_PLANE, back_in_time)])
    with pytest.raises(ValueError, match="before now"):
        loop.run(until=lambda: False)


def test_two_loops_keep_their_own_sequence_numbers():
    # vidur's class-wide id counter makes one simulator's tie-breaks depend on another's; ours
    # must not: the same pushes give the same order whatever another loop did before.
    def order(loop: EventLoop) -> list[str]:
        seen: list[str] = []
        loop.push([Event(1.0, DATA_PLANE, lambda n=n: seen.append(n) or []) for n in "abc"])
        loop.run(until=lambda: False)
        return seen

    first, second = EventLoop(), EventLoop()
    second.push([Event(0.0, DATA_PLANE, lambda: [])] * 10)
    assert order(first) == order(second) == ["a", "b", "c"]
