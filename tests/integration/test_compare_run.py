"""`tidal compare` for real: the main job never lending, then with `predictive`, one after the
other on the session's Ray cluster; each run has its own store, and the table and plot are written.
The runs' stored step metrics also carry every metric the twin reports for a step, by the same
names (one vocabulary for production and the twin)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from driver_support import cli_env

from flows.compare import read_rows

STEPS = 2


@pytest.fixture(scope="module")
def compared(tmp_path_factory, ray_address):
    out = tmp_path_factory.mktemp("compare") / "cmp"
    done = subprocess.run([sys.executable, "-m", "flows.cli", "compare", "main", "--steps", str(STEPS),
                           "--out", str(out), "--set", f"ray.address={ray_address}"],
                          capture_output=True, text=True, env=cli_env(), timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out, done.stdout


def test_compare_runs_both_setups_into_stores_of_their_own_and_writes_table_and_plot(compared):
    out, stdout = compared
    for folder in ("never-lend", "predictive"):
        rows = read_rows(f"sqlite:///{out / folder / 'tidal.db'}")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    never = read_rows(f"sqlite:///{out / 'never-lend' / 'tidal.db'}")
    assert not any(r["hybrid_active_after"] for r in never)  # never lending never lends
    table = (out / "compare.md").read_text()
    assert "| never lend | `static_fully_async` | 2 |" in table and "| predictive | `predictive` | 2 |" in table
    assert (out / "compare.png").stat().st_size > 10_000
    assert "== never lend: done in" in stdout and "== predictive: done in" in stdout


def test_a_real_run_stores_every_step_metric_the_twin_reports_by_the_same_name(compared):
    from config import load_config
    from policies import build_policy
    from sim import Simulator, spec_from_config

    out, _ = compared
    stored = set().union(*(r.keys() for r in read_rows(f"sqlite:///{out / 'predictive' / 'tidal.db'}")))
    cfg = load_config("main", [f"trainer.total_training_steps={STEPS}"])
    twin = Simulator(spec_from_config(cfg, steps=STEPS), build_policy("predictive")).run()
    reported = set().union(*(s.metrics.keys() for s in twin.steps))
    assert reported and reported <= stored, sorted(reported - stored)
