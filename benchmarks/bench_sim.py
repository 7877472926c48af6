"""Benchmarks of the discrete-event twin (``sim/``); each prints a Markdown section.

    python benchmarks/bench_sim.py speed        # 400 steps on 32 GPUs, seconds per run
    python benchmarks/bench_sim.py sweep        # 100 dynamic configurations × 400 steps
    python benchmarks/bench_sim.py seed         # the seed experiment: statics vs published, policies
    python benchmarks/bench_sim.py sensitivity  # the dynamic prediction under other cost-model shapes

``--write benchmarks/RESULTS.md`` replaces that section of the file (between its
``<!-- bench_sim:NAME -->`` markers) and leaves the other sections alone; ``seed`` also writes
PNGs to ``--plots`` (default ``benchmarks/plots``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from config import TidalConfig, load_config
from flows.simulate import Setup, write_plots
from policies import build_policy
from sim import SimResult, simulate, simulate_spec, spec_from_config, with_policy
from sim.calibrate import fit_speeds
from sim.plan import with_split

PUBLISHED_H = {"static 8+24": 6.379, "static 16+16": 6.546, "dynamic 16+16 default": 5.4}
PRESET = "sim/qwen35-35b-{}"
SEEDS = range(5)


def _load(name: str, *overrides: str) -> TidalConfig:
    return load_config(PRESET.format(name), list(overrides))


def _h(seconds: float) -> str:
    return f"{seconds / 3600:.3f}"


def _pct(ratio: float) -> str:
    """``ratio − 1`` as a signed percentage with a true minus sign: ``−3.3 %``."""
    return f"{(ratio - 1) * 100:+.1f} %".replace("-", "−")


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPUs, load average {load:.1f} when it started"


# --------------------------------------------------------------------------------------------


FIGURES: dict[str, dict] = {}
"""Machine-readable figures of the sections run in this process (``--write`` saves them as
``benchmarks/results/sim_SECTION.json``)."""


def bench_speed() -> str:
    """Wall-clock seconds of one 400-step simulation on 32 GPUs (best and median of 5)."""
    rows = []
    figures = FIGURES.setdefault("speed", {"setups": {}})
    for label, cfg in [("static 16+16", _load("static-16-16")), ("dynamic 16+16 default", _load("dynamic"))]:
        times, cpu, result = [], [], None
        for _ in range(5):
            t0, c0 = time.perf_counter(), time.process_time()
            result = simulate(cfg, seed=0)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        assert result is not None
        figures["setups"][label] = {"steps": len(result.steps), "best_s": min(times),
                                    "median_s": statistics.median(times), "best_cpu_s": min(cpu)}
        rows.append(
            f"| {label} | {len(result.steps)} | {result.events_handled:,} | {min(times):.2f} | "
            f"{statistics.median(times):.2f} | {min(cpu):.2f} | {result.events_handled / min(times):,.0f} |"
        )
    return "\n".join(
        [
            "Target: 400 steps on 32 GPUs in ≤ 2 s. Five runs each, " + _machine() + ".",
            "",
            "| setup | steps | events | best s | median s | best CPU s | events/s |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )


def bench_sweep() -> str:
    """100 dynamic configurations of the seed experiment, 400 steps each, timed end to end."""
    base = _load("dynamic")
    grid = list(
        itertools.product((8, 12, 16, 20, 24), ("default", "fixed_ratio"), (0.2, 0.4, 0.6, 0.8, 1.0), (True, False))
    )
    results: list[tuple[str, SimResult]] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for train, policy, ratio, rebalance in grid:
        cfg = with_policy(with_split(base, train, 32 - train), policy, dynamic=True)
        cfg = cfg.model_copy(deep=True)
        cfg.async_training.dynamic_schedule_deactivate_ratio = ratio
        cfg.async_training.dynamic_schedule_enable_rebalance = rebalance
        label = f"{train}+{32 - train} {policy} ratio {ratio} rebalance {'on' if rebalance else 'off'}"
        results.append((label, simulate(cfg, seed=0)))
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    FIGURES["sweep"] = {"configs": len(grid), "wall_s": took, "cpu_s": cpu}
    results.sort(key=lambda item: item[1].wall_clock_s)
    best = [f"| {label} | {_h(r.wall_clock_s)} | {r.wall_clock_s / r.fluid_bound_s:.2f} | {r.switches} |"
            for label, r in results[:5]]
    worst_label, worst = results[-1]
    return "\n".join(
        [
            f"{len(grid)} configurations (trainer GPUs 8–24 of 32 × policy default/fixed_ratio × initial "
            "ratio 0.2–1.0 × rebalance on/off), 400 steps each, seed 0, one process, " + _machine() + ".",
            "",
            f"**{took:.1f} s in all ({cpu:.1f} s of CPU), {took / len(grid):.2f} s per configuration.**",
            "",
            "Fastest five:",
            "",
            "| configuration | wall clock h | × bound | switches |",
            "|---|---:|---:|---:|",
            *best,
            "",
            f"Slowest: {worst_label}, {_h(worst.wall_clock_s)} h.",
        ]
    )


def _seed_setups() -> list[tuple[str, TidalConfig]]:
    dynamic = _load("dynamic")
    return [
        ("static 8+24", _load("static-8-24")),
        ("static 16+16", _load("static-16-16")),
        ("dynamic 16+16 default", dynamic),
        ("dynamic 16+16 fixed_ratio", with_policy(dynamic, "fixed_ratio")),
        ("dynamic 16+16 static_fully_async", with_policy(dynamic, "static_fully_async")),
    ]


def bench_seed(plot_dir: str | None) -> str:
    """The seed experiment: both statics against the published times; the three policies on the
    dynamic setup with their ratio to the fluid bound; mean and range over seeds 0–4."""
    rows, setups, base = [], [], {}
    for label, cfg in _seed_setups():
        runs = [simulate(cfg, seed=s) for s in SEEDS]
        walls = [r.wall_clock_s for r in runs]
        ratios = [r.wall_clock_s / r.fluid_bound_s for r in runs]
        mean = base[label] = statistics.fmean(walls)
        published = PUBLISHED_H.get(label)
        vs = f"{published:.3f} ({_pct(mean / 3600 / published)})" if published else "—"
        r0 = runs[0]
        rows.append(
            f"| {label} | {_h(mean)} | {_h(min(walls))}–{_h(max(walls))} | {vs} | {_h(r0.fluid_bound_s)} | "
            f"{statistics.fmean(ratios):.2f} | {r0.mean('train_util'):.2f} / {r0.mean('rollout_util'):.2f} / "
            f"{r0.mean('cluster_util'):.2f} | {r0.mean('mq_size'):.1f} | {r0.switches} |"
        )
        setups.append(Setup(label, cfg, r0))
    if plot_dir:
        write_plots(setups, plot_dir)
    dyn = base["dynamic 16+16 default"]
    return "\n".join(
        [
            "Presets `config/presets/sim/qwen35-35b-*.yaml` (Qwen3.5-35B-A3B on DAPO-Math-17K, 32 GPUs, "
            "400 steps). Wall clock = mean over seeds 0–4 (range beside it); the other columns are seed 0. "
            "The statics are fitted (docs/simulator.md, *Calibration*); every dynamic row is a prediction.",
            "",
            "| setup | simulated h | seeds 0–4 | published h (simulated vs it) | fluid bound h | × bound | "
            "train / rollout / cluster U | mean mq_size | switches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Predicted change of wall clock with `default` on 16+16: {_pct(dyn / base['static 8+24'])} vs 8+24 "
            f"and {_pct(dyn / base['static 16+16'])} vs 16+16 (published: −15.3 % and −17.5 %).",
            "",
            "`static_fully_async` on the dynamic setup never lends the hybrids (they start asleep), so it "
            "is the static 16+16 run event for event and its lines hide that one's in the plots.",
            "",
            "Plots (seed 0, one line per setup, rolling means): `benchmarks/plots/mq_size.png`, "
            "`benchmarks/plots/utilization.png`, `benchmarks/plots/step_time.png`.",
        ]
    )


SHAPES: dict[str, dict[str, float]] = {
    "preset (compute-bound decode, lengths 3000→6000, σ 0.6/0.5)": {},
    "memory-bound decode (base 2.9 ms, 0.036 ms/seq)": dict(decode_step_base_s=0.0029, decode_step_per_seq_s=0.0000362),
    "shorter responses (1500→3000 tokens)": dict(response_len_mean_start=1500.0, response_len_mean_end=3000.0),
    "narrower lengths (σ 0.4/0.3)": dict(response_len_sigma=0.4, prompt_len_sigma=0.3),
    "prefill 3× faster (300 k tokens/s: re-prefill after an abort is cheaper)": dict(prefill_tokens_per_s=300_000.0),
}
CHEAP_SWITCHES = dict(deactivate_s=1.0, hybrid_sync_s=1.0, activate_s=0.2, rebalance_s=0.2)
WHAT_IF: dict[str, dict[str, float]] = {
    "preset, switches 3× cheaper (deactivate 1 s, hybrid sync 1 s, activate and rebalance 0.2 s)": CHEAP_SWITCHES,
    "preset, hybrids as fast as standalones": dict(hybrid_throughput_factor=1.0),
    "preset, both": dict(CHEAP_SWITCHES, hybrid_throughput_factor=1.0),
}


def bench_sensitivity() -> str:
    """Refit the two speeds under other shapes of the cost model and predict the dynamic run."""
    static_a, static_b, dynamic = (spec_from_config(_load(n)) for n in ("static-8-24", "static-16-16", "dynamic"))
    rows = []

    def predict(label: str, changes: dict[str, float], refit: bool) -> None:
        a, b, d = (dataclasses.replace(s, **changes) for s in (static_a, static_b, dynamic))
        if refit:
            fit = fit_speeds(a, PUBLISHED_H["static 8+24"] * 3600, b, PUBLISHED_H["static 16+16"] * 3600, rtol=2e-3)
            speeds = dict(train_tokens_per_gpu_s=fit.train_tokens_per_gpu_s,
                          decode_step_base_s=fit.decode_step_base_s, decode_step_per_seq_s=fit.decode_step_per_seq_s)
            a, b, d = (dataclasses.replace(s, **speeds) for s in (a, b, d))
        walls = {}
        for name, spec, policy in (("8+24", a, "static_fully_async"), ("16+16", b, "static_fully_async"),
                                   ("default", d, "default"), ("fixed_ratio", d, "fixed_ratio")):
            walls[name] = simulate_spec(spec, build_policy(policy, deactivate_ratio=0.6)).wall_clock_s
        rows.append(
            f"| {label} | {'yes' if refit else 'no'} | {_h(walls['8+24'])} | {_h(walls['16+16'])} | "
            f"{_h(walls['default'])} ({_pct(walls['default'] / walls['16+16'])}) | "
            f"{_h(walls['fixed_ratio'])} ({_pct(walls['fixed_ratio'] / walls['16+16'])}) |"
        )

    for label, changes in SHAPES.items():
        predict(label, changes, refit=True)
    for label, changes in WHAT_IF.items():
        predict(label, changes, refit=False)
    return "\n".join(
        [
            "The two static wall clocks pin two speeds (trainer tokens/s, decode iteration cost), not the "
            "shape of the cost model. Each shape below is refitted to both statics (seed 0, 400 steps) "
            "and then predicts the dynamic setup; the last rows change only costs the statics never pay "
            "(switches, hybrid speed), so they keep the preset's speeds. Percentages are against the "
            "row's own 16+16.",
            "",
            "| cost-model shape | refit | 8+24 h | 16+16 h | default h | fixed_ratio h |",
            "|---|---|---:|---:|---:|---:|",
            *rows,
        ]
    )


# --------------------------------------------------------------------------------------------

SECTIONS: dict[str, tuple[str, Callable[[argparse.Namespace], str]]] = {
    "speed": ("Speed: 400 steps on 32 GPUs", lambda args: bench_speed()),
    "sweep": ("A 100-configuration sweep", lambda args: bench_sweep()),
    "seed": ("The seed experiment", lambda args: bench_seed(args.plots)),
    "sensitivity": (
        "How much the dynamic prediction depends on the cost model's shape",
        lambda args: bench_sensitivity(),
    ),
}
HEADER = "# Benchmark results\n\nEach section says the command that produced it; rerun it to refresh that section.\n"


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the ``name`` section of ``path`` between its markers."""
    title, _ = SECTIONS[name]
    block = (
        f"<!-- bench_sim:{name} -->\n## {title}\n\n"
        f"Command: `python benchmarks/bench_sim.py {name} --write {path.as_posix()}`\n\n{body}\n"
        f"<!-- /bench_sim:{name} -->"
    )
    text = path.read_text(encoding="utf-8") if path.exists() else HEADER
    pattern = re.compile(rf"<!-- bench_sim:{name} -->.*?<!-- /bench_sim:{name} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--write", metavar="RESULTS_MD", help="replace this section in the file")
    parser.add_argument("--plots", default="benchmarks/plots", help="where `seed` writes its PNGs")
    args = parser.parse_args()
    body = SECTIONS[args.section][1](args)
    print(body)
    if args.write:
        write_section(Path(args.write), args.section, body)
        if args.section in FIGURES:
            from results_io import write_json

            write_json(f"sim_{args.section}", {**FIGURES[args.section], "load_average": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
