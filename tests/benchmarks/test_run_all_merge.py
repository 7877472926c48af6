"""`run_all.merge`: every section of ``results.json`` carries the command and date of its run, a
results file that is gone leaves no section, and `run_all` fails in one line when a target names a
figure that no section holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import results_io  # noqa: E402
import run_all  # noqa: E402

REAL = json.loads((BENCH / "results.json").read_text(encoding="utf-8"))


def _results(tmp_path, monkeypatch, files: dict[str, dict]) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    for name, figures in files.items():
        (folder / f"{name}.json").write_text(json.dumps(figures))
    monkeypatch.setattr(results_io, "RESULTS_DIR", folder)
    monkeypatch.setattr(run_all, "RESULTS_DIR", folder)
    monkeypatch.setattr(run_all, "BENCH", tmp_path)
    return folder


def test_every_section_keeps_its_own_command_and_date_or_the_files_write_time(tmp_path, monkeypatch):
    _results(tmp_path, monkeypatch, {
        "hf_engine": {"ratio_at_32_median": 2.1, "command": "bench_hf_engine.py", "date": "2026-12-01",
                      "load_average": 3.0},
        "overhead": {"fraction_at_60s_step": 0.01, "command": "bench_control_plane.py", "note": "old tree"},
        "smollm2": {"steps": 3, "commands": {"a": "x --a", "b": "x --b"}, "date": "2026-12-01"},
        "sim_speed": {"setups": {"dynamic 16+16 default": {"best_s": 1.5, "median_s": 1.6}},
                      "command": "bench_sim.py speed", "date": "2026-12-05 10:16 UTC"},
        "sim_sweep": {"wall_s": 170.0, "cpu_s": 160.0, "command": "bench_sim.py sweep", "date": "2026-12-05 10:19 UTC"},
    })
    merged = run_all.merge()
    assert merged["hf_engine"] == {"ratio_at_32_median": 2.1, "command": "bench_hf_engine.py", "date": "2026-12-01"}
    assert merged["overhead"]["note"] == "old tree" and merged["overhead"]["date"].endswith(" UTC")
    assert merged["smollm2"]["command"] == "a: x --a; b: x --b"
    assert merged["sim"] == {"seconds_400_steps_32_gpus": 1.5, "seconds_400_steps_32_gpus_median": 1.6,
                             "sweep_100_configs_s": 170.0, "sweep_100_configs_cpu_s": 160.0,
                             "command": "bench_sim.py speed", "date": "2026-12-05 10:16 UTC",
                             "sweep_command": "bench_sim.py sweep", "sweep_date": "2026-12-05 10:19 UTC"}
    for name in ("compare", "emulated", "cpu_rollout_bound", "cpu_training_bound", "faults"):
        assert name not in merged  # no file, no section


def test_a_target_on_a_figure_no_section_holds_fails_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    _results(tmp_path, monkeypatch, {"sim_grid": {"predictive_worst_vs_never_lend": 0.0, "command": "c", "date": "d"}})
    monkeypatch.setattr(run_all, "TARGETS", {"sim_grid.predictive_worst_vs_never_lend": ("<=", 0.01),
                                             "sim_grid.gone": ("<=", 0.01), "nowhere.x": (">=", 1.0)})
    assert run_all.main(["--merge"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: target(s) name figures that benchmarks/results/ does not hold: nowhere.x, sim_grid.gone"]
    monkeypatch.setattr(run_all, "TARGETS", {"sim_grid.predictive_worst_vs_never_lend": ("<=", 0.01)})
    assert run_all.main(["--merge"]) == 0


def test_the_committed_summary_names_only_current_figures():
    for name, section in REAL.items():
        if name in ("targets", "sources"):
            continue
        assert section.get("command") and section.get("date"), name
    assert set(REAL["targets"]) == set(run_all.TARGETS)
    assert not [k for k, v in REAL["targets"].items() if v["value"] is None]


def test_a_writer_that_records_no_command_gets_its_steps_own(tmp_path, monkeypatch):
    _results(tmp_path, monkeypatch, {"faults_hf": {"injected": 2, "survived": 2, "samples_lost": 0,
                                                   "samples_duplicated": 0},
                                     "sim_grid": {"predictive_worst_vs_never_lend": 0.0}})
    merged = run_all.merge()
    assert merged["faults_hf"]["command"] == "python benchmarks/fault_campaign.py --preset tiny-hf"
    assert merged["sim_grid"]["command"] == "python benchmarks/bench_sim.py grid --write benchmarks/RESULTS.md"
    assert all(merged[name]["date"].endswith(" UTC") for name in ("faults_hf", "sim_grid"))
