"""The dynamic resource controller: lends hybrid replicas to rollout and takes them back.

Owns the policy context of each question (built here, from the run's static sizes, one read of
the rollout counters, the step's micro-step summaries, the membership and the cycle's switch
durations), production's executor of the switches (``loop.switches``: each operation a typed call
on the ``LoadBalancer`` or ``ReplicaPool`` protocol, timed), the state machine of the hybrid
replicas (``loop.switches.SwitchMachine``, the twin's too), and the small memory a resumed run
needs to continue exactly (``state_dict``).

Must not: import Ray (the Ray actor wraps this class) or a clock (the caller gives one), do any I/O
other than calling the ``LoadBalancer`` and ``ReplicaPool`` protocols and the counters callable,
order a switch's operations (``loop.switches`` does, for both sides), or hold policy logic: every
policy question goes through ``loop.Decider`` (asked in its order, recorded).

Switch orders: see ``loop.switches`` (take back, hybrid sync, activate, rebalance).

Graded lending (k of m): ``hybrid_sync(version, count=k)`` wakes the first k hybrids in
``hybrid_ids`` order, ``activate`` lends exactly those, and ``deactivate`` takes back exactly the
lent ones. HYBRID_ACTIVE means "k ≥ 1 lent" (``lent_ids``). A second lend while some hybrids are
lent is illegal (``IllegalTransition``): deactivate first, so a lend always starts from all asleep.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from loop.context import Snapshot, policy_context
from loop.decisions import Decider, DecisionRecord, SwitchBook
from loop.guards import Guard, only_hybrid_start, refill_sequence, relend_after_resume, stranded_refill
from loop.membership import Membership
from loop.plans import DeactivatePlan, LendPlan, MicroSummary, RolloutCounters, RunSizes, SwitchReport
from loop.readonly import ReadOnly
from loop.step import Activate, HybridSync, WaitForSamples
from loop.switches import (
    NOT_HERE,
    Abort,
    ClearSticky,
    ControllerState,
    Drain,
    Hold,
    IllegalTransition,
    Load,
    Offload,
    Operation,
    Reload,
    Resume,
    Route,
    Sleep,
    Switch,
    SwitchMachine,
    Unhold,
    Unroute,
    Wake,
    run_switch,
)
from policies import DynamicScheduleContext

if TYPE_CHECKING:
    from policies import DynamicSchedulePolicyBase

__all__ = [
    "ControllerState",
    "DecisionRecord",
    "DynamicResourceController",
    "IllegalTransition",
    "LoadBalancer",
    "ReplicaPool",
]

class LoadBalancer(Protocol):
    """The rollout load balancer, as far as the controller drives it."""

    def add_replicas(self, ids: Sequence[str]) -> None:
        """Start routing new requests to these replicas."""

    def remove_replicas(self, ids: Sequence[str]) -> None:
        """Stop routing new requests (and retries) to these replicas."""

    def clear_sticky(self) -> int:
        """Forget every sticky-session entry; returns how many were cleared."""

    def hold(self) -> None:
        """Route nothing (new requests and retries wait) until ``unhold``."""

    def unhold(self) -> None:
        """Route again."""

    def wait_drained(self, ids: Sequence[str], timeout_s: float) -> int:
        """Return once nothing is in flight on ``ids`` (0), or what still is after ``timeout_s``:
        woken by the requests' completions, not by polling."""


class ReplicaPool(Protocol):
    """The rollout replicas, addressed by id."""

    def abort(self, ids: Sequence[str]) -> int:
        """Pause the replicas and abort their in-flight requests; returns how many were aborted.

        The rollouter retries the aborted requests (partial rollout) on whatever is routable.
        """

    def sleep(self, ids: Sequence[str]) -> None:
        """Free the KV cache and offload the weights, giving the GPU back to training."""

    def wake_up(self, ids: Sequence[str]) -> None:
        """Take the GPU memory back for generation."""

    def load_weights(self, ids: Sequence[str], version: int) -> None:
        """Load the trainer's weights at param ``version``."""

    def resume(self, ids: Sequence[str]) -> None:
        """Let the replicas accept and run requests again."""


@runtime_checkable
class TrainerRoom(Protocol):
    """A pool whose hybrids share the trainer's devices may also move the trainer's state out of
    their way (optional: the controller calls these only when the pool has them)."""

    def offload(self, ids: Sequence[str]) -> Mapping[str, float]:
        """Before the hybrids ``ids`` wake: the trainer's optimizer state and gradients (and
        parameters, if configured) go to host memory; returns the seconds and GB of each move."""

    def reload(self, ids: Sequence[str]) -> Mapping[str, float]:
        """After they sleep: the trainer's state comes back to its devices."""


def _unique(ids: Sequence[str]) -> tuple[str, ...]:
    """The ids in first-seen order, each once."""
    return tuple(dict.fromkeys(ids))


class DynamicResourceController:
    """Drives the hybrid replicas between STANDALONE_ONLY and HYBRID_ACTIVE for one run.

    Per training step the caller (the controller actor, for the step flow) uses it in the order
    of ``loop.step_sequence``:

    1. ``should_deactivate`` -> [wait, ``deactivate``]
    2. train, broadcast weights to the standalone replicas
    3. ``should_activate`` -> [``hybrid_sync``, ``lend`` (activate, ``request_rebalance``, rebalance)]
    4. ``update_after_step`` (``update_after_step``, always); then persist ``state_dict()`` and the
       policy's state.

    Switches raise ``IllegalTransition`` before calling anything when the state does not allow
    them. A switch whose protocol call raises leaves the controller state as it was.

    ``sizes`` are the run's static sizes; ``counters()`` reads the rollout service's generated
    total and queue size (once per question); ``membership`` is the one view of the standalone
    replicas (built from ``standalone_ids`` when not given). ``clock`` times everything; pass a
    wall clock (``time.time``) when ``last_switch_at`` must stay meaningful across a restart.
    """

    def __init__(
        self,
        policy: DynamicSchedulePolicyBase,
        hybrid_ids: Sequence[str],
        lb: LoadBalancer,
        pool: ReplicaPool,
        *,
        standalone_ids: Sequence[str] = (),
        membership: Membership | None = None,
        sizes: RunSizes | None = None,
        counters: Callable[[], RolloutCounters] = RolloutCounters,
        enable_rebalance: bool = True,
        only_hybrid: bool = False,
        clock: Callable[[], float],
        rebalance_timeout_s: float = 60.0,
        initial_state: ControllerState = ControllerState.STANDALONE_ONLY,
    ) -> None:
        hybrids = _unique(hybrid_ids)
        members = membership if membership is not None else Membership(standalone_ids, hybrids)
        standalones = members.routable()
        if only_hybrid and standalones:
            raise ValueError(
                f"only_hybrid runs have no standalone replicas, got {len(standalones)}"
            )
        if only_hybrid and not hybrids:
            raise ValueError("only_hybrid needs at least one hybrid replica")
        if rebalance_timeout_s <= 0:
            raise ValueError(f"rebalance_timeout_s must be > 0, got {rebalance_timeout_s}")

        self._policy = policy
        self._decider = Decider(policy, enable_rebalance=enable_rebalance, timer=clock)
        self._enable_rebalance = enable_rebalance
        self._hybrids = hybrids
        self._members = members
        self._lb = lb
        self._pool = pool
        self._only_hybrid = only_hybrid
        self._sizes = sizes or RunSizes(required_samples=1, trigger_parameter_sync_step=1,
                                        only_hybrid=only_hybrid, standalone_replicas=len(standalones),
                                        hybrid_replicas=len(hybrids))
        self._counters = counters
        self._clock = clock
        self._rebalance_timeout_s = float(rebalance_timeout_s)

        # the hybrids' state machine and its memory (all of it in state_dict(), with the consumed count)
        self._machine = SwitchMachine(hybrids, initial_state)
        self._consumed = int(self._sizes.consumed_before)
        self._answered: dict[tuple[int, str], Any] = {}  # (step, question) -> its answer

    def _once(self, step: int, question: str, ask: Callable[[], Any]) -> Any:
        """``ask()`` the first time ``question`` comes for ``step``; its answer again after that.

        A retried Prefect task asks again: it gets the same answer, and nothing is recorded twice.
        Answers of steps before the previous one are forgotten.
        """
        key = (step, question)
        if key not in self._answered:
            self._answered = {k: v for k, v in self._answered.items() if k[0] >= step - 1}
            self._answered[key] = ask()
        return self._answered[key]

    # ------------------------------------------------------------------ state

    policy = ReadOnly["DynamicSchedulePolicyBase"]("_policy")
    decider = ReadOnly[Decider]("_decider")
    membership = ReadOnly[Membership]("_members")
    @property
    def state(self) -> ControllerState:
        return self._machine.state

    @property
    def is_hybrid_active(self) -> bool:
        return self._machine.active

    hybrid_ids = ReadOnly[tuple[str, ...]]("_hybrids")

    @property
    def standalone_ids(self) -> tuple[str, ...]:
        """The routable standalone replicas (membership's view), in slot order."""
        return self._members.routable()

    only_hybrid = ReadOnly[bool]("_only_hybrid")
    @property
    def lent_ids(self) -> tuple[str, ...]:
        """The hybrids lent to rollout now (the first k of ``hybrid_ids``; empty when none)."""
        return self._machine.lent

    @property
    def synced_version(self) -> int | None:
        """Param version the hybrids hold since their last sleep; None when not synced."""
        return self._machine.synced_version

    @property
    def _book(self) -> SwitchBook:
        return self._machine.book

    @property
    def switch_log(self) -> list[SwitchReport]:
        """Every completed switch (activate, deactivate, hybrid_sync, rebalance), oldest first."""
        return self._book.log

    @property
    def switch_count(self) -> int:
        """Completed activates plus deactivates over the whole run (survives a resume)."""
        return self._book.count

    @property
    def decisions(self) -> list[DecisionRecord]:
        """Every recorded policy call since the last ``drain_decisions``, oldest first."""
        return self._decider.records

    def drain_decisions(self) -> list[DecisionRecord]:
        """Return the recorded policy calls and forget them."""
        return self._decider.drain()

    def drain_switch_log(self) -> list[SwitchReport]:
        """Return the completed switches and forget them (``switch_count`` is kept)."""
        return self._book.drain()

    def active_replica_ids(self) -> tuple[str, ...]:
        """Replicas that generate now: routable standalone, plus hybrids when active; each once."""
        return _unique(self._members.routable() + self._machine.lent)

    def context(self, micro: Sequence[MicroSummary] = ()) -> DynamicScheduleContext:
        """The policy's view now: one read of the rollout counters, this step's micro-steps.

        ``last_activate_duration_s`` and ``last_deactivate_duration_s`` are this cycle's switch
        seconds (``loop.SwitchDurations``: 0 in a cycle that did not switch); ``last_switch_at``
        is when the last activate or deactivate finished.
        """
        counters = self._counters()
        return policy_context(self._sizes, Snapshot(
            generated_total=int(counters.generated_total), queue_size=int(counters.queue_size),
            in_flight=int(counters.in_flight), consumed=self._consumed, micro=tuple(micro),
            activate_s=self._book.durations.activate_s, deactivate_s=self._book.durations.deactivate_s,
            now=self._clock(), last_switch_at=self._book.last_switch_at,
            standalone_lost=self._members.standalone_lost, lent_replicas=len(self._machine.lent)))

    # ------------------------------------------------------------ step phases

    def should_deactivate(self, step: int) -> DeactivatePlan:
        """Take the hybrids back before training? (asked only while they are active; once a step)."""
        if not self._hybrids or not self.is_hybrid_active:
            return DeactivatePlan(step=step, hybrid_active=self.is_hybrid_active)
        return self._once(step, "should_deactivate", lambda: self._decider.should_deactivate(step, True, self.context()))

    def should_activate(self, step: int, micro: Sequence[MicroSummary]) -> LendPlan:
        """Lend the trainer's GPUs until the next step? (no question without hybrids; once a step)."""
        if not self._hybrids:
            return LendPlan(step=step)
        return self._once(step, "should_activate", lambda: self._decider.should_activate(
            step, self.is_hybrid_active, self.context(micro), len(self._hybrids)))

    def warm_up(self, version: int) -> LendPlan:
        """Before step 1: a recorded question only for a policy that sets ``warm_up_lend``."""
        if not self._hybrids or not self._decider.asks_warm_up:
            return LendPlan(step=0, of=len(self._hybrids))
        return self._decider.warm_up(self.context(), len(self._hybrids))

    def relend_after_resume(self, version: int) -> LendPlan:
        """A resumed run whose hybrids were lent when it stopped lends as many again (the guard
        ``loop.guards.relend_after_resume``, recorded)."""
        return self._guard(0, relend_after_resume(version, self._machine.relend_count, len(self._hybrids)), self.context())

    def lend_only_hybrids(self, version: int) -> LendPlan:
        """Only-hybrid mode: a fresh run lends every hybrid before step 1 (the guard
        ``loop.guards.only_hybrid_start``, recorded); nothing else would generate step 1's samples."""
        return self._guard(0, only_hybrid_start(version, len(self._hybrids)), self.context())

    def _guard(self, step: int, guard: Guard, ctx: DynamicScheduleContext) -> LendPlan:
        self._decider.record_guard(step, guard.hook, guard.answer, guard.reason, self.is_hybrid_active, ctx)
        return guard.plan

    def lend(self, step: int, micro: Sequence[MicroSummary], count: int | None = None) -> tuple[SwitchReport, ...]:
        """Activate the synced hybrids (``count`` of them, when given, must be what was synced);
        then rebalance when enabled and the policy asks."""
        reports = [self._run(self._machine.activate(count=count))]
        if self._enable_rebalance and self._decider.wants_rebalance(step, self.context(micro)):
            reports.append(self.rebalance())
        return tuple(reports)

    def update_after_step(self, step: int, micro: Sequence[MicroSummary]) -> None:
        """``update_after_step`` (always, once a step), then a new cycle: durations reset, samples
        consumed."""
        self._once(step, "update_after_step", lambda: self._update_after_step(step, micro))

    def _update_after_step(self, step: int, micro: Sequence[MicroSummary]) -> None:
        self._decider.update_after_step(step, self.is_hybrid_active, self.context(micro))
        self._book.durations.reset()
        self._consumed += sum(m.samples for m in micro)

    def refill_if_stranded(self, step: int, version: int, wait_for_queue: Callable[[int], Any]) -> bool:
        """The trainer waits, the hybrids sleep and no standalone replica is alive: nothing would
        generate its samples (``loop.guards.stranded_refill``). Record the guard, then carry out
        ``loop.guards.refill_sequence``: lend the hybrids at ``version`` (the last broadcast) until
        ``wait_for_queue`` has one micro-step queued, and take them back, even when the wait fails.
        Returns whether it refilled (the counters are not read while the hybrids are lent)."""
        if not self._hybrids or self.is_hybrid_active:
            return False
        ctx = self.context()
        guard = stranded_refill(step, ctx, hybrids=len(self._hybrids), active=self.is_hybrid_active,
                                version=version)
        if guard is None:
            return False
        self._guard(step, guard, ctx)
        for op in refill_sequence(guard, version, self._sizes.required_samples):
            match op:
                case HybridSync(plan=plan, version=v):
                    self.hybrid_sync(v, plan.count)
                case Activate():
                    self.activate()
                case WaitForSamples(plan=plan):
                    try:
                        wait_for_queue(plan.wait_samples)
                    finally:
                        self.deactivate()
        return True

    # --------------------------------------------------------------- switches

    def deactivate(self) -> SwitchReport:
        """Take the hybrids back for training (``loop.switches.take_back``)."""
        return self._run(self._machine.take_back())

    def hybrid_sync(self, version: int, count: int | None = None) -> SwitchReport:
        """Wake ``count`` sleeping hybrids (the first ones; all when None) and load ``version``."""
        return self._run(self._machine.hybrid_sync(version, count))

    def activate(self, version: int | None = None) -> SwitchReport:
        """Lend the synced hybrids to rollout (with ``version``, they must hold exactly it)."""
        return self._run(self._machine.activate(version))

    def rebalance(self) -> SwitchReport:
        """Spread the work onto the fresh hybrids (``loop.switches.rebalance``). Raises
        ``TimeoutError`` when requests are still in flight after ``rebalance_timeout_s``; the
        replicas are resumed and routing released first, so generation never stays paused."""
        return self._run(self._machine.rebalance(self.active_replica_ids(), self._rebalance_timeout_s))

    def _run(self, switch: Switch) -> SwitchReport:
        return run_switch(switch, self._execute, self._clock)

    def _execute(self, op: Operation) -> Any:
        """One operation, as a typed call on the balancer or the replica pool."""
        lb, pool = self._lb, self._pool
        match op:
            case Route(ids=ids):
                return lb.add_replicas(ids)
            case Unroute(ids=ids):
                return lb.remove_replicas(ids)
            case ClearSticky():
                return lb.clear_sticky()
            case Hold():
                return lb.hold()
            case Unhold():
                return lb.unhold()
            case Drain(ids=ids, timeout_s=timeout_s):
                return lb.wait_drained(ids, timeout_s)
            case Abort(ids=ids):
                return pool.abort(ids)
            case Sleep(ids=ids):
                return pool.sleep(ids)
            case Wake(ids=ids):
                return pool.wake_up(ids)
            case Load(ids=ids, version=version):
                return pool.load_weights(ids, version)
            case Resume(ids=ids):
                return pool.resume(ids)
            case Offload(ids=ids):
                return pool.offload(ids) if isinstance(pool, TrainerRoom) else NOT_HERE
            case Reload(ids=ids):
                return pool.reload(ids) if isinstance(pool, TrainerRoom) else NOT_HERE
        raise TypeError(f"not a switch operation: {op!r}")

    # ------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable controller memory; restoring it continues the run exactly."""
        return self._machine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output. Touches no replica: the caller builds them to match.

        A state dict written before the per-cycle switch durations (``last_activate_duration_s``
        and ``last_deactivate_duration_s`` instead of ``switch_durations``) loads with a fresh
        cycle: those were the last-ever switches, not this cycle's. ``lent`` (how many hybrids
        are lent; all, in a state written before graded lending) is what a resumed run lends
        again; a STANDALONE_ONLY state keeps it only for that.
        """
        self._machine.load_state_dict(state)
