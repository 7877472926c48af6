"""The rollout service actor: load balancer + message queue + rollouter in one event loop.

They call each other synchronously; with replica starters the service also starts replacements
for dead standalone replicas. Every death, replacement start, join and failure is reported to the
controller actor, which owns the run's membership (``loop.membership``). Must not: decide
anything about the hybrids (the controller drives them through ``lb_*``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from cluster.actors.names import CONTROLLER
from cluster.actors.remote_engine import ActorHung, RemoteEngine, actor_is_dead, kill_actor, kill_hung
from cluster.replacement import ReplicaReplacer
from data.types import Sample, SamplingSpec
from loop.plans import RolloutCounters
from rollout.load_balancer import LoadBalancer
from rollout.message_queue import MessageQueue, PullRecord
from rollout.rollouter import Rollouter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PulledBatch:
    """What the trainer's pull from the queue got (``RolloutService.get_batch``)."""

    samples: list[Sample] | None
    """``k`` samples; fewer only once the queue is closed; None when the pull timed out."""
    pull: PullRecord
    """The queue's record of the pull: the size it began with, what it asked for, whether it timed out."""
    mq_size: int
    """The queue's size right after the pull."""


@ray.remote(num_cpus=0, max_concurrency=10000)
class RolloutService:
    """The data plane's hub; see the module docstring of ``rollout.rollouter`` for the rules.

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
        scorer_factory: Callable[[], Any] | None = None,
        hybrid_handles: Mapping[str, Any] | None = None,
        heartbeat_timeout_s: float | None = None,
    ):
        self.lb = LoadBalancer()
        self._scorer = scorer_factory() if scorer_factory is not None else None
        """Scores each finished sample where it completes (``data.reward.SampleScorer``)."""
        self.queue = MessageQueue(max_required_samples)
        engines = {rid: RemoteEngine(rid, h, False) for rid, h in standalone.items()}
        # a hybrid's generate calls go to the actor hosting it: a trainer rank, else the trainer
        hosts = dict(hybrid_handles or {})
        engines.update({rid: RemoteEngine(rid, hosts.get(rid, trainer), True) for rid in hybrid_ids})
        self._engines = engines
        self._standalone = dict(standalone)  # every standalone actor started for this run, by id
        self._namespace = namespace
        self._starters = dict(replica_starters or {})
        self._replacer = (ReplicaReplacer(list(standalone), max_replacements, replacement_state)
                          if self._starters else None)
        self._replacement_timeout_s = float(replacement_timeout_s)
        self._replacing: dict[str, asyncio.Task[None]] = {}
        self._watching: dict[str, asyncio.Task[None]] = {}
        """A wait on each standalone's ``watch`` (``_watch``): how a death is seen while idle."""
        self._heartbeat_timeout_s = None if heartbeat_timeout_s is None else float(heartbeat_timeout_s)
        """``rollout.heartbeat_timeout_s``: a standalone that does not answer a ping within it is lost."""
        self._hung: list[dict[str, Any]] = []
        """Each standalone declared lost because it hung: id, when, in-flight requests failed over."""
        self._stopping = False
        self._rollouter_args = dict(
            n=n, sampling=sampling, lb=self.lb, engine_for=engines.__getitem__, queue=self.queue,
            max_required_samples=max_required_samples,
            concurrent_samples_per_replica=concurrent_samples_per_replica,
            partial_rollout=partial_rollout, seed=seed, param_version=param_version,
            replica_is_dead=actor_is_dead, on_replica_removed=self._on_replica_removed,
            score=self._scorer,
        )
        self.rollouter: Rollouter | None = None
        self.lb.add_replicas(list(standalone))

    async def start(self, prompts: list[tuple[int, int, list[int]]]) -> None:
        """Begin feeding ``prompts`` (already filtered for resume) to the replicas."""
        self.rollouter = Rollouter(prompts, **self._rollouter_args)
        self.rollouter.start()
        for rid in self._routable_standalone():
            self._start_watch(rid, self._standalone[rid])

    async def stop(self) -> list[str]:
        """Stop generating (and replacing); returns the uids that were in flight (they will be
        generated again). Replacements still starting are left to ``DataPlane.shutdown``."""
        self._stopping = True
        replacing = list(self._replacing.values())
        for task in replacing:
            task.cancel()
        await asyncio.gather(*replacing, return_exceptions=True)
        watching, self._watching = list(self._watching.values()), {}
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        if self.rollouter is None:
            return []
        await self.rollouter.stop()
        return self.rollouter.in_flight_uids()

    # -- the trainer's side ---------------------------------------------------------------------

    async def get_batch(self, k: int, timeout_s: float | None = None) -> PulledBatch:
        """``k`` samples, or (on timeout, taking nothing) ``samples=None``; with the queue's record
        of the pull."""
        try:
            samples = await self.queue.get_batch(k, timeout_s)
        except TimeoutError:
            samples = None
        pull = self.queue.last_pull()  # the record this call left (no await since it returned)
        assert pull is not None
        return PulledBatch(samples=samples, pull=pull, mq_size=self.queue.size())

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
        """Requests in flight (for observers: the control plane waits with ``lb_wait_drained``)."""
        return self.lb.in_flight(None if ids is None else list(ids))

    async def lb_wait_drained(self, ids: Sequence[str], timeout_s: float) -> int:
        return await self.lb.wait_drained(list(ids), timeout_s)

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
        if self._scorer is not None:  # the extras of dict rewards, averaged over the window
            window.update(self._scorer.drain_metrics())
        return window

    def counters(self) -> RolloutCounters:
        """The generated total and the queue size, read together (one per policy question)."""
        generated = 0 if self.rollouter is None else self.rollouter.total_generated_samples
        in_flight = 0 if self.rollouter is None else self.rollouter.in_flight_samples
        return RolloutCounters(generated_total=int(generated), queue_size=self.queue.size(), in_flight=int(in_flight))

    def stats(self) -> dict[str, Any]:
        base = {"queue_size": self.queue.size(), "active_replicas": list(self.lb.active_ids()),
                "standalone_replicas": self._routable_standalone(),
                "replaced_replicas": self._replacer.records() if self._replacer else [],
                "replacements_in_progress": sorted(self._replacing),
                "hung_replicas": [dict(h) for h in self._hung]}
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

    def _tell_controller(self, send: Callable[[Any], Any]) -> None:
        """Report a membership change to the controller actor (fire and forget: Ray keeps the
        order of one caller's calls, so the controller sees a death before its replacement)."""
        if self._namespace is None:
            return
        try:
            send(ray.get_actor(CONTROLLER, namespace=self._namespace))
        except ValueError:  # no controller (yet): nothing acts on membership
            pass

    def _start_watch(self, replica_id: str, handle: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._watch(replica_id, handle), name=f"watch-{replica_id}")
        self._watching[replica_id] = task
        task.add_done_callback(lambda _task: self._watching.pop(replica_id, None))

    async def _watch(self, replica_id: str, handle: Any) -> None:
        """Wait on the replica's ``watch``, which returns only by failing: when its actor died, the
        rollouter takes it out of the balancer and reports it (``Rollouter.replica_lost``), as a
        failed request would, unless one already did. So the controller's membership knows every
        death without asking the replicas (a policy question reads it).

        A replica that hangs (its process stopped, its event loop wedged) never fails its
        ``watch``, so with ``heartbeat_timeout_s`` it is also pinged every quarter of that
        deadline; one that does not answer within it is declared lost (``_declare_hung``), at most
        1.25 deadlines after it stopped. A ping, not a deadline per request: a healthy engine
        answers it in milliseconds however long its responses are, so the deadline need not
        exceed the longest generation, and an idle hung replica is found too."""
        watch = asyncio.ensure_future(handle.watch.remote())
        try:
            timeout = self._heartbeat_timeout_s
            while True:
                done, _ = await asyncio.wait({watch}, timeout=None if timeout is None else timeout / 4)
                if done:
                    watch.result()  # raises: the actor is gone
                    return
                assert timeout is not None
                try:
                    await asyncio.wait_for(handle.ping.remote(), timeout)
                except TimeoutError:
                    if not self._stopping and self.rollouter is not None:
                        self._declare_hung(replica_id, handle, timeout)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - only a death is acted on
            if not self._stopping and actor_is_dead(exc) and self.rollouter is not None:
                self.rollouter.replica_lost(replica_id)
        finally:
            watch.cancel()

    def _declare_hung(self, replica_id: str, handle: Any, timeout_s: float) -> None:
        """``replica_id`` did not answer a ping within ``timeout_s``: take it out of the balancer
        and report it as a death (the replacement path), fail its unanswered requests so the
        rollouter retries them elsewhere (each response goes on from the tokens it had, so no
        sample is lost or generated twice), then end its actor and process."""
        assert self.rollouter is not None
        log.error("standalone replica %s did not answer a ping within %gs (rollout.heartbeat_timeout_s): "
                  "declared lost", replica_id, timeout_s)
        exc = ActorHung(f"standalone replica {replica_id} did not answer a ping within {timeout_s:g}s "
                        "(rollout.heartbeat_timeout_s)")
        self.rollouter.replica_lost(replica_id)
        engine = self._engines.get(replica_id)
        failed = engine.fail_in_flight(exc) if isinstance(engine, RemoteEngine) else 0
        self._hung.append({"replica": replica_id, "at": time.time(), "requests_failed_over": failed})
        kill_hung(handle)

    def _on_replica_removed(self, replica_id: str) -> None:
        """The rollouter took ``replica_id`` out because its actor died."""
        if replica_id in self._standalone:
            self._tell_controller(lambda controller: controller.replica_died.remote(replica_id))
        if self._replacer is None or self._stopping:
            return
        new_id = self._replacer.on_failure(replica_id, time.time())
        if new_id is None:
            return
        log.warning("standalone replica %s died: starting %s in its place", replica_id, new_id)
        self._tell_controller(lambda controller: controller.replacement_started.remote(replica_id, new_id))
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
                kill_actor(handle)
            self._on_replica_removed(new)  # try again within the slot's budget
            return
        self._engines[new] = RemoteEngine(new, handle, False)
        self.lb.add_replicas([new])
        self._start_watch(new, handle)
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
