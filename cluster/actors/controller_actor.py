"""The controller actor: the typed API of a step, around ``DynamicResourceController``.

Each step phase is one method returning a frozen plan or report of ``loop.plans``
(``should_deactivate`` → ``DeactivatePlan``, ``wait_for_samples`` → ``WaitReport``, ``broadcast`` →
``BroadcastReport`` (with the hybrid sync, when it overlaps), ``should_activate`` → ``LendPlan``,
``hybrid_sync`` → ``SwitchReport``, ``lend`` → its ``SwitchReport``s, ``update_after_step`` →
``StepOutcome``), so a Prefect task is one call. It owns the
run's standalone membership (``loop.membership``): the rollout service reports deaths and
replacements to it, and a failed call or ping of its own counts too.

Every call it makes has a deadline (``async_training.switch_call_timeout_s``, on top of a call's
own wait; the collective send: ``actor_rollout_ref.rollout.weight_sync.timeout_s`` + 30 s): an
actor that has not answered by then hangs and is ended (``get_within``). A standalone replica is
then marked dead and replaced; the trainer (or a rank), a hybrid it hosts or the rollout service
raises ``ActorHung``, a ``RayActorError``, so the run stops with exit 3 and the resume line.

Must not: hold policy logic (the controller asks ``loop.Decider``), or be called by name strings:
tasks go through ``call(handle, ControllerHost.method, ...)`` so go-to-definition leads here.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster import weight_sync as ws
from cluster.actors.names import ROLLOUT_SERVICE, TRAINER, replica_name
from cluster.actors.remote_engine import ActorHung, actor_is_dead, kill_hung, local_pid
from cluster.actors.trainer_rank import rank_name
from loop.controller import DynamicResourceController
from loop.membership import Membership
from loop.plans import RolloutCounters
from loop.plans import (
    BroadcastReport,
    DeactivatePlan,
    LendPlan,
    MicroSummary,
    RunSizes,
    StepOutcome,
    SwitchReport,
    WaitReport,
)

log = logging.getLogger(__name__)

SWITCH_TIMEOUT_KEY = "async_training.switch_call_timeout_s"

HANG_TRAINER_AT_ENV = "TIDAL_HANG_TRAINER_AT"
"""Failpoint ``<moment>:<n>[/rank<K>][@<pid file>]``, read by the driver (``builders.sync_options``): the
controller SIGSTOPs the trainer's process (it hosts the hybrids; with ``/rank<K>``: its rank
``K``'s) as ``moment`` begins, where
``moment`` is ``take_back`` (step ``n``'s take-back of the hybrids), ``hybrid_sync`` (step
``n``'s wake and load of the lent hybrids) or ``broadcast`` (the broadcast of version ``n``), and
writes its pid to ``pid file``. The trainer hangs rather than dies: the moment's calls meet their
deadline (``tests/faults/test_fault_hang.py``)."""
HANG_MOMENTS = ("take_back", "hybrid_sync", "broadcast")


def get_within(ref: Any, timeout_s: float, what: str, handle: Any, key: str = SWITCH_TIMEOUT_KEY) -> Any:
    """``ray.get(ref)`` within ``timeout_s``. An actor that has not answered by then hangs: it is
    ended (``kill_hung``; ``handle`` may be a callable giving every actor to end, e.g. the trainer
    and its ranks, one of which it may be waiting on) and ``ActorHung`` raised, a
    ``RayActorError`` like a death, so the run stops with exit 3 and the resume line
    (``flows.errors.actor_lost``) instead of waiting forever."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        log.error("%s did not answer within %gs (%s): declared lost", what, timeout_s, key)
        for h in ([handle] if isinstance(handle, ray.actor.ActorHandle) else handle()):
            kill_hung(h)
        raise ActorHung(f"{what} did not answer within {timeout_s:g}s ({key})") from None


def trainer_group(trainer: Any, namespace: str | None) -> Callable[[], list[Any]]:
    """The trainer actor and its rank actors (found by name when asked): what a hang of the
    trainer's ends, since the stopped process may be a rank the trainer waits on."""

    def group() -> list[Any]:
        handles = [trainer]
        for rank in range(1024):
            try:
                handles.append(ray.get_actor(rank_name(rank), namespace=namespace))
            except ValueError:
                break
        return handles

    return group


class _BalancerAdapter:
    """The controller's ``LoadBalancer`` protocol, spoken to the rollout service; each call within
    ``timeout_s`` (``get_within``)."""

    def __init__(self, service: Any, timeout_s: float = 300.0):
        self.service, self.timeout_s = service, float(timeout_s)

    def call(self, ref: Any, what: str, extra_s: float = 0.0) -> Any:
        """The rollout service's answer to ``ref`` within the deadline plus ``extra_s`` (the call's own wait)."""
        return get_within(ref, self.timeout_s + extra_s, f"the rollout service ({what})", self.service)

    def add_replicas(self, ids: Sequence[str]) -> None:
        self.call(self.service.lb_add.remote(list(ids)), "lb_add")

    def remove_replicas(self, ids: Sequence[str]) -> None:
        self.call(self.service.lb_remove.remote(list(ids)), "lb_remove")

    def clear_sticky(self) -> int:
        return self.call(self.service.lb_clear_sticky.remote(), "lb_clear_sticky")

    def wait_drained(self, ids: Sequence[str], timeout_s: float) -> int:
        return self.call(self.service.lb_wait_drained.remote(list(ids), timeout_s), "lb_wait_drained", timeout_s)

    def hold(self) -> None:
        self.call(self.service.lb_hold.remote(), "lb_hold")

    def unhold(self) -> None:
        self.call(self.service.lb_unhold.remote(), "lb_unhold")


class _PoolAdapter:
    """The controller's ``ReplicaPool`` protocol over standalone actors and the trainer's hybrids.

    A standalone replica whose call fails because its actor died, or that does not answer within
    ``timeout_s`` (it hangs: it is then ended, ``kill_hung``), is reported to ``members`` and
    skipped from then on (the run goes on without it; the rollout service sees it gone and
    replaces it). The trainer not answering within ``timeout_s`` (it, or a rank it waits on,
    hangs) raises ``ActorHung``: the run stops with exit 3, as when it dies.
    """

    def __init__(self, standalone: Mapping[str, Any], trainer: Any, members: Membership, timeout_s: float = 300.0,
                 namespace: str | None = None):
        self.standalone, self.trainer, self.members = dict(standalone), trainer, members
        self.timeout_s = float(timeout_s)
        self.trainer_group = trainer_group(trainer, namespace)

    def _trainer(self, ref: Any, what: str) -> Any:
        return get_within(ref, self.timeout_s, f"the trainer ({what})", self.trainer_group)

    def _split(self, ids: Sequence[str]) -> tuple[list[str], list[str]]:
        hybrids = set(self.members.hybrid_ids)
        hyb = [i for i in ids if i in hybrids]
        return hyb, [i for i in ids if i not in hybrids and not self.members.is_dead(i)]

    def get_alive(self, refs: Mapping[str, Any]) -> dict[str, Any]:
        """``ray.get`` each standalone replica's result within ``timeout_s`` (one deadline for all);
        a dead actor, or one that has not answered by then (ended first), is reported and left out."""
        out = {}
        deadline = time.perf_counter() + self.timeout_s
        for rid, ref in refs.items():
            try:
                out[rid] = ray.get(ref, timeout=max(0.0, deadline - time.perf_counter()))
            except ray.exceptions.GetTimeoutError:
                log.error("standalone replica %s did not answer within %gs (%s): declared lost",
                          rid, self.timeout_s, SWITCH_TIMEOUT_KEY)
                kill_hung(self.standalone[rid])  # the rollout service sees it dead and replaces it
                self.members.died(rid)
            except Exception as exc:  # noqa: BLE001 - only actor death is tolerated
                if not actor_is_dead(exc):
                    raise
                self.members.died(rid)
        return out

    def _each(self, ids: Sequence[str], standalone: Callable[[Any], Any], hybrids: Callable[[Any], Any]) -> int:
        """One verb on every replica of ``ids``: ``standalone(actor)`` is the replica actor's
        method (``lambda a: a.sleep``), ``hybrids(trainer)`` the trainer's for its hybrids
        (``lambda t: t.hybrid_sleep``); the sum of what they return (aborted requests)."""
        hyb, std = self._split(ids)
        total = sum(r or 0 for r in self.get_alive({i: standalone(self.standalone[i]).remote() for i in std}).values())
        if hyb:
            method = hybrids(self.trainer)
            total += self._trainer(method.remote(hyb), getattr(method, "_method_name", "hybrids")) or 0
        return int(total)

    def abort(self, ids: Sequence[str]) -> int:
        self._each(ids, lambda a: a.pause, lambda t: t.hybrid_pause)
        return self._each(ids, lambda a: a.abort_all, lambda t: t.hybrid_abort_all)

    def sleep(self, ids: Sequence[str]) -> None:
        self._each(ids, lambda a: a.sleep, lambda t: t.hybrid_sleep)

    def wake_up(self, ids: Sequence[str]) -> None:
        self._each(ids, lambda a: a.wake_up, lambda t: t.hybrid_wake_up)

    def offload(self, ids: Sequence[str]) -> dict[str, float]:
        """Before hybrids wake on the trainer's devices: its state to host memory (``TrainerRoom``)."""
        hyb, _ = self._split(ids)
        return self._trainer(self.trainer.offload.remote(), "offload") if hyb else {}

    def reload(self, ids: Sequence[str]) -> dict[str, float]:
        """After they sleep: the trainer's state back on its devices."""
        hyb, _ = self._split(ids)
        return self._trainer(self.trainer.reload.remote(), "reload") if hyb else {}

    def resume(self, ids: Sequence[str]) -> None:
        self._each(ids, lambda a: a.resume, lambda t: t.hybrid_resume)

    def load_weights(self, ids: Sequence[str], version: int) -> None:
        hyb, std = self._split(ids)
        if std:  # not used by the controller (hybrids only), but keep the protocol whole
            weights = self.trainer.weights.remote()
            self.get_alive({i: self.standalone[i].load_weights.remote(weights, version) for i in std})
        if hyb:
            self._trainer(self.trainer.hybrid_load_weights.remote(hyb, version), "hybrid_load_weights")


class _InThread:
    """``fn(*args)`` on a thread of its own; ``result()`` joins it (and raises what it raised)."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        import concurrent.futures

        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self._future = self._pool.submit(fn, *args)

    def result(self) -> Any:
        try:
            return self._future.result()
        finally:
            self._pool.shutdown(wait=False)


@dataclass(frozen=True)
class SyncReport:
    """One sync of the standalone replicas: each loaded replica's seconds, the sender's report
    (the collective's; None for the object store, or when no replica was left to sync) and the
    generations it took beyond the first (``retries``)."""

    loaded: Mapping[str, float] = field(default_factory=dict)
    sent: ws.SendReport | None = None
    retries: int = 0

    @property
    def sent_bytes(self) -> int:
        return self.sent.stats.nbytes if self.sent is not None else 0


class CollectiveSync:
    """The collective transport driven from the controller: the trainer sends, every replica of
    ``run``'s receives, in a group re-formed (a new generation) whenever its members change.
    The trainer's sender is built once, with the manifest it plans from its own wire dtype and
    bucket size (``TrainerActor.weight_sender``); this side only forms the groups on it.

    A sync that loses a member (its actor dies, or the group's timeout passes) marks it dead
    through ``members`` (a hung one is killed first, so the rollout service replaces it) and
    syncs the rest again in a new generation, at most ``retries`` times: the step goes on.
    """

    def __init__(self, trainer: Any, members: Membership, timeout_s: float, retries: int = 2,
                 kill_in_sync: str | None = None, call_timeout_s: float = 300.0,
                 trainer_group: Callable[[], list[Any]] | None = None):
        self.trainer, self.members = trainer, members
        self.trainer_group = trainer_group or (lambda: [trainer])
        self.call_timeout_s = float(call_timeout_s)  # the sender's setup, a replica's rank count
        self._kill = kill_in_sync  # failpoint "<replica>:<version>" (replica.KILL_IN_SYNC_ENV)
        self.timeout_s, self.retries = float(timeout_s), retries
        self._sender: ws.SenderEndpoint | None = None
        self._generation = 0
        self._members: tuple[tuple[str, int], ...] | None = None
        self._ranks: dict[str, int] = {}

    def _spec(self, sender: ws.SenderEndpoint, layout: tuple[tuple[str, int], ...], world: int,
              fresh: bool) -> ws.GroupSpec:
        if fresh or layout != self._members:
            self._generation += 1
            self._members = layout
        return sender.group(world, self._generation, self.timeout_s)

    def run(self, handles: Mapping[str, Any], version: int) -> SyncReport:
        """Sync ``version`` into ``handles``' replicas."""
        if self._sender is None:
            self._sender = get_within(self.trainer.weight_sender.remote(), self.call_timeout_s,
                                      "the trainer (weight_sender)", self.trainer_group)
        sender = self._sender
        fresh = False
        for attempt in range(self.retries + 1):
            alive = {rid: h for rid, h in handles.items() if not self.members.is_dead(rid)}
            if not alive:
                return SyncReport(retries=attempt)
            for rid, handle in alive.items():
                if rid not in self._ranks:
                    try:
                        self._ranks[rid] = int(ray.get(handle.weight_ranks.remote(), timeout=self.call_timeout_s))
                    except Exception as exc:  # noqa: BLE001 - dead or hung: out of this sync
                        if not (actor_is_dead(exc) or isinstance(exc, ray.exceptions.GetTimeoutError)):
                            raise
                        kill_hung(handle)
                        self.members.died(rid)
            alive = {rid: h for rid, h in alive.items() if rid in self._ranks and not self.members.is_dead(rid)}
            if not alive:
                return SyncReport(retries=attempt)
            layout, rank = [], 1
            for rid in alive:
                layout.append((rid, rank))
                rank += self._ranks[rid]
            spec = self._spec(sender, tuple(layout), rank, fresh)
            receives = {rid: alive[rid].receive_weights.remote(spec, r, sender.manifest, version,
                                                               self._kill == f"{rid}:{version}")
                        for rid, r in layout}
            send = self.trainer.send_weights.remote(spec)
            refs = [send, *receives.values()]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s + 30)
            loaded, errors = {}, {}
            for rid, ref in receives.items():
                try:
                    if ref not in ready:
                        raise TimeoutError(f"{rid} did not finish the weight sync in {self.timeout_s:g}s")
                    loaded[rid] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a lost member; the others sync again
                    errors[rid] = exc
                    if actor_is_dead(exc) or isinstance(exc, TimeoutError):
                        kill_hung(alive[rid])  # a hung one too: the rollout service replaces it
                        self.members.died(rid)
            if send not in ready:
                # the group's own timeout fails a send whose receivers are gone or hung, so a send
                # still unanswered 30 s past it is the trainer's (or a rank's) own hang: the run stops
                what = f"the trainer (send_weights of version {version})"
                log.error("%s did not answer within %gs (weight_sync.timeout_s + 30): declared lost",
                          what, self.timeout_s + 30)
                for handle in self.trainer_group():
                    kill_hung(handle)
                raise ActorHung(f"{what} did not answer within {self.timeout_s + 30:g}s "
                                "(actor_rollout_ref.rollout.weight_sync.timeout_s + 30)")
            try:
                sent = ray.get(send)
            except Exception as exc:  # noqa: BLE001
                if actor_is_dead(exc):
                    raise  # the trainer is gone: the run stops (exit 3, resumable)
                errors["trainer"] = exc
            if not errors:
                return SyncReport(loaded=loaded, sent=sent, retries=attempt)
            log.warning("weight sync of version %d (generation %d) failed: %s; dead now: %s",
                        version, spec.generation, "; ".join(f"{k}: {type(e).__name__}: {str(e)[:200]}"
                                                             for k, e in errors.items()),
                        [rid for rid in alive if self.members.is_dead(rid)])
            fresh = True
        raise RuntimeError(f"weight sync of version {version} failed {self.retries + 1} times")


def call(handle: Any, method: Callable[..., Any], *args: Any) -> Any:
    """``handle.<method>.remote(*args)`` for a method of ``ControllerHost`` (or any actor class):
    the method is named by reference, not by a string, so an editor finds its definition."""
    return getattr(handle, method.__name__).remote(*args)


class ControllerHost:
    """The controller actor's class (``ControllerActor`` is it under ``ray.remote``)."""

    def __init__(
        self,
        policy_factory: Callable[[], Any],
        *,
        namespace: str,
        standalone_ids: Sequence[str],
        hybrid_ids: Sequence[str],
        enable_rebalance: bool,
        only_hybrid: bool,
        sizes: RunSizes,
        rebalance_timeout_s: float = 60.0,
        keep_broadcast_weights: bool = False,
        transport: str = ws.OBJECT_STORE,
        sync_timeout_s: float = 60.0,
        kill_in_sync: str | None = None,
        switch_timeout_s: float = 300.0,
        hang_trainer_at: str | None = None,
    ):
        self._hang_at = hang_trainer_at
        self._namespace = namespace
        self.switch_timeout_s = float(switch_timeout_s)
        """``async_training.switch_call_timeout_s``: the deadline of every call this actor makes."""
        self.service = ray.get_actor(ROLLOUT_SERVICE, namespace=namespace)
        self.trainer = ray.get_actor(TRAINER, namespace=namespace)
        self.standalone = {rid: ray.get_actor(replica_name(rid), namespace=namespace) for rid in standalone_ids}
        self.policy = policy_factory()
        self.members = Membership(standalone_ids, hybrid_ids)
        self.pool = _PoolAdapter(self.standalone, self.trainer, self.members, self.switch_timeout_s, namespace)
        self.balancer = _BalancerAdapter(self.service, self.switch_timeout_s)
        self.ctl = DynamicResourceController(
            self.policy, list(hybrid_ids), self.balancer, self.pool,
            membership=self.members, sizes=sizes, counters=self._counters,
            enable_rebalance=enable_rebalance, only_hybrid=only_hybrid, clock=time.time,
            rebalance_timeout_s=rebalance_timeout_s,
        )
        self._keep_weights = keep_broadcast_weights
        self._last_broadcast: tuple[Any, int] | None = None
        """(weights ref, version) of the last broadcast, kept for replacements when asked to."""
        self._version: int | None = None
        """The param version of the last broadcast (what a refill loads into the hybrids)."""
        self._outcome: StepOutcome | None = None
        """The last step's outcome, answered again to a retried ``update_after_step``."""
        if transport not in ws.STANDALONE_TRANSPORTS:
            raise ValueError(f"standalone transport {transport!r}: expected one of {ws.STANDALONE_TRANSPORTS}")
        self.sync = CollectiveSync(self.trainer, self.members, sync_timeout_s, kill_in_sync=kill_in_sync,
                                   call_timeout_s=self.switch_timeout_s, trainer_group=self.pool.trainer_group) if transport == ws.COLLECTIVE else None

    def _hang_point(self, moment: str, n: int) -> None:
        """The failpoint of ``HANG_TRAINER_AT_ENV``: SIGSTOP the trainer here, once."""
        if not self._hang_at:
            return
        where, _, pid_file = self._hang_at.partition("@")
        point, _, target = where.partition("/")
        if point != f"{moment}:{n}":
            return
        self._hang_at = None
        actor = self.trainer if not target else ray.get_actor(rank_name(int(target.removeprefix("rank"))),
                                                               namespace=self._namespace)
        pid = local_pid(actor)
        assert pid is not None, f"the process of {target or 'the trainer'} is not on the controller's node"
        if pid_file:
            with open(pid_file, "w") as f:
                f.write(f"{pid} {time.time()}\n")
        log.warning("failpoint %s: SIGSTOP %s (pid %d)", where, target or "the trainer", pid)
        os.kill(pid, signal.SIGSTOP)

    def _counters(self) -> RolloutCounters:
        """One read of the rollout service per policy question. Membership is what this actor
        already knows: the rollout service reports each death as it sees it (a failed request,
        or the replica's ``watch`` failing when it died idle), and a failed switch call reports
        its own; nothing asks the replicas."""
        return self._service(self.service.counters.remote(), "counters")

    def _service(self, ref: Any, what: str, extra_s: float | None = 0.0) -> Any:
        """A rollout service call within the switch deadline (plus ``extra_s``, the call's own wait;
        None: it has none, so neither has this)."""
        return ray.get(ref) if extra_s is None else self.balancer.call(ref, what, extra_s)

    # ------------------------------------------------------------------ step phases

    def should_deactivate(self, step: int) -> DeactivatePlan:
        """Take the hybrids back before training, and after how many queued samples?"""
        return self.ctl.should_deactivate(step)

    def wait_for_samples(self, plan: DeactivatePlan, timeout_s: float | None) -> WaitReport:
        """Let the hybrids generate until ``plan.wait_samples`` are queued (or data runs out),
        then take them back."""
        waited = self._service(self.service.wait_for_queue.remote(plan.wait_samples, timeout_s), "wait_for_queue",
                               timeout_s)
        if plan.deactivate:
            self._hang_point("take_back", plan.step)
        report = self.ctl.deactivate()
        return WaitReport(waited_s=waited["waited_s"], mq_size=waited["mq_size"], exhausted=waited["exhausted"],
                          deactivate=report)

    def refill_if_stranded(self, step: int, timeout_s: float | None) -> tuple[SwitchReport, ...]:
        """The trainer waits and nothing can generate: lend the hybrids (a recorded guard
        decision) at the last broadcast's version until one micro-step is queued. Returns the
        refill's switches (none when it did not fire), which count in the step's switch seconds
        (``loop.step_switch_seconds``)."""
        version = 0 if self._version is None else self._version
        before = len(self.ctl.switch_log)
        self.ctl.refill_if_stranded(step, version, lambda k: self._service(
            self.service.wait_for_queue.remote(k, timeout_s), "wait_for_queue", timeout_s))
        return tuple(self.ctl.switch_log[before:])

    def broadcast_sync(self, version: int, window: bool = True, lend: LendPlan | None = None) -> BroadcastReport:
        """Trainer → every routable standalone replica at ``version``; with ``window``, then the
        rollouter's staleness window closes at it (the warm-up broadcast has none yet). With
        ``lend`` (a plan that lends), the lent hybrids wake and load ``version`` in the trainer's
        process while the standalones' loads are in flight (``overlap_hybrid_sync``)."""
        assert lend is None or lend.lends, f"a broadcast that syncs the hybrids for a plan that lends nothing: {lend}"
        self._hang_point("broadcast", int(version))
        t0 = time.perf_counter()
        synced = self._sync_standalone({rid: self.standalone[rid] for rid in self.members.routable()}, int(version))
        hybrid = self.ctl.hybrid_sync(version, lend.count) if lend is not None else None
        report = synced()
        self._version = int(version)
        broadcast_s = time.perf_counter() - t0
        metrics = self._service(self.service.on_weight_sync.remote(version), "on_weight_sync") if window else {}
        return BroadcastReport(version=int(version), broadcast_s=broadcast_s,
                               max_replica_load_s=max(report.loaded.values(), default=0.0),
                               replicas=len(report.loaded), window=dict(metrics), hybrid=hybrid,
                               transport=ws.COLLECTIVE if self.sync is not None else ws.OBJECT_STORE,
                               sent_bytes=report.sent_bytes, retries=report.retries)

    def _sync_standalone(self, targets: Mapping[str, Any], version: int) -> Callable[[], SyncReport]:
        """Start loading ``version`` into ``targets`` by the standalones' transport; returns the
        wait for it. The collective runs in a thread: a lent hybrid syncs meanwhile (its trainer
        call waits for the send, which holds the trainer's lock)."""
        if self.sync is not None:
            return _InThread(self.sync.run, targets, version).result
        weights = self.trainer.weights.remote()
        loads = {rid: handle.load_weights.remote(weights, version) for rid, handle in targets.items()}

        def wait() -> SyncReport:
            # the weights first: a trainer that hangs must not pass for every replica hanging
            get_within(weights, self.switch_timeout_s, "the trainer (weights)", self.pool.trainer_group)
            report = SyncReport(loaded=self.pool.get_alive(loads))
            if self._keep_weights:
                self._last_broadcast = (weights, version)
            return report

        return wait

    def should_activate(self, step: int, micro: Sequence[MicroSummary]) -> LendPlan:
        """Lend the trainer's GPUs to rollout until the next step?"""
        return self.ctl.should_activate(step, micro)

    def asks_warm_up(self) -> bool:
        """Whether the policy wants to be asked for a lend before step 1 (``warm_up_lend``)."""
        return self.ctl.decider.asks_warm_up

    def warm_up(self, version: int) -> LendPlan:
        """Before step 1: no question unless the policy sets ``warm_up_lend``."""
        return self.ctl.warm_up(version)

    def relend_after_resume(self, version: int) -> LendPlan:
        """The resumed run's hybrids were lent when it stopped: lend them again (guard decision)."""
        return self.ctl.relend_after_resume(version)

    def lend_only_hybrids(self, version: int) -> LendPlan:
        """Only-hybrid mode, before step 1: lend every hybrid (guard decision)."""
        return self.ctl.lend_only_hybrids(version)

    def hybrid_sync(self, plan: LendPlan, version: int) -> SwitchReport:
        """Wake the hybrids and load ``version`` in the trainer's process (only when ``plan`` lends)."""
        assert plan.lends, f"hybrid_sync for a plan that lends nothing: {plan}"
        self._hang_point("hybrid_sync", plan.step)
        return self.ctl.hybrid_sync(version, plan.count)

    def activate(self, plan: LendPlan, micro: Sequence[MicroSummary]) -> tuple[SwitchReport, ...]:
        """Activate the ``plan.count`` synced hybrids, then ask ``request_rebalance`` and rebalance
        if it says so."""
        assert plan.lends, f"lend for a plan that lends nothing: {plan}"
        return self.ctl.lend(plan.step, micro, plan.count)

    def update_after_step(self, step: int, micro: Sequence[MicroSummary]) -> StepOutcome:
        """``update_after_step``, then what the store keeps: policy and controller state, the
        step's drained decisions and switches, and the replacer's state.

        Retry-safe: every remote read comes before the logs are drained, so a read that fails
        leaves them for the retry; and the outcome is kept, so a retry after a lost reply gets the
        same records again instead of empty logs."""
        if self._outcome is not None and self._outcome.step == step:
            return self._outcome
        replacements = self.service.replacement_state.remote()  # read while the policy adapts
        self.ctl.update_after_step(step, micro)
        replaced = self._service(replacements, "replacement_state")
        self._outcome = StepOutcome(
            step=step,
            hybrid_active=self.ctl.is_hybrid_active,
            policy_state=self.policy.state_dict(),
            controller_state=self.ctl.state_dict(),
            decisions=tuple(self.ctl.drain_decisions()),
            switch_events=tuple(self.ctl.drain_switch_log()),
            replacements=replaced,
        )
        return self._outcome

    # ------------------------------------------------------------------ membership

    def replica_died(self, replica_id: str) -> None:
        """The rollout service saw ``replica_id``'s actor die."""
        self.members.died(replica_id)

    def replacement_started(self, old: str, new: str) -> None:
        """The rollout service started ``new`` in place of the dead ``old``."""
        self.members.replacing(old, new)

    def adopt_standalone(self, old: str, new: str, handle: Any) -> int | None:
        """Take ``new`` (a started replica actor) in place of the dead ``old``: load the last
        broadcast's weights into it and include it in every later broadcast and switch. Returns
        the param version it now holds (None before the first broadcast: the first broadcast
        loads it, as it does the others). Runs between broadcasts, never during one (this actor
        serves one call at a time), so the new replica holds the version the others hold."""
        version = None
        if self.sync is not None and self._version is not None:
            # the same transport as the others: a group of the trainer and the newcomer alone
            if new not in self.sync.run({new: handle}, self._version).loaded:
                raise RuntimeError(f"replacement {new} did not load version {self._version}")
            version = self._version
        elif self._last_broadcast is not None:
            weights, version = self._last_broadcast
            # a dead (or hung) new actor raises: not adopted
            get_within(handle.load_weights.remote(weights, version), self.switch_timeout_s,
                       f"replacement {new} (load_weights)", handle)
        for handles in (self.standalone, self.pool.standalone):
            handles[new] = handle
        self.members.joined(old, new)
        return version

    # ------------------------------------------------------------------ state

    def hybrid_active(self) -> bool:
        return self.ctl.is_hybrid_active

    def load_controller_state(self, state: dict[str, Any]) -> None:
        self.ctl.load_state_dict(state)

    def load_policy_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)

    def ping(self) -> str:
        return "ok"


ControllerActor = ray.remote(num_cpus=0)(ControllerHost)
