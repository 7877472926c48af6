"""bench_compare's CPU shares over part of a run (the steps, without the start-up)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_compare import window_shares  # noqa: E402


def series():
    # every 1 s: the trainer burns a full core, the driver a quarter, the other 0.75 core is idle
    return [(100.0 + t, {"trainer + hybrid": 1.0 * t, "driver": 0.25 * t, "idle": 50.0 + 0.75 * t})
            for t in range(6)]


def test_the_window_takes_the_samples_inside_it_and_divides_by_both_cores():
    shares = window_shares(series(), 100.5, 104.5)  # samples at 101 … 104: 3 s × 2 cores
    assert shares["trainer + hybrid"] == pytest.approx(0.5)
    assert shares["driver"] == pytest.approx(0.125)
    assert shares["idle"] == pytest.approx(0.375)
    assert shares["Prefect server"] == 0.0 and sum(shares.values()) == pytest.approx(1.0)


def test_a_window_with_fewer_than_two_samples_has_no_shares():
    assert window_shares(series(), 101.2, 101.9) is None
    assert window_shares([], 0.0, 1e12) is None
