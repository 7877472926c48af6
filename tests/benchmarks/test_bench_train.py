"""benchmarks/bench_train.py: the ``train_ranks`` section at its smallest (1 and 2 real gloo ranks, one
step each) through ``main --write``: its JSON's keys and values, the checkpoint files of each rank
count, what offload returns on CPU and the bytes it would move; and how a rank count's figures are
combined over ranks and rounds."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_train  # noqa: E402

TINY_PARAMS = 107_648
"""The tiny-cpu model's parameters (2 layers, width 64, the character vocabulary)."""
HEADLINE = [f"{figure}_{tag}" for tag in ("1_rank", "2_ranks") for figure in (
    "step_ms", "cpu_ms_per_step", "ckpt_sync_ms", "ckpt_async_return_ms", "ckpt_async_done_ms", "ckpt_bytes",
    "offload_returned", "offload_would_move_bytes", "host_copy_round_trip_ms")]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One smallest run of both sections, as ``--write`` leaves it: (figures, RESULTS.md text)."""
    tmp = tmp_path_factory.mktemp("bench_train")
    results, figures = tmp / "RESULTS.md", tmp / "train_ranks.json"
    results.write_text("# Benchmark results\n\n<!-- multinode -->\nkept\n<!-- /multinode -->\n")
    code = bench_train.main(["--steps", "1", "--warmup", "0", "--repeats", "1", "--zero-stages", "",
                             "--rounds", "1", "--rank-steps", "1", "--rank-warmup", "1", "--ckpt-repeats", "1",
                             "--copy-repeats", "1", "--write", str(results), "--json-out", str(figures)])
    assert code == 0
    return json.loads(figures.read_text()), results.read_text()


@pytest.mark.slow
def test_the_json_has_every_headline_figure_for_1_and_2_ranks(written):
    data, _ = written
    for key in HEADLINE:
        assert key in data, key
    for key in HEADLINE:
        if not key.startswith("offload_returned"):
            assert positive(data[key]), (key, data[key])
    assert positive(data["step_ratio_2_over_1"])
    assert data["step_ratio_2_over_1"] == pytest.approx(data["step_ms_2_ranks"] / data["step_ms_1_rank"])
    assert data["step_overhead_ms_2_ranks"] == pytest.approx(data["step_ms_2_ranks"] - data["step_ms_1_rank"] / 2)
    assert data["config"] == "tiny-cpu" and "--rank-steps 1" in data["command"]
    assert "load_average" in data and sorted(data["by_ranks"]) == ["1", "2"]


@pytest.mark.slow
def test_each_rank_trains_its_share_and_every_save_is_timed(written):
    data, _ = written
    one, two = data["by_ranks"]["1"], data["by_ranks"]["2"]
    assert one["samples_per_rank"] == [8] and two["samples_per_rank"] == [4, 4]  # tiny-cpu: 8 samples per step
    assert sum(one["params_per_rank"]) == sum(two["params_per_rank"]) == TINY_PARAMS
    assert all(0 < p < TINY_PARAMS for p in two["params_per_rank"])  # FSDP2 sharded them
    assert one["responses"] == two["responses"] == 128  # the metrics are the whole micro-step's on every rank
    for b in (one, two):
        assert b["steps_measured"] == 1 and b["ckpt"]["saves_measured"] == 1
        for key in ("step_ms", "cpu_ms_per_step", "init_s"):
            assert positive(b[key]), key
        assert len(b["per_rank_step_ms"]) == b["world"] and all(map(positive, b["per_rank_step_ms"]))
        assert b["round_step_ms"] == pytest.approx([b["step_ms"]])  # one round of one step
        for key in ("sync_ms", "async_return_ms", "async_done_ms"):
            assert positive(b["ckpt"][key]), key
        assert b["trains_after_reload"] is True


@pytest.mark.slow
def test_one_rank_writes_one_file_and_two_ranks_a_shard_each_and_the_marker(written):
    data, _ = written
    one, two = data["by_ranks"]["1"]["ckpt"], data["by_ranks"]["2"]["ckpt"]
    assert list(one["files"]) == list(one["async_files"]) == ["actor.pt"]
    for files in (two["files"], two["async_files"]):
        assert sorted(n for n in files if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert "tidal-commit.json" in files and ".metadata" in files
        assert all(size > 0 for size in files.values())
    for ckpt in (one, two):
        assert ckpt["bytes_written"] == sum(ckpt["files"].values())
        assert ckpt["async_bytes_written"] == sum(ckpt["async_files"].values())
        assert ckpt["bytes_written"] > 3 * 4 * TINY_PARAMS  # fp32 weights + AdamW's two moments
    assert data["ckpt_bytes_2_ranks"] == two["bytes_written"]


@pytest.mark.slow
def test_offload_returns_nothing_on_cpu_and_the_bytes_it_would_move_are_adamw_state(written):
    data, _ = written
    assert data["offload_returned_1_rank"] == {} and data["offload_returned_2_ranks"] == {}
    assert "CPU" in data["offload_note"]
    for world in ("1", "2"):
        off = data["by_ranks"][world]["offload"]
        assert off["offload_returned"] == off["reload_returned"] == [{}] * int(world)
        moved = off["would_move_bytes"]
        # summed over the ranks' shards: two fp32 moments per parameter, the fp32 parameters, no grads
        assert moved == {"optimizer_and_grads": 2 * 4 * TINY_PARAMS, "optimizer": 2 * 4 * TINY_PARAMS,
                         "grads": 0, "params": 4 * TINY_PARAMS}
        assert sum(r["params"] for r in off["would_move_bytes_per_rank"]) == 4 * TINY_PARAMS
        copy = off["host_copy"]
        assert copy["optimizer_and_grads"]["bytes"] == 2 * 4 * TINY_PARAMS
        for group in ("optimizer_and_grads", "params"):
            assert positive(copy[group]["out_ms"]) and positive(copy[group]["back_ms"])


@pytest.mark.slow
def test_results_md_gets_its_section_with_the_command_and_both_tables(written):
    _, text = written
    assert "<!-- multinode -->\nkept\n<!-- /multinode -->" in text
    section = text[text.index("<!-- bench_train -->"):text.index("<!-- /bench_train -->")]
    assert text.index("<!-- /multinode -->") < text.index("<!-- bench_train -->")
    assert "Command: `.venv/bin/python benchmarks/bench_train.py --steps 1 " in section
    assert "| torch |" in section and "deepspeed" not in section  # --zero-stages ''
    assert "| **train_step ms** (median; min–max) |" in section and "2 ranks / 1 rank step time" in section
    assert "`__0_0.distcp`, `__1_0.distcp`" in section


def _rank(step_s, cpu_s, ckpt_s, bytes_, samples=4):
    copy = {"out_ms": 1.0, "back_ms": 2.0}
    return {"step_s": step_s, "step_cpu_s": cpu_s, "samples": samples, "tokens": 10.0, "responses": 8.0,
            "params": 100, "init_s": 0.5, "trains_after_reload": True,
            "ckpt": {"sync_s": ckpt_s, "async_return_s": ckpt_s, "async_done_s": ckpt_s},
            "offload": {"offload_returned": {}, "reload_returned": {}, "offload_call_s": 1e-5, "reload_call_s": 1e-5,
                        "bytes": bytes_, "host_copy": {"optimizer_and_grads": copy, "params": copy}}}


def test_a_step_counts_its_slowest_rank_and_cpu_adds_up_over_the_ranks():
    files = {"sync": {"a": 3, "b": 4}, "async": {"a": 3, "b": 5}}
    sizes = {"optimizer": 800, "grads": 0, "params": 400}
    rounds = [
        {"world": 2, "files": files, "ranks": [_rank([0.010, 0.050], [0.004, 0.004], [0.1], sizes),
                                               _rank([0.030, 0.020], [0.006, 0.008], [0.3], sizes)]},
        {"world": 2, "files": files, "ranks": [_rank([0.040, 0.001], [0.001, 0.001], [0.2], sizes),
                                               _rank([0.001, 0.060], [0.001, 0.001], [0.2], sizes)]},
    ]
    out = bench_train.combine(rounds)
    # slowest rank per step: 30, 50 (round 1), 40, 60 (round 2) ms -> median 45
    assert out["step_ms"] == pytest.approx(45.0) and out["step_ms_min"] == pytest.approx(30.0)
    assert out["steps_measured"] == 4 and out["rounds"] == 2
    assert out["round_step_ms"] == pytest.approx([40.0, 50.0])
    assert out["cpu_ms_per_step"] == pytest.approx(statistics.median([10, 12, 2, 2]))
    assert out["ckpt"]["sync_ms"] == pytest.approx(250.0)  # max over ranks 300, 200 -> median 250
    assert out["ckpt"]["bytes_written"] == 7 and out["ckpt"]["async_bytes_written"] == 8
    assert out["offload"]["would_move_bytes"] == {"optimizer_and_grads": 1600, "optimizer": 1600, "grads": 0,
                                                  "params": 800}
    assert out["samples_per_rank"] == [4, 4]

