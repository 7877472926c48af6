"""The Ray actors of the data plane, each a thin shell around a plain class of this package.

- ``ReplicaActor``: one standalone rollout replica (an engine on its own emulated/real GPU).
- ``TrainerActor``: the train backend *and* the hybrid replicas' engines, in one process, so
  lending the trainer's GPU to rollout really time-shares the same device (or core).
- ``RolloutService``: load balancer + message queue + rollouter in one event loop (they call
  each other synchronously); with replica starters it also replaces dead standalone replicas.
- ``ControllerActor``: the ``DynamicResourceController`` with adapters that drive the actors
  above; every Prefect task talks to it (or to the others) by actor name.

Actors are named ``{role}`` inside the run's Ray namespace, so any process (a Prefect task on a
Ray worker included) finds them with ``ray.get_actor(name, namespace=run_uid)``; standalone replicas
are ``replica:{id}``, replacements included (``replica:standalone-I.rK``). Constructors take
plain values and factories, never the whole config (the builders in ``cluster.builders`` make
them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from cluster.controller import DynamicResourceController
from cluster.load_balancer import LoadBalancer
from cluster.message_queue import MessageQueue
from cluster.replacement import ReplicaReplacer
from cluster.rollouter import Rollouter, request_sample_uid
from cluster.types import GenerationRequest, GenerationResult, Sample, SamplingSpec

ROLLOUT_SERVICE = "rollout"
TRAINER = "trainer"
CONTROLLER = "controller"

log = logging.getLogger(__name__)


def replica_name(replica_id: str) -> str:
    return f"replica:{replica_id}"


# ------------------------------------------------------------------------------------------------
# Standalone replica


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

    def engine_stats(self) -> dict[str, float]:
        return dict(self.engine.stats())

    async def close(self) -> None:
        """Shut the engine down (vLLM's worker processes too) before the actor is killed."""
        await self.engine.shutdown()

    def ping(self) -> str:
        return "ok"


@ray.remote(num_cpus=0, max_concurrency=1000)
class ReplicaActor(_EngineHost):
    """One standalone replica. ``engine_factory()`` builds its engine inside this process."""

    def __init__(self, replica_id: str, engine_factory: Callable[[], Any]):
        self.replica_id = replica_id
        self.engine = engine_factory()


# ------------------------------------------------------------------------------------------------
# Trainer (+ hybrid engines in the same process)


@ray.remote(num_cpus=0, max_concurrency=1000)
class TrainerActor:
    """The train backend and, beside it, the engines of the hybrid replicas it can lend."""

    def __init__(
        self,
        backend_factory: Callable[[], Any],
        hybrid_factories: Mapping[str, Callable[[], Any]],
        *,
        namespace: str,
        required_samples: int,
    ):
        self.backend = backend_factory()
        self.hybrids = {rid: make() for rid, make in hybrid_factories.items()}
        self.namespace = namespace
        self.required_samples = required_samples
        self._train_lock = asyncio.Lock()

    # -- training ---------------------------------------------------------------------------

    async def train_micro_step(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Pull ``required_samples`` from the queue (timed) and run one update.

        Returns the micro-step report: wait seconds and wait samples (for the policy), the
        trained samples' identities and versions (for the store and staleness checks), the
        backend's metrics and timings, and the queue size right after the update (``mq_size``).
        """
        rollout = ray.get_actor(ROLLOUT_SERVICE, namespace=self.namespace)
        async with self._train_lock:
            t0 = time.perf_counter()
            pulled = await rollout.get_batch.remote(self.required_samples, timeout_s)
            samples: list[Sample] | None = pulled["samples"]
            waited = time.perf_counter() - t0
            if samples is None:  # timed out, nothing taken: the caller decides whether to wait on
                return {"samples": None, "timed_out": True, "wait_s": waited,
                        "size_at_start": pulled["size_at_start"], "mq_size": pulled["mq_size"]}
            if not samples:
                return {"samples": [], "wait_s": waited, "wait_samples": pulled["wait_samples"],
                        "mq_size": pulled["mq_size"], "exhausted": True, "allocated_s": waited}
            result = await asyncio.to_thread(self.backend.train_step, samples)
            allocated = time.perf_counter() - t0
            # the reference's mq_size: a snapshot of the queue right after the fit step, i.e. with
            # what the rollout side produced while the trainer trained (reference §4.4)
            mq_size = await rollout.queue_size.remote()
            return {
                "samples": [(s.epoch, s.prompt_index, s.min_version, s.max_version) for s in samples],
                "wait_s": waited,
                "wait_samples": pulled["wait_samples"],
                "mq_size": int(mq_size),
                "exhausted": False,
                "metrics": dict(result.metrics),
                "timing_s": dict(result.timing_s),
                "compute_s": result.compute_s,
                "allocated_s": allocated,
            }

    def weights(self) -> dict[str, Any]:
        """Current weights for the broadcast (Ray puts the return value in the object store)."""
        return self.backend.state_dict_for_rollout()

    async def save_checkpoint(self, path: str) -> dict[str, Any]:
        info = await asyncio.to_thread(self.backend.save_checkpoint, path)
        return {"path": info.path, "sha256": info.sha256, "size_bytes": info.size_bytes}

    async def load_checkpoint(self, path: str, sha256: str | None = None) -> int:
        await asyncio.to_thread(self.backend.load_checkpoint, path, expected_sha256=sha256)
        return self.backend.updates

    # -- hybrid engines (same process: the weights never leave it) ----------------------------

    async def hybrid_generate_batch(
        self, replica_id: str, requests: Sequence[GenerationRequest]
    ) -> list[GenerationResult | BaseException]:
        return await generate_each(self.hybrids[replica_id], requests)

    async def hybrid(self, op: str, replica_ids: Sequence[str]) -> int:
        """Run an engine verb (abort_all, pause, resume, sleep, wake_up) on hybrid engines."""
        if op not in {"abort_all", "pause", "resume", "sleep", "wake_up"}:
            raise ValueError(f"unknown hybrid op {op!r}")
        results = await asyncio.gather(*(getattr(self.hybrids[rid], op)() for rid in replica_ids))
        return int(sum(r or 0 for r in results))

    async def hybrid_load_weights(self, replica_ids: Sequence[str], version: int) -> float:
        t0 = time.perf_counter()
        state = self.backend.state_dict_for_rollout()
        for rid in replica_ids:
            await self.hybrids[rid].load_weights(state, version)
        return time.perf_counter() - t0

    def hybrid_stats(self) -> dict[str, dict[str, float]]:
        return {rid: dict(engine.stats()) for rid, engine in self.hybrids.items()}

    async def close(self) -> None:
        """Shut the hybrid engines and the backend down before the actor is killed."""
        await asyncio.gather(*(engine.shutdown() for engine in self.hybrids.values()))
        self.backend.close()

    def ping(self) -> str:
        return "ok"


# ------------------------------------------------------------------------------------------------
# Rollout service: load balancer + queue + rollouter


def _kill_actor(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _actor_is_dead(exc: BaseException) -> bool:
    """Only a dead actor takes a replica out of the balancer; other errors are retried."""
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                            ray.exceptions.ActorUnavailableError))


class _RemoteEngine:
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


@ray.remote(num_cpus=0, max_concurrency=10000)
class RolloutService:
    """The data plane's hub; see the module docstring of ``cluster.rollouter`` for the rules.

    Replacing dead standalone replicas (when ``replica_starters`` is given: per slot, a callable
    that starts a replica actor under the id it is given). When the rollouter takes a
    standalone replica out because its actor died, ``ReplicaReplacer`` picks the replacement's id
    (within ``max_replacements`` per slot), the slot's starter starts it, and once its engine is
    up the controller adopts it (``ControllerActor.adopt_standalone``: it loads the last
    broadcast's weights at that version and from then on includes it in every broadcast; the
    controller runs one call at a time, so no broadcast slips in between). Only then does it join
    the load balancer, so it never serves an older version than the other replicas and the
    capacity goes back up. A replacement that fails or takes longer than
    ``replacement_timeout_s`` is killed and counts as a death of its own (retried within the
    budget). ``stats()`` lists every death and its outcome under ``replaced_replicas``.
    """

    def __init__(
        self,
        *,
        standalone: Mapping[str, Any],
        trainer: Any,
        hybrid_ids: Sequence[str],
        max_required_samples: int,
        concurrent_samples_per_replica: int,
        n: int,
        sampling: SamplingSpec,
        partial_rollout: bool,
        seed: int,
        param_version: int,
        namespace: str | None = None,
        replica_starters: Mapping[str, Callable[[str], Any]] | None = None,
        max_replacements: int = 0,
        replacement_timeout_s: float = 300.0,
        replacement_state: Mapping[str, Any] | None = None,
    ):
        self.lb = LoadBalancer()
        self.queue = MessageQueue(max_required_samples)
        engines = {rid: _RemoteEngine(rid, h, False) for rid, h in standalone.items()}
        engines.update({rid: _RemoteEngine(rid, trainer, True) for rid in hybrid_ids})
        self._engines = engines
        self._standalone = dict(standalone)  # every standalone actor started for this run, by id
        self._namespace = namespace
        self._starters = dict(replica_starters or {})
        self._replacer = (ReplicaReplacer(list(standalone), max_replacements, replacement_state)
                          if self._starters else None)
        self._replacement_timeout_s = float(replacement_timeout_s)
        self._replacing: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self._rollouter_args = dict(
            n=n, sampling=sampling, lb=self.lb, engine_for=engines.__getitem__, queue=self.queue,
            max_required_samples=max_required_samples,
            concurrent_samples_per_replica=concurrent_samples_per_replica,
            partial_rollout=partial_rollout, seed=seed, param_version=param_version,
            replica_is_dead=_actor_is_dead, on_replica_removed=self._on_replica_removed,
        )
        self.rollouter: Rollouter | None = None
        self.lb.add_replicas(list(standalone))

    async def start(self, prompts: list[tuple[int, int, list[int]]]) -> None:
        """Begin feeding ``prompts`` (already filtered for resume) to the replicas."""
        self.rollouter = Rollouter(prompts, **self._rollouter_args)
        self.rollouter.start()

    async def stop(self) -> list[str]:
        """Stop generating (and replacing); returns the uids that were in flight (they will be
        generated again). Replacements still starting are left to ``DataPlane.shutdown``."""
        self._stopping = True
        replacing = list(self._replacing.values())
        for task in replacing:
            task.cancel()
        await asyncio.gather(*replacing, return_exceptions=True)
        if self.rollouter is None:
            return []
        await self.rollouter.stop()
        return self.rollouter.in_flight_uids()

    # -- the trainer's side ---------------------------------------------------------------------

    async def get_batch(self, k: int, timeout_s: float | None = None) -> dict[str, Any]:
        """``k`` samples, or (on timeout, taking nothing) ``samples=None`` and ``timed_out``."""
        size_at_start = self.queue.size()
        try:
            samples = await self.queue.get_batch(k, timeout_s)
        except TimeoutError:
            return {"samples": None, "timed_out": True, "size_at_start": size_at_start,
                    "wait_samples": max(0, k - size_at_start), "mq_size": self.queue.size()}
        return {
            "size_at_start": size_at_start,
            "samples": samples,
            "wait_samples": max(0, k - size_at_start),
            "mq_size": self.queue.size(),
        }

    async def wait_for_queue(self, k: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until ``k`` samples are queued or no more will come (the wait-for-samples phase)."""
        assert self.rollouter is not None, "start() first"
        rollouter = self.rollouter
        t0 = time.perf_counter()
        await asyncio.wait_for(
            rollouter.wait_until(lambda: self.queue.size() >= k or rollouter.exhausted or self.queue.closed),
            timeout_s,
        )
        return {"waited_s": time.perf_counter() - t0, "mq_size": self.queue.size(),
                "exhausted": rollouter.exhausted}

    def queue_size(self) -> int:
        return self.queue.size()

    # -- the controller's side (LoadBalancer protocol) ----------------------------------------

    def lb_add(self, ids: Sequence[str]) -> None:
        self.lb.add_replicas(list(ids))

    def lb_remove(self, ids: Sequence[str]) -> None:
        self.lb.remove_replicas(list(ids))

    def lb_clear_sticky(self) -> int:
        return self.lb.clear_sticky()

    def lb_in_flight(self, ids: Sequence[str] | None = None) -> int:
        return self.lb.in_flight(None if ids is None else list(ids))

    def lb_hold(self) -> None:
        self.lb.hold()

    def lb_unhold(self) -> None:
        self.lb.unhold()

    def on_weight_sync(self, version: int) -> dict[str, float]:
        """The rollouter's window metrics plus the replica counts at this sync."""
        assert self.rollouter is not None, "start() first"
        window = self.rollouter.on_weight_sync(version)
        window.update({
            "fully_async/rollouter/standalone_replicas": float(len(self._routable_standalone())),
            "fully_async/rollouter/max_concurrent_samples": float(self.rollouter.max_concurrent_samples),
            "fully_async/rollouter/failed_replicas": float(len(self.rollouter.failed_replicas)),
            "fully_async/rollouter/replaced_replicas": float(self._replacer.replaced if self._replacer else 0),
        })
        return window

    def stats(self) -> dict[str, Any]:
        base = {"queue_size": self.queue.size(), "active_replicas": list(self.lb.active_ids()),
                "standalone_replicas": self._routable_standalone(),
                "replaced_replicas": self._replacer.records() if self._replacer else [],
                "replacements_in_progress": sorted(self._replacing)}
        if self.rollouter is not None:
            base.update(self.rollouter.stats())
            base["failed_replicas"] = self.rollouter.failed_replicas
            base["replica_versions"] = self.rollouter.replica_versions()
            base["exhausted"] = self.rollouter.exhausted
            error = self.rollouter.error
            base["error"] = None if error is None else repr(error)
        return base

    def replacement_state(self) -> dict[str, Any]:
        """The replacer's state (committed with each step; a resume continues from it)."""
        return self._replacer.state_dict() if self._replacer else {}

    def standalone_handles(self) -> dict[str, Any]:
        """Every standalone actor started for this run (dead, replaced and starting ones too)."""
        return dict(self._standalone)

    def _routable_standalone(self) -> list[str]:
        return [rid for rid in self.lb.active_ids() if rid in self._standalone]

    # -- replacing dead standalone replicas (see the class docstring) ---------------------------

    def _on_replica_removed(self, replica_id: str) -> None:
        """The rollouter took ``replica_id`` out because its actor died."""
        if self._replacer is None or self._stopping:
            return
        new_id = self._replacer.on_failure(replica_id, time.time())
        if new_id is None:
            return
        log.warning("standalone replica %s died: starting %s in its place", replica_id, new_id)
        task = asyncio.get_running_loop().create_task(self._replace(replica_id, new_id), name=f"replace-{new_id}")
        self._replacing[new_id] = task
        task.add_done_callback(lambda _task: self._replacing.pop(new_id, None))

    async def _replace(self, old: str, new: str) -> None:
        assert self._replacer is not None
        t0 = time.perf_counter()
        handle = None
        try:
            handle = self._starters[self._replacer.slot_of(new)](new)
            self._standalone[new] = handle  # from now on DataPlane.shutdown ends it
            version = await asyncio.wait_for(self._adopt(old, new, handle), self._replacement_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed start counts as a death of its own
            reason = "timed out" if isinstance(exc, TimeoutError) else repr(exc)
            log.error("replacement %s for %s did not start: %s", new, old, reason)
            self._replacer.start_failed(new, reason)
            if handle is not None:
                _kill_actor(handle)
            self._on_replica_removed(new)  # try again within the slot's budget
            return
        self._engines[new] = _RemoteEngine(new, handle, False)
        self.lb.add_replicas([new])
        self._replacer.joined(new, time.time(), version)
        log.warning("standalone replica %s replaced by %s (param version %s) in %.1fs; %d standalone routable",
                    old, new, version, time.perf_counter() - t0, len(self._routable_standalone()))

    async def _adopt(self, old: str, new: str, handle: Any) -> int | None:
        """Wait for the new actor's engine, then let the controller load the weights into it."""
        await handle.ping.remote()
        controller = ray.get_actor(CONTROLLER, namespace=self._namespace)
        return await controller.adopt_standalone.remote(old, new, handle)

    def in_flight_uids(self) -> list[str]:
        return [] if self.rollouter is None else self.rollouter.in_flight_uids()

    def ping(self) -> str:
        return "ok"


# ------------------------------------------------------------------------------------------------
# Controller


class _BalancerAdapter:
    """The controller's ``LoadBalancer`` protocol, spoken to the rollout service."""

    def __init__(self, service: Any):
        self.service = service

    def add_replicas(self, ids: Sequence[str]) -> None:
        ray.get(self.service.lb_add.remote(list(ids)))

    def remove_replicas(self, ids: Sequence[str]) -> None:
        ray.get(self.service.lb_remove.remote(list(ids)))

    def clear_sticky(self) -> int:
        return ray.get(self.service.lb_clear_sticky.remote())

    def in_flight(self, ids: Sequence[str] | None = None) -> int:
        return ray.get(self.service.lb_in_flight.remote(None if ids is None else list(ids)))

    def hold(self) -> None:
        ray.get(self.service.lb_hold.remote())

    def unhold(self) -> None:
        ray.get(self.service.lb_unhold.remote())


class _PoolAdapter:
    """The controller's ``ReplicaPool`` protocol over standalone actors and the trainer's hybrids."""

    def __init__(self, standalone: Mapping[str, Any], trainer: Any, hybrid_ids: Sequence[str]):
        self.standalone, self.trainer, self.hybrid_ids = dict(standalone), trainer, set(hybrid_ids)
        self.dead: set[str] = set()
        """Standalone replicas whose actor died: skipped from then on (the run goes on without them)."""

    def _split(self, ids: Sequence[str]) -> tuple[list[str], list[str]]:
        hyb = [i for i in ids if i in self.hybrid_ids]
        return hyb, [i for i in ids if i not in self.hybrid_ids and i not in self.dead]

    def get_alive(self, refs: Mapping[str, Any]) -> dict[str, Any]:
        """``ray.get`` each standalone replica's result; a dead actor is noted and left out."""
        out = {}
        for rid, ref in refs.items():
            try:
                out[rid] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - only actor death is tolerated
                if not _actor_is_dead(exc):
                    raise
                self.dead.add(rid)
        return out

    def _run(self, op: str, ids: Sequence[str]) -> int:
        hyb, std = self._split(ids)
        total = sum(r or 0 for r in self.get_alive({i: getattr(self.standalone[i], op).remote() for i in std}).values())
        if hyb:
            total += ray.get(self.trainer.hybrid.remote(op, hyb)) or 0
        return int(total)

    def abort(self, ids: Sequence[str]) -> int:
        self._run("pause", ids)
        return self._run("abort_all", ids)

    def sleep(self, ids: Sequence[str]) -> None:
        self._run("sleep", ids)

    def wake_up(self, ids: Sequence[str]) -> None:
        self._run("wake_up", ids)

    def resume(self, ids: Sequence[str]) -> None:
        self._run("resume", ids)

    def load_weights(self, ids: Sequence[str], version: int) -> None:
        hyb, std = self._split(ids)
        if std:  # not used by the controller (hybrids only), but keep the protocol whole
            weights = self.trainer.weights.remote()
            self.get_alive({i: self.standalone[i].load_weights.remote(weights, version) for i in std})
        if hyb:
            ray.get(self.trainer.hybrid_load_weights.remote(hyb, version))


@ray.remote(num_cpus=0)
class ControllerActor:
    """Holds the policy and the controller; the Prefect tasks call it by name."""

    def __init__(
        self,
        policy_factory: Callable[[], Any],
        *,
        namespace: str,
        standalone_ids: Sequence[str],
        hybrid_ids: Sequence[str],
        enable_rebalance: bool,
        only_hybrid: bool,
        keep_broadcast_weights: bool = False,
    ):
        service = ray.get_actor(ROLLOUT_SERVICE, namespace=namespace)
        trainer = ray.get_actor(TRAINER, namespace=namespace)
        standalone = {rid: ray.get_actor(replica_name(rid), namespace=namespace) for rid in standalone_ids}
        self.policy = policy_factory()
        self.standalone = standalone
        self.trainer = trainer
        self.service = service
        self.pool = _PoolAdapter(standalone, trainer, hybrid_ids)
        self.ctl = DynamicResourceController(
            self.policy, list(hybrid_ids), _BalancerAdapter(service), self.pool,
            standalone_ids=list(standalone_ids), enable_rebalance=enable_rebalance, only_hybrid=only_hybrid,
            clock=time.time,
        )
        self._keep_weights = keep_broadcast_weights
        self._last_broadcast: tuple[Any, int] | None = None
        """(weights ref, version) of the last broadcast, kept for replacements when asked to."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a controller method by name (decisions, switches, context, state)."""
        return getattr(self.ctl, method)(*args, **kwargs)

    def broadcast(self, version: int) -> dict[str, float]:
        """Trainer → every standalone replica at ``version``; returns timings."""
        t0 = time.perf_counter()
        weights = self.trainer.weights.remote()
        alive = {rid: h for rid, h in self.standalone.items() if rid not in self.pool.dead}
        per_replica = self.pool.get_alive({rid: h.load_weights.remote(weights, version) for rid, h in alive.items()})
        if self._keep_weights:
            self._last_broadcast = (weights, int(version))
        return {"broadcast_s": time.perf_counter() - t0, "max_replica_load_s": max(per_replica.values(), default=0.0),
                "replicas": float(len(per_replica))}

    def adopt_standalone(self, old: str, new: str, handle: Any) -> int | None:
        """Take ``new`` (a started replica actor) in place of the dead ``old``: load the last
        broadcast's weights into it and include it in every later broadcast and switch. Returns
        the param version it now holds (None before the first broadcast: the first broadcast
        loads it, as it does the others). Runs between broadcasts, never during one (this actor
        serves one call at a time), so the new replica holds the version the others hold."""
        version = None
        if self._last_broadcast is not None:
            weights, version = self._last_broadcast
            ray.get(handle.load_weights.remote(weights, version))  # a dead new actor raises: not adopted
        for handles in (self.standalone, self.pool.standalone):
            handles.pop(old, None)
            handles[new] = handle
        self.ctl.replace_standalone(old, new)
        return version

    def standalone_alive(self) -> int:
        """Standalone replicas still alive and routable (a killed actor drops out of both counts).
        Each one is pinged, so a death is seen even when no request of it has failed yet."""
        self.pool.get_alive({rid: h.ping.remote() for rid, h in self.standalone.items() if rid not in self.pool.dead})
        failed = set(ray.get(self.service.stats.remote()).get("failed_replicas", []))
        return len(set(self.standalone) - self.pool.dead - failed)

    def hybrid_active(self) -> bool:
        return self.ctl.is_hybrid_active

    def controller_state(self) -> dict[str, Any]:
        return self.ctl.state_dict()

    def drain_records(self) -> dict[str, list[dict[str, Any]]]:
        """This step's decisions and switch timings (for the store), cleared afterwards."""
        return {
            "decisions": [dataclasses.asdict(d) for d in self.ctl.drain_decisions()],
            "switch_events": [dataclasses.asdict(s) for s in self.ctl.drain_switch_log()],
        }

    def policy_state(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_policy_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)

    def deactivate_ratio(self) -> float | None:
        value = getattr(self.policy, "deactivate_ratio", None)
        return None if value is None else float(value)

    def ping(self) -> str:
        return "ok"
