"""The simulator: the event loop, the data plane, and the control plane as one process.

Owns the virtual-time execution of the ``loop`` package's step: it drives ``loop.run_start`` and
``loop.step_sequence`` (production's sequence), carries out each intent as waits (a delay, enough
queued samples, an empty flight) that the event loop turns into events or wake-up conditions, and
asks every policy question through ``loop.Decider``, with ``loop.SwitchBook``'s durations in the context.
A trainer left waiting with nothing to generate its samples gets production's stranded refill
(``loop.guards``: the rule, its guard decision and its switches). Must not ask a policy hook itself,
decide what a step does next (``loop`` does) or decide when a guard fires (``loop.guards`` does).

Timing conventions of the metrics (per micro-step ``i``, reference §4):

- ``alloc_i`` runs from the moment micro-step ``i`` starts pulling samples to the end of its
  update; the first also holds the deactivation, the last the weight syncs, the activation and
  the rebalance. The hybrids' wait for samples before deactivation is not trainer time: it is
  ``timing_s/wait_for_enough_samples`` (the cluster formula's ``x``).
- The rollout window of step ``s`` runs from one ``reset_staleness`` (end of a broadcast sync)
  to the next.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from types import GeneratorType
from typing import Any, NamedTuple

from loop import (
    Activate,
    BroadcastSync,
    Commit,
    GuardedStart,
    DeactivatePlan,
    Decider,
    DecisionRecord,
    HybridSync,
    Intent,
    LendPlan,
    RunSizes,
    ShouldActivate,
    ShouldDeactivate,
    Skipped,
    Snapshot,
    STRANDED_POLL_S,
    SwitchReport,
    Train,
    UpdateAfterStep,
    WaitForSamples,
    WaitReport,
    WarmUp,
    micro_summaries,
    only_hybrid_start,
    policy_context,
    refill_sequence,
    relend_after_resume,
    run_start,
    step_sequence,
    step_switch_seconds,
    stranded_refill,
)
from loop.switches import (
    Abort,
    ClearSticky,
    ControllerState,
    Drain,
    Hold,
    Operation,
    PhaseLog,
    Resume,
    Route,
    Switch,
    SwitchMachine,
    Unhold,
    Unroute,
)
from loop.workload import LengthModel

from metrics import (
    MQ_SIZE,
    RESOURCE_UTILIZATION,
    ROLLOUT_RESOURCE_UTILIZATION,
    STEP_GENERATED_SAMPLES,
    TRAIN_RESOURCE_UTILIZATION,
    WASTE_SWITCH_S,
    WastedWork,
    fold_step,
    rollout_resource_utilization,
)
from policies import DynamicScheduleContext, DynamicSchedulePolicyBase
from sim.events import CONTROL_PLANE, DATA_PLANE, Event, EventLoop
from sim.replica import Replica, Sample
from sim.result import SimResult, SimStep, Transition, WeightSync
from sim.rollouter import SimRollouter
from sim.spec import SimSpec


class SimulationStalled(RuntimeError):
    """No event is left but the run is not finished (e.g. nothing can ever generate)."""


class Delay(NamedTuple):
    seconds: float


class UntilQueued(NamedTuple):
    samples: int


class UntilQueuedOrStranded(NamedTuple):
    """Until ``samples`` are queued, or nothing can generate them: no standalone replica is alive
    and the hybrids sleep (``loop.guards.stranded_refill``'s condition)."""

    samples: int


class UntilIdle(NamedTuple):
    """Until nothing routable is in flight (a sync without partial rollout drains first)."""


Wait = Delay | UntilQueued | UntilQueuedOrStranded | UntilIdle


@dataclass
class _StepLog:
    """What one step has measured so far (turned into a ``SimStep`` at commit)."""

    step: int
    start: float
    waste0: WastedWork
    wait_for_samples_s: float = 0.0
    deactivate_s: float = 0.0
    deactivated: bool = False
    activated: bool = False
    rebalanced: bool = False
    compute: list[float] = field(default_factory=list)
    """Each micro-step's update seconds."""
    allocated: list[float] = field(default_factory=list)
    """Each micro-step's seconds from the start of its pull to the end of its update (refills out)."""
    queued: list[int] = field(default_factory=list)
    """The queue's size after each micro-step took its samples."""
    after_train_s: float = 0.0
    """From the last update to ``update_after_step``, less the tasks between (the reference counts
    syncs, the activation and the rebalance, not tasks)."""
    step_generated: int = 0
    window_end: float = 0.0
    history: list[tuple[float, int, int]] = field(default_factory=list)
    train_end: float = 0.0
    tasks_since_train: int = 0
    """Tasks paid since the last micro-step ended (not trainer time in the last one's allocation)."""
    switches: list[SwitchReport] = field(default_factory=list)
    """The switches made since the step started (``loop.step_switch_seconds`` folds them)."""


class Simulator:
    """One simulated run of ``spec.steps`` steps under ``policy``, deterministic per ``seed``;
    with ``resume_after``, stopped after that step's commit and resumed (``_restart``)."""

    def __init__(
        self,
        spec: SimSpec,
        policy: DynamicSchedulePolicyBase,
        *,
        seed: int = 0,
        policy_name: str = "",
        trace: bool = False,
        resume_after: int | None = None,
    ):
        self.spec = spec
        self.policy = policy
        self.resume_after = resume_after
        """The run stops after this step's commit and is resumed (``_restart``); None: never."""
        self._policy_at_start = copy.deepcopy(policy) if resume_after is not None else None
        """The policy as built, for the resumed process to restore its state into."""
        self._decided_before: list[DecisionRecord] = []
        """The decisions of the processes before a resume."""
        self.policy_name = policy_name or type(policy).__name__
        self.seed = seed
        self.rng = random.Random(seed)
        self.loop = EventLoop()
        self.trace: list[tuple[Any, ...]] | None = [] if trace else None
        lengths = LengthModel(
            mean_start=spec.response_len_mean_start,
            mean_end=spec.response_len_mean_end,
            response_sigma=spec.response_len_sigma,
            prompt_sigma=spec.prompt_len_sigma,
            max_len=spec.response_length,
            last_version=spec.steps - 1,
        )
        self.rollouter = SimRollouter(spec, lengths, self.rng, clock=lambda: self.loop.now, trace=self._record_trace)
        self.rollouter.on_generated = self._check_wake
        self._replica = {rep.name: rep for rep in self.rollouter.replicas}
        self.machine = SwitchMachine([rep.name for rep in self.rollouter.hybrids])
        """The hybrids' state machine and switch book, production's (``loop.switches``)."""
        self._held: list[tuple[Sample, Replica]] | None = None
        """The requests aborted while routing is held (``Hold``): retried at ``Resume``/``Unhold``."""
        self._unstick = False
        """``ClearSticky`` ran: the next ``Resume`` retries least-loaded, not on the same replica."""
        self.records: list[SimStep] = []
        self.decider = Decider(policy, enable_rebalance=spec.enable_rebalance)
        self.transitions: list[Transition] = []
        self.broadcasts = 0
        self.trained_ids: list[int] = []
        self.trained_longest: list[int] = []
        self.trained_tokens: list[int] = []
        self.train_compute_total_s = 0.0
        self.trained_response_tokens = 0
        self.switch_s = 0.0
        self.sizes = RunSizes(required_samples=spec.required_samples,
                              trigger_parameter_sync_step=spec.trigger_parameter_sync_step,
                              buffer_samples=spec.buffer_samples, only_hybrid=spec.only_hybrid,
                              standalone_replicas=spec.standalone_replicas, hybrid_replicas=spec.hybrid_replicas,
                              max_required_samples=spec.max_required_samples, sample_budget=spec.total_samples)
        """The run's static sizes, as the controller has them (``loop.policy_context``)."""
        self.consumed = 0
        """Samples the trainer consumed before the current step (as the controller counts them)."""
        self._wait_sums: tuple[list[float], list[int]] = ([], [])
        self._wake_when: Callable[[], bool] | None = None
        self._log = _StepLog(step=0, start=0.0, waste0=WastedWork())
        self._phases: dict[type, Callable[[Any], Any]] = {
            WarmUp: self._warm_up, ShouldDeactivate: self._should_deactivate, WaitForSamples: self._wait_for_samples,
            Train: self._train, BroadcastSync: self._broadcast_sync, ShouldActivate: self._should_activate,
            HybridSync: self._hybrid_sync, Activate: self._activate, UpdateAfterStep: self._update_after_step,
        }
        self._process: Iterator[Wait] = self._training_run()
        self._done = False

    # ------------------------------------------------------------------ running

    def run(self) -> SimResult:
        """Simulate every step; returns the result (raises ``SimulationStalled`` if stuck)."""
        spec = self.spec
        if self.rollouter.hybrids and spec.initial_hybrid_active and not spec.only_hybrid:
            self.rollouter.add(self.rollouter.hybrids)
            self.machine = SwitchMachine(self.machine.hybrids, ControllerState.HYBRID_ACTIVE)
            self._record_trace("activate")
        self.rollouter.try_start()
        for t, number in spec.standalone_deaths:
            self.loop.push([Event(float(t), DATA_PLANE, self._death, (self.rollouter.standalones[number],))])
        self.loop.push([Event(0.0, CONTROL_PLANE, self._resume)])
        self.loop.push(self.rollouter.flush())
        self.loop.run(until=lambda: self._done)
        if not self._done:
            step = len(self.records) + 1
            raise SimulationStalled(
                f"step {step}: nothing left to happen at t={self.loop.now:.1f}s "
                f"(queue {len(self.rollouter.queue)}, in flight {self.rollouter.in_flight}, "
                f"routable replicas {len(self.rollouter.routable)})"
            )
        return self._result()

    def _resume(self) -> list[Event]:
        """Handler: run the control plane until it waits; schedule or arm its wake-up."""
        while True:
            try:
                wait = next(self._process)
            except StopIteration:
                self._done = True
                return self.rollouter.flush()
            if isinstance(wait, Delay):
                if wait.seconds > 0:
                    return [Event(self.loop.now + wait.seconds, CONTROL_PLANE, self._resume), *self.rollouter.flush()]
                continue
            ready = self._condition(wait)
            if not ready():
                self._wake_when = ready
                return self.rollouter.flush()

    def _condition(self, wait: Wait) -> Callable[[], bool]:
        r = self.rollouter
        if isinstance(wait, UntilQueued):
            return lambda: len(r.queue) >= wait.samples
        if isinstance(wait, UntilQueuedOrStranded):
            return lambda: len(r.queue) >= wait.samples or self._stranded()
        return lambda: r.in_flight == len(r.pending)  # retries with no replica cannot drain

    def _death(self, rep: Replica) -> list[Event]:
        """Handler: a standalone replica dies (``SimSpec.standalone_deaths``)."""
        self.rollouter.kill(rep)
        return self._check_wake() + self.rollouter.flush()

    def _check_wake(self) -> list[Event]:
        if self._wake_when is not None and self._wake_when():
            self._wake_when = None
            return [Event(self.loop.now, CONTROL_PLANE, self._resume)]
        return []

    def _record_trace(self, kind: str, *detail: Any) -> None:
        if self.trace is not None:
            self.trace.append((self.loop.now, kind, *detail))

    # ------------------------------------------------------------ control plane

    def _training_run(self) -> Iterator[Wait]:
        """``loop.run_start``, then ``loop.step_sequence`` per step, each intent executed here."""
        spec, r = self.spec, self.rollouter
        self._log = _StepLog(step=0, start=0.0, waste0=self._waste())  # the warm-up's (never committed)
        yield from self._start(0)
        for step in range(1, spec.steps + 1):
            self._log = _StepLog(step=step, start=self.loop.now, waste0=self._waste())
            self._wait_sums = ([], [])
            yield from self._drive(step_sequence(step, micro_steps=spec.trigger_parameter_sync_step,
                                                 final=step == spec.steps, has_hybrids=bool(r.hybrids),
                                                 overlap_sync=spec.overlap_hybrid_sync, lent=self.machine.active))
            if step == self.resume_after and step < spec.steps:
                yield from self._restart()

    def _start(self, version: int, relend: bool = False) -> Iterator[Wait]:
        """Before the first step of a process, as ``flows.training_run`` starts one: ``loop.run_start``
        (``relend``: the hybrids were lent when a resumed run stopped)."""
        r = self.rollouter
        yield from self._drive(run_start(version, has_hybrids=bool(r.hybrids) and not self.machine.active,
                                         asks_warm_up=self.decider.asks_warm_up, relend=relend,
                                         only_hybrid=self.spec.only_hybrid))

    def _guarded_start(self, intent: GuardedStart) -> LendPlan:
        """The guard's decision, recorded (``loop.guards``), and its lend."""
        r = self.rollouter
        guard = (relend_after_resume(intent.version, self.machine.relend_count, len(r.hybrids)) if intent.relend
                 else only_hybrid_start(intent.version, len(r.hybrids)))
        self.decider.record_guard(0, guard.hook, guard.answer, guard.reason, self.machine.active, self.context())
        return guard.plan

    def _restart(self) -> Iterator[Wait]:
        """The run stops after the step just committed and is resumed at once, as ``flows.training_run``
        resumes: the policy's and the controller's memory (``loop.SwitchBook``) come back from their
        ``state_dict`` (through JSON, as the store keeps them) into the policy as built and a new
        ``Decider``; the hybrids start asleep (a resumed run's actors are new); then the process
        starts (``_start``), lending again as many hybrids as were lent.

        Only the control plane restarts: the data plane goes on, its queued and in-flight samples
        kept (production generates those prompts again) and the hybrids' in-flight ones retried
        elsewhere; a standalone replica that died stays dead (production builds all anew)."""
        r = self.rollouter
        stored = json.loads(json.dumps({"policy": self.policy.state_dict(), "machine": self.machine.state_dict()}))
        lent = len(self.machine.lent)
        self._decided_before += self.decider.drain()
        self.policy = copy.deepcopy(self._policy_at_start)
        self.policy.load_state_dict(stored["policy"])
        self.decider = Decider(self.policy, enable_rebalance=self.spec.enable_rebalance)
        self._record_trace("resume")
        if self.machine.active:
            r.remove(r.hybrids)
        self.machine = SwitchMachine(self.machine.hybrids)
        self.machine.load_state_dict({**stored["machine"], "state": ControllerState.STANDALONE_ONLY.name})
        self._log = _StepLog(step=0, start=self.loop.now, waste0=self._waste())  # the restart's (never committed)
        self._wait_sums = ([], [])
        yield from self._start(r.version, relend=lent > 0)

    def _drive(self, intents: Generator[Intent, Any, None], *, tasks: bool = True) -> Iterator[Wait]:
        """Execute each intent and send its result back, until the sequence ends: the one executor
        of the step, the run start and the stranded refill (``tasks=False``: its intents run inside
        the train task, so none pays a task's overhead)."""
        answer: Any = None
        while True:
            try:
                intent = intents.send(answer)
            except StopIteration:
                return
            answer = yield from self._execute(intent, tasks)

    def _execute(self, intent: Intent, task: bool = True) -> Generator[Wait, None, Any]:
        """One phase: in Tidal one Prefect task each (``task_overhead_s`` first), but the commit,
        which is the rest of the flow run (``step_overhead_s``)."""
        if isinstance(intent, Skipped):  # no task runs
            return None
        if isinstance(intent, GuardedStart):  # a controller call of the driver's, not a task
            return self._guarded_start(intent)
        if isinstance(intent, Commit):
            yield Delay(self.spec.step_overhead_s)
            self._record_trace("commit", intent.step)
            self.records.append(self._step_record(self._log))
            return None
        if task:
            yield Delay(self.spec.task_overhead_s)
            self._log.tasks_since_train += 1
        result = self._phases[type(intent)](intent)
        if isinstance(result, GeneratorType):
            result = yield from result
        return result

    def _warm_up(self, intent: WarmUp) -> LendPlan:
        """Only for a policy with ``warm_up_lend``: lend before step 1 (the standalones generate)."""
        return self.decider.warm_up(self.context(), of=len(self.rollouter.hybrids))

    def _should_deactivate(self, intent: ShouldDeactivate) -> DeactivatePlan:
        return self.decider.should_deactivate(intent.step, self.machine.active, self.context())

    def _wait_for_samples(self, intent: WaitForSamples) -> Iterator[Wait]:
        """Let the hybrids generate until enough is queued (a threshold above the queue's capacity
        could never be met: it is clamped to it), then take them back. A refill's wait is not
        the step's: it measures nothing."""
        r, log, t = self.rollouter, self._log, self.loop.now
        r.takeback_samples = min(intent.plan.wait_samples, self.spec.max_required_samples)
        yield UntilQueued(r.takeback_samples)
        if intent.refill:
            return (yield from self._take_back(intent.plan.step))
        log.wait_for_samples_s = self.loop.now - t
        report = yield from self._take_back(intent.plan.step)
        log.deactivated, log.deactivate_s = True, report.duration_s
        return WaitReport(waited_s=log.wait_for_samples_s, mq_size=len(r.queue), deactivate=report)

    def _take_back(self, step: int) -> Generator[Wait, None, SwitchReport]:
        """Take the lent hybrids back (``loop.switches.take_back``)."""
        self._record_trace("deactivate")
        return (yield from self._switch(step, self.machine.take_back()))

    def _train(self, intent: Train) -> Iterator[Wait]:
        spec, r, log, t = self.spec, self.rollouter, self._log, self.loop.now
        queued = len(r.queue)
        refill_s = yield from self._pull(intent.step, spec.required_samples, t)
        self._wait_sums[0].append(self.loop.now - t - refill_s)
        self._wait_sums[1].append(max(0, spec.required_samples - queued))
        batch = r.take(spec.required_samples)
        compute_s = self._train_time(batch)
        self._record_trace("train", intent.step, intent.micro + 1, [s.id for s in batch])
        yield Delay(compute_s)
        self.trained_ids.extend(s.id for s in batch)
        self.trained_longest.extend(max(s.lengths) for s in batch)
        self.trained_tokens.extend(s.tokens for s in batch)
        self.trained_response_tokens += sum(sum(s.lengths) for s in batch)
        self.train_compute_total_s += compute_s
        log.compute.append(compute_s)
        log.allocated.append(self.loop.now - t - refill_s)
        log.queued.append(len(r.queue))
        log.train_end, log.tasks_since_train = self.loop.now, 0
        return None  # never ``exhausted``: the data budget covers every step

    def _pull(self, step: int, samples: int, began: float) -> Generator[Wait, None, float]:
        """Wait until ``samples`` are queued, as production's train task pulls: in slices of
        ``STRANDED_POLL_S``, asking ``loop.guards.stranded_refill`` after a slice that ended short
        while nothing could generate (the refill runs then). Returns the refills' seconds, which
        production's trainer does not count as its wait."""
        r, refill_s = self.rollouter, 0.0
        while len(r.queue) < samples:
            yield UntilQueuedOrStranded(samples)
            if len(r.queue) >= samples:
                break
            slices = max(1, math.ceil((self.loop.now - began - refill_s) / STRANDED_POLL_S))
            yield Delay(began + refill_s + slices * STRANDED_POLL_S - self.loop.now)  # the slice ends short
            t = self.loop.now
            if (yield from self._refill(step)):
                refill_s += self.loop.now - t
            else:  # stranded, yet the rule does not fire: nothing will come (production times out)
                yield UntilQueued(samples)
        return refill_s

    def _stranded(self) -> bool:
        r = self.rollouter
        return bool(r.dead) and bool(r.hybrids) and not self.machine.active and r.standalone_lost

    def _refill(self, step: int) -> Generator[Wait, None, bool]:
        """``loop.guards.stranded_refill``: when it fires, its guard decision, then its switches
        (``loop.guards.refill_sequence``) as delays, booked as the controller books them. Returns
        whether it fired."""
        r = self.rollouter
        ctx = self.context(micro=False)  # production's train task carries no micro-step summaries
        guard = stranded_refill(step, ctx, hybrids=len(r.hybrids), active=self.machine.active, version=r.version)
        if guard is None:
            return False
        self.decider.record_guard(step, guard.hook, guard.answer, guard.reason, self.machine.active, ctx)
        yield from self._drive(refill_sequence(guard, r.version, self.spec.required_samples), tasks=False)
        return True

    def _broadcast_sync(self, intent: BroadcastSync) -> Iterator[Wait]:
        """Sync the routable replicas; generation pauses (partial rollout) or drains first (without
        it); then a new version and a reset staleness count. With ``intent.lend``, the lent hybrids
        sync meanwhile, on the trainer's GPUs: the phase lasts the longer of the two."""
        spec, r, log = self.spec, self.rollouter, self._log
        self.broadcasts += 1
        if not spec.partial_rollout:
            r.accepting = False
            yield UntilIdle()
        if spec.sync_aborts:
            paused_reps = list(r.routable)
            aborted = r.pause(paused_reps)
        else:
            paused_reps, aborted = [], []
            r.stall([rep for rep in r.routable if not rep.hybrid], spec.broadcast_sync_s)
        began, lend = self.loop.now, intent.lend
        hybrid = self.machine.hybrid_sync(intent.version, lend.count) if lend else None
        hybrid_s = sum(spec.operation_s.get(op.name, 0.0) for op in hybrid.preview()) if hybrid else 0.0
        if hybrid and hybrid_s <= spec.broadcast_sync_s:
            yield from self._switch(lend.step, hybrid)
            hybrid = None
        yield Delay(spec.broadcast_sync_s - (self.loop.now - began))
        r.accepting = True
        log.step_generated, log.window_end = r.step_generated, self.loop.now
        log.history, r.history = r.history, [(self.loop.now, r.in_flight, r.capacity())]
        r.resume(paused_reps, aborted, sticky=True)
        r.reset_staleness()
        self._record_trace("sync", r.version)
        if hybrid:  # it outlasts the broadcast: what it ran meanwhile is already paid
            yield from self._switch(lend.step, hybrid, began=began, paid_s=self.loop.now - began)

    def _should_activate(self, intent: ShouldActivate) -> LendPlan:
        return self.decider.should_activate(intent.step, self.machine.active, self.context(),
                                       of=len(self.rollouter.hybrids))

    def _hybrid_sync(self, intent: HybridSync) -> Iterator[Wait]:
        return (yield from self._switch(intent.plan.step, self.machine.hybrid_sync(intent.version, intent.plan.count)))

    def _activate(self, intent: Activate) -> Iterator[Wait]:
        """Activate the synced hybrids, then rebalance if the policy asks (and it is enabled)."""
        r, log, step = self.rollouter, self._log, intent.plan.step
        reports = [(yield from self._lend(step, intent.plan.count))]
        log.activated |= intent.rebalance  # a refill's lend (no question) is not the step's
        if intent.rebalance and self.decider.wants_rebalance(step, self.context()):
            active = tuple(rep.name for rep in r.routable)
            reports.append((yield from self._switch(step, self.machine.rebalance(active, math.inf))))
            log.rebalanced = True
            self._record_trace("rebalance")
        return reports

    def _lend(self, step: int, count: int) -> Generator[Wait, None, SwitchReport]:
        """Activate the first ``count`` (synced) hybrids (``loop.switches.activate``)."""
        report = yield from self._switch(step, self.machine.activate(count=count))
        self._record_trace("activate")
        return report

    def _update_after_step(self, intent: UpdateAfterStep) -> None:
        """The last micro-step's allocation runs on to here (the syncs, the lend), less the tasks
        between (the reference counts syncs, not tasks); then ``update_after_step``, always."""
        log = self._log
        log.after_train_s = self.loop.now - log.train_end - log.tasks_since_train * self.spec.task_overhead_s
        self.decider.update_after_step(intent.step, self.machine.active, self.context())
        self.machine.book.durations.reset()
        self.machine.book.drain()  # the transitions keep every switch
        self.consumed += len(self._wait_sums[0]) * self.spec.required_samples

    def _waste(self) -> WastedWork:
        r = self.rollouter
        return WastedWork(r.aborted_requests, r.aborted_tokens, r.reprefilled_tokens, self.switch_s)

    def _step_record(self, log: _StepLog) -> SimStep:
        """Fold the step's metrics by production's rule (``metrics.fold_step``) into a ``SimStep``:
        the rollout window (its utilization from the rollouter's history, what it generated, the
        waste counters) is the twin's own measure of what production's rollout service reports."""
        spec, total, before = self.spec, self._waste(), log.waste0
        waste = WastedWork(
            aborted_requests=total.aborted_requests - before.aborted_requests,
            aborted_tokens=total.aborted_tokens - before.aborted_tokens,
            reprefilled_tokens=total.reprefilled_tokens - before.reprefilled_tokens,
            switch_s=step_switch_seconds(log.switches),
        )
        window = {ROLLOUT_RESOURCE_UTILIZATION: rollout_resource_utilization(log.history, log.window_end),
                  STEP_GENERATED_SAMPLES: float(log.step_generated),
                  **{name: value for name, value in waste.as_metrics().items() if name != WASTE_SWITCH_S}}
        metrics = fold_step([{MQ_SIZE: float(q)} for q in log.queued], compute_s=log.compute,
                            allocated_s=log.allocated, deactivate_s=log.deactivate_s, after_train_s=log.after_train_s,
                            wait_s=log.wait_for_samples_s, step_s=self.loop.now - log.start, switch_s=waste.switch_s,
                            window=window, trainer_gpus=spec.trainer_gpus, standalone_gpus=spec.standalone_gpus)
        ratio = getattr(self.policy, "deactivate_ratio", None)
        return SimStep(
            step=log.step,
            start_s=log.start,
            end_s=self.loop.now,
            param_version=self.rollouter.version,
            wait_for_samples_s=log.wait_for_samples_s,
            micro_wait_s=list(self._wait_sums[0]),
            micro_wait_samples=list(self._wait_sums[1]),
            train_compute_s=sum(log.compute),
            mq_size=int(metrics[MQ_SIZE]),
            step_generated_samples=log.step_generated,
            deactivated=log.deactivated,
            activated=log.activated,
            rebalanced=log.rebalanced,
            hybrid_active=self.machine.active,
            deactivate_ratio=None if ratio is None else float(ratio),
            train_util=metrics[TRAIN_RESOURCE_UTILIZATION],
            rollout_util=metrics[ROLLOUT_RESOURCE_UTILIZATION],
            cluster_util=metrics[RESOURCE_UTILIZATION],
            waste=waste,
            metrics=metrics,
        )

    def _train_time(self, batch: list[Sample]) -> float:
        s = self.spec
        tokens = sum(sample.tokens for sample in batch)
        return s.train_step_overhead_s + tokens / (s.trainer_gpus * s.train_tokens_per_gpu_s)

    # ------------------------------------------------------------------ switches

    def _switch(self, step: int, switch: Switch, *, began: float | None = None,
                paid_s: float = 0.0) -> Generator[Wait, None, SwitchReport]:
        """Carry out ``switch`` (``loop.switches``, production's operations in production's order)
        in virtual time: each operation waits its cost (``SimSpec.operation_s``), then acts on
        the rollouter (``_operate``). ``paid_s``: seconds of it that already ran (a hybrid sync
        that outlasts the broadcast it overlaps; its operations touch no replica that generates).
        Then it is booked as the controller books it: the machine's switch book and the run's
        transitions; ``switch_s`` sums every switch's seconds."""
        log = PhaseLog(self.loop.now if began is None else began)
        ops, result, costs = switch.ops, None, self.spec.operation_s
        while True:
            try:
                op = ops.send(result)
            except StopIteration as done:
                aborted = done.value or 0
                break
            t, cost = self.loop.now, costs.get(op.name, 0.0)
            wait, paid_s = max(0.0, cost - paid_s), max(0.0, paid_s - cost)
            if wait > 0:
                yield Delay(wait)
            result = self._operate(op)
            log.ran(op, self.loop.now - t, result)
        report = switch.done(log.report(switch, self.loop.now, aborted))
        self.transitions.append(Transition(step, report))
        self._log.switches.append(report)
        self.switch_s += report.duration_s
        return report

    def _operate(self, op: Operation) -> Any:
        """One operation on the twin's data plane (the same effects production's calls have)."""
        r = self.rollouter
        reps = [self._replica[name] for name in op.ids]
        match op:
            case Route():
                r.add(reps)
            case Unroute():
                r.unroute(reps)
            case ClearSticky():
                self._unstick = True
            case Hold():
                self._held = []
            case Abort():
                aborted = r.pause(reps)
                if self._held is not None:  # the retries wait for routing
                    self._held.extend(aborted)
                else:  # retried at once on whatever is routable
                    r.retry(aborted)
                return len(aborted)
            case Resume():
                held, self._held = self._held or [], None if self._held is None else []
                r.resume(reps, held, sticky=not self._unstick)
                self._unstick = False
            case Unhold():
                held, self._held = self._held or [], None
                r.retry(held)
            case Drain():
                return 0  # paused replicas run nothing: what was in flight was aborted
        return None  # Sleep, Wake, Load, Offload, Reload: the twin charges only their cost

    # ------------------------------------------------------------------ policy

    def context(self, micro: bool = True) -> DynamicScheduleContext:
        """The context a policy sees now (built fresh before every question, as in production).

        The switch durations are the current cycle's (``loop.SwitchDurations``); ``standalone_lost``
        once every standalone died (``SimSpec.standalone_deaths``). ``micro``: with this step's
        micro-steps so far (production's train task has none to give the stranded refill)."""
        r = self.rollouter
        sums = self._wait_sums if micro else ([], [])
        return policy_context(self.sizes, Snapshot(
            generated_total=r.total_generated, queue_size=len(r.queue), in_flight=r.in_flight,
            consumed=self.consumed,
            micro=micro_summaries(sums[0], sums[1], self.spec.required_samples),
            activate_s=self.machine.book.durations.activate_s, deactivate_s=self.machine.book.durations.deactivate_s,
            now=self.loop.now, last_switch_at=self.machine.book.last_switch_at, standalone_lost=r.standalone_lost,
            lent_replicas=sum(1 for rep in r.hybrids if rep in r.routable)))

    # ------------------------------------------------------------------ result

    def _result(self) -> SimResult:
        s, r = self.spec, self.rollouter
        in_flight = sorted(
            {resp.sample.id for rep in r.replicas for _, _, resp in rep.running}
            | {resp.sample.id for rep in r.replicas for resp in rep.waiting}
            | {sample.id for sample in r.pending}
        )
        rollout_gpu_s = self._rollout_work_gpu_s()
        train_gpu_s = self.train_compute_total_s * s.trainer_gpus
        return SimResult(
            policy=self.policy_name,
            seed=self.seed,
            wall_clock_s=self.loop.now,
            fluid_bound_s=(rollout_gpu_s + train_gpu_s) / s.total_gpus,
            rollout_gpu_s=rollout_gpu_s,
            train_gpu_s=train_gpu_s,
            total_gpus=s.total_gpus,
            steps=self.records,
            started=r.total_started,
            trained_ids=list(self.trained_ids),
            trained_longest=list(self.trained_longest),
            trained_tokens=list(self.trained_tokens),
            queued_ids=[sample.id for sample in r.queue],
            in_flight_ids=in_flight,
            switches=self.machine.book.count,
            waste=self._waste(),
            decisions=self._decided_before + self.decider.records,
            transitions=list(self.transitions),
            trace=self.trace,
            events_handled=self.loop.handled,
            weight_sync=self._weight_sync(),
        )

    def _weight_sync(self) -> dict[str, WeightSync]:
        """The run's syncs by kind, each named by the transport the twin charged for it."""
        s = self.spec
        hybrid = sum(t.kind == "hybrid_sync" for t in self.transitions)
        out = {"broadcast": WeightSync(s.broadcast_transport, s.broadcast_sync_s, self.broadcasts)}
        if s.hybrid_replicas:
            out["hybrid_sync"] = WeightSync(s.hybrid_transport, s.hybrid_sync_s, hybrid)
        return out

    def _rollout_work_gpu_s(self) -> float:
        """GPU-seconds to generate the trained samples once, every replica at its best speed.

        A replica is fastest per sequence-iteration at a full batch of its ``max_num_seqs``; each
        trained sample needs its prompt prefilled once and one iteration per generated token.
        """
        spec, reps = self.spec, self.rollouter.replicas
        token_s = min((r.base_s + r.per_seq_s * r.max_num_seqs) / (r.max_num_seqs * r.speed) for r in reps)
        best_speed = max(rep.speed for rep in reps)
        prefill_s = len(self.trained_ids) * spec.prompt_tokens / spec.prefill_tokens_per_s / best_speed
        return (self.trained_response_tokens * token_s + prefill_s) * spec.gpus_per_replica


def simulate_spec(
    spec: SimSpec,
    policy: DynamicSchedulePolicyBase,
    *,
    seed: int = 0,
    policy_name: str = "",
    trace: bool = False,
) -> SimResult:
    """Run one simulation of ``spec`` under ``policy`` (see ``Simulator``)."""
    return Simulator(spec, policy, seed=seed, policy_name=policy_name, trace=trace).run()

