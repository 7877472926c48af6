"""`tidal compare`: the table and the plot from two setups' step rows, and bad input."""

from __future__ import annotations

import math

import pytest

from flows.cli import main
from flows.compare import LAST_REWARDS, NEVER_LEND, RECOMMENDED, SETUPS, SetupRun, lent_spans, plot, table


def _rows(n: int, *, wait: float, lent_after: set[int] = frozenset(), switch: float = 0.0) -> list[dict]:
    return [{"step": s, "timing_s/step": 1.0 + wait, "timing_s/wait_for_enough_samples": wait,
             "waste/switch_s": switch if s in lent_after else 0.0, "train/reward_mean": s / n,
             "hybrid_active_after": s in lent_after} for s in range(1, n + 1)]


NEVER = SetupRun("never lend", NEVER_LEND, 40.0, _rows(12, wait=1.0))
LENDING = SetupRun(RECOMMENDED, RECOMMENDED, 35.0, _rows(12, wait=0.5, lent_after={3, 4, 5, 6}, switch=0.1))


def test_the_setups_differ_only_in_the_policy():
    assert [label for label, _ in SETUPS] == ["never lend", RECOMMENDED]
    assert all(o.startswith("async_training.dynamic_schedule_") for _, extra in SETUPS for o in extra)


def test_the_table_sums_each_run_and_says_how_much_faster_the_recommended_policy_was():
    text = table([NEVER, LENDING])
    never, lending = (line for line in text.splitlines() if line.startswith("| never") or line.startswith("| pre"))
    assert never == "| never lend | `static_fully_async` | 12 | 24.0 | 40.0 | 0 | 12.0 | 0.0 | 0.625 |"
    # lent after steps 3-6: steps 4-7 generated lent; the switches are the lending steps' own
    assert lending == "| predictive | `predictive` | 12 | 18.0 | 35.0 | 4 | 6.0 | 0.4 | 0.625 |"
    assert "the steps took 18.0 s against 24.0 s, 1.333× as fast" in text
    assert NEVER.final_reward == pytest.approx(sum(s / 12 for s in range(3, 13)) / LAST_REWARDS)


def test_the_shading_covers_each_stretch_of_lent_steps_once():
    assert lent_spans(LENDING) == [(3.5, 7.5)]  # lent after steps 3-6: steps 4-7 lent
    apart = SetupRun(RECOMMENDED, RECOMMENDED, 1.0, _rows(12, wait=0.5, lent_after={1, 2, 8}))
    assert lent_spans(apart) == [(1.5, 3.5), (8.5, 9.5)]
    assert lent_spans(NEVER) == []


def test_the_plot_is_written_with_the_lent_steps_of_the_recommended_policy(tmp_path):
    path = plot([NEVER, LENDING], tmp_path / "compare.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert math.isnan(SetupRun("x", "y", 0.0, []).final_reward)


@pytest.mark.parametrize("args,says", [
    (["compare", "no-such-preset"], "no file or preset named 'no-such-preset'"),
    (["compare", "main", "--set", "async_training.nope=1"], "nope"),
    (["compare", "main", "--steps", "0"], "--steps"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys, args, says):
    out = tmp_path / "cmp"
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tidal: error: ") and err.count("\n") == 1 and says in err
    assert not out.exists()
