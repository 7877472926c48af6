"""The best lend schedule in hindsight, found by local search in the twin (``bench_sim.py oracle``).

A *schedule* is the set of steps after whose weight sync every hybrid is lent (step 0 = the
warm-up lend before step 1; the run's last step never lends). ``ScheduledLend`` is `predictive`
with only ``should_activate_after_step`` replaced by the schedule, so the take-back queue, the
rebalance answer and everything else stay `predictive`'s: the search varies *when* to lend and
nothing else. ``search`` knows the scenario and its seed (hindsight): from several starting
schedules (`predictive`'s and `default`'s own lends in the same run, "lend from step k") it
improves by local moves (set a block of steps to lend or to not lend, blocks from coarse to fine,
first improvement) until no move improves. What it finds is an estimate from below of what a
lending policy could get with all-or-nothing lends, not a bound: the search is local, and a
k-of-m schedule is not searched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from policies.predictive import PredictiveDynamicSchedulePolicy
from sim import SimResult, simulate_spec
from sim.spec import SimSpec


class ScheduledLend(PredictiveDynamicSchedulePolicy):
    """`predictive` whose lend answer is a fixed schedule (the steps that lend; 0 = warm-up)."""

    def __init__(self, schedule: Iterable[int] = (), **kwargs):
        super().__init__(**kwargs)
        self.schedule = sorted(set(int(s) for s in schedule))
        self.warm_up_lend = 0 in self.schedule

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return global_steps in self.schedule


def lent_steps(result: SimResult) -> frozenset[int]:
    """The steps of a run that lent (``SimStep.activated``; a warm-up lend is step 0's)."""
    out = {s.step for s in result.steps if s.activated}
    if any(t.step == 0 and t.kind == "activate" for t in result.transitions):
        out.add(0)
    return frozenset(out)


@dataclass
class Search:
    """One search's outcome: the best schedule found, its wall clock, and what it cost."""

    best: frozenset[int]
    wall_s: float
    start: str
    """The starting schedule it was improved from."""
    starts: dict[str, float] = field(default_factory=dict)
    """Each starting schedule's own wall clock."""
    evaluations: int = 0


def blocks(steps: int, sizes: Sequence[int]) -> list[range]:
    """Aligned blocks of ``sizes`` (coarse first) over the lendable steps 0 … steps − 1."""
    return [range(i, min(i + b, steps)) for b in sizes for i in range(0, steps, b)]


def search(run: Callable[[frozenset[int]], float], starts: dict[str, frozenset[int]],
           moves: Sequence[range], max_evaluations: int = 10_000) -> Search:
    """Local search over schedules. ``run(schedule)`` is a run's wall clock (cached here). From
    each start (the fastest first), a pass tries every block of ``moves`` set to lend and set to
    not lend and keeps the first that improves; passes repeat until one improves nothing (or
    ``max_evaluations`` runs were spent). The best over all starts wins."""
    cache: dict[frozenset[int], float] = {}

    def wall(schedule: frozenset[int]) -> float:
        if schedule not in cache:
            cache[schedule] = run(schedule)
        return cache[schedule]

    found: Search | None = None
    start_walls = {name: wall(s) for name, s in starts.items()}
    for name, start in sorted(starts.items(), key=lambda item: start_walls[item[0]]):
        current, current_s, improved = start, start_walls[name], True
        while improved and len(cache) < max_evaluations:
            improved = False
            for block in moves:
                for candidate in (current | frozenset(block), current - frozenset(block)):
                    if candidate != current and wall(candidate) < current_s - 1e-9:
                        current, current_s, improved = candidate, wall(candidate), True
                        break
                if len(cache) >= max_evaluations:
                    break
        if found is None or current_s < found.wall_s:
            found = Search(current, current_s, name)
    assert found is not None
    found.starts, found.evaluations = start_walls, len(cache)
    return found


def scheduled_run(spec: SimSpec, kwargs: dict, seed: int) -> Callable[[frozenset[int]], float]:
    """``run`` for ``search``: the wall clock of ``spec`` at ``seed`` under a schedule."""
    return lambda schedule: simulate_spec(spec, ScheduledLend(schedule, **kwargs), seed=seed).wall_clock_s


def policy_kwargs(policy: PredictiveDynamicSchedulePolicy) -> dict:
    """The constructor arguments of a built `predictive` (its config's), for ``ScheduledLend``."""
    return dict(deactivate_ratio=policy.deactivate_ratio, only_hybrid=policy.only_hybrid,
                prior_switch_s=policy.prior_switch_s)


def schedule_text(schedule: frozenset[int], steps: int) -> str:
    """A schedule as runs of steps: ``1-5, 9-467`` (``none`` for the empty one)."""
    runs, out = sorted(schedule), []
    i = 0
    while i < len(runs):
        j = i
        while j + 1 < len(runs) and runs[j + 1] == runs[j] + 1:
            j += 1
        out.append(f"{runs[i]}" if i == j else f"{runs[i]}-{runs[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"
