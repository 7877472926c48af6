"""`flows.simulate.simulate_main`: summary table, JSON, plots, comparison, bad input."""

from __future__ import annotations

import json

import pytest

from config import ConfigError
from flows.simulate import simulate_main


def run(tmp_path, config="sim/qwen35-35b-dynamic", **kw):
    args = dict(overrides=[], policy=None, steps=6, seed=0, json_path=None, plot_dir=None, compare=False)
    args.update(kw)
    return simulate_main(config, **args)


def test_simulate_prints_a_summary_and_writes_the_json_fields(tmp_path, capsys):
    out = tmp_path / "out" / "run.json"
    assert run(tmp_path, json_path=str(out)) == 0
    text = capsys.readouterr().out
    assert "dynamic 16+16 default" in text and "wall h" in text
    data = json.loads(out.read_text())
    assert data["steps"] == 6 and data["policy"] == "default"
    assert data["wall_clock_s"] >= data["fluid_bound_s"] > 0
    row = data["per_step"][0]
    assert set(row) >= {"step", "step_time_s", "mq_size", "train_util", "rollout_util", "cluster_util",
                        "hybrid_active", "deactivate_ratio"}
    assert [r["step"] for r in data["per_step"]] == [1, 2, 3, 4, 5, 6]


def test_policy_and_overrides_change_what_is_simulated(tmp_path):
    out = tmp_path / "run.json"
    run(tmp_path, policy="static_fully_async", overrides=["sim.deactivate_s=9"], json_path=str(out))
    data = json.loads(out.read_text())
    assert data["policy"] == "static_fully_async" and data["switches"] == 0


def test_compare_runs_every_static_split_and_the_dynamic_setups(tmp_path, capsys):
    out, plots = tmp_path / "cmp.json", tmp_path / "plots"
    run(tmp_path, steps=3, compare=True, json_path=str(out), plot_dir=str(plots))
    data = json.loads(out.read_text())
    labels = [s["setup"] for s in data["compare"]]
    assert labels == [f"static {t}+{32 - t}" for t in range(8, 32, 8)] + [  # TP 8: splits in 8s
        "dynamic 16+16 default", "dynamic 16+16 fixed_ratio", "dynamic 16+16 predictive"
    ]
    statics = [s for s in data["compare"] if s["setup"].startswith("static")]
    assert all(s["wall_clock_s"] >= s["lower_bound_s"] >= s["fluid_bound_s"] for s in data["compare"])
    assert data["best_static"] == min(statics, key=lambda s: s["wall_clock_s"])["setup"]
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100  # fits 100 columns, nothing truncated
    best_dynamic = min((s for s in data["compare"] if s["setup"].startswith("dynamic")), key=lambda s: s["wall_clock_s"])
    best_static = min(statics, key=lambda s: s["wall_clock_s"])
    pct = 100 * (best_dynamic["wall_clock_s"] - best_static["wall_clock_s"]) / best_static["wall_clock_s"]
    split = best_static["setup"].removeprefix("static ")
    expected = (f"best dynamic {best_dynamic['setup'].removeprefix('dynamic ')} ({best_dynamic['wall_clock_s'] / 3600:.3f} h)"
                f" is {abs(pct):.1f} % {'slower' if pct > 0 else 'faster'} than the best static {split}"
                f" ({best_static['wall_clock_s'] / 3600:.3f} h)")
    assert (lines[-1], data["verdict"]) == (expected, expected)
    rows = [line.split("  ")[0] for line in lines if "fixed_ratio" in line and not line.startswith("best")]
    assert rows == ["dynamic 16+16 fixed_ratio"] * 2  # one row in each table: no label wrapped
    assert sorted(p.name for p in plots.iterdir()) == ["mq_size.png", "step_time.png", "utilization.png"]
    assert all(p.stat().st_size > 1000 for p in plots.iterdir())


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(policy="nope"), "--policy: unknown dynamic scheduling policy 'nope'"),
        (dict(steps=0), "--steps: must be >= 1"),
        (dict(seed=-1), "--seed: must be >= 0"),
        (dict(config="no/such/preset"), "no file or preset named"),
        (dict(overrides=["sim.decode_step_base_s=-1"]), "sim.decode_step_base_s"),
        (dict(overrides=["sim.bogus=1"]), "sim.bogus: unknown key"),
    ],
)
def test_bad_input_is_a_one_line_config_error(tmp_path, kw, message):
    with pytest.raises(ConfigError) as info:
        run(tmp_path, **kw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_plots_smooth_each_line_with_a_rolling_mean():
    from flows.simulate import rolling_mean

    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([2.0, 4.0], 1) == [2.0, 4.0]


def test_a_policy_for_a_config_without_hybrids_is_flagged_as_never_asked(tmp_path, capsys):
    run(tmp_path, config="sim/qwen35-35b-static-16-16", policy="default", steps=2)
    assert "dynamic scheduling is off" in capsys.readouterr().out
