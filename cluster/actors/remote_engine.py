"""What the rollouter calls ``generate`` on: one replica actor (or hybrid) behind a call batcher.

Also the two Ray facts the data plane needs about a failed call: was it an actor death, and how
to end an actor that may already be gone. Must not: route or retry (the rollouter does).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import ray

from cluster.engines.base import request_sample_uid
from data.types import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


class ActorHung(ray.exceptions.RayActorError):
    """An actor that did not answer within its deadline (a stopped process, a wedged driver call):
    declared lost exactly as a dead one is, so every path that handles a death handles it (a
    standalone replica is taken out and replaced; the trainer's loss stops the run with exit 3
    and the resume line, ``flows.errors.actor_lost``)."""

    def __init__(self, what: str = "an actor did not answer within its deadline"):
        super().__init__(error_msg=what)
        self.what = what

    def __reduce__(self):  # crosses Ray's boundary inside a RayTaskError
        return (ActorHung, (self.what,))

    def __str__(self) -> str:
        return self.what


def kill_actor(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def local_pid(handle: Any) -> int | None:
    """The pid of ``handle``'s actor process as the GCS records it, when it runs on this node
    (None elsewhere, or when the GCS has no record)."""
    try:
        info = ray._private.state.actors(handle._actor_id.hex())
        address = info.get("Address") or {}
        if address.get("IPAddress") in (None, "", ray.util.get_node_ip_address()):
            return int(info.get("Pid") or 0) or None
    except Exception:  # noqa: BLE001 - no GCS record
        pass
    return None


def kill_hung(handle: Any) -> None:
    """End an actor that stopped answering. ``ray.kill`` marks it dead at once (its callers' calls
    fail, its resources are freed) but a stopped process (SIGSTOP, a wedged kernel call) never
    runs its exit, so the process is also SIGKILLed by the pid the GCS holds for it, when it
    lives on this node."""
    pid = local_pid(handle)
    kill_actor(handle)
    if pid is not None and pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        log.warning("killed hung actor process %d", pid)


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
        self._in_flight: dict[int, list[asyncio.Future[GenerationResult]]] = {}
        """The callers' futures of each call sent and not yet answered (``fail_in_flight``)."""
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
        self._in_flight[id(batch)] = [future for _, future in batch]
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
        finally:
            self._in_flight.pop(id(batch), None)
        for (request, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller gave up (cancelled)
                continue
            if isinstance(result, asyncio.CancelledError):  # not the caller's cancellation
                future.set_exception(RuntimeError(f"{request.request_id} was cancelled on {self.replica_id}"))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def fail_in_flight(self, exc: BaseException) -> int:
        """The replica was declared lost while calls to it were unanswered (it hung): fail each
        of their requests with ``exc`` now, so the rollouter retries them elsewhere, and stop
        waiting on the calls. Returns how many requests it failed."""
        failed = 0
        for futures in self._in_flight.values():
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
                    failed += 1
        self._in_flight.clear()
        for task in list(self._sending):
            task.cancel()  # its futures are done: the cancellation reaches no caller
        return failed

