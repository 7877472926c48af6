"""bench_compare's fluid bound: the lowest per-token costs of the calibrations before and after."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_compare import apply_calibration, fold_calibrations, main  # noqa: E402


def test_the_bound_takes_each_cost_at_its_lowest_over_the_calibrations():
    before = {"gen_s_per_token": 90e-6, "train_s_per_token": 26e-6, "at": 1.0}  # a slow spell for generation
    after = {"gen_s_per_token": 65e-6, "train_s_per_token": 27e-6, "at": 2.0}
    cal = fold_calibrations([before, after])
    assert cal["gen_s_per_token"] == 65e-6 and cal["train_s_per_token"] == 26e-6
    assert cal["samples"] == [before, after]


def test_a_run_is_re_summarized_with_the_folded_costs():
    run = {"gen_tokens": 1_000_000, "train_tokens": 2_000_000, "wall_s": 100.0}
    apply_calibration(run, fold_calibrations([{"gen_s_per_token": 90e-6, "train_s_per_token": 26e-6}]))
    assert run["fluid_bound_s"] == pytest.approx((90.0 + 52.0) / 2)
    apply_calibration(run, fold_calibrations([{"gen_s_per_token": 90e-6, "train_s_per_token": 26e-6},
                                              {"gen_s_per_token": 60e-6, "train_s_per_token": 30e-6}]))
    assert run["fluid_bound_s"] == pytest.approx((60.0 + 52.0) / 2)
    assert run["fraction_of_fluid_bound"] == pytest.approx(0.56)


def test_recalibrate_without_reuse_is_refused_before_anything_starts(capsys):
    assert main(["--recalibrate"]) == 2
    assert "--recalibrate goes with --reuse" in capsys.readouterr().err
