"""A standalone rollout replica actor, and the engine verbs it shares with the trainer's hybrids.

Must not: know the load balancer, the queue or the controller; it only runs its engine.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from data.types import GenerationRequest, GenerationResult


async def generate_each(engine: Any, requests: Sequence[GenerationRequest]) -> list[GenerationResult | BaseException]:
    """Run ``requests`` on ``engine`` side by side; one entry per request, in order: its result,
    or the exception it raised (so that one bad request fails alone, as it would on its own)."""
    return list(await asyncio.gather(*(engine.generate(r) for r in requests), return_exceptions=True))


class _EngineHost:
    """The engine verbs shared by standalone replicas and the trainer's hybrid engines."""

    engine: Any

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.engine.generate(request)

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult | BaseException]:
        return await generate_each(self.engine, requests)

    async def abort_all(self) -> int:
        return await self.engine.abort_all()

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def load_weights(self, state: Mapping[str, Any], version: int) -> float:
        t0 = time.perf_counter()
        await self.engine.load_weights(state, version)
        return time.perf_counter() - t0

    async def receive_weights(self, spec: Any, rank: int, manifest: Any, version: int) -> float:
        """The collective transport: join ``spec``'s group at ``rank`` and load the buckets."""
        t0 = time.perf_counter()
        await self.engine.receive_weights(spec, rank, manifest, version)
        return time.perf_counter() - t0

    def weight_ranks(self) -> int:
        """Ranks this replica's engine takes in a weight-sync group (its tensor-parallel workers)."""
        return int(getattr(self.engine, "weight_ranks", 1))

    def engine_stats(self) -> dict[str, float]:
        return dict(self.engine.stats())

    async def close(self) -> None:
        """Shut the engine down (vLLM's worker processes too) before the actor is killed."""
        await self.engine.shutdown()

    def ping(self) -> str:
        return "ok"

    async def watch(self) -> None:
        """Never returns: the caller's wait on it fails when this actor dies, so a death is seen
        at once, with no request in flight and without pinging (``RolloutService._watch``)."""
        await asyncio.Event().wait()


@ray.remote(num_cpus=0, max_concurrency=1000)
class ReplicaActor(_EngineHost):
    """One standalone replica. ``engine_factory()`` builds its engine inside this process."""

    def __init__(self, replica_id: str, engine_factory: Callable[[], Any]):
        self.replica_id = replica_id
        self.engine = engine_factory()

    async def receive_weights(self, spec: Any, rank: int, manifest: Any, version: int, die: bool = False) -> float:
        """``die``: the failpoint of ``KILL_IN_SYNC_ENV`` (join the group, then exit: a member
        lost while the trainer broadcasts)."""
        if die:  # through the engine's own membership (a second one would not meet this generation)
            from cluster import weight_sync as ws

            (getattr(self.engine, "receiver", None) or ws.Receiver()).join(spec, rank)
            os._exit(1)
        return await _EngineHost.receive_weights(self, spec, rank, manifest, version)


KILL_IN_SYNC_ENV = "TIDAL_KILL_REPLICA_IN_SYNC"
"""Failpoint ``<replica id>:<version>``, read by the driver: that replica joins the sync group
of that version, then its process exits while the trainer broadcasts."""

