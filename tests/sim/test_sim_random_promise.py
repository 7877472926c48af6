"""The lending promise on drawn scenarios: `predictive` is never more than 1 % slower than never
lending (``static_fully_async`` on the same GPUs, the grid's baseline).

Draws 60 scenarios (``sim.random_scenarios.draw(60, 0)``, the first 60 of the bench's 200: the test
must stay under a minute on 2 shared cores; ``benchmarks/bench_sim.py random`` checks all 200) and
fails naming every scenario that breaks the promise, with its parameters.

Known to fail (strict xfail): scenarios #34 and #1; #34 (16+8 TP 8, staleness 0.17, trigger 2, response lengths
falling 2027 → 777 over the 16 steps, switches ×2.74) is +9 %: while it lends, `predictive`'s no-lend
trend T0 and wait W are not re-measured (the first refresh comes after 48 lends), so a fast fall
of the lengths inside a short run keeps it lending on stale numbers. Remove the mark when fixed.
"""

from __future__ import annotations

import pytest

from sim import simulate_spec
from sim.random_scenarios import NEVER_LEND, draw

SCENARIOS = 60
PROMISE = 0.01


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="#34 (+9.1 %), #1 (+1.2 %): the cycle model overestimates short lends with dear switches")
def test_predictive_is_never_more_than_one_percent_slower_than_never_lending():
    broken = []
    for sc in draw(SCENARIOS, 0):
        walls = {p: simulate_spec(sc.spec(p), sc.policy(p), seed=sc.seed).wall_clock_s
                 for p in (NEVER_LEND, "predictive")}
        ratio = walls["predictive"] / walls[NEVER_LEND] - 1
        if ratio > PROMISE:
            broken.append(f"{ratio:+.2%} {sc.label} {sc.params()}")

    assert not broken, "predictive breaks the 1 % promise on:\n" + "\n".join(broken)
