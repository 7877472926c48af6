"""The dynamic resource controller: lends hybrid replicas to rollout and takes them back.

Owns the STANDALONE_ONLY <-> HYBRID_ACTIVE state machine of the hybrid replicas (the rollout
engines that live on trainer GPUs), the order in which a switch drives the load balancer and the
replica pool, the timing of every switch and every policy call, and the small memory a resumed
run needs to continue exactly (``state_dict``).

Must not: import Ray (the Ray actors wrap this class), do any I/O other than calling the
``LoadBalancer`` and ``ReplicaPool`` protocols, or hold policy logic. The policy decides; the
controller asks it, records the answer with its inputs, reason and duration, and acts.

Switch orders (each one timed per phase):

1. ``deactivate``:  remove from load balancer -> abort in-flight -> sleep
2. ``hybrid_sync``: wake up -> load weights at the new version
3. ``activate``:    add to load balancer -> resume generation
4. ``rebalance``:   clear sticky sessions -> abort all active replicas -> wait until nothing is in
   flight -> resume all active replicas
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from policies import DynamicScheduleContext, DynamicSchedulePolicyBase

__all__ = [
    "ControllerState",
    "DecisionRecord",
    "DynamicResourceController",
    "IllegalTransition",
    "LoadBalancer",
    "ReplicaPool",
    "SwitchTiming",
]

# Seconds between two in-flight polls while a rebalance waits for the aborted requests to drain.
DRAIN_POLL_INTERVAL_S = 0.01


class ControllerState(enum.Enum):
    """Where the hybrid replicas are: asleep on the trainer, or generating behind the balancer."""

    STANDALONE_ONLY = "STANDALONE_ONLY"
    HYBRID_ACTIVE = "HYBRID_ACTIVE"


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

    def in_flight(self, ids: Sequence[str] | None = None) -> int:
        """Total requests in flight on these replicas (on all replicas when ``ids`` is None)."""


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


class IllegalTransition(RuntimeError):
    """A switch that the current controller state does not allow; nothing was called."""


@dataclass(frozen=True)
class SwitchTiming:
    """How long one switch took, in seconds of the controller's clock.

    ``phases`` maps each phase name (e.g. ``"remove"``, ``"abort"``, ``"sleep"``) to its
    duration, in the order the phases ran. ``aborted`` counts the requests aborted (0 when the
    switch aborts nothing).
    """

    kind: str
    started_at: float
    duration_s: float
    phases: dict[str, float] = field(default_factory=dict)
    aborted: int = 0


@dataclass(frozen=True)
class DecisionRecord:
    """One policy call: which hook, at which step, with what inputs, answer and reason.

    ``inputs`` summarises the context the policy saw (totals rather than whole lists), so a
    record stays small enough to store for every step. ``duration_s`` is the policy call alone.
    """

    step: int
    hook: str
    answer: Any
    reason: str
    inputs: dict[str, Any]
    duration_s: float


class _PhaseTimer:
    """Times the phases of one switch with the controller's clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.started_at = clock()
        self.phases: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        begin = self._clock()
        result = fn(*args)
        self.phases[name] = self._clock() - begin
        return result

    def finish(self, kind: str, aborted: int = 0) -> SwitchTiming:
        return SwitchTiming(
            kind=kind,
            started_at=self.started_at,
            duration_s=self._clock() - self.started_at,
            phases=dict(self.phases),
            aborted=int(aborted),
        )


def _unique(ids: Sequence[str]) -> tuple[str, ...]:
    """The ids in first-seen order, each once."""
    return tuple(dict.fromkeys(ids))


class DynamicResourceController:
    """Drives the hybrid replicas between STANDALONE_ONLY and HYBRID_ACTIVE for one run.

    Per training step the caller (the step flow) uses it in this order:

    1. ``should_deactivate`` -> [``deactivate_wait_samples``, wait, ``deactivate``]
    2. train, broadcast weights to the standalone replicas
    3. ``should_activate`` -> [``hybrid_sync``, ``activate``, ``request_rebalance`` ->
       ``rebalance``]
    4. ``update_policy``; then persist ``state_dict()`` and the policy's state.

    Decision methods return the policy's answer unchanged in meaning (the caller checks that a
    switch is legal, e.g. ``is_hybrid_active`` before ``deactivate``); switches raise
    ``IllegalTransition`` before calling anything when the state does not allow them. A switch
    whose protocol call raises leaves the controller state as it was.

    ``clock`` times everything; pass a wall clock (``time.time``) when ``last_switch_at`` must
    stay meaningful across a process restart.
    """

    def __init__(
        self,
        policy: DynamicSchedulePolicyBase,
        hybrid_ids: Sequence[str],
        lb: LoadBalancer,
        pool: ReplicaPool,
        *,
        standalone_ids: Sequence[str] = (),
        enable_rebalance: bool = True,
        only_hybrid: bool = False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rebalance_timeout_s: float = 60.0,
        initial_state: ControllerState = ControllerState.STANDALONE_ONLY,
    ) -> None:
        hybrids = _unique(hybrid_ids)
        standalones = _unique(standalone_ids)
        if only_hybrid and standalones:
            raise ValueError(
                f"only_hybrid runs have no standalone replicas, got {len(standalones)}"
            )
        if only_hybrid and not hybrids:
            raise ValueError("only_hybrid needs at least one hybrid replica")
        if rebalance_timeout_s <= 0:
            raise ValueError(f"rebalance_timeout_s must be > 0, got {rebalance_timeout_s}")
        initial_state = ControllerState(initial_state)
        if initial_state is ControllerState.HYBRID_ACTIVE and not hybrids:
            raise ValueError("cannot start HYBRID_ACTIVE with no hybrid replicas")

        self._policy = policy
        self._hybrids = hybrids
        self._standalones = standalones
        self._lb = lb
        self._pool = pool
        self._enable_rebalance = enable_rebalance
        self._only_hybrid = only_hybrid
        self._clock = clock
        self._sleep = sleep
        self._rebalance_timeout_s = float(rebalance_timeout_s)

        self._state = initial_state
        self._decisions: list[DecisionRecord] = []
        self._switch_log: list[SwitchTiming] = []
        # Memory a resumed run needs (all of it is in state_dict()).
        self._synced_version: int | None = None  # weights the hybrids hold since the last sleep
        self._sync_duration_s: float | None = None  # the hybrid_sync that goes with them
        self._last_activate_duration_s = 0.0
        self._last_deactivate_duration_s = 0.0
        self._last_switch_at: float | None = None
        self._switch_count = 0

    # ------------------------------------------------------------------ state

    @property
    def policy(self) -> DynamicSchedulePolicyBase:
        return self._policy

    @property
    def state(self) -> ControllerState:
        return self._state

    @property
    def is_hybrid_active(self) -> bool:
        return self._state is ControllerState.HYBRID_ACTIVE

    @property
    def hybrid_ids(self) -> tuple[str, ...]:
        return self._hybrids

    @property
    def standalone_ids(self) -> tuple[str, ...]:
        return self._standalones

    @property
    def only_hybrid(self) -> bool:
        return self._only_hybrid

    @property
    def synced_version(self) -> int | None:
        """Param version the hybrids hold since their last sleep; None when not synced."""
        return self._synced_version

    @property
    def switch_log(self) -> list[SwitchTiming]:
        """Every completed switch (activate, deactivate, hybrid_sync, rebalance), oldest first."""
        return list(self._switch_log)

    @property
    def switch_count(self) -> int:
        """Completed activates plus deactivates over the whole run (survives a resume)."""
        return self._switch_count

    @property
    def decisions(self) -> list[DecisionRecord]:
        """Every recorded policy call since the last ``drain_decisions``, oldest first."""
        return list(self._decisions)

    def drain_decisions(self) -> list[DecisionRecord]:
        """Return the recorded policy calls and forget them."""
        drained, self._decisions = self._decisions, []
        return drained

    def drain_switch_log(self) -> list[SwitchTiming]:
        """Return the completed switches and forget them (``switch_count`` is kept)."""
        drained, self._switch_log = self._switch_log, []
        return drained

    def replace_standalone(self, old: str, new: str) -> None:
        """A new standalone replica ``new`` took the place of ``old`` (whose actor died); it
        keeps ``old``'s position (or comes last when ``old`` is unknown). Touches no replica."""
        if new in self._standalones or new in self._hybrids:
            raise ValueError(f"replica id {new!r} is already in use")
        if old in self._standalones:
            self._standalones = tuple(new if rid == old else rid for rid in self._standalones)
        else:
            self._standalones = (*self._standalones, new)

    def active_replica_ids(self) -> tuple[str, ...]:
        """Replicas that generate now: standalone, plus hybrids when active; each id once."""
        if self.is_hybrid_active:
            return _unique(self._standalones + self._hybrids)
        return self._standalones

    def context(self, ctx: DynamicScheduleContext) -> DynamicScheduleContext:
        """A copy of ``ctx`` with the clock and the controller's own switch measurements.

        ``last_activate_duration_s`` is the last hybrid_sync plus the activate that followed it
        (weight sync + onload); ``last_deactivate_duration_s`` the last deactivate; both 0.0
        until measured. ``last_switch_at`` is when the last activate or deactivate finished.
        """
        return dataclasses.replace(
            ctx,
            now=self._clock(),
            last_switch_at=self._last_switch_at,
            last_activate_duration_s=self._last_activate_duration_s,
            last_deactivate_duration_s=self._last_deactivate_duration_s,
        )

    # -------------------------------------------------------------- decisions

    def should_deactivate(self, step: int, ctx: DynamicScheduleContext) -> bool:
        args = (step, self.is_hybrid_active, ctx)
        return self._ask(step, "should_deactivate", ctx, args, bool)

    def deactivate_wait_samples(self, step: int, ctx: DynamicScheduleContext) -> int:
        """The policy's buffered-sample threshold before deactivating, never below 0."""
        return self._ask(
            step, "deactivate_wait_samples", ctx, (ctx,), lambda answer: max(0, int(answer))
        )

    def should_activate(self, step: int, ctx: DynamicScheduleContext) -> bool:
        args = (step, self.is_hybrid_active, ctx)
        return self._ask(step, "should_activate_after_step", ctx, args, bool)

    def request_rebalance(self, step: int, ctx: DynamicScheduleContext) -> bool:
        """Whether to rebalance now; False without asking the policy when rebalance is off."""
        if not self._enable_rebalance:
            return False
        return self._ask(step, "request_rebalance", ctx, (step, ctx), bool)

    def update_policy(self, step: int, ctx: DynamicScheduleContext) -> None:
        self._ask(step, "update_after_step", ctx, (step, ctx), lambda _: None)

    def _ask(
        self,
        step: int,
        hook: str,
        ctx: DynamicScheduleContext,
        args: tuple[Any, ...],
        convert: Callable[[Any], Any],
    ) -> Any:
        """Call the policy method named ``hook``, timed; record and return its converted answer.

        The reason comes from the policy's optional ``explain``, called before the hook with
        the same inputs so that it sees the policy state the hook sees. Only the hook itself is
        timed.
        """
        active = self.is_hybrid_active
        explain = getattr(self._policy, "explain", None)
        reason = str(explain(hook, step, active, ctx)) if callable(explain) else ""
        call = getattr(self._policy, hook)
        begin = self._clock()
        raw = call(*args)
        duration_s = self._clock() - begin
        answer = convert(raw)
        self._decisions.append(
            DecisionRecord(
                step=step,
                hook=hook,
                answer=answer,
                reason=reason,
                inputs=_summarise(ctx, active),
                duration_s=duration_s,
            )
        )
        return answer

    # --------------------------------------------------------------- switches

    def deactivate(self) -> SwitchTiming:
        """Take the hybrids back for training: remove -> abort -> sleep."""
        self._require_hybrids("deactivate")
        if not self.is_hybrid_active:
            raise IllegalTransition("cannot deactivate: hybrid replicas are not active")
        timer = _PhaseTimer(self._clock)
        timer.run("remove", self._lb.remove_replicas, self._hybrids)
        aborted = timer.run("abort", self._pool.abort, self._hybrids)
        timer.run("sleep", self._pool.sleep, self._hybrids)
        timing = timer.finish("deactivate", aborted)

        self._state = ControllerState.STANDALONE_ONLY
        self._synced_version = None
        self._sync_duration_s = None
        self._last_deactivate_duration_s = timing.duration_s
        self._count_switch(timing)
        return timing

    def hybrid_sync(self, version: int) -> SwitchTiming:
        """Wake the sleeping hybrids and load the weights at ``version``."""
        self._require_hybrids("sync")
        if self.is_hybrid_active:
            raise IllegalTransition(
                "cannot hybrid_sync while hybrid replicas are active; deactivate first"
            )
        timer = _PhaseTimer(self._clock)
        timer.run("wake_up", self._pool.wake_up, self._hybrids)
        timer.run("load_weights", self._pool.load_weights, self._hybrids, version)
        timing = timer.finish("hybrid_sync")

        self._synced_version = int(version)
        self._sync_duration_s = timing.duration_s
        self._switch_log.append(timing)
        return timing

    def activate(self, version: int | None = None) -> SwitchTiming:
        """Lend the synced hybrids to rollout: add to the balancer -> resume.

        With ``version`` (the current param version), the hybrids must hold exactly it.
        """
        self._require_hybrids("activate")
        if self.is_hybrid_active:
            raise IllegalTransition("cannot activate: hybrid replicas are already active")
        if self._synced_version is None:
            raise IllegalTransition("cannot activate: no hybrid_sync since the last deactivate")
        if version is not None and version != self._synced_version:
            raise IllegalTransition(
                f"cannot activate: hybrid replicas hold version {self._synced_version} but the "
                f"current version is {version}; call hybrid_sync({version}) first"
            )
        timer = _PhaseTimer(self._clock)
        timer.run("add", self._lb.add_replicas, self._hybrids)
        timer.run("resume", self._pool.resume, self._hybrids)
        timing = timer.finish("activate")

        self._state = ControllerState.HYBRID_ACTIVE
        self._last_activate_duration_s = (self._sync_duration_s or 0.0) + timing.duration_s
        self._count_switch(timing)
        return timing

    def rebalance(self) -> SwitchTiming:
        """Spread the work onto the fresh hybrids: clear sticky -> hold -> abort -> drain ->
        resume -> unhold.

        Routing is held from before the abort until the replicas are resumed, so the aborted
        requests' retries wait in the balancer instead of bouncing off the paused replicas (which
        kept the in-flight count from ever reaching zero with hundreds of requests), and then
        spread least-loaded over every active replica.

        Raises ``TimeoutError`` when requests are still in flight after
        ``rebalance_timeout_s``; the replicas are resumed and routing released first, so
        generation never stays paused.
        """
        self._require_hybrids("rebalance")
        if not self.is_hybrid_active:
            raise IllegalTransition("cannot rebalance: hybrid replicas are not active")
        ids = self.active_replica_ids()
        timer = _PhaseTimer(self._clock)
        timer.run("clear_sticky", self._lb.clear_sticky)
        self._lb.hold()
        left = None
        try:
            aborted = timer.run("abort", self._pool.abort, ids)
            left = timer.run("drain", self._wait_for_drain, ids)
        finally:
            if left != 0:  # timed out, or a call failed: never leave generation paused or held
                try:
                    self._pool.resume(ids)
                finally:
                    self._lb.unhold()
        if left:
            raise TimeoutError(
                f"rebalance: {left} requests still in flight on {len(ids)} replicas after "
                f"{self._rebalance_timeout_s:g}s; the replicas were resumed"
            )
        try:
            timer.run("resume", self._pool.resume, ids)
        finally:
            self._lb.unhold()
        timing = timer.finish("rebalance", aborted)
        self._switch_log.append(timing)
        return timing

    def _wait_for_drain(self, ids: Sequence[str]) -> int:
        """Poll until nothing is in flight on ``ids``; returns what is left (0 when drained)."""
        begin = self._clock()
        while True:
            left = int(self._lb.in_flight(ids))
            if left <= 0:
                return 0
            if self._clock() - begin >= self._rebalance_timeout_s:
                return left
            self._sleep(DRAIN_POLL_INTERVAL_S)

    def _require_hybrids(self, verb: str) -> None:
        if not self._hybrids:
            raise IllegalTransition(f"no hybrid replicas to {verb}")

    def _count_switch(self, timing: SwitchTiming) -> None:
        self._switch_log.append(timing)
        self._switch_count += 1
        self._last_switch_at = timing.started_at + timing.duration_s

    # ------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable controller memory; restoring it continues the run exactly."""
        return {
            "state": self._state.name,
            "synced_version": self._synced_version,
            "hybrid_sync_duration_s": self._sync_duration_s,
            "last_activate_duration_s": self._last_activate_duration_s,
            "last_deactivate_duration_s": self._last_deactivate_duration_s,
            "last_switch_at": self._last_switch_at,
            "switch_count": self._switch_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output. Touches no replica: the caller builds them to match."""
        try:
            name = state["state"]
            synced_version = state["synced_version"]
            sync_duration_s = state["hybrid_sync_duration_s"]
            activate_s = float(state["last_activate_duration_s"])
            deactivate_s = float(state["last_deactivate_duration_s"])
            last_switch_at = state["last_switch_at"]
            switch_count = int(state["switch_count"])
        except KeyError as missing:
            raise ValueError(f"controller state_dict is missing {missing}") from None
        if name not in ControllerState.__members__:
            known = ", ".join(ControllerState.__members__)
            raise ValueError(f"unknown controller state {name!r}; known: {known}")
        new_state = ControllerState[name]
        if new_state is ControllerState.HYBRID_ACTIVE and not self._hybrids:
            raise ValueError("cannot restore HYBRID_ACTIVE with no hybrid replicas")

        self._state = new_state
        self._synced_version = None if synced_version is None else int(synced_version)
        self._sync_duration_s = None if sync_duration_s is None else float(sync_duration_s)
        self._last_activate_duration_s = activate_s
        self._last_deactivate_duration_s = deactivate_s
        self._last_switch_at = None if last_switch_at is None else float(last_switch_at)
        self._switch_count = switch_count


def _summarise(ctx: Any, is_hybrid_active: bool) -> dict[str, Any]:
    """The few numbers of a context that explain a decision, with lists reduced to totals."""
    return {
        "total_generated_samples": getattr(ctx, "total_generated_samples", 0),
        "expected_samples": getattr(ctx, "expected_samples", 0),
        "buffer_samples": getattr(ctx, "buffer_samples", 0),
        "sum_step_wait_times": float(sum(getattr(ctx, "step_wait_times", ()) or ())),
        "sum_step_wait_samples": int(sum(getattr(ctx, "step_wait_samples", ()) or ())),
        "now": getattr(ctx, "now", 0.0),
        "is_hybrid_active": is_hybrid_active,
    }
