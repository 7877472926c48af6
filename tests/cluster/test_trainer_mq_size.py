"""The trainer's ``mq_size``: the queue right after the fit step (reference §4.4), i.e. with what
the rollout side produced while the trainer trained, not what was left right after the pull."""

from __future__ import annotations

import asyncio
import types

import cluster.actors.trainer as actors
from cluster.actors.rollout_service import PulledBatch
from cluster.backends.base import StepResult
from rollout.message_queue import PullRecord

Trainer = actors.TrainerActor.__ray_metadata__.modified_class  # the plain class behind the Ray actor


class Method:
    def __init__(self, fn):
        self.remote = fn


class FakeRollout:
    """A queue of ``size`` samples; ``get_batch`` takes ``n`` of them at once."""

    def __init__(self, size: int):
        self.size = size
        self.get_batch = Method(self._get_batch)
        self.queue_size = Method(self._queue_size)

    async def _get_batch(self, n: int, timeout_s: float | None) -> PulledBatch:
        at_start = self.size
        self.size -= n
        samples = [types.SimpleNamespace(epoch=0, prompt_index=i, min_version=0, max_version=0) for i in range(n)]
        pull = PullRecord(started_at=0.0, queue_size_at_start=at_start, wait_s=0.0, got=n, requested=n)
        return PulledBatch(samples=samples, pull=pull, mq_size=self.size)

    async def _queue_size(self) -> int:
        return self.size


class ProducingBackend:
    """Training takes a while; meanwhile the rollout side queues ``produced`` more samples."""

    def __init__(self, rollout: FakeRollout, produced: int):
        self.rollout, self.produced = rollout, produced

    def train_step(self, samples):
        self.rollout.size += self.produced
        return StepResult(metrics={"samples": float(len(samples))}, timing_s={"update_actor": 0.1})


def test_mq_size_is_the_queue_after_the_update_not_after_the_pull(monkeypatch):
    rollout = FakeRollout(size=8)
    trainer = Trainer(lambda: ProducingBackend(rollout, produced=5), {}, namespace="unit", required_samples=4)
    monkeypatch.setattr(trainer, "_rollout_service", lambda: rollout)
    report = asyncio.run(trainer.train_micro_step())
    assert (report.samples, report.prompts, report.queue_size_at_start) == (4, ((0, 0), (0, 1), (0, 2), (0, 3)), 8)
    assert report.mq_size == 8 - 4 + 5  # after the pull alone it would be 4
    assert report.wait_samples == 0 and report.exhausted is False
