"""The switches no policy hook asks for: the guarded starts and the stranded refill, one copy.

Owns the rules (when each guard fires, what it lends, the reason its guard decision records) and
the stranded refill's switches as a sequence of ``loop.step`` intents, so production's controller
and the twin decide and order them alike; each side executes the intents its own way (production:
calls on the load balancer and the replica pool; the twin: delays and waits in virtual time).

Must not: observe anything (the caller passes the policy context it built for the question),
record a decision (the caller hands the ``Guard`` to ``Decider.record_guard``), or know how a
switch is carried out.

Guards:

1. ``only_hybrid_start``: an only-hybrid run lends every hybrid before step 1 (nothing else
   generates step 1's samples); ``loop.step.run_start`` asks for it (``GuardedStart``).
2. ``relend_after_resume``: a resumed run whose hybrids were lent when it stopped lends as many
   again (``GuardedStart`` too).
3. ``refill_if_stranded``: the trainer waits for a micro-step, the hybrids sleep and no standalone
   replica is alive: lend them at the last broadcast's version until one micro-step is queued,
   then take them back (``refill_sequence``). Asked when a pull of ``STRANDED_POLL_S`` seconds
   timed out.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from loop.plans import DeactivatePlan, LendPlan
from loop.step import Activate, HybridSync, Intent, WaitForSamples
from policies import DynamicScheduleContext

ONLY_HYBRID_START = "only_hybrid_start"
RELEND_AFTER_RESUME = "relend_after_resume"
STRANDED_REFILL = "refill_if_stranded"

STRANDED_POLL_S = 5.0
"""How often a trainer waiting for samples re-checks that something can still generate them: its
pull is made in slices this long, and the stranded refill is asked after each slice that timed out."""


@dataclass(frozen=True)
class Guard:
    """A guard that fired: the decision it records (``hook``, ``answer``, ``reason``) and the lend."""

    hook: str
    answer: Any
    reason: str
    plan: LendPlan


def only_hybrid_start(version: int, hybrids: int) -> Guard:
    """Only-hybrid mode: the hybrids are the only replicas, so a fresh run lends them all."""
    return Guard(ONLY_HYBRID_START, hybrids,
                 f"only-hybrid mode: no standalone replica, so the hybrids generate from the start "
                 f"(param version {version})", LendPlan(step=0, count=hybrids, of=hybrids))


def relend_after_resume(version: int, lent: int, hybrids: int) -> Guard:
    """A resumed run lends again the ``lent`` hybrids that were lent when it stopped."""
    return Guard(RELEND_AFTER_RESUME, lent,
                 f"the hybrids were lent when the run stopped (param version {version})",
                 LendPlan(step=0, count=lent, of=hybrids))


def stranded_refill(step: int, ctx: DynamicScheduleContext, *, hybrids: int, active: bool,
                    version: int) -> Guard | None:
    """The refill for a trainer waiting at ``step``, or None when something can still generate: the
    run has hybrids, they sleep (``active`` is False), no standalone replica is alive and fewer
    than one micro-step's samples are queued. It lends every hybrid at ``version``."""
    if not hybrids or active or not ctx.standalone_lost or ctx.mq_size >= ctx.required_samples:
        return None
    return Guard(STRANDED_REFILL, True,
                 f"no standalone replica alive and {ctx.mq_size} of {ctx.required_samples} samples "
                 f"queued: lend the hybrids at version {version} until a micro-step is queued",
                 LendPlan(step=step, count=hybrids, of=hybrids))


def refill_sequence(guard: Guard, version: int, required_samples: int) -> Generator[Intent, Any, None]:
    """The stranded refill's switches, in order: wake the hybrids and load ``version``; lend them
    (``Activate`` with ``rebalance=False``: no policy question); wait until ``required_samples``
    are queued, then take them back (``WaitForSamples``: the caller takes them back even when the
    wait fails)."""
    plan = guard.plan
    yield HybridSync(plan, version)
    yield Activate(plan, rebalance=False)
    yield WaitForSamples(DeactivatePlan(step=plan.step, deactivate=True, wait_samples=required_samples,
                                        hybrid_active=True), refill=True)
