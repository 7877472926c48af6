"""What the rollouter calls ``generate`` on: one replica actor (or hybrid) behind a call batcher.

Also the two Ray facts the data plane needs about a failed call: was it an actor death, and how
to end an actor that may already be gone. Must not: route or retry (the rollouter does).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from cluster.engines.base import request_sample_uid
from data.types import GenerationRequest, GenerationResult

def kill_actor(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def actor_is_dead(exc: BaseException) -> bool:
    """Only a dead actor takes a replica out of the balancer; other errors are retried."""
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                            ray.exceptions.ActorUnavailableError))


class RemoteEngine:
    """What the rollouter calls ``generate`` on: a standalone actor or a hybrid in the trainer.

    The ``generate`` calls made in one turn of the event loop for one sample go to the actor as
    one Ray call (``generate_batch``). A new sample starts its ``n`` responses in the same turn, so
    they travel together: on CPU one Ray call costs about twice what the tiny engine spends
    generating a 16-token response (``benchmarks/bench_replica_call.py``). A call returns when its
    last response ends, which costs a sample nothing (it waits for all of them anyway); requests
    of different samples never share a call, so no sample waits for another's long response. Each
    caller gets its own result or exception; a failed call (the actor died) fails every request in
    it, and each is retried on its own.
    """

    def __init__(self, replica_id: str, handle: Any, hybrid: bool):
        self.replica_id, self.handle, self.hybrid = replica_id, handle, hybrid
        self._pending: dict[str, list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]]] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self.calls = 0  # Ray calls made (for tests and benchmarks)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerationResult] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(request_sample_uid(request.request_id), []).append((request, future))
        return await future

    def _flush(self) -> None:
        groups, self._pending = self._pending, {}
        loop = asyncio.get_running_loop()
        for batch in groups.values():
            task = loop.create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[GenerationRequest, asyncio.Future[GenerationResult]]]) -> None:
        requests = [request for request, _ in batch]
        self.calls += 1
        try:
            if self.hybrid:
                results = await self.handle.hybrid_generate_batch.remote(self.replica_id, requests)
            else:
                results = await self.handle.generate_batch.remote(requests)
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - handed to every caller in the batch
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (request, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller gave up (cancelled)
                continue
            if isinstance(result, asyncio.CancelledError):  # not the caller's cancellation
                future.set_exception(RuntimeError(f"{request.request_id} was cancelled on {self.replica_id}"))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

