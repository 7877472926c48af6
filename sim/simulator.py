"""The simulator: the event loop, the data plane, and the control plane as one process.

The control plane is a generator that reads like DESIGN §2's step sequence. It yields what it
waits for (a delay, enough queued samples, an empty flight); the loop turns that into an event or
a wake-up condition and resumes it at the right virtual time. The policy is the same object
production uses, asked the same hooks in the same order, with a ``DynamicScheduleContext`` built
fresh before each call.

Timing conventions of the metrics (per micro-step ``i``, reference §4):

- ``alloc_i`` runs from the moment micro-step ``i`` starts pulling samples to the end of its
  update; the first also holds the deactivation, the last the weight syncs, the activation and
  the rebalance. The hybrids' wait for samples before deactivation is not trainer time: it is
  ``timing_s/wait_for_enough_samples`` (the cluster formula's ``x``).
- The rollout window of step ``s`` runs from one ``reset_staleness`` (end of a broadcast sync)
  to the next.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from metrics import (
    MQ_SIZE,
    RESOURCE_UTILIZATION,
    ROLLOUT_RESOURCE_UTILIZATION,
    STEP_GENERATED_SAMPLES,
    STEP_S,
    TRAIN_ALLOCATED_TIME_S,
    TRAIN_COMPUTE_TIME_S,
    TRAIN_RESOURCE_UTILIZATION,
    WAIT_FOR_ENOUGH_SAMPLES_S,
    WastedWork,
    aggregate_cycle,
    cycle_utilizations,
)
from policies import DynamicScheduleContext, DynamicSchedulePolicyBase
from sim.events import CONTROL_PLANE, Event, EventLoop
from sim.replica import Sample
from sim.result import SimResult, StepRecord
from sim.rollouter import Rollouter
from sim.spec import SimSpec
from sim.workload import ResponseLengths


class SimulationStalled(RuntimeError):
    """No event is left but the run is not finished (e.g. nothing can ever generate)."""


class Delay(NamedTuple):
    seconds: float


class UntilQueued(NamedTuple):
    samples: int


class UntilIdle(NamedTuple):
    """Until nothing routable is in flight (a sync without partial rollout drains first)."""


Wait = Delay | UntilQueued | UntilIdle


@dataclass
class _StepLog:
    """What one step has measured so far (turned into a ``StepRecord`` at commit)."""

    step: int
    start: float
    waste0: WastedWork
    wait_for_samples_s: float = 0.0
    deactivate_s: float = 0.0
    deactivated: bool = False
    activated: bool = False
    rebalanced: bool = False
    micro: list[dict[str, float]] = field(default_factory=list)
    step_generated: int = 0
    window_end: float = 0.0
    history: list[tuple[float, int, int]] = field(default_factory=list)


class Simulator:
    """One simulated run of ``spec.steps`` steps under ``policy``, deterministic per ``seed``."""

    def __init__(
        self,
        spec: SimSpec,
        policy: DynamicSchedulePolicyBase,
        *,
        seed: int = 0,
        policy_name: str = "",
        trace: bool = False,
    ):
        self.spec = spec
        self.policy = policy
        self.policy_name = policy_name or type(policy).__name__
        self.seed = seed
        self.rng = random.Random(seed)
        self.loop = EventLoop()
        self.trace: list[tuple[Any, ...]] | None = [] if trace else None
        lengths = ResponseLengths(
            rng=self.rng,
            n=spec.n,
            mean_start=spec.response_len_mean_start,
            mean_end=spec.response_len_mean_end,
            response_sigma=spec.response_len_sigma,
            prompt_sigma=spec.prompt_len_sigma,
            max_len=spec.response_length,
            last_version=spec.steps - 1,
        )
        self.rollouter = Rollouter(spec, lengths, clock=lambda: self.loop.now, trace=self._record_trace)
        self.rollouter.on_generated = self._check_wake
        self.hybrid_active = False
        self.records: list[StepRecord] = []
        self.decisions: list[tuple[int, str, Any]] = []
        self.trained_ids: list[int] = []
        self.train_compute_total_s = 0.0
        self.trained_response_tokens = 0
        self.switches = 0
        self.switch_s = 0.0
        self.last_activate_s = 0.0
        self.last_deactivate_s = 0.0
        self.last_switch_at: float | None = None
        self._wait_sums: tuple[list[float], list[int]] = ([], [])
        self._wake_when: Callable[[], bool] | None = None
        self._process: Iterator[Wait] = self._training_run()
        self._done = False

    # ------------------------------------------------------------------ running

    def run(self) -> SimResult:
        """Simulate every step; returns the result (raises ``SimulationStalled`` if stuck)."""
        spec = self.spec
        if self.rollouter.hybrids and (spec.only_hybrid or spec.initial_hybrid_active):
            self.rollouter.add(self.rollouter.hybrids)
            self.hybrid_active = True
            self._record_trace("activate")
        self.rollouter.try_start()
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
        return lambda: r.in_flight == len(r.pending)  # retries with no replica cannot drain

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
        yield from self._warm_up()
        for step in range(1, self.spec.steps + 1):
            yield from self._training_step(step, final=step == self.spec.steps)

    def _warm_up(self) -> Iterator[Wait]:
        """``tidal run``'s warm-up (``flows/training_run._warm_up``): with the standalones already
        generating, the policy is asked ``should_activate_after_step(0)`` (nothing generated or
        consumed yet); yes = hybrid sync → activate, no rebalance, before step 1 starts."""
        r = self.rollouter
        if not r.hybrids or self.hybrid_active or not self._ask(0, "should_activate_after_step"):
            return
        t = self.loop.now
        yield Delay(self.spec.hybrid_sync_s)
        yield Delay(self.spec.activate_s)
        r.add(r.hybrids)
        self.hybrid_active = True
        self._record_trace("activate")
        self._switched("activate", t)

    def _training_step(self, step: int, final: bool = False) -> Iterator[Wait]:
        """DESIGN §2: should_deactivate → [wait → deactivate] → train × k → broadcast_sync →
        should_activate → [hybrid_sync → activate → rebalance] → update_policy → commit. The
        run's last step does not ask should_activate (``flows/training_step``: nothing trains after it)."""
        spec, r, now = self.spec, self.rollouter, lambda: self.loop.now
        has_hybrids = bool(r.hybrids)
        log = _StepLog(step=step, start=now(), waste0=self._waste())
        self._wait_sums = ([], [])
        task = Delay(spec.task_overhead_s)  # before each phase: one Prefect task each in Tidal

        # 1-2. take the hybrids back once enough samples are buffered (a threshold above the
        # queue's capacity could never be met: it is clamped to it)
        yield task
        if has_hybrids and self._ask(step, "should_deactivate") and self.hybrid_active:
            want = min(self._ask(step, "deactivate_wait_samples"), spec.max_required_samples)
            yield task
            t = now()
            yield UntilQueued(want)
            log.wait_for_samples_s = now() - t
            t = now()
            self._record_trace("deactivate")
            r.remove(r.hybrids)
            yield Delay(spec.deactivate_s)
            self.hybrid_active, log.deactivated = False, True
            log.deactivate_s = self._switched("deactivate", t)

        # 3. train: trigger_parameter_sync_step micro-steps
        for i in range(spec.trigger_parameter_sync_step):
            yield task
            t = now()
            queued = len(r.queue)
            yield UntilQueued(spec.required_samples)
            self._wait_sums[0].append(now() - t)
            self._wait_sums[1].append(max(0, spec.required_samples - queued))
            batch = r.take(spec.required_samples)
            compute_s = self._train_time(batch)
            self._record_trace("train", step, i + 1, [s.id for s in batch])
            yield Delay(compute_s)
            self.trained_ids.extend(s.id for s in batch)
            self.trained_response_tokens += sum(sum(s.lengths) for s in batch)
            self.train_compute_total_s += compute_s
            alloc = now() - t + (log.deactivate_s if i == 0 else 0.0)
            log.micro.append({TRAIN_COMPUTE_TIME_S: compute_s, TRAIN_ALLOCATED_TIME_S: alloc, MQ_SIZE: len(r.queue)})
        last_micro_end = now()

        # 4. broadcast sync to the routable replicas; generation pauses (partial rollout) or
        # drains first (no partial rollout); then a new version and a reset staleness count
        yield task
        if not spec.partial_rollout:
            r.accepting = False
            yield UntilIdle()
        if spec.sync_aborts:
            paused_reps = list(r.routable)
            aborted = r.pause(paused_reps)
        else:
            paused_reps, aborted = [], []
            r.stall([rep for rep in r.routable if not rep.hybrid], spec.broadcast_sync_s)
        yield Delay(spec.broadcast_sync_s)
        r.accepting = True
        log.step_generated, log.window_end = r.step_generated, now()
        log.history, r.history = r.history, [(now(), r.in_flight, r.capacity())]
        r.resume(paused_reps, aborted, sticky=True)
        r.reset_staleness()
        self._record_trace("sync", r.version)

        # 5. lend the trainer GPUs again? (not after the last step: nothing would use them)
        lend = False
        if not final:
            yield task
            lend = has_hybrids and self._ask(step, "should_activate_after_step") and not self.hybrid_active
        if lend:
            yield task
            t = now()
            yield Delay(spec.hybrid_sync_s)
            synced_s = now() - t
            yield task
            t = now()
            yield Delay(spec.activate_s)
            r.add(r.hybrids)
            self.hybrid_active, log.activated = True, True
            self._record_trace("activate")
            self._switched("activate", t - synced_s)  # hybrid sync + activate, not the tasks between
            if spec.enable_rebalance and self._ask(step, "request_rebalance"):
                t = now()
                aborted = r.pause(list(r.routable))
                yield Delay(spec.rebalance_s)
                r.resume(list(r.routable), aborted, sticky=False)
                self.switch_s += now() - t
                log.rebalanced = True
                self._record_trace("rebalance")
        tasks_s = spec.task_overhead_s * (1 + (not final) + 2 * log.activated)  # the reference counts syncs, not tasks
        log.micro[-1][TRAIN_ALLOCATED_TIME_S] += now() - last_micro_end - tasks_s

        # 6. adapt the policy, 7. commit
        yield task
        if has_hybrids:
            self._ask(step, "update_after_step")
        yield Delay(spec.step_overhead_s)
        self._record_trace("commit", step)
        self.records.append(self._step_record(log))

    def _waste(self) -> WastedWork:
        r = self.rollouter
        return WastedWork(r.aborted_requests, r.aborted_tokens, r.reprefilled_tokens, self.switch_s)

    def _step_record(self, log: _StepLog) -> StepRecord:
        """Fold the step's micro-step metrics with the ``metrics`` package into a ``StepRecord``."""
        spec, total, before = self.spec, self._waste(), log.waste0
        waste = WastedWork(
            aborted_requests=total.aborted_requests - before.aborted_requests,
            aborted_tokens=total.aborted_tokens - before.aborted_tokens,
            reprefilled_tokens=total.reprefilled_tokens - before.reprefilled_tokens,
            switch_s=max(0.0, total.switch_s - before.switch_s),
        )
        log.micro[-1].update(
            {
                STEP_S: self.loop.now - log.start,
                WAIT_FOR_ENOUGH_SAMPLES_S: log.wait_for_samples_s,
                STEP_GENERATED_SAMPLES: log.step_generated,
                **waste.as_metrics(),
            }
        )
        metrics = aggregate_cycle(log.micro)
        metrics.update(
            cycle_utilizations(
                metrics,
                rollout_history=log.history,
                window_end_t=log.window_end,
                hybrid_gpus=spec.trainer_gpus,
                standalone_gpus=spec.standalone_gpus,
            )
        )
        ratio = getattr(self.policy, "deactivate_ratio", None)
        return StepRecord(
            step=log.step,
            start_s=log.start,
            end_s=self.loop.now,
            param_version=self.rollouter.version,
            wait_for_samples_s=log.wait_for_samples_s,
            micro_wait_s=list(self._wait_sums[0]),
            micro_wait_samples=list(self._wait_sums[1]),
            train_compute_s=sum(m[TRAIN_COMPUTE_TIME_S] for m in log.micro),
            mq_size=int(metrics[MQ_SIZE]),
            step_generated_samples=log.step_generated,
            deactivated=log.deactivated,
            activated=log.activated,
            rebalanced=log.rebalanced,
            hybrid_active=self.hybrid_active,
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

    def _switched(self, kind: str, began: float) -> float:
        """Book a finished activate (incl. its hybrid sync) or deactivate; returns its seconds."""
        took = self.loop.now - began
        if kind == "activate":
            self.last_activate_s = took
        else:
            self.last_deactivate_s = took
        self.last_switch_at = self.loop.now
        self.switches += 1
        self.switch_s += took
        return took

    # ------------------------------------------------------------------ policy

    def context(self, step: int) -> DynamicScheduleContext:
        """The context a policy sees now (built fresh before every hook, as in production)."""
        s, r = self.spec, self.rollouter
        return DynamicScheduleContext(
            required_samples=s.required_samples,
            trigger_parameter_sync_step=s.trigger_parameter_sync_step,
            total_generated_samples=r.total_generated,
            expected_samples=step * s.step_required_samples,
            buffer_samples=s.buffer_samples,
            step_wait_times=list(self._wait_sums[0]),
            step_wait_samples=list(self._wait_sums[1]),
            only_hybrid=s.only_hybrid,
            last_activate_duration_s=self.last_activate_s,
            last_deactivate_duration_s=self.last_deactivate_s,
            now=self.loop.now,
            last_switch_at=self.last_switch_at,
            mq_size=len(r.queue),
            standalone_replicas=s.standalone_replicas,
            hybrid_replicas=s.hybrid_replicas,
        )

    def _ask(self, step: int, hook: str) -> Any:
        """Call one policy hook with a fresh context; record and return its answer."""
        ctx = self.context(step)
        p = self.policy
        if hook == "should_deactivate":
            answer: Any = bool(p.should_deactivate(step, self.hybrid_active, ctx))
        elif hook == "deactivate_wait_samples":
            answer = max(0, int(p.deactivate_wait_samples(ctx)))
        elif hook == "should_activate_after_step":
            answer = bool(p.should_activate_after_step(step, self.hybrid_active, ctx))
        elif hook == "request_rebalance":
            answer = bool(p.request_rebalance(step, ctx))
        else:
            p.update_after_step(step, ctx)
            answer = None
        self.decisions.append((step, hook, answer))
        return answer

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
            queued_ids=[sample.id for sample in r.queue],
            in_flight_ids=in_flight,
            switches=self.switches,
            waste=self._waste(),
            decisions=self.decisions,
            trace=self.trace,
            events_handled=self.loop.handled,
        )

    def _rollout_work_gpu_s(self) -> float:
        """GPU-seconds to generate the trained samples once, every replica at its best speed.

        A replica is fastest per sequence-iteration at a full batch of ``max_num_seqs``; each
        trained sample needs its prompt prefilled once and one iteration per generated token.
        """
        spec, b = self.spec, self.spec.max_num_seqs
        best_speed = max(rep.speed for rep in self.rollouter.replicas)
        decode_s = self.trained_response_tokens * (spec.decode_step_base_s + spec.decode_step_per_seq_s * b) / b
        prefill_s = len(self.trained_ids) * spec.prompt_tokens / spec.prefill_tokens_per_s
        return (decode_s + prefill_s) / best_speed * spec.gpus_per_replica


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

