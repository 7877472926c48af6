"""The policy questions of a step, asked in one order and recorded, and the switch durations.

``Decider`` is the only caller of a policy's hooks, in production (inside the controller actor)
and in the simulator, so both ask the same hooks in the same order and record the same
decisions. It wraps the policy in ``LostStandaloneGuard`` (a run whose standalone replicas all
died behaves as only-hybrid), so that every switch has a decision record saying why.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from loop.plans import DeactivatePlan, LendPlan, SwitchReport
from policies import DynamicScheduleContext, DynamicSchedulePolicyBase
from policies.guard import LostStandaloneGuard


@dataclass(frozen=True)
class DecisionRecord:
    """One policy call (or guard): which hook, at which step, with what inputs, answer and reason.

    ``inputs`` summarises the context (totals rather than lists), small enough to store for every
    step. ``duration_s`` is the policy call alone, by the caller's timer (0 in the simulator).
    """

    step: int
    hook: str
    answer: Any
    reason: str
    inputs: dict[str, Any]
    duration_s: float


def lend_count(answer: Any, of: int) -> int:
    """How many of ``of`` hybrids a ``should_activate_after_step`` answer lends (True = all)."""
    if answer is None or isinstance(answer, bool):
        return of if answer else 0
    return max(0, min(int(answer), of))


@dataclass
class SwitchDurations:
    """Switch seconds of the current cycle, as the policy sees them (reference semantics).

    Deactivations add to ``deactivate_s``; hybrid syncs, activations and rebalances add to
    ``activate_s``. Both are reset after ``update_after_step``, so a cycle that did not switch
    reports 0.
    """

    activate_s: float = 0.0
    deactivate_s: float = 0.0

    def add(self, kind: str, seconds: float) -> None:
        if kind == "deactivate":
            self.deactivate_s += float(seconds)
        elif kind in ("hybrid_sync", "activate", "rebalance"):
            self.activate_s += float(seconds)
        else:
            raise ValueError(f"unknown switch kind {kind!r}")

    def reset(self) -> None:
        self.activate_s = self.deactivate_s = 0.0

    def state_dict(self) -> dict[str, float]:
        return {"activate_s": self.activate_s, "deactivate_s": self.deactivate_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.activate_s = float(state.get("activate_s", 0.0))
        self.deactivate_s = float(state.get("deactivate_s", 0.0))


def step_switch_seconds(switches: Iterable[SwitchReport | None]) -> float:
    """A step's switch seconds (``waste/switch_s``), one rule for production's step fold
    (``tasks.summary``) and the twin's (``sim.simulator``): every switch made between the step's
    start and its commit, each once, in order: the wait's deactivation, each hybrid sync (its own
    phase or inside the broadcast), the lend's activation and rebalance, and every stranded
    refill's hybrid sync, activation and deactivation. A (re)start's switches (before step 1, or
    a resumed run's relend) are no step's, though the store keeps them with the first step's
    switch events. ``None`` stands for a phase that did not switch."""
    return math.fsum(s.duration_s for s in switches if s is not None)


class SwitchBook:
    """The bookkeeping of finished switches, one copy for production and the twin.

    ``book(report)`` logs a switch, adds its seconds to the cycle's ``durations`` (what the policy
    sees), and for an activate or deactivate counts it and moves ``last_switch_at`` to its end.
    ``drain()`` hands over the log (each switch is reported once); the count, the last switch's
    end and the cycle's durations are the memory a resumed run needs (``state_dict``).
    """

    COUNTED = ("activate", "deactivate")

    def __init__(self) -> None:
        self.durations = SwitchDurations()
        self.count = 0
        self.last_switch_at: float | None = None
        self._log: list[SwitchReport] = []

    def book(self, report: SwitchReport) -> SwitchReport:
        self._log.append(report)
        self.durations.add(report.kind, report.duration_s)
        if report.kind in self.COUNTED:
            self.count += 1
            self.last_switch_at = report.started_at + report.duration_s
        return report

    @property
    def log(self) -> list[SwitchReport]:
        """The switches booked since the last ``drain``, oldest first."""
        return list(self._log)

    def drain(self) -> list[SwitchReport]:
        drained, self._log = self._log, []
        return drained

    def state_dict(self) -> dict[str, Any]:
        return {"switch_durations": self.durations.state_dict(), "last_switch_at": self.last_switch_at,
                "switch_count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state_dict()`` output (or a controller state dict that holds it): the count and the
        last switch's end are required; a state without ``switch_durations`` starts a fresh cycle."""
        try:
            last_switch_at, count = state["last_switch_at"], int(state["switch_count"])
        except KeyError as missing:
            raise ValueError(f"controller state_dict is missing {missing}") from None
        self.durations.load_state_dict(state.get("switch_durations", {}))
        self.last_switch_at = None if last_switch_at is None else float(last_switch_at)
        self.count = count


class Decider:
    """Asks a policy a step's questions and records every answer.

    Questions (each takes the context built for it, once, by the caller):

    - ``should_deactivate``: ``should_deactivate`` only while the hybrids are active, then
      ``deactivate_wait_samples`` only when it said yes;
    - ``should_activate``: ``should_activate_after_step`` (a count or a bool; lends only when inactive);
    - ``wants_rebalance``: ``request_rebalance``, only after a lend and when rebalance is enabled;
    - ``update_after_step``: ``update_after_step``, always;
    - ``warm_up``: ``should_activate_after_step(0)``, only for a policy with ``warm_up_lend``.

    ``timer`` times the policy calls (production passes ``time.perf_counter``).
    """

    def __init__(
        self,
        policy: DynamicSchedulePolicyBase,
        *,
        enable_rebalance: bool = True,
        timer: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.policy = policy
        self._guarded = LostStandaloneGuard(policy)
        self._enable_rebalance = enable_rebalance
        self._timer = timer
        self._records: list[DecisionRecord] = []

    @property
    def asks_warm_up(self) -> bool:
        return bool(getattr(self.policy, "warm_up_lend", False))

    @property
    def records(self) -> list[DecisionRecord]:
        return list(self._records)

    def drain(self) -> list[DecisionRecord]:
        """The records since the last drain, oldest first; forgets them."""
        drained, self._records = self._records, []
        return drained

    # ------------------------------------------------------------------ questions

    def should_deactivate(self, step: int, active: bool, ctx: DynamicScheduleContext) -> DeactivatePlan:
        """Two hooks, recorded together or not at all: if the second raises, the first's record is
        taken back, so the retried question records each hook once."""
        if not active:
            return DeactivatePlan(step=step, hybrid_active=False)
        with self._all_or_nothing():
            yes = self._ask(step, "should_deactivate", active, ctx, bool,
                            lambda p: p.should_deactivate(step, active, ctx))
            wait = self._ask(step, "deactivate_wait_samples", active, ctx, lambda a: max(0, int(a)),
                             lambda p: p.deactivate_wait_samples(ctx)) if yes else 0
        return DeactivatePlan(step=step, deactivate=yes, wait_samples=wait, hybrid_active=True)

    def should_activate(self, step: int, active: bool, ctx: DynamicScheduleContext, of: int) -> LendPlan:
        count = self._ask(step, "should_activate_after_step", active, ctx, lambda a: lend_count(a, of),
                          lambda p: p.should_activate_after_step(step, active, ctx))
        return LendPlan(step=step, count=0 if active else count, of=of)

    def warm_up(self, ctx: DynamicScheduleContext, of: int) -> LendPlan:
        if not self.asks_warm_up:
            return LendPlan(step=0, of=of)
        count = self._ask(0, "should_activate_after_step", False, ctx, lambda a: lend_count(a, of),
                          lambda p: p.should_activate_after_step(0, False, ctx))
        return LendPlan(step=0, count=count, of=of)

    def wants_rebalance(self, step: int, ctx: DynamicScheduleContext) -> bool:
        if not self._enable_rebalance:
            return False
        return self._ask(step, "request_rebalance", True, ctx, bool, lambda p: p.request_rebalance(step, ctx))

    def update_after_step(self, step: int, active: bool, ctx: DynamicScheduleContext) -> None:
        self._ask(step, "update_after_step", active, ctx, lambda _: None, lambda p: p.update_after_step(step, ctx))

    def record_guard(self, step: int, guard: str, answer: Any, reason: str, active: bool,
                     ctx: DynamicScheduleContext) -> None:
        """A switch that no policy hook asked for (e.g. the stranded refill): recorded all the same."""
        self._records.append(DecisionRecord(step, guard, answer, reason, summarise(ctx, active), 0.0))

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """The records made inside the block are kept only if the block does not raise."""
        mark = len(self._records)
        try:
            yield
        except BaseException:
            del self._records[mark:]
            raise

    def _ask(self, step: int, hook: str, active: bool, ctx: DynamicScheduleContext,
             convert: Callable[[Any], Any], call: Callable[[LostStandaloneGuard], Any]) -> Any:
        """``call`` the guarded policy's hook (named ``hook`` in the record), timed; record and
        return its converted answer.

        The reason comes from ``explain``, called first with the same inputs so that it sees the
        policy state the hook sees.
        """
        p = self._guarded
        reason = str(p.explain(hook, step, active, ctx))
        begin = self._timer()
        raw = call(p)
        duration_s = self._timer() - begin
        answer = convert(raw)
        self._records.append(DecisionRecord(step, hook, answer, reason, summarise(ctx, active), duration_s))
        return answer


def summarise(ctx: DynamicScheduleContext, is_hybrid_active: bool) -> dict[str, Any]:
    """The few numbers of a context that explain a decision, with lists reduced to totals."""
    return {
        "total_generated_samples": ctx.total_generated_samples,
        "expected_samples": ctx.expected_samples,
        "buffer_samples": ctx.buffer_samples,
        "sum_step_wait_times": float(sum(ctx.step_wait_times)),
        "sum_step_wait_samples": int(sum(ctx.step_wait_samples)),
        "mq_size": ctx.mq_size,
        "standalone_lost": ctx.standalone_lost,
        "now": ctx.now,
        "is_hybrid_active": is_hybrid_active,
    }
