"""learning.py's pure parts: the never-lending band, where a lending curve leaves it, the plot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from learning import against_band, band, final_reward, main, plot, summarize_policy, val_curve  # noqa: E402

NEVER_SEEDS = [{1: 0.0, 2: 0.2, 3: 0.4}, {1: 0.1, 2: 0.3, 3: 0.5}, {1: 0.2, 2: 0.1, 3: 0.6}]


def test_the_band_is_min_mean_max_over_seeds_on_the_steps_every_seed_has():
    ref = band([*NEVER_SEEDS, {1: 0.1, 2: 0.2}])  # a seed without step 3
    assert list(ref) == [1, 2]
    assert ref[1] == pytest.approx((0.0, 0.1, 0.2))
    assert ref[2] == pytest.approx((0.1, 0.2, 0.3))


def test_a_curve_inside_the_band_at_every_step_is_inside():
    got = against_band({1: 0.0, 2: 0.3, 3: 0.5}, band(NEVER_SEEDS))
    assert got == {"steps_compared": 3, "steps_outside": [], "n_outside": 0, "n_below": 0, "n_above": 0,
                   "max_excursion": 0.0, "inside": True}


def test_steps_outside_are_counted_and_the_largest_excursion_keeps_its_sign():
    got = against_band({1: 0.25, 2: 0.0, 3: 0.3}, band(NEVER_SEEDS))  # above by .05, below by .1 and .1
    assert got["steps_outside"] == [1, 2, 3] and not got["inside"]
    assert (got["n_below"], got["n_above"]) == (2, 1)
    assert got["max_excursion"] == pytest.approx(-0.1)


def test_a_policy_summary_takes_the_last_steps_of_each_seed_and_compares_its_seed_mean():
    lending = {0: {1: 0.9, 2: 0.2, 3: 0.4}, 1: {1: 0.9, 2: 0.2, 3: 0.6}}
    s = summarize_policy(lending, band(NEVER_SEEDS), last=2)
    assert s["final_reward_per_seed"] == pytest.approx({0: 0.3, 1: 0.4})
    assert s["final_reward"] == pytest.approx(0.35)
    assert s["steps_outside"] == [1]  # the seed mean 0.9 is above the band's 0.2 at step 1 only
    assert final_reward({1: 1.0, 2: 3.0}, last=10) == pytest.approx(2.0)


def test_validation_before_training_is_step_zero():
    rows = [{"step": 1, "val-core/x/reward/mean@1/before_train": 0.0}, {"step": 2},
            {"step": 3, "val-core/x/reward/mean@1": 0.25}]
    assert val_curve(rows, "val-core/x/reward/mean@1") == {0: 0.0, 3: 0.25}


def test_the_plot_is_written(tmp_path):
    curves = {"never lend": dict(enumerate(NEVER_SEEDS)), "predictive": {0: {1: 0.1, 2: 0.2, 3: 0.5}}}
    path = plot("synthetic", curves, tmp_path / "p" / "learning_synthetic.png", val={"never lend": {0: {0: 0.0}}})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--seeds", "0"], ["--seeds", "x"], ["--presets", "no-such"]])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
