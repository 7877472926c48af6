"""The run's progress artifact is posted by a background thread, in order, and drained on close."""

from __future__ import annotations

import threading
import time

from tasks.artifact import RunProgress


class Recorder:
    """Prefect's two progress-artifact functions, recording what they were asked (and where)."""

    def __init__(self, fail_on: int | None = None):
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self.fail_on = fail_on

    def create(self, *, progress, key, description):
        self.threads.add(threading.current_thread().name)
        self.calls.append(("create", progress, key, description))
        return "artifact-1"

    def update(self, *, artifact_id, progress, description):
        self.threads.add(threading.current_thread().name)
        if self.fail_on is not None and progress == self.fail_on:
            raise RuntimeError("API down")
        self.calls.append(("update", artifact_id, progress, description))


def test_updates_are_posted_in_call_order_off_the_calling_thread_and_all_sent_by_close():
    api = Recorder()
    with RunProgress("Run_1", 4, create=api.create, update=api.update) as shown:
        for done in range(5):
            shown.show(done)
    assert api.calls == [("create", 0.0, "run-1-progress", "Tidal run Run_1: 0 of 4 steps committed")] + [
        ("update", "artifact-1", 25.0 * n, f"Tidal run Run_1: {n} of 4 steps committed") for n in range(1, 5)]
    assert [name.startswith("tidal-progress") for name in api.threads] == [True]


def test_a_failed_post_is_skipped_and_the_later_ones_still_go():
    api = Recorder(fail_on=50.0)
    with RunProgress("r", 2, create=api.create, update=api.update) as shown:
        for done in range(3):
            shown.show(done)
    assert [call[0:3] for call in api.calls] == [("create", 0.0, "r-progress"), ("update", "artifact-1", 100.0)]


def test_a_post_waits_until_it_is_released_by_the_next_steps_data_plane():
    api = Recorder()
    with RunProgress("r", 2, create=api.create, update=api.update) as shown:
        shown.show(0)
        time.sleep(0.2)
        held = list(api.calls)
        shown.release()
        deadline = time.monotonic() + 5
        while not api.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        released = list(api.calls)
    assert (held, [c[:2] for c in released]) == ([], [("create", 0.0)])
