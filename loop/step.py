"""A Tidal step as a generator of phase intents, in DESIGN §2's order.

The generator decides *what* happens next from the answers it is sent back; the caller decides
*how* (production: a Prefect task around one controller call; the simulator: virtual time).
Send each intent's result back with ``generator.send``:

=====================  =======================================================
intent                 what the caller sends back
=====================  =======================================================
``WarmUp``             a ``LendPlan`` (only for policies that ask a warm-up lend)
``GuardedStart``       the guard's ``LendPlan`` (a resume that relends, an only-hybrid run)
``ShouldDeactivate``   a ``DeactivatePlan`` (only while the hybrids are lent)
``WaitForSamples``     a ``WaitReport``
``Train``              the micro-step's report (anything with ``exhausted``)
``BroadcastSync``      the sync's timings (anything; with a ``lend``, the hybrid sync's too)
``ShouldActivate``     a ``LendPlan``
``HybridSync``         a ``SwitchReport``
``Activate``           the activation's switch reports (anything)
``UpdateAfterStep``    anything (the policy has adapted)
``Commit``             anything (the step is recorded)
``Skipped``            nothing: a phase the step does not run, with why (run nothing)
=====================  =======================================================

The step's skipped phases are what it said it skipped (``Skipped``, by task name, each once):
the step's artifact lists them, since the UI's timeline shows only the tasks that ran.

With ``overlap_sync`` (config ``async_training.dynamic_schedule_overlap_hybrid_sync``) the lend
question comes before the broadcast, and a step that lends syncs its hybrids *during* the
broadcast (``BroadcastSync.lend``: no ``HybridSync`` of its own), so the hybrid sync leaves the
critical path: the trainer's GPUs load the new weights while the standalones do.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from loop.plans import DeactivatePlan, LendPlan


@dataclass(frozen=True)
class _OfStep:
    """The fields of an intent about one step."""

    step: int


@dataclass(frozen=True)
class _OfVersion(_OfStep):
    """The fields of an intent about one step and the param version its weights become."""

    version: int


@dataclass(frozen=True)
class WarmUp:
    """Before step 1: ask the policy for a warm-up lend (only if it wants to be asked)."""

    version: int


@dataclass(frozen=True)
class GuardedStart:
    """Before step 1, a lend no policy asks for (``loop.guards``): with ``relend`` a resumed run
    lends again as many hybrids as were lent when it stopped (the controller's stored count,
    ``relend_after_resume``), else an only-hybrid run lends them all (``only_hybrid_start``). Send
    back the guard's ``LendPlan``, once recorded."""

    version: int
    relend: bool = False


@dataclass(frozen=True)
class ShouldDeactivate(_OfStep):
    """Ask ``should_deactivate`` (only while the hybrids are active) and how many to wait for."""


@dataclass(frozen=True)
class WaitForSamples:
    """Let the hybrids generate until ``plan.wait_samples`` are queued, then take them back.
    ``refill``: the stranded refill's wait (``loop.guards.refill_sequence``), inside a train task:
    not the step's wait for samples, and taken back even when the wait fails."""

    plan: DeactivatePlan
    refill: bool = False


@dataclass(frozen=True)
class Train(_OfStep):
    """Micro-step ``micro`` (0-based) of ``step``: pull one micro-step's samples and update."""

    micro: int


@dataclass(frozen=True)
class BroadcastSync(_OfVersion):
    """Trainer → standalone replicas at ``version``; resets the staleness window. With ``lend``
    (``overlap_sync`` on a step that lends), the lent hybrids wake and load ``version`` meanwhile."""

    lend: LendPlan | None = None


@dataclass(frozen=True)
class ShouldActivate(_OfVersion):
    """Ask ``should_activate_after_step``: lend the trainer's GPUs until the next step?"""


@dataclass(frozen=True)
class HybridSync:
    """Wake the lent hybrids and load ``version`` (only on steps that lend)."""

    plan: LendPlan
    version: int


@dataclass(frozen=True)
class Activate:
    """Activate the synced hybrids; then ask ``request_rebalance`` and rebalance if it says so
    (only with ``rebalance``: a guard's lend, ``loop.guards.refill_sequence``, asks nothing)."""

    plan: LendPlan
    rebalance: bool = True


@dataclass(frozen=True)
class UpdateAfterStep(_OfStep):
    """``update_after_step``: always asked, hybrids or not."""


@dataclass(frozen=True)
class Commit(_OfVersion):
    """Record the step (checkpoint, then one transaction)."""


@dataclass(frozen=True)
class Skipped:
    """A phase (by task name) this step does not run, and why: nothing to carry out."""

    phase: str
    why: str


Intent = (WarmUp | GuardedStart | ShouldDeactivate | WaitForSamples | Train | BroadcastSync | ShouldActivate | HybridSync | Activate
          | UpdateAfterStep | Commit | Skipped)


def run_start(version: int, *, has_hybrids: bool, asks_warm_up: bool, relend: bool = False,
              only_hybrid: bool = False) -> Generator[Intent, Any, None]:
    """What happens before step 1 of a process: a guarded lend (``relend``: the hybrids were lent
    when a resumed run stopped; or ``only_hybrid``: nothing else generates step 1's samples); else
    nothing, unless the policy asks for a warm-up lend.

    The reference never asks a question at step 0; a policy that wants the hybrids lent from the
    start says so with ``warm_up_lend = True`` and its answer is then a recorded decision.
    """
    if not has_hybrids:
        return
    if relend or only_hybrid:
        plan: LendPlan = yield GuardedStart(version, relend)
    elif asks_warm_up:
        plan = yield WarmUp(version)
    else:
        return
    if plan.lends:
        yield HybridSync(plan, version)
        yield Activate(plan)


def step_sequence(
    step: int, *, micro_steps: int, final: bool, has_hybrids: bool, overlap_sync: bool = False, lent: bool = True
) -> Generator[Intent, Any, None]:
    """One step. ``final``: the run's last step, after which nothing trains, so nothing is lent.
    ``overlap_sync``: ask the lend question before the broadcast and sync the lent hybrids during it.
    ``lent``: the hybrids were lent when the step began (the controller's state at the end of the
    last step); ``should_deactivate`` is asked only then, so ``ShouldDeactivate`` comes only then.
    Every phase it does not run it names, with why (``Skipped``)."""
    lent = lent and has_hybrids
    if lent:
        plan: DeactivatePlan = yield ShouldDeactivate(step)
        if plan.deactivate:
            yield WaitForSamples(plan)
        else:
            yield Skipped("wait_for_samples", KEPT_LENT)
    else:
        why = NOT_LENT if has_hybrids else NO_HYBRIDS
        yield Skipped("should_deactivate", why)
        yield Skipped("wait_for_samples", why)
    for micro in range(micro_steps):
        report = yield Train(step, micro)
        if getattr(report, "exhausted", False):
            break
    version = step  # the weights after step N are param version N
    asks = has_hybrids and not final
    if overlap_sync and asks:
        lend: LendPlan = yield ShouldActivate(step, version)
        yield BroadcastSync(step, version, lend if lend.lends else None)
    else:
        yield BroadcastSync(step, version)
        lend = (yield ShouldActivate(step, version)) if asks else LendPlan(step)
        if lend.lends:
            yield HybridSync(lend, version)
    if not asks:
        for phase in ("should_activate", "hybrid_sync", "activate"):
            yield Skipped(phase, LAST_STEP if has_hybrids else NO_HYBRIDS)
    elif not lend.lends:
        yield Skipped("hybrid_sync", NOT_LENDING)
        yield Skipped("activate", NOT_LENDING)
    elif overlap_sync:
        yield Skipped("hybrid_sync", OVERLAPPED)
    if lend.lends:
        yield Activate(lend)
    yield UpdateAfterStep(step)
    yield Commit(step, version)


NO_HYBRIDS = "the run has no hybrid replicas: nothing is lent or taken back"
NOT_LENT = "the hybrids were not lent as the step began: nothing to take back"
KEPT_LENT = "should_deactivate kept the hybrids lent through this step"
LAST_STEP = "the run's last step: nothing trains after it, so nothing is lent"
NOT_LENDING = "should_activate did not lend"
OVERLAPPED = "the lent hybrids loaded the weights during broadcast_sync (overlap_hybrid_sync)"
