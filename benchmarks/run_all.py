"""`make bench`: run every benchmark, then merge their figures into ``benchmarks/results.json``.

Owns: the order of the benchmarks (one after the other, never in parallel), the merge of
``benchmarks/results/*.json`` and each figure's target (``TARGETS``). Must not: measure anything
itself. The figures and what they mean: ``docs/benchmarks.md``.

Every section of ``results.json`` carries the ``command`` and ``date`` of the run its figures come
from (``source``); a results file that is gone leaves no section, and a target that names a figure
no section holds fails the run (exit 1, one line).

Usage:
    .venv/bin/python benchmarks/run_all.py [--only sim,sweep,overhead,prefect_server,compare,emulated,emulated_tp8,faults,faults_hf,train_ranks,weight_sync]
        [--merge]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from results_io import RESULTS_DIR, read_json  # noqa: E402

PY = sys.executable
STEPS: dict[str, list[str]] = {
    "sim": [PY, "benchmarks/bench_sim.py", "speed", "--write", "benchmarks/RESULTS.md"],
    "sweep": [PY, "benchmarks/bench_sim.py", "sweep", "--write", "benchmarks/RESULTS.md"],
    "overhead": [PY, "benchmarks/bench_control_plane.py", "--write", "benchmarks/RESULTS.md"],
    "prefect_server": [PY, "benchmarks/bench_prefect_server.py", "--write", "benchmarks/RESULTS.md"],
    "compare": [PY, "benchmarks/bench_compare.py"],
    "emulated": [PY, "benchmarks/bench_emulated.py"],
    "emulated_tp8": [PY, "benchmarks/bench_emulated.py", "--setups",
                     "tp8-static-8-24,tp8-static-16-16,tp8-dynamic,tp8-dynamic-rebalance,tp8-dynamic-overlap"],
    "faults": [PY, "benchmarks/fault_campaign.py"],
    "faults_hf": [PY, "benchmarks/fault_campaign.py", "--preset", "tiny-hf"],
    "train_ranks": [PY, "benchmarks/bench_train.py", "--config", "tiny-cpu,tiny-hf",
                    "--write", "benchmarks/RESULTS.md"],
    "weight_sync": [PY, "benchmarks/bench_weight_sync.py", "--write", "benchmarks/RESULTS.md"],
}
TARGETS = {
    # the reference's policy on real compute (bench_compare's headline setup is `default`):
    # rollout-bound at least 15 % faster than static, training-bound at most 2 % slower
    # (static wall / default wall >= 1 / 1.02)
    "compare_predictive.rollout_default_speedup_vs_static": (">=", 1.15),
    "compare_predictive.training_default_speedup_vs_static": (">=", 0.98),
    "compare_predictive.rollout_predictive_over_default": (">=", 1.0),
    # issue 38: the recommended policy at least 1.2x static rollout-bound (RESULTS.md, compare_predictive,
    # bounds its 16-step schedule at 1.124x even at the fluid bound)
    "compare_predictive.rollout_predictive_speedup_vs_static": (">=", 1.2),
    "emulated_tp8.relative_error_vs_sim": ("<=", 0.10),
    "emulated_tp8.dynamic_relative_error_vs_sim": ("<=", 0.10),
    "overhead.fraction_at_60s_step": ("<=", 0.02),
    "overhead.ray_calls_per_step": ("<=", 10),
    "overhead.seconds_per_step_in_process": ("<=", 0.15),
    "sim.seconds_400_steps_32_gpus": ("<=", 2.0),
    "faults.samples_lost": ("<=", 0),
    "faults.samples_duplicated": ("<=", 0),
    "faults_hf.samples_lost": ("<=", 0),
    "faults_hf.samples_duplicated": ("<=", 0),
    "prefect_stalls.over_1s_after": ("<=", 0),
    "hf_engine.ratio_at_32_median": (">=", 2.0),
    "sim_seed.predictive_vs_best_static": ("<=", -0.20),
    "sim_grid.predictive_worst_vs_never_lend": ("<=", 0.01),
    "sim_random.predictive_worst_vs_never_lend": ("<=", 0.01),
}


FAULT_FIGURES = ("injected", "survived", "samples_lost", "samples_duplicated")
FAULT_PLANE = ("trainer_ranks", "transport", "reruns")
"""The compute plane a campaign's kills hit (``fault_campaign.py --ranks / --transport``; absent in a
campaign recorded before they existed) and the test files it ran again (``--rerun``)."""
META = ("command", "date", "commit", "note", "superseded_by")
"""What every section of ``results.json`` says about where its figures came from: the command and
the date of the run (both always), the tree it measured, and why a figure is to be read with care."""
WRITTEN_BY = {"sim_speed": "sim", "sim_sweep": "sweep", "overhead": "overhead", "prefect_server": "prefect_server",
              "compare": "compare", "emulated": "emulated", "emulated_tp8": "emulated_tp8", "faults": "faults",
              "faults_hf": "faults_hf", "train_ranks": "train_ranks", "weight_sync": "weight_sync"}
"""The step of ``STEPS`` that writes each results file."""
COMMANDS = {
    "gpu": "python benchmarks/gpu_check.py --write-results",
    "sim_seed": "python benchmarks/bench_sim.py seed --write benchmarks/RESULTS.md",
    "sim_grid": "python benchmarks/bench_sim.py grid --write benchmarks/RESULTS.md",
    "sim_random": "python benchmarks/bench_sim.py random",
    **{name: "python " + " ".join(STEPS[step][1:]) for name, step in WRITTEN_BY.items()},
}
"""The command of a results file whose writer does not record one (that step's own, for ``make bench``'s)."""
DETAIL = {"load_average", "closest", "by_ranks"}
"""Keys of a results file that stay in it (too detailed for the summary)."""


def source(name: str) -> dict | None:
    """``benchmarks/results/NAME.json`` with its ``command`` and ``date`` always set: the file's own,
    else its writer's known command and the time the file was written (``written_at``), so a writer
    that records neither still dates its figures by its own run."""
    figures = read_json(name)
    if not figures:
        return None
    commands = figures.get("commands")
    command = figures.get("command") or (
        "; ".join(f"{k}: {v}" for k, v in commands.items()) if isinstance(commands, dict) else COMMANDS.get(name))
    date = figures.get("date") or written_at(RESULTS_DIR / f"{name}.json") + " UTC"
    return {**figures, "command": command, "date": date}


def meta(figures: dict) -> dict:
    return {k: figures[k] for k in META if k in figures}


def merge() -> dict:
    """``results.json``: a section per results file that exists (none for a file that does not), each
    with its command and date; then ``targets`` and ``sources``."""
    out: dict = {}
    compare = source("compare")  # bench_compare.py without --no-write
    if compare:
        rb, tb = compare.get("cpu_rollout_bound", {}), compare.get("cpu_training_bound", {})
        out["cpu_rollout_bound"] = {**{k: rb.get(k) for k in ("speedup_vs_static", "fraction_of_fluid_bound",
                                                              "fraction_of_in_system_bound", "headline_setup",
                                                              "best_dynamic")}, **meta(compare)}
        out["cpu_training_bound"] = {**{k: tb.get(k) for k in ("slowdown_vs_static",
                                                               "slowdown_vs_static_speed_adjusted",
                                                               "static_vs_static_spread", "headline_setup")},
                                     **meta(compare)}
        if rb.get("setups"):
            out["cpu_rollout_bound"]["setups"] = {
                k: {kk: v[kk] for kk in ("speedup_vs_static_median", "fraction_of_fluid_bound_median")}
                for k, v in rb["setups"].items()}
        if tb.get("setups"):
            out["cpu_training_bound"]["setups"] = {k: {"speedup_vs_static_median": v["speedup_vs_static_median"]}
                                                   for k, v in tb["setups"].items()}
    picked = {
        "emulated": ("relative_error_vs_sim",),
        "emulated_tp8": ("relative_error_vs_sim", "dynamic_relative_error_vs_sim"),
        "overhead": ("fraction_at_60s_step", "worst_fraction_at_60s_step", "ray_calls_per_step",
                     "seconds_per_step_in_process", "seconds_per_step_ray_runner"),
        "faults": (*FAULT_FIGURES, *FAULT_PLANE),
        "faults_hf": (*FAULT_FIGURES, *FAULT_PLANE),
        "faults_object_store": (*FAULT_FIGURES, *FAULT_PLANE),
        "faults_hf_object_store": (*FAULT_FIGURES, *FAULT_PLANE),
    }
    for name, keys in picked.items():
        figures = source(name)
        if figures:
            out[name] = {**{k: figures.get(k) for k in keys if k in figures or k not in FAULT_PLANE}, **meta(figures)}
    platform = source("faults_platform")  # fault_campaign.py --platform: each platform fault, per kind
    if platform:
        out.setdefault("faults", {})["platform"] = {
            **{kind: {k: v.get(k) for k in FAULT_FIGURES} for kind, v in sorted(platform.get("kinds", {}).items())},
            **{k: platform.get(k) for k in (*FAULT_FIGURES, "preset")},
            "seconds": round(platform["seconds"]) if platform.get("seconds") is not None else None,
            **meta(platform)}
    speed, sweep = source("sim_speed"), source("sim_sweep")  # bench_sim.py speed / sweep --write
    if speed or sweep:
        sim: dict = {}
        if speed:
            dyn = next((v for k, v in speed.get("setups", {}).items() if k.startswith("dynamic")), {})
            sim.update(seconds_400_steps_32_gpus=dyn.get("best_s"), seconds_400_steps_32_gpus_median=dyn.get("median_s"),
                       **meta(speed))
        if sweep:
            sim.update(sweep_100_configs_s=sweep.get("wall_s"), sweep_100_configs_cpu_s=sweep.get("cpu_s"),
                       sweep_command=sweep["command"], sweep_date=sweep["date"])
            sim.setdefault("command", sweep["command"])
            sim.setdefault("date", sweep["date"])
        out["sim"] = sim
    # written by bench_sim.py seed / grid / random --write, gpu_check.py --write-results, and by hand from
    # the runs RESULTS.md quotes (prefect_stalls, multinode, hf_engine, smollm2, compare_predictive: each
    # with its command there); train_ranks by bench_train.py --write (every rank's detail stays in its
    # file), weight_sync by bench_weight_sync.py --write
    for name in ("sim_seed", "sim_grid", "sim_random", "sim_random_64", "sim_draws", "sim_oracle", "sim_admission", "gpu",
                 "prefect_stalls", "multinode", "hf_engine", "smollm2", "compare_predictive", "train_ranks",
                 "weight_sync"):
        figures = source(name)
        if figures:
            out[name] = {k: v for k, v in figures.items() if k not in DETAIL and k != "commands"}
    soak = source("soak")  # soak.py --write: the summary (its per-sample detail, "figures", stays in its file)
    if soak:
        out["soak"] = {k: v for k, v in soak.items() if k not in DETAIL | {"figures", "commands"}}
    tp = source("vllm_tp")  # bench_vllm_tp.py --write (the vLLM venv): each TP size's phase medians
    if tp:
        out["vllm_tp"] = {**{f"tp{r['tp']}": {"median_s": r["median_s"], "build_s": r["build_s"],
                                              "equal_to_tp1": r["equal_to_tp1"],
                                              "weight_bytes_per_rank": r["weight_bytes_per_rank"]}
                             for r in tp.get("runs", [])}, **meta(tp)}
    learning = source("learning")  # learning.py: per preset and policy, the reward against never lending's band
    if learning:
        out["learning"] = {**{preset: {policy: {k: v.get(k) for k in ("final_reward", "inside", "n_outside", "n_below",
                                                                      "n_above", "max_excursion", "lent_steps_per_seed")
                                                if k in v}
                                       for policy, v in entry["policies"].items()}
                              for preset, entry in learning["presets"].items()},
                           "git_commit": learning.get("git_commit"), **meta(learning)}
    for figures in out.get("train_ranks", {}).get("other_configs", {}).values():
        figures.pop("by_ranks", None)
    checks = {}
    for key, (op, bound) in TARGETS.items():
        section, name = key.split(".")
        value = out.get(section, {}).get(name)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        checks[key] = {"value": value, "target": f"{op} {bound}", "met": met}
    out["targets"] = checks
    # each results file and the date of the run it holds (not when the file was last edited: a note
    # added by hand does not re-date its figures)
    out["sources"] = {p.stem: source(p.stem)["date"] for p in sorted(RESULTS_DIR.glob("*.json")) if read_json(p.stem)}
    return out


def missing_targets(summary: dict) -> list[str]:
    """The targets whose figure ``summary`` lacks (a target must name a figure that exists)."""
    return [key for key, check in summary["targets"].items() if check["value"] is None]


def written_at(path: Path) -> str:
    """When a results file was written (UTC): its last commit's time while the working tree holds
    that commit's content (a fresh clone resets every file's mtime), else its mtime."""
    git = ["git", "-C", str(ROOT)]
    unchanged = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", str(path)], capture_output=True).returncode == 0
    committed = subprocess.run([*git, "log", "-1", "--format=%ct", "--", str(path)], capture_output=True,
                               text=True).stdout.strip()
    stamp = float(committed) if unchanged and committed else path.stat().st_mtime
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(stamp))


def write_summary() -> Path:
    """Merge ``benchmarks/results/*.json`` into ``benchmarks/results.json``; returns its path."""
    path = BENCH / "results.json"
    path.write_text(json.dumps(merge(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS))
    ap.add_argument("--merge", action="store_true", help="do not run anything; merge benchmarks/results/*.json")
    args = ap.parse_args(argv)
    failed = []
    if not args.merge:
        names = [n for n in args.only.split(",") if n]
        unknown = [n for n in names if n not in STEPS]
        if unknown:
            print(f"error: unknown benchmark(s) {unknown}; choose from {list(STEPS)}", file=sys.stderr)
            return 2
        for name in names:
            print(f"== {name}: {' '.join(STEPS[name][1:])}", flush=True)
            t0 = time.perf_counter()
            code = subprocess.call(STEPS[name], cwd=ROOT)
            print(f"== {name}: exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
            if code != 0:
                failed.append(name)
    path = write_summary()
    summary = json.loads(path.read_text(encoding="utf-8"))
    print(json.dumps(summary["targets"], indent=2))
    print(f"wrote {path}")
    if failed:
        print(f"error: benchmark(s) failed: {failed}", file=sys.stderr)
        return 1
    if missing := missing_targets(summary):
        print(f"error: target(s) name figures that benchmarks/results/ does not hold: {', '.join(missing)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
