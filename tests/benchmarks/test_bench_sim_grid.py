"""`bench_sim.py grid`: its scenario list covers the issue's ranges, and its figures land under
``sim_grid`` of a results file (a one-cell, one-seed, three-step grid here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_sim  # noqa: E402
import results_io  # noqa: E402

from policies import registered_policies  # noqa: E402


def test_the_grid_has_at_least_30_cells_covering_gpus_splits_staleness_trigger_and_drift():
    cells = bench_sim.grid_scenarios()
    assert len(cells) >= 30
    assert sorted({c.total_gpus for c in cells}) == [16, 32, 64, 128]
    assert sorted({c.trainer_gpus / c.total_gpus for c in cells}) == [0.25, 0.5, 0.75]  # 8+24 … 24+8
    assert sorted({c.staleness for c in cells}) == [0.0, 0.5, 1.0]
    assert sorted({c.trigger for c in cells}) == [1, 2, 3, 4]
    assert sorted({c.drift for c in cells}) == ["down", "flat", "up"]
    assert len({(c.staleness, c.trigger) for c in cells}) == 12  # every pair meets
    assert bench_sim.GRID_SEEDS == (0, 1, 2)


def test_a_cell_is_the_seed_preset_resized_with_hybrids_on_its_trainer_gpus():
    cfg = bench_sim.Scenario(16, 12, 0.5, 2, "down").config("default")
    assert (cfg.trainer_gpus, cfg.standalone_gpus, cfg.hybrid_replicas, cfg.standalone_replicas) == (12, 4, 3, 1)
    assert (cfg.required_samples, cfg.async_training.trigger_parameter_sync_step) == (8, 2)
    assert (cfg.sim.response_len_mean_start, cfg.sim.response_len_mean_end) == (6000.0, 3000.0)
    assert cfg.async_training.dynamic_schedule_policy == "default"


def test_every_registered_policy_is_compared_with_never_lending():
    assert bench_sim.grid_policies() == ["static_fully_async", *(p for p in registered_policies()
                                                                 if p != "static_fully_async")]


def test_the_grid_writes_its_keys_into_the_results_file(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_sim, "GRID_STEPS", 3)
    monkeypatch.setattr(results_io, "RESULTS_DIR", tmp_path / "results")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"sim": {"kept": 1}}))
    body = bench_sim.bench_grid([bench_sim.Scenario(16, 8, 0.5, 1, "flat")], seeds=(0,), workers=1)
    bench_sim.publish("grid", bench_sim.FIGURES["grid"], results)
    data = json.loads(results.read_text())
    assert data["sim"] == {"kept": 1}
    grid = data["sim_grid"]
    assert (grid["cells"], grid["seeds"], grid["steps"]) == (1, 1, 3)
    for policy in bench_sim.grid_policies()[1:]:
        assert grid[f"{policy}_worst_vs_never_lend"] == grid[f"{policy}_median_vs_never_lend"]  # one cell
    assert "8+8 staleness 0.5 trigger 1 lengths flat" in body
    assert json.loads((tmp_path / "results" / "sim_grid.json").read_text())["cells"] == 1


def test_the_fluid_lend_ceiling_shortens_every_cycle_by_the_lent_share_of_its_wait():
    # ρ 1: a 60 s cycle with a 30 s wait → 45 s; a 40 s cycle without a wait stays 40 s
    assert bench_sim.fluid_lend_ceiling_s([(60.0, 30.0), (40.0, 0.0)], 1.0) == 85.0
