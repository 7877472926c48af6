"""benchmarks/gpu_check.py: its --dry-run on CPU (without the packages the GPU machine lacks), its
JSON, the FSDP2 / offload / checkpoint sections, and the JSON → calibration round trip."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

from config import load_config  # noqa: E402
from config.calibration import load_calibration  # noqa: E402


ABSENT_ON_THE_GPU_MACHINE = ("ray", "prefect", "pydantic", "pydantic_core", "sqlalchemy", "alembic", "vllm",
                             "deepspeed", "wandb", "mlflow", "math_verify")
"""Packages the lent GPU machine lacks: the script runs with each of them made unimportable."""

RUN_WITHOUT = (f"import runpy, sys\nfor name in {ABSENT_ON_THE_GPU_MACHINE!r}: sys.modules[name] = None\n"
               f"sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")


def run_script(*args: str, as_on_the_gpu_machine: bool = True, timeout: float = 300,
               tmpdir: Path | None = None) -> subprocess.CompletedProcess:
    """The script in a subprocess; ``--write-calibration`` needs the project's own venv (pydantic)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    head = ["-c", RUN_WITHOUT] if as_on_the_gpu_machine else []
    return subprocess.run([sys.executable, *head, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One --dry-run for the module (tens of seconds on these cores: its tests are marked slow)."""
    out, tmp = tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("gpu_check_tmp")
    proc = run_script("--dry-run", "--out", str(out), tmpdir=tmp)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp.glob("gpu_check_dcp_*")), "the checkpoint section left its folder behind"
    return out, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_the_dry_run_writes_its_json_and_its_table(dry_run):
    out, data = dry_run
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.txt"]
    assert (data["format"], data["dry_run"], data["finished"], data["failures"]) == ("tidal-gpu-check/1", True, True, [])
    assert (data["env"]["device"], data["env"]["dtype"]) == ("cpu", "float32")
    assert list(data["shapes"]) == ["tiny-64", "tiny-128"]  # in the order they ran
    assert [line.split()[0] for line in (out / "gpu_check.txt").read_text().splitlines()[1:4]] == \
        ["shape", "tiny-64", "tiny-128"]


@pytest.mark.slow
def test_every_shape_has_positive_engine_and_trainer_figures(dry_run):
    _, data = dry_run
    for name, shape in data["shapes"].items():
        eng, trainer = shape["engine"], shape["trainer"]
        assert shape["status"] == "ok", name
        assert sorted(eng["tokens_per_s"]) == ["1", "128", "32"]
        assert all(v > 0 for v in eng["tokens_per_s"].values()), name
        assert [eng["throughput"][c]["tokens"] for c in ("1", "32", "128")] == [6, 32 * 6, 128 * 6]
        times = ("first_load_s", "sleep_in_flight_s", "wake_s", "load_woken_s", "load_awake_s", "sleep_idle_s")
        assert all(eng[k] > 0 for k in times), name
        assert eng["wake_and_load_s"] == eng["wake_s"] + eng["load_woken_s"]
        assert sorted(trainer) == ["checkpointing", "plain"]
        for run in trainer.values():
            assert run["micro_step_s"] > 0 and run["peak_bytes"] > 0 and run["tokens"] == 4 * 16


@pytest.mark.slow
def test_sleep_with_requests_in_flight_aborts_them_and_returns_all_the_engine_held(dry_run):
    _, data = dry_run
    for shape in data["shapes"].values():
        eng, mem = shape["engine"], shape["engine"]["memory"]
        assert eng["sleep_in_flight_requests"] == 128
        assert mem["kv_cache_bytes_before"] > 0
        assert mem["engine_bytes_before"] == shape["weight_bytes"] + mem["kv_cache_bytes_before"]
        assert (mem["engine_bytes_after"], mem["freed_bytes"]) == (0, mem["engine_bytes_before"])


@pytest.mark.slow
def test_vllm_and_deepspeed_are_skipped_with_their_reason_in_a_dry_run(dry_run):
    _, data = dry_run
    assert data["vllm"] == data["deepspeed"] == {"status": "skipped", "reason": "not run with --dry-run"}


@pytest.mark.slow
def test_a_budget_too_short_for_any_shape_skips_them_all_and_still_exits_0(tmp_path):
    proc = run_script("--dry-run", "--budget-s", "0.5", "--out", str(tmp_path))
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (proc.returncode, data["finished"]) == (0, True)
    assert [s["status"] for s in data["shapes"].values()] == ["skipped", "skipped"]
    assert "budget left" in data["shapes"]["tiny-64"]["reason"]
    for key in ("fsdp2", "offload", "checkpoint", "weight_sync"):
        assert data[key]["status"] == "skipped" and "budget left" in data[key]["reason"], key


@pytest.mark.slow
def test_the_dry_run_json_becomes_a_calibration_the_twin_loads(dry_run, tmp_path):
    out, data = dry_run
    target = tmp_path / "cpu-dry.yaml"
    proc = run_script("--write-calibration", str(target), "--from", str(out / "gpu_check.json"),
                      "--base", "qwen35-35b-judgement", as_on_the_gpu_machine=False)
    assert proc.returncode == 0, proc.stderr
    cal = load_calibration(target)
    assert (cal.name, cal.device, cal.weight_gb) == ("cpu-dry", "cpu", round(data["shapes"]["tiny-128"]["weight_bytes"] / 1e9, 6))
    assert sorted(cal.costs) == ["activate_s", "broadcast_sync_s", "deactivate_s", "hybrid_sync_s", "rebalance_s"]
    assert "measured by benchmarks/gpu_check.py on cpu" in cal.costs["deactivate_s"].source
    assert cal.costs["activate_s"].source.startswith("from calibration qwen35-35b-judgement: ")
    assert sorted(cal.weight_sync) == ["collective", "in_rank"]  # object_store: not measured there, not in the base
    sim = load_config("sim/qwen35-35b-dynamic", [f"sim.calibration={target}", "sim.calibration_weight_gb=2.0"]).sim
    expected = {k: c.fixed_s + c.per_gb_s * 2.0 for k, c in cal.costs.items()}
    # the two syncs come from the weight-sync model of the sim's transports, over the file's fixed costs
    expected.update(broadcast_sync_s=cal.weight_sync["collective"].seconds(2.0),
                    hybrid_sync_s=cal.weight_sync["in_rank"].seconds(2.0))
    assert {k: getattr(sim, k) for k in expected} == pytest.approx(expected)


def test_write_calibration_from_a_file_that_is_no_gpu_check_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    target = tmp_path / "cal.yaml"
    assert gpu_check.main(["--write-calibration", str(target), "--from", str(tmp_path / "other.json")]) == 2
    assert not target.exists()


def test_an_unknown_shape_is_refused_with_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry-run", "--shapes", "qwen2.5-7b"])
    err = capsys.readouterr().err
    assert (stop.value.code, err.count("\n")) == (2, 1)
    assert err == "gpu_check: --shapes: unknown ['qwen2.5-7b']; known: tiny-64, tiny-128\n"


@pytest.mark.parametrize(("points", "line"), [
    ([(1.0, 2.0), (3.0, 4.0)], (1.0, 1.0)),          # exact line
    ([(2.0, 4.0)], (0.0, 2.0)),                       # one size: proportional
    ([(1.0, 3.0), (2.0, 1.0)], (2.0, 0.0)),           # slower when smaller: the mean, no slope
    ([(1.0, 1.0), (2.0, 3.0)], (0.0, 1.4)),           # intercept would be -1: through 0, 7/5
])
def test_fit_line_keeps_both_terms_non_negative(points, line):
    assert gpu_check.fit_line(points) == pytest.approx(line)


def test_the_real_shapes_are_qwen25s_public_dimensions():
    dims = {k: (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab, s.tie_embeddings)
            for k, s in gpu_check.SHAPES.items()}
    assert dims == {"qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
                    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
                    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False)}


def check_json(**sizes_and_seconds):
    """A gpu_check.json of completed shapes: name → (GB, sleep_in_flight_s, wake_and_load_s)."""
    shapes = {name: {"status": "ok", "weight_bytes": int(gb * 1e9),
                     "engine": {"sleep_in_flight_s": sleep, "wake_and_load_s": sync}}
              for name, (gb, sleep, sync) in sizes_and_seconds.items()}
    return {"format": "tidal-gpu-check/1", "dry_run": False, "started_at": "2026-12-01T12:00:00+00:00",
            "env": {"device": "NVIDIA H200", "dtype": "bfloat16", "torch": "2.11.0", "transformers": "5.17.0"},
            "workload": {"concurrency": [1, 32, 128]}, "shapes": shapes}


def test_the_calibration_fits_each_switch_cost_per_gb_over_the_shapes():
    data = check_json(small=(1.0, 0.3, 0.15), big=(15.0, 1.7, 1.55), failed=(3.0, 9.0, 9.0))
    data["shapes"]["failed"]["status"] = "error"
    doc = gpu_check.calibration_from_check(data, name="h200")
    assert (doc["name"], doc["device"], doc["measured"], doc["weight_gb"]) == ("h200", "NVIDIA H200", "2026-12-01", 15.0)
    assert {k: (c["fixed_s"], c["per_gb_s"]) for k, c in doc["costs"].items()} == \
        {"deactivate_s": (0.2, 0.1), "hybrid_sync_s": (0.05, 0.1)}
    assert doc["costs"]["deactivate_s"]["source"] == (
        "measured by benchmarks/gpu_check.py on NVIDIA H200, 2026-12-01: engine sleep with 128 requests in flight "
        "(abort + free KV cache and weights); torch engine, bfloat16; fitted over small 1 GB: 0.3 s, big 15 GB: 1.7 s")
    assert gpu_check.calibration_from_check(data, name="h200", weight_shape="small")["weight_gb"] == 1.0


def test_a_calibration_needs_a_completed_shape():
    data = check_json(small=(1.0, 0.3, 0.15))
    data["shapes"]["small"]["status"] = "skipped"
    with pytest.raises(ValueError, match="no shape that completed"):
        gpu_check.calibration_from_check(data, name="x")


def test_what_sleep_returned_on_cuda_is_the_device_free_memory_it_gained():
    before = {"allocated_bytes": 40, "reserved_bytes": 50, "device_free_bytes": 100, "device_total_bytes": 200}
    after = {"allocated_bytes": 10, "reserved_bytes": 12, "device_free_bytes": 138, "device_total_bytes": 200}
    assert gpu_check.memory_returned(30, 0, 6, before, after) == {
        "engine_bytes_before": 30, "engine_bytes_after": 0, "kv_cache_bytes_before": 6, "engine_freed_bytes": 30,
        "allocated_before": 40, "allocated_after": 10, "allocated_freed_bytes": 30, "device_freed_bytes": 38,
        "device_total_bytes": 200, "freed_bytes": 38}


@pytest.mark.slow
def test_the_results_figures_are_the_headline_numbers_of_each_completed_shape(dry_run):
    _, data = dry_run
    figures = gpu_check.results_figures(data)
    small = data["shapes"]["tiny-64"]
    assert (figures["device"], figures["dry_run"], list(figures["shapes"])) == ("cpu", True, ["tiny-64", "tiny-128"])
    assert figures["shapes"]["tiny-64"] == {
        "weight_gb": small["weight_bytes"] / 1e9,
        "tokens_per_s_1": small["engine"]["tokens_per_s"]["1"], "tokens_per_s_32": small["engine"]["tokens_per_s"]["32"],
        "tokens_per_s_128": small["engine"]["tokens_per_s"]["128"],
        **{k: small["engine"][k] for k in ("sleep_in_flight_s", "sleep_idle_s", "wake_s", "load_woken_s",
                                           "wake_and_load_s", "load_awake_s")},
        "sleep_freed_gb": small["engine"]["memory"]["freed_bytes"] / 1e9, "engine_peak_gb": small["engine"]["peak_bytes"] / 1e9,
        "micro_step_s": small["trainer"]["plain"]["micro_step_s"],
        "micro_step_checkpointing_s": small["trainer"]["checkpointing"]["micro_step_s"],
        "train_peak_gb": small["trainer"]["plain"]["peak_bytes"] / 1e9,
        "train_peak_checkpointing_gb": small["trainer"]["checkpointing"]["peak_bytes"] / 1e9,
    }
    assert gpu_check.results_section(data).startswith("## GPU check\n\n`python3 benchmarks/gpu_check.py --out \"$OUT\"` on cpu")


# ------------------------------------------------------------------------------------------------
# FSDP2 at world size 1, offload and reload, sharded checkpoints


@pytest.mark.slow
def test_fsdp2_trains_every_shape_in_a_one_rank_gloo_group(dry_run):
    _, data = dry_run
    f = data["fsdp2"]
    assert (f["status"], f["backend"], f["world_size"], f["param_dtype"], f["reduce_dtype"]) == \
        ("ok", "gloo", 1, "float32", "float32")
    assert list(f["shapes"]) == ["tiny-64", "tiny-128"]
    for name, run in f["shapes"].items():
        assert run["status"] == "ok", (name, run)
        assert run["step_s"] > 0 and run["first_step_s"] > 0 and run["group_init_s"] > 0, name
        assert (run["steps_timed"], run["tokens"]) == (2, 4 * 16)
        assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["step_s"])
        assert math.isfinite(run["loss"]) and run["loss"] > 0
        assert run["peak_bytes"] > 0
        # at world size 1 the shard is the whole fp32 parameter; AdamW holds two moments and a step count each
        assert run["param_bytes"] == 4 * run["params"] == data["shapes"][name]["weight_bytes"]
        assert 2 * run["param_bytes"] < run["optimizer_state_bytes"] < 2 * run["param_bytes"] + 1024


@pytest.mark.slow
def test_offload_moves_optimizer_state_grads_and_params_and_restores_them_exactly(dry_run):
    _, data = dry_run
    o = data["offload"]
    assert (o["status"], o["shape"], o["pinned"]) == ("ok", "tiny-64", False)
    assert o["note"].startswith("a no-op on CPU: the state is already in host memory")
    params = data["fsdp2"]["shapes"]["tiny-64"]["param_bytes"]
    assert o["params"]["bytes"] == params
    assert o["optimizer_and_grads"]["bytes"] == params + data["fsdp2"]["shapes"]["tiny-64"]["optimizer_state_bytes"]
    for key in ("optimizer_and_grads", "params"):
        moved = o[key]
        assert moved["restored_exactly"] is True, key
        assert moved["offload_s"] > 0 and moved["reload_s"] > 0, key
        assert moved["offload_s_per_gb"] == pytest.approx(moved["offload_s"] / (moved["bytes"] / 1e9))
        assert moved["reload_s_per_gb"] == pytest.approx(moved["reload_s"] / (moved["bytes"] / 1e9))
        assert "device_freed_bytes" not in moved and "allocated_freed_bytes" not in moved  # CUDA only
    # FSDP2 reduces each group's gradients into one flat buffer: fewer storages than tensors
    assert o["optimizer_and_grads"]["storages"] < o["optimizer_and_grads"]["tensors"]
    assert math.isfinite(o["loss_after_reload"])


@pytest.mark.slow
def test_async_save_returns_before_it_is_written_and_writes_what_save_writes(dry_run):
    _, data = dry_run
    c = data["checkpoint"]
    assert (c["status"], c["shape"], c["files"]) == ("ok", "tiny-64", [".metadata", "__0_0.distcp"])
    assert 0 < c["async_return_s"] <= c["async_complete_s"]
    assert c["save_s"] > 0
    fsdp2 = data["fsdp2"]["shapes"]["tiny-64"]
    assert c["state_bytes"] == fsdp2["param_bytes"] + fsdp2["optimizer_state_bytes"]  # the tied embedding once
    assert c["async_bytes_written"] > c["state_bytes"]
    assert c["save_bytes_written"] == pytest.approx(c["async_bytes_written"], abs=64)  # .metadata may differ by a byte


@pytest.mark.slow
def test_the_table_has_a_row_per_fsdp2_shape_and_the_offload_and_checkpoint_lines(dry_run):
    out, data = dry_run
    lines = (out / "gpu_check.txt").read_text().splitlines()
    at = lines.index("fsdp2 (1 rank, gloo, compute float32, AdamW): ok")
    assert [line.split()[0] for line in lines[at + 1:at + 4]] == ["shape", "tiny-64", "tiny-128"]
    assert lines[at + 4].startswith("offload (tiny-64, host to host on CPU): optimizer+grads ")
    assert lines[at + 4].endswith("; ok")
    assert lines[at + 5].startswith("checkpoint (tiny-64): ") and lines[at + 5].endswith("; ok")
    figures = gpu_check.results_figures(data)
    assert figures["offload"]["params"] == data["offload"]["params"]


@pytest.mark.slow
def test_sections_runs_only_those_named(tmp_path):
    proc = run_script("--dry-run", "--sections", "checkpoint", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["checkpoint"]["status"] == "ok"
    skipped = [data["shapes"]["tiny-64"], data["shapes"]["tiny-128"], data["fsdp2"], data["offload"], data["weight_sync"]]
    assert all(s["status"] == "skipped" and s["reason"] == "not selected with --sections" for s in skipped)


def test_an_unknown_section_is_refused_with_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry-run", "--sections", "fsdp2,fsdp3"])
    assert (stop.value.code, capsys.readouterr().err) == \
        (2, "gpu_check: --sections: unknown ['fsdp3']; known: shapes, fsdp2, offload, checkpoint, weight_sync, vllm, "
            "vllm_tp, deepspeed\n")


def run_in_process(tmp_path, *sections: str) -> tuple[int, dict]:
    code = gpu_check.main(["--dry-run", "--sections", ",".join(sections), "--budget-s", "1e6", "--out", str(tmp_path)])
    return code, json.loads((tmp_path / "gpu_check.json").read_text())


@pytest.mark.slow
def test_a_shape_that_runs_out_of_memory_is_recorded_and_the_next_one_still_runs(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    real = gpu_check.fsdp2_steps

    def first_does_not_fit(shape, work, dev, deadline, run):
        if shape.hidden == 64:
            with gpu_check.one_rank_group(dev):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.00 GiB")
        real(shape, work, dev, deadline, run)

    monkeypatch.setattr(gpu_check, "fsdp2_steps", first_does_not_fit)
    code, data = run_in_process(tmp_path, "fsdp2")
    runs = data["fsdp2"]["shapes"]
    assert (code, data["fsdp2"]["status"], data["failures"]) == (0, "ok", [])
    assert runs["tiny-64"] == {"status": "oom", "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 30.00 GiB"}
    assert runs["tiny-128"]["status"] == "ok" and runs["tiny-128"]["step_s"] > 0
    assert not dist.is_initialized()  # each shape's group was destroyed


@pytest.mark.slow
def test_a_failing_section_is_recorded_and_the_next_section_still_runs(tmp_path, monkeypatch):
    import torch.distributed as dist

    def broken(name, shape, work, dev, out):
        with gpu_check.one_rank_group(dev):
            raise RuntimeError("no pinned memory")

    monkeypatch.setattr(gpu_check, "offload_section", broken)
    code, data = run_in_process(tmp_path, "offload", "checkpoint")
    assert (code, data["offload"]["status"], data["offload"]["error"]) == (1, "error", "RuntimeError: no pinned memory")
    assert [f["section"] for f in data["failures"]] == ["offload"]
    assert data["checkpoint"]["status"] == "ok" and data["checkpoint"]["save_s"] > 0
    assert not dist.is_initialized()


def test_a_round_trip_restores_every_byte_and_moves_a_shared_storage_once():
    import torch

    dev = gpu_check.Device("cpu")
    base = torch.arange(1000, dtype=torch.float32)
    other = torch.randn(10, 10)
    tensors = [base[:500], base[500:], other, other.t()]  # two views of each storage
    expected = [t.clone() for t in tensors]
    moved = gpu_check.round_trip(tensors, dev)
    assert (moved["bytes"], moved["tensors"], moved["storages"], moved["restored_exactly"]) == (4400, 4, 2, True)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    assert moved["offload_s"] > 0 and moved["reload_s"] > 0


def test_an_oom_is_the_allocators_error_or_one_that_says_so():
    import torch

    assert gpu_check.is_oom(torch.OutOfMemoryError("CUDA out of memory."))
    assert gpu_check.is_oom(RuntimeError("NCCL error: unhandled cuda error, NCCL version 2.27: Cuda failure 'out of memory'"))
    assert not gpu_check.is_oom(RuntimeError("Expected all tensors to be on the same device"))


# ------------------------------------------------------------------------------------------------
# weight sync: the handoff to an engine process, the in-process copy, the bucketed copy, the collective


@pytest.mark.slow
def test_the_dry_run_measures_every_weight_sync_path_on_cpu_and_each_loads_the_weights_exactly(dry_run):
    out, data = dry_run
    w = data["weight_sync"]
    assert (w["status"], w["dtype"], w["source_dtype"], w["cpu_threads"]) == ("ok", "bfloat16", "float32", 1)
    sizes = ["0.001", "0.004"]
    h = w["handoff"]
    assert h["mode"] == "cpu_shared_memory" and h["what"].startswith("no CUDA IPC on CPU: emulated with shared memory")
    assert list(h["sizes"]) == sizes
    for run in h["sizes"].values():
        assert run["copied_exactly"] is True and run["device"] == "cpu"
        assert run["open_s"] > 0 and run["seconds"] > 0
        assert run["gb_per_s"] == pytest.approx(run["bytes"] / 1e9 / run["seconds"])
    assert [r["bytes"] for r in h["sizes"].values()] == [1_000_000, 4_000_000]
    local = w["in_process"]
    assert list(local["sizes"]) == sizes and all(r["seconds"] > 0 for r in local["sizes"].values())
    b = w["bucketed"]
    assert b["loaded_exactly"] is True
    assert [(k, r["buckets"]) for k, r in b["buckets"].items()] == [("0.25", 19), ("1", 4)]  # 60 tensors of ≤ 0.2 MiB
    assert len({r["bytes"] for r in b["buckets"].values()}) == 1
    c = w["collective"]
    assert (c["status"], c["backend"], c["world_size"], c["bucket_mb"]) == ("ok", "gloo", 2, 1.0)
    assert list(c["sizes"]) == sizes and [r["buckets"] for r in c["sizes"].values()] == [1, 4]
    for part in (h, local, c):
        assert part["fixed_s"] >= 0 and part["per_gb_s"] >= 0 and part["fixed_s"] + part["per_gb_s"] > 0
    lines = (out / "gpu_check.txt").read_text().splitlines()
    at = lines.index("weight_sync (fp32 → bf16): ok")
    assert [line.split()[0] for line in lines[at + 1:at + 5]] == ["path", "handoff", "in-process", "collective"]
    assert lines[at + 5].startswith("bucketed copy GB/s by bucket MiB: 0.25: ")
    assert gpu_check.results_figures(data)["weight_sync"] == w


@pytest.mark.slow
def test_the_dry_runs_weight_sync_becomes_per_transport_entries_and_the_base_adds_the_object_store(dry_run, tmp_path):
    out, data = dry_run
    target = tmp_path / "cpu-sync.yaml"
    proc = run_script("--write-calibration", str(target), "--from", str(out / "gpu_check.json"),
                      "--base", "cpu-weight-sync", as_on_the_gpu_machine=False)
    assert proc.returncode == 0, proc.stderr
    cal = load_calibration(target)
    assert sorted(cal.weight_sync) == ["collective", "in_rank", "object_store"]
    w = data["weight_sync"]
    assert (cal.weight_sync["in_rank"].fixed_s, cal.weight_sync["in_rank"].per_gb_s) == \
        (round(w["in_process"]["fixed_s"], 6), round(w["in_process"]["per_gb_s"], 6))
    assert (cal.weight_sync["collective"].fixed_s, cal.weight_sync["collective"].per_gb_s) == \
        (round(w["collective"]["fixed_s"], 6), round(w["collective"]["per_gb_s"], 6))
    assert cal.weight_sync["collective"].source.startswith(
        "measured by benchmarks/gpu_check.py on cpu, ")
    assert "gpu_check.json weight_sync.collective): weight_sync.send → receive + copy_into across two processes over gloo" \
        in cal.weight_sync["collective"].source
    assert "`python3 benchmarks/gpu_check.py --dry-run --out " in cal.weight_sync["in_rank"].source
    assert cal.weight_sync["object_store"].source.startswith("from calibration cpu-weight-sync: benchmarks/bench_weight_sync.py")


def gpu_weight_sync_json(**extra):
    """A gpu_check.json of a GPU run's weight_sync section (and ``extra`` top-level keys)."""
    return {"format": "tidal-gpu-check/1", "dry_run": False, "started_at": "2026-12-06T12:00:00+00:00",
            "command": "python3 benchmarks/gpu_check.py --sections weight_sync --out /out",
            "env": {"device": "NVIDIA H200", "dtype": "bfloat16", "torch": "2.11.0", "transformers": "5.17.0"},
            "workload": {"sync_gb": [0.5, 2.0]}, "shapes": {},
            "weight_sync": {
                "status": "ok",
                "handoff": {"mode": "cuda_ipc", "fixed_s": 0.02, "per_gb_s": 0.001,
                            "sizes": {"0.5": {"bytes": 5e8, "seconds": 0.0005, "open_s": 0.02, "gb_per_s": 1000.0},
                                      "2": {"bytes": 2e9, "seconds": 0.002, "open_s": 0.02, "gb_per_s": 1000.0}}},
                "in_process": {"fixed_s": 0.0, "per_gb_s": 0.002,
                               "sizes": {"2": {"bytes": 2e9, "seconds": 0.004, "gb_per_s": 500.0}}},
                "bucketed": {"buckets": {mb: {"bucket_mb": float(mb), "bytes": 2e9, "seconds": s, "gb_per_s": 2 / s}
                                         for mb, s in (("64", 0.01), ("512", 0.005), ("1024", 0.0045))}},
                "collective": {"status": "skipped", "reason": "one GPU lent"}},
            **extra}


def test_a_gpu_runs_in_rank_entry_is_the_ipc_handoff_plus_the_engines_wake_up():
    data = gpu_weight_sync_json(shapes={"a": {"status": "ok", "weight_bytes": 1e9, "engine": {"wake_s": 0.1}},
                                        "b": {"status": "ok", "weight_bytes": 3e9, "engine": {"wake_s": 0.3}},
                                        "c": {"status": "error"}})
    entry = gpu_check.weight_sync_entries(data, "NVIDIA H200, 2026-12-06")["in_rank"]
    assert (entry["fixed_s"], entry["per_gb_s"]) == (pytest.approx(0.02 + 0.2), 0.001)
    assert entry["source"].startswith("measured by benchmarks/gpu_check.py on NVIDIA H200, 2026-12-06 "
                                      "(`python3 benchmarks/gpu_check.py --sections weight_sync --out /out`, "
                                      "gpu_check.json weight_sync.handoff): a CUDA IPC handle")
    assert "plus the torch engine's wake_up, median over the shapes 0.2 s" in entry["source"]
    assert entry["source"].endswith("in the rank's own process the copy runs at 500 GB/s")


def test_without_a_collective_the_gpu_entry_is_the_bucketed_copy_at_the_twins_bucket_and_says_it_is_a_floor():
    doc = gpu_check.calibration_from_check(gpu_weight_sync_json(), name="h200-sync")
    assert (doc["weight_gb"], doc["costs"], sorted(doc["weight_sync"])) == (2.0, {}, ["collective", "in_rank"])
    entry = doc["weight_sync"]["collective"]
    assert (entry["fixed_s"], entry["per_gb_s"]) == (0.0, 0.0025)  # 512 MiB: 0.005 s for 2 GB
    assert "weight_sync.bucketed.512): " in entry["source"]
    assert "WITHOUT the wire, a floor (one GPU lent)" in entry["source"]
    assert doc["weight_sync"]["in_rank"]["fixed_s"] == 0.02  # no shapes ran: no wake-up to add
    from config.calibration import parse_calibration

    assert parse_calibration(doc).sync_seconds("collective", 8.75) == pytest.approx(0.0025 * 8.75)


def test_a_weight_sync_section_that_did_not_complete_gives_no_entries():
    data = gpu_weight_sync_json()
    data["weight_sync"]["status"] = "error"
    with pytest.raises(ValueError, match="no shape that completed and no weight_sync or vllm_tp section"):
        gpu_check.calibration_from_check(data, name="x")


def test_the_synthetic_weights_are_decoder_like_and_near_the_size_asked():
    for nbytes in (1e6, 4e6, 5e7, 2e8, 2e9):
        shapes = gpu_check.synthetic_shapes(nbytes)
        total = sum(2 * math.prod(shape) for _, shape in shapes)
        assert abs(total - nbytes) <= 0.5 * 2 * sum(math.prod(s) for _, s in shapes[:5]), nbytes  # within half a layer
        assert [n.split(".")[-1] for n, _ in shapes[:5]] == ["q", "o", "up", "down", "norm"]


def test_the_bucketed_and_in_process_copies_load_the_weights_in_this_process():
    import dataclasses

    dev = gpu_check.Device("cpu")
    work = dataclasses.replace(gpu_check.DRY_WORK, sync_gb=(0.0005,), bucket_gb=0.0005, bucket_mb=(0.1,), sync_repeats=1)
    b = gpu_check.bucketed_copy(dev, work)
    assert b["loaded_exactly"] is True and b["buckets"]["0.1"]["buckets"] > 1
    local = gpu_check.in_process_copy(dev, work)
    assert list(local["sizes"]) == ["0.0005"] and local["sizes"]["0.0005"]["seconds"] > 0


def test_a_weight_sync_size_out_of_range_is_refused_with_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry-run", "--weight-sync-gb", "0"])
    assert (stop.value.code, capsys.readouterr().err) == (2, "gpu_check: --weight-sync-gb must be in (0, 64], got 0.0\n")


def test_a_tp2_vllm_hybrid_section_sets_the_hybrid_switch_costs_per_gb_of_weights_one_gpu_holds():
    data = gpu_weight_sync_json()
    data["weight_sync"]["status"] = "error"
    data["vllm_tp"] = {"status": "ok", "shape": "qwen2.5-0.5b", "dtype": "bfloat16", "gpu_memory_utilization": 0.45,
                       "tp2": {"weight_bytes_per_rank": 0.5e9,
                               "median_s": {"train": 1.0, "sleep": 0.2, "wake": 0.1, "load": 0.4, "generate": 2.0}}}
    doc = gpu_check.calibration_from_check(data, name="h100-vllm-tp2")
    assert doc["weight_gb"] == 0.5
    assert (doc["costs"]["deactivate_s"]["fixed_s"], doc["costs"]["deactivate_s"]["per_gb_s"]) == (0.0, 0.4)
    assert doc["costs"]["hybrid_sync_s"]["per_gb_s"] == pytest.approx(1.0)
    assert "TP-2 vLLM hybrid" in doc["costs"]["hybrid_sync_s"]["source"]
    data["vllm_tp"]["status"] = "skipped"
    with pytest.raises(ValueError, match="no weight_sync or vllm_tp section"):
        gpu_check.calibration_from_check(data, name="none")
