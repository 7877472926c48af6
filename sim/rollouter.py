"""The simulated data plane: rollouter, load balancer and message queue (one object).

Owns the simulated samples' life: start (under ``loop.staleness.StalenessGate``, DESIGN §5), route
(``loop.balance.least_loaded``, sticky per sample), abort, retry and queue; and the
``(t, in flight, capacity)`` history (``loop.staleness.record_change``). The rules are the loop
package's, shared with ``rollout.rollouter``; docs/simulator.md says what is modelled.
Must not decide anything of the control plane (the simulator calls the verbs below).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import math
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
        self.takeback_samples: int | None = None
        """The latest plan's ``wait_samples``: the lent hybrids go when the queue holds them."""
        self.attempts = {False: 0, True: 0}
        """Routings (first or retry) to standalones (False) and hybrids (True)."""
        self.delivered_tokens = {False: 0, True: 0}
        """Tokens of the samples that finished on each kind."""
        self.kind_aborted_tokens = {False: 0, True: 0}
        """``aborted_tokens`` by the kind of replica they were aborted on."""
        self.kind_reprefilled_tokens = {False: 0, True: 0}
        """``reprefilled_tokens`` by the kind of replica that prefilled them again."""
        self._ahead: list[tuple[float, list[int]]] = []
        """``SimSpec.admission_lookahead``: (predicted mean length, lengths) of prompts drawn ahead."""
        self._predicted: dict[int, float] = {}
        """Predicted mean response length per started sample (length-aware admission or routing)."""
        self._predicted_next = 0.0

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
        while (self.accepting and self.total_started < s.total_samples
               and gate.allows(self.in_flight, len(self.queue))):
            lengths = self._next_lengths()
            sample = Sample(self.total_started, lengths, s.prompt_tokens, self.version, now)
            if s.admission_lookahead > 0 or s.route_by_length:
                self._predicted[sample.id] = (self._predicted_next if s.admission_lookahead > 0
                                              else sum(lengths) / len(lengths))
            self.total_started += 1
            gate.started()
            self._route(sample, resubmit=False)
            started = True
        if started:
            self._record()

    def _next_lengths(self) -> list[int]:
        """The next sample's response lengths: drawn now (FIFO), or, with
        ``SimSpec.admission_lookahead``, the longest predicted of that many drawn ahead."""
        s = self.spec
        if s.admission_lookahead <= 0:
            return self.lengths.draw(self._rng, s.n, self.version)
        left = s.total_samples - self.total_started
        while len(self._ahead) < min(s.admission_lookahead, left):
            lengths = self.lengths.draw(self._rng, s.n, self.version)
            error = math.exp(self._rng.gauss(0.0, s.admission_predict_sigma)) if s.admission_predict_sigma else 1.0
            self._ahead.append((sum(lengths) / len(lengths) * error, lengths))
        best = max(range(len(self._ahead)), key=lambda i: self._ahead[i][0])
        predicted, lengths = self._ahead.pop(best)
        self._predicted_next = predicted
        return lengths

    def _route(self, sample: Sample, *, resubmit: bool) -> None:
        if not self.routable:
            self.pending.append(sample)
            return
        candidates = self.routable
        if self.spec.route_by_length:
            candidates = self._by_length(sample, candidates)
        rep = least_loaded(candidates, _load, _replica_id)
        self._place(sample, rep, resubmit=resubmit)

    def _by_length(self, sample: Sample, candidates: list[Replica]) -> list[Replica]:
        """``SimSpec.route_by_length``: long samples to standalones, short ones to lent hybrids."""
        lent = [r for r in candidates if r.hybrid]
        if not lent or len(lent) == len(candidates):
            return candidates
        predicted = self._predicted.get(sample.id, sum(sample.lengths) / len(sample.lengths))
        side = ([r for r in candidates if not r.hybrid] if predicted > self.lengths.mean(sample.version) else lent)
        if min(r.samples for r in side) < self.spec.concurrent_samples_per_replica:
            return side
        return candidates

    def _place(self, sample: Sample, rep: Replica, *, resubmit: bool) -> None:
        now = self._clock()
        prefilled = rep.add(sample, now, resubmit=resubmit)
        self.reprefilled_tokens += prefilled
        self.kind_reprefilled_tokens[rep.hybrid] += prefilled
        self.attempts[rep.hybrid] += 1
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
                self.delivered_tokens[rep.hybrid] += sample.tokens
                self._predicted.pop(sample.id, None)
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
            self.kind_aborted_tokens[rep.hybrid] += tokens
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
                self._place(sample, home, resubmit=True)
            else:
                self._route(sample, resubmit=True)
        self.try_start()

    def unroute(self, reps: list[Replica]) -> None:
        """Take ``reps`` out of the balancer; they keep generating what they have (a drain). Only
        ``SimSpec.abort_drain_s`` uses it; removed with issue 46 once the simulator stops reading that."""
        self._set_routable([r for r in self.routable if r not in reps])
        self._record()

    def retry(self, aborted: list[tuple[Sample, Replica]]) -> None:
        """Route ``aborted`` again, least-loaded over what is routable (a take-back's abort)."""
        for sample, _ in aborted:
            self._route(sample, resubmit=True)
        self._record()

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
