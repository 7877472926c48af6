"""The simulated data plane: rollouter, load balancer and message queue (one object).

Owns the simulated samples' life: start (under ``loop.staleness.StalenessGate``, DESIGN §5), route
(``loop.balance.least_loaded``, sticky per sample), abort, retry and queue; and the
``(t, in flight, capacity)`` history (``loop.staleness.record_change``). The rules are the loop
package's, shared with ``cluster.rollouter``; docs/simulator.md says what is modelled.
Must not decide anything of the control plane (the simulator calls the verbs below).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import random

from loop.balance import least_loaded
from loop.staleness import StalenessGate, record_change
from loop.workload import LengthModel, replica_costs
from sim.events import DATA_PLANE, Event
from sim.replica import Replica, Sample
from sim.spec import SimSpec

TraceFn = Callable[..., None]


class SimRollouter:
    """Starts samples under the staleness rules, routes them, and queues the finished ones.

    Sticky sessions: a sample's responses stay on one replica; a retry goes elsewhere only when
    its replica left the balancer or a rebalance cleared the sticky cache. Aborted samples with
    nowhere to go wait in ``pending``.
    """

    def __init__(
        self,
        spec: SimSpec,
        lengths: LengthModel,
        rng: random.Random,
        clock: Callable[[], float],
        trace: TraceFn,
    ):
        self.spec = spec
        self.lengths = lengths
        self._rng = rng
        self._clock = clock
        self._trace = trace
        costs = {hybrid: replica_costs(spec, hybrid=hybrid) for hybrid in (False, True)}
        self.replicas = []
        for i in range(spec.standalone_replicas + spec.hybrid_replicas):
            hybrid = i >= spec.standalone_replicas
            c = costs[hybrid]
            self.replicas.append(Replica(
                i, hybrid=hybrid, base_s=c.base_s, per_seq_s=c.per_seq_s, speed=c.speed,
                max_num_seqs=c.max_num_seqs, prefill_tokens_per_s=spec.prefill_tokens_per_s,
                prompt_tokens=spec.prompt_tokens, name=f"hybrid-{i - spec.standalone_replicas}" if hybrid else "",
            ))
        self.standalones = [r for r in self.replicas if not r.hybrid]
        self.hybrids = [r for r in self.replicas if r.hybrid]
        self.routable: list[Replica] = list(self.standalones)
        self.dead: list[Replica] = []
        for rep in self.hybrids:
            rep.paused = True  # asleep until activated
        self.queue: deque[Sample] = deque()
        self.pending: list[Sample] = []
        self.accepting = True
        """False while a sync without partial rollout drains the in-flight samples."""
        self.version = 0
        self.gate = StalenessGate(spec.max_required_samples, spec.concurrent_samples_per_replica)
        self.gate.set_routable(len(self.routable))
        self.total_started = 0
        self.total_generated = 0
        self.step_generated = 0
        self.history: list[tuple[float, int, int]] = [(0.0, 0, self.capacity())]
        self.aborted_requests = 0
        self.aborted_tokens = 0
        self.reprefilled_tokens = 0
        self.on_generated: Callable[[], list[Event]] = lambda: []
        """Called after samples land in the queue or leave flight; returns control-plane events."""
        self._dirty: dict[int, Replica] = {}

    # ------------------------------------------------------------------ state

    @property
    def in_flight(self) -> int:
        return self.total_started - self.total_generated

    @property
    def started_in_version(self) -> int:
        return self.gate.started_this_version

    def capacity(self) -> int:
        """max_concurrent_samples = min(routable replicas × per-replica, max_required_samples)."""
        return self.gate.capacity

    def _set_routable(self, routable: list[Replica]) -> None:
        self.routable = routable
        self.gate.set_routable(len(routable))

    def _record(self) -> None:
        record_change(self.history, self._clock(), self.in_flight, self.gate.capacity)

    # -------------------------------------------------------------- starting

    def try_start(self) -> None:
        """Start samples while the staleness rules allow (see the module docstring)."""
        s, now, gate = self.spec, self._clock(), self.gate
        started = False
        while self.accepting and self.total_started < s.total_samples and gate.allows(self.in_flight, len(self.queue)):
            lengths = self.lengths.draw(self._rng, s.n, self.version)
            sample = Sample(self.total_started, lengths, s.prompt_tokens, self.version, now)
            self.total_started += 1
            gate.started()
            self._route(sample, resubmit=False)
            started = True
        if started:
            self._record()

    def _route(self, sample: Sample, *, resubmit: bool) -> None:
        if not self.routable:
            self.pending.append(sample)
            return
        rep = least_loaded(self.routable, _load, _replica_id)
        self.reprefilled_tokens += rep.add(sample, self._clock(), resubmit=resubmit)
        self._dirty[rep.index] = rep
        self._trace("route", sample.id, rep.name)

    # -------------------------------------------------------------- handlers

    def tick(self, rep: Replica, epoch: int) -> list[Event]:
        """Handler: ``rep``'s next sequence completion (stale when ``epoch`` moved on)."""
        if epoch != rep.epoch:
            return []
        finished = rep.pop_finished(self._clock())
        self._dirty[rep.index] = rep
        events: list[Event] = []
        if finished:
            for sample in finished:
                self.queue.append(sample)
                self._trace("generated", sample.id)
            self.total_generated += len(finished)
            self.step_generated += len(finished)
            self.try_start()
            self._record()
            events = self.on_generated()
        return events + self.flush()

    def flush(self) -> list[Event]:
        """Re-schedule the next completion of every replica changed since the last flush."""
        events = []
        for rep in self._dirty.values():
            rep.epoch += 1
            t = rep.next_completion()
            if t is not None:
                events.append(Event(t, DATA_PLANE, self.tick, (rep, rep.epoch)))
        self._dirty.clear()
        return events

    # ---------------------------------------------------- control-plane verbs

    def pause(self, reps: list[Replica]) -> list[tuple[Sample, Replica]]:
        """Abort everything on ``reps`` and stop them; returns (aborted sample, its replica) by id."""
        now, aborted = self._clock(), []
        for rep in reps:
            samples, requests, tokens = rep.abort(now, partial=self.spec.partial_rollout)
            rep.paused = True
            self.aborted_requests += requests
            self.aborted_tokens += tokens
            self._dirty[rep.index] = rep
            aborted.extend((sample, rep) for sample in samples)
            for sample in samples:
                self._trace("abort", sample.id, rep.name)
        aborted.sort(key=lambda pair: pair[0].id)
        return aborted

    def stall(self, reps: list[Replica], seconds: float) -> None:
        """Stop ``reps`` decoding for ``seconds`` (a weight load), keeping what they generate."""
        now = self._clock()
        for rep in reps:
            rep.advance(now)
            rep.busy_until = max(rep.busy_until, now) + seconds
            self._dirty[rep.index] = rep

    def resume(self, reps: list[Replica], aborted: list[tuple[Sample, Replica]], *, sticky: bool) -> None:
        """Restart ``reps`` and retry ``aborted``: on their own replica when ``sticky`` (and it is
        still routable), else least-loaded."""
        now = self._clock()
        for rep in reps:
            rep.advance(now)
            rep.paused = False
            self._dirty[rep.index] = rep
        for sample, home in aborted:
            if sticky and home in self.routable:
                self.reprefilled_tokens += home.add(sample, now, resubmit=True)
                self._dirty[home.index] = home
                self._trace("route", sample.id, home.name)
            else:
                self._route(sample, resubmit=True)
        self.try_start()

    def remove(self, reps: list[Replica]) -> None:
        """Deactivate: remove from the balancer → abort (retries go elsewhere) → sleep."""
        self._set_routable([r for r in self.routable if r not in reps])
        for sample, _ in self.pause(reps):
            self._route(sample, resubmit=True)
        self._record()

    def kill(self, rep: Replica) -> None:
        """``rep`` dies: out of the balancer for good; its samples are retried elsewhere."""
        self.dead.append(rep)
        self.remove([rep])
        self._trace("death", rep.name)

    @property
    def standalone_lost(self) -> bool:
        """Every standalone replica has died (a run that never had one has lost none)."""
        return bool(self.standalones) and all(rep in self.dead for rep in self.standalones)

    def add(self, reps: list[Replica]) -> None:
        """Activate: add to the balancer → resume; pending retries and new samples flow in."""
        now = self._clock()
        self._set_routable([r for r in self.replicas if r in self.routable or r in reps])
        for rep in reps:
            rep.advance(now)
            rep.paused = False
            self._dirty[rep.index] = rep
        pending, self.pending = self.pending, []
        for sample in pending:
            self._route(sample, resubmit=True)
        self.try_start()
        self._record()

    def reset_staleness(self) -> None:
        """After a weight sync: new version; started-count = in flight + queued."""
        self.version += 1
        self.gate.on_sync(self.in_flight, len(self.queue))
        self.step_generated = 0
        self.try_start()

    def take(self, k: int) -> list[Sample]:
        """The trainer pulls ``k`` samples (FIFO); the rollouter may start more."""
        batch = [self.queue.popleft() for _ in range(k)]
        self.try_start()
        return batch


def _load(rep: Replica) -> int:
    return rep.samples


def _replica_id(rep: Replica) -> str:
    return rep.name
