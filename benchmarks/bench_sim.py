"""Benchmarks of the discrete-event twin (``sim/``); each prints a Markdown section.

    python benchmarks/bench_sim.py speed        # 400 steps on 32 GPUs, seconds per run
    python benchmarks/bench_sim.py sweep        # 100 dynamic configurations × 400 steps
    python benchmarks/bench_sim.py seed         # the seed experiment: statics vs published, policies
    python benchmarks/bench_sim.py sensitivity  # the dynamic prediction under other cost-model shapes
    python benchmarks/bench_sim.py grid         # every policy vs never lending over 36 scenarios × 3 seeds
    python benchmarks/bench_sim.py ceiling      # how far lending can take the seed preset (free switches)
    python benchmarks/bench_sim.py random [--n 200] [--seed 0] [--steps 16]  # default, predictive vs never
                                                # lending on scenarios drawn from sim/random_scenarios.py
    python benchmarks/bench_sim.py admission    # length-aware admission and routing on the seed preset
    python benchmarks/bench_sim.py oracle [--sample 50] [--seed 0]  # the best lend schedule in hindsight
                                                # (benchmarks/sim_oracle.py): seed preset and a drawn sample

``--write benchmarks/RESULTS.md`` replaces that section of the file (between its
``<!-- bench_sim:NAME -->`` markers) and leaves the other sections alone, and saves the section's
figures as ``benchmarks/results/sim_NAME.json`` and under the key ``sim_NAME`` of
``benchmarks/results.json`` (``--results``); ``seed`` also writes PNGs to ``--plots`` (default
``benchmarks/plots``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from config import TidalConfig, load_config
from flows.simulate import Setup, write_plots
from policies import build_policy, policy_from_config, registered_policies
from sim import SimResult, simulate, simulate_spec, spec_from_config, with_policy
from sim.bound import lower_bound
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


def _old_shape(*overrides: str, dynamic: bool = True) -> TidalConfig:
    """The seed experiment's shape before issue 16 (TP 4, n = 8, 400 steps), 16+16, dynamic
    (policy ``default``) unless told otherwise."""
    return _load("tp4-dynamic" if dynamic else "tp4-static-16-16", *overrides)


def bench_speed() -> str:
    """Wall-clock seconds of one 400-step simulation on 32 GPUs (best and median of 5)."""
    rows = []
    figures = FIGURES.setdefault("speed", {"setups": {}})
    # The old shape (TP 4, n = 8, 400 steps) keeps this figure comparable with its target; the
    # faithful presets (n = 16, 468 steps) have ~2.3× the events.
    for label, cfg in [("static 16+16", _old_shape(dynamic=False)), ("dynamic 16+16 default", _old_shape())]:
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
            "Target: 400 steps on 32 GPUs in ≤ 2 s, on the seed experiment's old shape (TP 4, n = 8: "
            "`config/presets/sim/_qwen35-35b-tp4.yaml`). Five runs each, " + _machine() + ".",
            "",
            "| setup | steps | events | best s | median s | best CPU s | events/s |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )


def bench_sweep() -> str:
    """100 dynamic configurations of the seed experiment's old shape (TP 4, so trainer GPUs in
    steps of 4), 400 steps each, timed end to end."""
    base = _old_shape()
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
            "ratio 0.2–1.0 × rebalance on/off), 400 steps each on the old shape (TP 4, n = 8), seed 0, one process, " + _machine() + ".",
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


OVERLAP_KEY = "async_training.dynamic_schedule_overlap_hybrid_sync=true"
OVERLAP_LABEL = "dynamic 16+16, hybrid sync during the broadcast,"
OVERLAP_POLICIES = ("default", "predictive")
"""The seed setups run again with the hybrid sync under the broadcast."""


def _seed_setups() -> list[tuple[str, TidalConfig]]:
    dynamic = _load("dynamic")
    setups = [
        ("static 8+24", _load("static-8-24")),
        ("static 16+16", _load("static-16-16")),
        ("dynamic 16+16 default", dynamic),
        ("dynamic 16+16 fixed_ratio", with_policy(dynamic, "fixed_ratio")),
        ("dynamic 16+16 static_fully_async", with_policy(dynamic, "static_fully_async")),
    ]
    if "predictive" in registered_policies():
        setups.insert(2, ("dynamic 16+16 predictive", with_policy(dynamic, "predictive")))
    for policy in OVERLAP_POLICIES:
        if policy in registered_policies():
            setups.append((f"{OVERLAP_LABEL} {policy}", with_policy(_load("dynamic", OVERLAP_KEY), policy)))
    return setups


def _bounded(job: tuple[TidalConfig, int, int | None, bool]) -> tuple[SimResult | None, dict[str, float]]:
    """Worker: simulate one config and seed; its figures, and the whole result when asked."""
    cfg, seed, steps, keep = job
    result = simulate(cfg, seed=seed, steps=steps)
    bound = lower_bound(spec_from_config(cfg, steps), result)
    figures = {"wall_s": result.wall_clock_s, "fluid_s": bound.fluid_s, "bound_s": bound.lower_bound_s,
               "aborted_tokens": result.waste.aborted_tokens, "reprefill_tokens": result.waste.reprefilled_tokens}
    return (result if keep else None), figures


def _map(jobs: list, workers: int = 2) -> list:
    """``_bounded`` over ``jobs`` on ``workers`` processes (in order)."""
    if workers <= 1:
        return [_bounded(job) for job in jobs]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_bounded, jobs, chunksize=1)


def bench_seed(plot_dir: str | None) -> str:
    """The seed experiment: both statics against the published times; the policies on the dynamic
    setup with their ratio to the fluid bound and to the lower bound; mean and range over seeds."""
    rows, setups, walls_by, waste_by = [], [], {}, {}
    labelled = _seed_setups()
    out = _map([(cfg, seed, None, seed == 0) for _, cfg in labelled for seed in SEEDS])
    for i, (label, cfg) in enumerate(labelled):
        runs = out[i * len(SEEDS):(i + 1) * len(SEEDS)]
        walls = [f["wall_s"] for _, f in runs]
        x_fluid = statistics.fmean(f["wall_s"] / f["fluid_s"] for _, f in runs)
        x_bound = statistics.fmean(f["wall_s"] / f["bound_s"] for _, f in runs)
        mean = statistics.fmean(walls)
        walls_by[label] = (mean, x_bound)
        waste_by[label] = tuple(statistics.fmean(f[key] for _, f in runs) for key in ("aborted_tokens", "reprefill_tokens"))
        published = PUBLISHED_H.get(label)
        vs = f"{published:.3f} ({_pct(mean / 3600 / published)})" if published else "—"
        r0 = runs[0][0]
        assert r0 is not None
        rows.append(
            f"| {label} | {_h(mean)} | {_h(min(walls))}–{_h(max(walls))} | {vs} | {x_fluid:.2f} | {x_bound:.2f} | "
            f"{r0.mean('train_util'):.2f} / {r0.mean('rollout_util'):.2f} / "
            f"{r0.mean('cluster_util'):.2f} | {r0.mean('mq_size'):.1f} | {r0.switches} |"
        )
        setups.append(Setup(label, cfg, r0))
    if plot_dir:
        write_plots(setups, plot_dir)
    best_static = min(walls_by["static 8+24"][0], walls_by["static 16+16"][0])
    figures = FIGURES["seed"] = {
        "static_8_24_h": walls_by["static 8+24"][0] / 3600,
        "static_16_16_h": walls_by["static 16+16"][0] / 3600,
        "default_h": walls_by["dynamic 16+16 default"][0] / 3600,
        "default_vs_best_static": walls_by["dynamic 16+16 default"][0] / best_static - 1,
        "default_x_lower_bound": walls_by["dynamic 16+16 default"][1],
        "seeds": len(SEEDS),
    }
    if "dynamic 16+16 predictive" in walls_by:
        wall, x_bound = walls_by["dynamic 16+16 predictive"]
        figures.update(predictive_h=wall / 3600, predictive_vs_best_static=wall / best_static - 1,
                       predictive_x_lower_bound=x_bound,
                       # predictive's lent replicas' wasted work: mean over the seeds
                       aborted_tokens=waste_by["dynamic 16+16 predictive"][0],
                       reprefill_tokens=waste_by["dynamic 16+16 predictive"][1])
    for policy in OVERLAP_POLICIES:
        if f"{OVERLAP_LABEL} {policy}" in walls_by:
            wall, _ = walls_by[f"{OVERLAP_LABEL} {policy}"]
            figures.update({f"{policy}_overlap_h": wall / 3600, f"{policy}_overlap_vs_best_static": wall / best_static - 1})
    dyn = walls_by["dynamic 16+16 default"][0]
    return "\n".join(
        [
            "Presets `config/presets/sim/qwen35-35b-*.yaml` (Qwen3.5-35B-A3B on DAPO-Math-17K, 32 GPUs, "
            f"shaped after the reference's script, 468 steps). Wall clock = mean over seeds 0–{len(SEEDS) - 1} "
            "(range beside it); × fluid and × bound are means over the seeds (the bound counts the staleness "
            "rule: docs/simulator.md, *Lower bound*); the other columns are seed 0. The statics are fitted "
            "(docs/simulator.md, *Calibration*); every dynamic row is a prediction.",
            "",
            f"| setup | simulated h | seeds 0–{len(SEEDS) - 1} | published h (simulated vs it) | × fluid | × bound | "
            "train / rollout / cluster U | mean mq_size | switches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Predicted change of wall clock with `default` on 16+16: {_pct(dyn / walls_by['static 8+24'][0])} vs 8+24 "
            f"and {_pct(dyn / walls_by['static 16+16'][0])} vs 16+16 (published: −15.3 % and −17.5 %).",
            "",
            "The last two rows set `async_training.dynamic_schedule_overlap_hybrid_sync=true` (off in the "
            "presets, as in the reference): the lend is asked before the broadcast, and a step that lends "
            "wakes its hybrids and loads the new weights while the standalones load theirs.",
            "",
            "`static_fully_async` on the dynamic setup never lends the hybrids (they start asleep), so it "
            "is the static 16+16 run event for event and its lines hide that one's in the plots.",
            "",
            "Plots (seed 0, one line per setup, rolling means): `benchmarks/plots/mq_size.png`, "
            "`benchmarks/plots/utilization.png`, `benchmarks/plots/step_time.png`.",
        ]
    )


SHAPES: dict[str, dict[str, float]] = {
    "preset (latency-bound decode, MTP 2×, max_num_seqs 128, lengths 3000→6000, σ 0.6/0.5)": {},
    "compute-bound decode (per_seq × 128 = 8 × base)": dict(decode_step_base_s=0.0005, decode_step_per_seq_s=0.00003125),
    "shorter responses (1500→3000 tokens)": dict(response_len_mean_start=1500.0, response_len_mean_end=3000.0),
    "longer responses (6000→12000 tokens)": dict(response_len_mean_start=6000.0, response_len_mean_end=12000.0),
    "narrower lengths (σ 0.4/0.3)": dict(response_len_sigma=0.4, prompt_len_sigma=0.3),
}
OLD_SHAPE = "old shape (TP 4, n 8, 400 steps, 16 384 cap, compute-bound decode, hybrids at 80 %, 7 s switches)"
"""The presets before issue 16 (``_qwen35-35b-tp4.yaml``), refitted the same way."""
WHAT_IF: dict[str, dict[str, float]] = {
    "preset, hybrid KV binds at 0.45 of memory (hybrid_max_num_seqs 64)": dict(hybrid_max_num_seqs=64),
    "preset, switches 2× dearer (7 s per lend cycle)": dict(deactivate_s=3.0, hybrid_sync_s=3.0, activate_s=0.5,
                                                         rebalance_s=0.5),
    "preset, hybrids at 80 % speed": dict(hybrid_throughput_factor=0.8),
}


def _old_shape_specs() -> tuple:
    """The three seed setups in the old shape (8+24, 16+16, dynamic 16+16)."""
    return (
        spec_from_config(_load("tp4-static-8-24")),
        spec_from_config(_old_shape(dynamic=False)),
        spec_from_config(_old_shape()),
    )


def bench_sensitivity() -> str:
    """Refit the two speeds under other shapes of the cost model and predict the dynamic run."""
    seed_specs = tuple(spec_from_config(_load(n)) for n in ("static-8-24", "static-16-16", "dynamic"))
    rows = []

    def predict(label: str, specs: tuple, changes: dict[str, float], refit: bool) -> None:
        a, b, d = (dataclasses.replace(s, **changes) for s in specs)
        if refit:
            fit = fit_speeds(a, PUBLISHED_H["static 8+24"] * 3600, b, PUBLISHED_H["static 16+16"] * 3600, rtol=2e-3)
            speeds = dict(train_tokens_per_gpu_s=fit.train_tokens_per_gpu_s,
                          decode_step_base_s=fit.decode_step_base_s, decode_step_per_seq_s=fit.decode_step_per_seq_s)
            a, b, d = (dataclasses.replace(s, **speeds) for s in (a, b, d))
        walls = {}
        for name, spec, policy in (("8+24", a, "static_fully_async"), ("16+16", b, "static_fully_async"),
                                   ("default", d, "default"), ("fixed_ratio", d, "fixed_ratio")):
            walls[name] = simulate_spec(spec, build_policy(policy, deactivate_ratio=0.6)).wall_clock_s
        best = min(walls["8+24"], walls["16+16"])
        rows.append(
            f"| {label} | {'yes' if refit else 'no'} | {_h(walls['8+24'])} | {_h(walls['16+16'])} | "
            f"{_h(walls['default'])} ({_pct(walls['default'] / best)}) | "
            f"{_h(walls['fixed_ratio'])} ({_pct(walls['fixed_ratio'] / best)}) |"
        )

    for label, changes in SHAPES.items():
        predict(label, seed_specs, changes, refit=True)
    predict(OLD_SHAPE, _old_shape_specs(), {}, refit=True)
    for label, changes in WHAT_IF.items():
        predict(label, seed_specs, changes, refit=False)
    return "\n".join(
        [
            "The two static wall clocks pin two speeds (trainer tokens/s, decode iteration cost), not the "
            "shape of the cost model. Each shape below is refitted to both statics (seed 0) "
            "and then predicts the dynamic setup; the last rows change only costs the statics never pay "
            "(hybrid KV room, switches, hybrid speed), so they keep the preset's speeds. Percentages are "
            "against the row's own best static split.",
            "",
            "| cost-model shape | refit | 8+24 h | 16+16 h | default h | fixed_ratio h |",
            "|---|---|---:|---:|---:|---:|",
            *rows,
        ]
    )


GRID_STEPS = 40
"""Steps per grid run (not the preset's 468: 36 scenarios × 3 seeds × every policy must take minutes)."""
GRID_SEEDS = (0, 1, 2)
NEVER_LEND = "static_fully_async"
DRIFTS = {"up": (3000.0, 6000.0), "down": (6000.0, 3000.0), "flat": (4500.0, 4500.0)}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One grid cell: GPUs, split, staleness, trigger and length drift on the seed preset's costs."""

    total_gpus: int
    trainer_gpus: int
    staleness: float
    trigger: int
    drift: str

    @property
    def label(self) -> str:
        return (f"{self.trainer_gpus}+{self.total_gpus - self.trainer_gpus} staleness {self.staleness:g} "
                f"trigger {self.trigger} lengths {self.drift}")

    def config(self, policy: str) -> TidalConfig:
        """The seed preset resized: nodes of 4 GPUs (a TP-4 hybrid spans one node's trainer GPUs,
        which the config now checks: 8 nodes of ``total/8`` left 2 a node at 16 GPUs), TP 4,
        mini-batch 16 per 32 GPUs."""
        per_node, mini = 4, 16 * self.total_gpus // 32
        start, end = DRIFTS[self.drift]
        cfg = _load("dynamic", f"trainer.nnodes={self.trainer_gpus // per_node}",
                    f"rollout.nnodes={(self.total_gpus - self.trainer_gpus) // per_node}",
                    f"trainer.n_gpus_per_node={per_node}", f"rollout.n_gpus_per_node={per_node}",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                    f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
                    f"async_training.staleness_threshold={self.staleness}",
                    f"async_training.trigger_parameter_sync_step={self.trigger}",
                    f"sim.response_len_mean_start={start}", f"sim.response_len_mean_end={end}",
                    f"trainer.total_training_steps={GRID_STEPS}",
                    f"rollout.total_rollout_steps={GRID_STEPS * mini * self.trigger}")
        return with_policy(cfg, policy, dynamic=True)


def grid_scenarios() -> list[Scenario]:
    """36 cells: GPU totals 16–128 × splits 24+8, 16+16, 8+24 (scaled) × drift up/down/flat, with
    staleness 0–1 and trigger 1–4 rotated through them so that every value meets every other axis."""
    out = []
    for i, (total, share, drift) in enumerate(itertools.product((16, 32, 64, 128), (0.75, 0.5, 0.25), DRIFTS)):
        out.append(Scenario(total, int(total * share), (0.0, 0.5, 1.0)[(i // 3 + i) % 3], (1, 2, 3, 4)[i // 3 % 4],
                            drift))
    return out


def grid_policies() -> list[str]:
    """Every registered policy, never-lending first."""
    return [NEVER_LEND, *(p for p in registered_policies() if p != NEVER_LEND)]


def bench_grid(scenarios: list[Scenario] | None = None, seeds: tuple[int, ...] = GRID_SEEDS, workers: int = 2) -> str:
    """Every policy against never lending on the same GPUs, per scenario (mean wall clock over
    the seeds); worst and median ratio per policy."""
    scenarios = grid_scenarios() if scenarios is None else scenarios
    policies = grid_policies()
    t0 = time.perf_counter()
    jobs = [(sc.config(p), seed, None, False) for sc in scenarios for p in policies for seed in seeds]
    out = iter(_map(jobs, workers))
    walls = {(sc, p): statistics.fmean(next(out)[1]["wall_s"] for _ in seeds) for sc in scenarios for p in policies}
    took = time.perf_counter() - t0
    figures: dict[str, float | int] = {"cells": len(scenarios), "seeds": len(seeds), "steps": GRID_STEPS,
                                       "wall_s": took}
    rows = []
    for sc in scenarios:
        never = walls[(sc, NEVER_LEND)]
        cells = " | ".join(f"{walls[(sc, p)] / never - 1:+.1%}".replace("-", "−") for p in policies[1:])
        rows.append(f"| {sc.label} | {never / 3600:.3f} | {cells} |")
    summary = []
    for p in policies[1:]:
        ratios = [walls[(sc, p)] / walls[(sc, NEVER_LEND)] - 1 for sc in scenarios]
        figures[f"{p}_worst_vs_never_lend"] = max(ratios)
        figures[f"{p}_median_vs_never_lend"] = statistics.median(ratios)
        summary.append(f"| {p} | {statistics.median(ratios):+.1%} | {max(ratios):+.1%} | {min(ratios):+.1%} | "
                       f"{sum(r > 0.01 for r in ratios)} |".replace("-", "−"))
    FIGURES["grid"] = figures
    return "\n".join(
        [
            f"{len(scenarios)} scenarios × seeds {', '.join(map(str, seeds))} × {len(policies)} policies, "
            f"{GRID_STEPS} steps each (not the preset's 468, to keep the grid to minutes), on the seed "
            "preset's fitted costs resized: nodes of 4 GPUs, TP 4, mini-batch 16 per 32 GPUs. "
            f"{took:.0f} s on 2 worker processes, " + _machine() + ". Each figure: wall clock (mean over "
            f"the seeds) against `{NEVER_LEND}` on the same GPUs (hybrids never lent); negative = faster.",
            "",
            "| policy | median | worst | best | cells > +1 % |",
            "|---|---:|---:|---:|---:|",
            *summary,
            "",
            f"| scenario | never lend h | {' | '.join(policies[1:])} |",
            "|---|---:|" + "---:|" * (len(policies) - 1),
            *rows,
        ]
    )


CEILING_VARIANTS: dict[str, tuple[str, ...]] = {
    "preset": (),
    "hybrid sync hidden behind the broadcast (sim.hybrid_sync_s=0)": ("sim.hybrid_sync_s=0",),
    "every switch free (sync, activate, rebalance, take-back 0 s)": (
        "sim.hybrid_sync_s=0", "sim.activate_s=0", "sim.deactivate_s=0", "sim.rebalance_s=0"),
}
CEILING_SEEDS = (0, 1)


def fluid_lend_ceiling_s(cycles: list[tuple[float, float]], rho: float) -> float:
    """The fluid model's best lending run from a never-lending one's (cycle s, trainer wait s):
    every cycle shortened by ρ W / (1 + ρ), its wait W fully lent at no switch cost
    (docs/policies.md, *The model*)."""
    return sum(cycle - rho * wait / (1.0 + rho) for cycle, wait in cycles)


def bench_ceiling() -> str:
    """`predictive` and `default` on the dynamic seed preset with cheaper switches, beside the
    fluid model's ceiling: how much of the 20 % target any lend-while-the-trainer-waits can reach."""
    dynamic = _load("dynamic")
    labelled = [(name, pol) for name in CEILING_VARIANTS for pol in ("predictive", "default")]
    jobs = [(with_policy(_load("dynamic", *CEILING_VARIANTS[name]), pol), seed, None, False)
            for name, pol in labelled for seed in CEILING_SEEDS]
    out = iter(_map(jobs))
    best_static = min(statistics.fmean(simulate(_load(n), seed=s).wall_clock_s for s in CEILING_SEEDS)
                      for n in ("static-8-24", "static-16-16"))
    rows = []
    for name, pol in labelled:
        runs = [next(out)[1] for _ in CEILING_SEEDS]
        wall = statistics.fmean(f["wall_s"] for f in runs)
        x_bound = statistics.fmean(f["wall_s"] / f["bound_s"] for f in runs)
        rows.append(f"| {name} | {pol} | {_h(wall)} | {_pct(wall / best_static)} | {x_bound:.2f} |")
    never = [simulate(with_policy(dynamic, NEVER_LEND), seed=s) for s in CEILING_SEEDS]
    # ρ = hybrid GPUs / standalone GPUs at the same per-GPU speed (the seed preset: 16 / 16)
    spec = spec_from_config(dynamic)
    rho = spec.hybrid_replicas * spec.hybrid_throughput_factor / spec.standalone_replicas
    fluid = statistics.fmean(fluid_lend_ceiling_s([(s.step_time_s, sum(s.micro_wait_s)) for s in r.steps], rho)
                             for r in never)
    FIGURES["ceiling"] = {"best_static_h": best_static / 3600, "fluid_lend_ceiling_h": fluid / 3600,
                          "fluid_lend_ceiling_vs_best_static": fluid / best_static - 1}
    return "\n".join([
        f"Dynamic 16+16 seed preset, mean over seeds {', '.join(map(str, CEILING_SEEDS))}; percentages against the "
        f"best static split ({_h(best_static)} h, same seeds). {_machine()}.",
        "",
        "| switch costs | policy | wall clock h | vs best static | × lower bound |",
        "|---|---|---:|---:|---:|",
        *rows,
        f"| fluid ceiling: every no-lend cycle − ρW/(1+ρ), ρ = {rho:g}, no switch cost | — | {_h(fluid)} | "
        f"{_pct(fluid / best_static)} | — |",
    ])


RANDOM_POLICIES = (NEVER_LEND, "default", "predictive")


def _random_job(sc) -> dict:
    """Worker: one drawn scenario under never lending, ``default`` and ``predictive``; wall clocks
    and what explains a close call (never lending's waits, predictive's lends)."""
    runs = {p: simulate_spec(sc.spec(p), sc.policy(p), seed=sc.seed, policy_name=p) for p in RANDOM_POLICIES}
    never, pred = runs[NEVER_LEND], runs["predictive"]
    spec = sc.spec("predictive")
    return {
        "walls": {p: r.wall_clock_s for p, r in runs.items()},
        "never_cycle_s": statistics.fmean(s.step_time_s for s in never.steps),
        "never_wait_s": statistics.fmean(sum(s.micro_wait_s) for s in never.steps),
        "switch_s": sum(getattr(spec, k) for k in ("hybrid_sync_s", "activate_s", "rebalance_s", "deactivate_s")),
        "predictive_lends": sum(s.activated for s in pred.steps),
        "default_lends": sum(s.activated for s in runs["default"].steps),
        "standalone_replicas": spec.standalone_replicas, "hybrid_replicas": spec.hybrid_replicas,
        "cap": spec.max_required_samples, "step_samples": spec.step_required_samples,
    }


def _why(sc, f: dict) -> str:
    """A close scenario's numbers: what lending could win (the wait) against what it costs."""
    w, t, c = f["never_wait_s"], f["never_cycle_s"], f["switch_s"]
    lends = f["predictive_lends"]
    return (f"never lending waits {w:.1f} s of a {t:.1f} s cycle; a lend cycle's switches cost {c:.1f} s "
            f"(×{sc.switch_factor:.2f}); {f['hybrid_replicas']} hybrids vs {f['standalone_replicas']} standalones, "
            f"cap {f['cap']} for {f['step_samples']} samples a step; predictive lent after {lends} of "
            f"{sc.steps} steps" + (" (it never lent: it stayed within noise of never lending)" if not lends else "")
            + f", default after {f['default_lends']}")


REGRET_OVER = 0.03
"""A scenario's regret counts as large above this (issue 45's table)."""


def _vs_never_and_regret(found: list[dict]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per policy (``default``, ``predictive``) and scenario of ``_random_job`` results: the wall
    clock against never lending, and the regret (against the better of never lending and ``default``)."""
    policies = ("default", "predictive")
    ratios = {p: [f["walls"][p] / f["walls"][NEVER_LEND] - 1 for f in found] for p in policies}
    regrets = {p: [f["walls"][p] / min(f["walls"][NEVER_LEND], f["walls"]["default"]) - 1 for f in found]
               for p in policies}
    return ratios, regrets


def bench_random(n: int = 200, seed: int = 0, workers: int = 2, steps: int | None = None) -> str:
    """``default`` and ``predictive`` against never lending on ``n`` scenarios drawn from
    ``sim.random_scenarios``' distribution (its docstring states it), ``steps`` steps each; and
    each policy's regret: its wall clock against the better of never lending and ``default``."""
    from sim import random_scenarios

    steps = random_scenarios.STEPS if steps is None else steps
    scenarios = random_scenarios.draw(n, seed, steps)
    t0 = time.perf_counter()
    if workers <= 1:
        found = [_random_job(sc) for sc in scenarios]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            found = pool.map(_random_job, scenarios, chunksize=4)
    took = time.perf_counter() - t0
    ratios, regrets = _vs_never_and_regret(found)
    order = sorted(range(n), key=lambda i: ratios["predictive"][i], reverse=True)
    closest = [{"label": scenarios[i].label, "predictive_vs_never_lend": ratios["predictive"][i],
                "default_vs_never_lend": ratios["default"][i], "params": scenarios[i].params(),
                "why": _why(scenarios[i], found[i])} for i in order[:5]]
    by_regret = sorted(range(n), key=lambda i: regrets["predictive"][i], reverse=True)
    largest = [{"label": scenarios[i].label, "regret": regrets["predictive"][i],
                "predictive_vs_never_lend": ratios["predictive"][i], "default_vs_never_lend": ratios["default"][i],
                "params": scenarios[i].params(), "why": _why(scenarios[i], found[i])} for i in by_regret[:5]]
    key = "random" if steps == random_scenarios.STEPS else f"random_{steps}"
    FIGURES[key] = {
        "distribution": "sim/random_scenarios.py (module docstring): TP 4/8; GPU total 8-128 log-uniform; "
                        "trainer GPUs uniform over the multiples of TP leaving one replica each side; staleness "
                        "0 w.p. 1/4 else U[0,1]; trigger 1-4; response-length mean 750-12000 log-uniform with a "
                        "drift x1/3-x3; switch costs x0.25-x4 log-uniform; simulation seed 0-4; "
                        f"{steps} steps",
        "draw_seed": seed, "scenarios": n, "steps": steps, "never_lend": NEVER_LEND,
        "wall_s": took,
        **{f"{p}_{stat}_vs_never_lend": fn(ratios[p]) for p in ("predictive", "default")
           for stat, fn in (("worst", max), ("median", statistics.median), ("mean", statistics.fmean))},
        **{f"{p}_best_vs_never_lend": min(ratios[p]) for p in ("predictive", "default")},
        **{f"{p}_over_1pct": sum(r > 0.01 for r in ratios[p]) for p in ("predictive", "default")},
        **{f"{p}_mean_regret": statistics.fmean(regrets[p]) for p in ("predictive", "default")},
        **{f"{p}_regret_over_3pct": sum(r > REGRET_OVER for r in regrets[p]) for p in ("predictive", "default")},
        "closest": closest, "largest_regrets": largest,
    }
    summary = [f"| {p} | {_pct(1 + statistics.fmean(r))} | {_pct(1 + statistics.median(r))} | {_pct(1 + max(r))} | "
               f"{_pct(1 + min(r))} | {sum(x > 0.01 for x in r)} | {_pct(1 + statistics.fmean(regrets[p]))} | "
               f"{sum(x > REGRET_OVER for x in regrets[p])} | {_pct(1 + max(regrets[p]))} |" for p, r in ratios.items()]
    rows = [f"| {c['label']} | {_pct(1 + c['predictive_vs_never_lend'])} | {_pct(1 + c['default_vs_never_lend'])} | "
            f"{c['why']} |" for c in closest]
    regret_rows = [f"| {c['label']} | {_pct(1 + c['regret'])} | {_pct(1 + c['predictive_vs_never_lend'])} | "
                   f"{_pct(1 + c['default_vs_never_lend'])} | {c['why']} |" for c in largest]
    return "\n".join([
        f"{n} scenarios drawn by `sim.random_scenarios.draw({n}, {seed}, {steps})` (the distribution: that module's "
        f"docstring), {steps} steps each, each at its drawn simulation seed; `{NEVER_LEND}` on "
        f"the same GPUs is never lending. Regret: the wall clock against the better of never lending and "
        f"`default` in the same scenario. {took:.0f} s on {workers} worker processes, {_machine()}.",
        "",
        "| policy | mean vs never | median | worst | best | scenarios > +1 % | mean regret | regret > 3 % | largest regret |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *summary,
        "",
        "The five closest for `predictive` (largest wall clock against never lending):",
        "",
        "| scenario | predictive | default | why |",
        "|---|---:|---:|---|",
        *rows,
        "",
        "The five largest regrets of `predictive`:",
        "",
        "| scenario | regret | predictive | default | why |",
        "|---|---:|---:|---:|---|",
        *regret_rows,
    ])


DRAWS = "200:5:16,200:9:16,200:13:16,100:3:64,100:7:64"
"""``bench_sim.py draws``' default: draws other than the benchmark's (``random`` uses seed 0)."""


def bench_draws(spec: str = DRAWS, workers: int = 2) -> str:
    """The lending promise and the regret on other draws of the same distribution: ``spec`` is
    ``N:SEED:STEPS`` comma-separated; per draw, `predictive`'s mean, worst and count over +1 %
    against never lending, its mean and largest regret and count over 3 %, and `default`'s mean."""
    from sim import random_scenarios

    try:
        draws = [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]
        if any(len(d) != 3 or min(d[0], d[2]) < 1 or d[1] < 0 for d in draws):
            raise ValueError
    except ValueError:
        print(f"bench_sim.py draws: --draws wants N:SEED:STEPS[,...] with N, STEPS >= 1 (got {spec!r})", file=sys.stderr)
        raise SystemExit(2) from None
    t0, rows, figures = time.perf_counter(), [], {}
    for n, seed, steps in draws:
        scenarios = random_scenarios.draw(n, seed, steps)
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            found = pool.map(_random_job, scenarios, chunksize=4)
        ratio, regrets = _vs_never_and_regret(found)
        regret = regrets["predictive"]
        worst = max(range(n), key=lambda i: ratio["predictive"][i])
        key = f"draw_{n}_{seed}_{steps}"
        figures[key] = {"predictive_mean_vs_never_lend": statistics.fmean(ratio["predictive"]),
                        "predictive_worst_vs_never_lend": ratio["predictive"][worst],
                        "predictive_over_1pct": sum(r > 0.01 for r in ratio["predictive"]),
                        "predictive_mean_regret": statistics.fmean(regret),
                        "predictive_regret_over_3pct": sum(r > REGRET_OVER for r in regret),
                        "predictive_largest_regret": max(regret),
                        "default_mean_vs_never_lend": statistics.fmean(ratio["default"]),
                        "worst_scenario": scenarios[worst].label}
        f = figures[key]
        rows.append(f"| `draw({n}, {seed}, {steps})` | {_pct(1 + f['predictive_mean_vs_never_lend'])} | "
                    f"{_pct(1 + f['predictive_worst_vs_never_lend'])} ({scenarios[worst].label}) | "
                    f"{f['predictive_over_1pct']} | {_pct(1 + f['predictive_mean_regret'])} | "
                    f"{f['predictive_regret_over_3pct']} | {_pct(1 + f['predictive_largest_regret'])} | "
                    f"{_pct(1 + f['default_mean_vs_never_lend'])} |")
        print(rows[-1], flush=True)
    took = time.perf_counter() - t0
    FIGURES["draws"] = {"draws": spec, "wall_s": took, **figures,
                        "predictive_worst_vs_never_lend": max(v["predictive_worst_vs_never_lend"] for v in figures.values()),
                        "scenarios": sum(d[0] for d in draws)}
    return "\n".join([
        f"The promise and the regret on draws other than the benchmark's (`random` draws with seed 0): "
        f"{sum(d[0] for d in draws)} scenarios, each at its drawn simulation seed; `{NEVER_LEND}` is never "
        f"lending; regret against the better of never lending and `default`. {took:.0f} s on {workers} worker "
        f"processes, {_machine()}.",
        "",
        "| draw | `predictive` mean vs never | worst (scenario) | over +1 % | mean regret | regret > 3 % | "
        "largest regret | `default` mean vs never |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        *rows,
    ])


ORACLE_SAMPLE_STEPS = 16
ORACLE_SAMPLE_MOVES = (4, 1)
"""The sample's search moves: blocks of 4 steps, then single steps, over lend steps 0-15."""
ORACLE_SAMPLE_BUDGET = 250
"""Runs a sample scenario's search may spend (all starts together)."""
ORACLE_PRESET_BUDGET = 70
"""Runs a seed-preset search may spend (468-step runs: ~3.5 s of CPU each)."""


def _oracle_starts(steps: int, lends: dict[str, frozenset[int]], froms: tuple[int, ...]) -> dict[str, frozenset[int]]:
    """The search's starting schedules: the policies' own lends, and "lend from step k"."""
    return {**{f"{p}'s": s for p, s in lends.items()}, **{f"from step {k}": frozenset(range(k, steps)) for k in froms}}


def _oracle_sample_job(sc) -> dict:
    """Worker: one drawn scenario's never-lending, `default` and `predictive` runs, the search, and
    the best schedule run again at the next simulation seed."""
    from sim_oracle import blocks, lent_steps, policy_kwargs, scheduled_run, search

    runs = {p: simulate_spec(sc.spec(p), sc.policy(p), seed=sc.seed, policy_name=p) for p in RANDOM_POLICIES}
    spec, kwargs = sc.spec("predictive"), policy_kwargs(sc.policy("predictive"))
    starts = _oracle_starts(sc.steps, {p: lent_steps(runs[p]) for p in ("predictive", "default")}, (0, 1, 3, 5))
    found = search(scheduled_run(spec, kwargs, sc.seed), starts, blocks(sc.steps, ORACLE_SAMPLE_MOVES),
                   ORACLE_SAMPLE_BUDGET)
    other = (sc.seed + 1) % 5
    never_other = simulate_spec(sc.spec(NEVER_LEND), sc.policy(NEVER_LEND), seed=other).wall_clock_s
    return {"walls": {p: r.wall_clock_s for p, r in runs.items()}, "oracle_s": found.wall_s,
            "schedule": sorted(found.best), "start": found.start, "evaluations": found.evaluations,
            "other_seed": other, "oracle_other_s": scheduled_run(spec, kwargs, other)(found.best),
            "never_other_s": never_other}


def _oracle_preset_job(job: tuple[str, tuple[str, ...]]) -> dict:
    """Worker: the search on the dynamic seed preset (seed 0) with ``overrides``."""
    from sim_oracle import lent_steps, policy_kwargs, scheduled_run, search

    label, overrides = job
    cfg = _load("dynamic", *overrides)
    spec = spec_from_config(cfg)
    pred_cfg = with_policy(cfg, "predictive")
    kwargs = policy_kwargs(policy_from_config(pred_cfg))
    lends = {p: lent_steps(simulate(with_policy(cfg, p), seed=0)) for p in ("predictive", "default")}
    steps = spec.steps
    starts = _oracle_starts(steps, lends, (1, 5))
    # coarse blocks over the whole run, then single steps over the first 12 (where lending starts)
    moves = [*(range(i, min(i + 117, steps)) for i in range(0, steps, 117)),
             *(range(i, min(i + 39, steps)) for i in range(0, steps, 39)),
             *(range(i, i + 1) for i in range(12))]
    found = search(scheduled_run(spec, kwargs, 0), starts, moves, ORACLE_PRESET_BUDGET)
    return {"label": label, "overrides": overrides, "schedule": sorted(found.best), "start": found.start,
            "seed0_s": found.wall_s, "starts": found.starts, "evaluations": found.evaluations, "steps": steps}


def _oracle_seed_job(job: tuple) -> float:
    """Worker: one seed-preset run: ("policy", overrides, name, seed) or ("schedule", overrides, schedule, seed)."""
    from sim_oracle import ScheduledLend, policy_kwargs

    kind, overrides, what, seed = job
    if kind == "static":
        return simulate(_load(what), seed=seed).wall_clock_s
    cfg = _load("dynamic", *overrides)
    if kind == "policy":
        return simulate(with_policy(cfg, what), seed=seed).wall_clock_s
    kwargs = policy_kwargs(policy_from_config(with_policy(cfg, "predictive")))
    return simulate_spec(spec_from_config(cfg), ScheduledLend(what, **kwargs), seed=seed).wall_clock_s


def bench_oracle(args: argparse.Namespace) -> str:
    """The best lend schedule in hindsight (``benchmarks/sim_oracle.py``): on the dynamic seed
    preset with and without the overlapped hybrid sync (searched at seed 0, then run at every
    seed), and on a sample of drawn 16-step scenarios."""
    from sim import random_scenarios
    from sim_oracle import schedule_text

    t0 = time.perf_counter()
    seeds = range(args.preset_seeds)
    variants = [("without overlap", ()), ("with overlap", (OVERLAP_KEY,))]
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        found = pool.map(_oracle_preset_job, variants, chunksize=1)
        jobs = [("static", (), name, s) for name in ("static-8-24", "static-16-16") for s in seeds]
        for (_, overrides), f in zip(variants, found):
            jobs += [("policy", overrides, p, s) for p in ("predictive", "default", NEVER_LEND) for s in seeds]
            jobs += [("schedule", overrides, f["schedule"], s) for s in seeds]
            jobs += [("schedule", overrides, list(range(5, f["steps"])), s) for s in seeds]
        walls = iter(pool.map(_oracle_seed_job, jobs, chunksize=1))
        mean = lambda: statistics.fmean(next(walls) for _ in seeds)  # noqa: E731
        statics = {name: mean() for name in ("static 8+24", "static 16+16")}
        best_static = min(statics.values())
        preset_rows, figures = [], {"seeds": len(seeds), "best_static_h": best_static / 3600}
        for (label, _), f in zip(variants, found):
            got = {"predictive": mean(), "default": mean(), "never lend": mean(), "oracle": mean(),
                   "lend from step 5, no pauses": mean()}
            key = "overlap" if "with" in label else "no_overlap"
            figures[key] = {**{f"{k.replace(' ', '_').replace(',', '')}_h": v / 3600 for k, v in got.items()},
                            **{f"{k.replace(' ', '_').replace(',', '')}_vs_best_static": v / best_static - 1
                               for k, v in got.items()},
                            "oracle_seed0_h": f["seed0_s"] / 3600, "oracle_schedule": schedule_text(frozenset(f["schedule"]), f["steps"]),
                            "oracle_lends": len(f["schedule"]), "oracle_start": f["start"], "evaluations": f["evaluations"]}
            for name, v in got.items():
                preset_rows.append(f"| {label} | {name} | {_h(v)} | {_pct(v / best_static)} | {_pct(v / got['never lend'])} |")
            preset_rows.append(f"| {label} | oracle at seed 0 (searched there) | {_h(f['seed0_s'])} | "
                               f"{_pct(f['seed0_s'] / best_static)} | — |")
        scenarios = random_scenarios.draw(args.sample, args.seed, ORACLE_SAMPLE_STEPS)
        sample = pool.map(_oracle_sample_job, scenarios, chunksize=1)
    took = time.perf_counter() - t0
    gains = {p: [f["walls"][p] / f["walls"][NEVER_LEND] - 1 for f in sample] for p in ("predictive", "default")}
    gains["oracle"] = [f["oracle_s"] / f["walls"][NEVER_LEND] - 1 for f in sample]
    other = [f["oracle_other_s"] / f["never_other_s"] - 1 for f in sample]
    oracle_mean = statistics.fmean(gains["oracle"])
    share = statistics.fmean(gains["predictive"]) / oracle_mean if oracle_mean < 0 else float("nan")
    figures["sample"] = {
        "scenarios": len(sample), "draw": f"sim.random_scenarios.draw({args.sample}, {args.seed}, {ORACLE_SAMPLE_STEPS})",
        **{f"{p}_mean_vs_never_lend": statistics.fmean(g) for p, g in gains.items()},
        **{f"{p}_median_vs_never_lend": statistics.median(g) for p, g in gains.items()},
        "oracle_at_other_seed_mean_vs_never_lend": statistics.fmean(other),
        "predictive_share_of_oracle_gain": share,
        "evaluations_mean": statistics.fmean(f["evaluations"] for f in sample),
        "starts_that_won": {s: sum(f["start"] == s for f in sample) for s in sorted({f["start"] for f in sample})},
    }
    figures["wall_s"] = took
    FIGURES["oracle"] = figures
    worst = sorted(range(len(sample)), key=lambda i: gains["predictive"][i] - gains["oracle"][i], reverse=True)[:5]
    gap_rows = [f"| {scenarios[i].label} | {_pct(1 + gains['oracle'][i])} ({schedule_text(frozenset(sample[i]['schedule']), 16)}) | "
                f"{_pct(1 + gains['predictive'][i])} | {_pct(1 + gains['default'][i])} | {_pct(1 + other[i])} |" for i in worst]
    sample_rows = [f"| {p} | {_pct(1 + statistics.fmean(g))} | {_pct(1 + statistics.median(g))} | {_pct(1 + max(g))} |"
                   for p, g in (("oracle", gains["oracle"]), ("predictive", gains["predictive"]), ("default", gains["default"]))]
    return "\n".join([
        "The best lend schedule found in hindsight by local search in the twin (`benchmarks/sim_oracle.py`): "
        "`predictive` with only its lend answer replaced by a schedule (all hybrids or none after each sync; "
        "step 0 is a warm-up lend), searched from `predictive`'s and `default`'s own lends and from \"lend from "
        "step k\", moving blocks of steps to lend or not until no move improves. **An estimate from below of "
        "what a lending policy could get, not a bound**: the search is local, knows the seed, and does not try "
        f"k-of-m lends. {took:.0f} s on {args.workers} worker processes, {_machine()}.",
        "",
        f"**The seed preset** (dynamic 16 + 16, 468 steps): searched at seed 0 (at most {ORACLE_PRESET_BUDGET} runs; "
        "blocks of 117 and 39 steps, then single steps over the first 12), the best schedule then run at "
        f"seeds 0–{len(seeds) - 1} like every other row (mean over those seeds; best static = "
        f"{_h(best_static)} h, static 8+24 {_h(statics['static 8+24'])} h, 16+16 {_h(statics['static 16+16'])} h):",
        "",
        "| hybrid sync | schedule | wall clock h | vs best static | vs never lending |",
        "|---|---|---:|---:|---:|",
        *preset_rows,
        "",
        *(f"- {label}: the best schedule found lends after {len(f['schedule'])} of {f['steps']} steps "
          f"({schedule_text(frozenset(f['schedule']), f['steps'])}), improved from {f['start']}, {f['evaluations']} runs."
          for (label, _), f in zip(variants, found)),
        "",
        f"**The sample**: `sim.random_scenarios.draw({args.sample}, {args.seed}, {ORACLE_SAMPLE_STEPS})`, each at its "
        f"drawn seed; at most {ORACLE_SAMPLE_BUDGET} runs a scenario (blocks of 4 steps, then single steps). Against "
        "never lending (negative = faster):",
        "",
        "| schedule | mean | median | worst |",
        "|---|---:|---:|---:|",
        *sample_rows,
        "",
        f"`predictive` gets {share:.0%} of the oracle's mean gain. The oracle's schedule run at the next "
        f"simulation seed (against never lending at that seed) keeps {_pct(1 + statistics.fmean(other))} on average "
        "of its own seed's gain: what hindsight of the seed is worth is the difference.",
        "",
        "The five scenarios where `predictive` is furthest from the oracle:",
        "",
        "| scenario | oracle (its lends) | predictive | default | oracle's schedule at the next seed |",
        "|---|---:|---:|---:|---:|",
        *gap_rows,
    ])


ADMISSION_VARIANTS: dict[str, dict] = {
    "first come, first started (today)": {},
    "longest predicted first, exact predictions": dict(admission_lookahead=64),
    "longest predicted first, predictions ×/÷ e^0.3": dict(admission_lookahead=64, admission_predict_sigma=0.3),
    "long to standalones, short to lent hybrids (exact)": dict(route_by_length=True),
    "both, predictions ×/÷ e^0.3": dict(admission_lookahead=64, admission_predict_sigma=0.3, route_by_length=True),
}
"""The twin study of issue 45 item 3 (``SimSpec.admission_*``, ``route_by_length``): lookahead
64 = one step's samples on the seed preset."""


def _admission_job(job: tuple[str, tuple[str, ...], str, int]) -> dict[str, float]:
    variant, overrides, policy, seed = job
    spec = dataclasses.replace(spec_from_config(with_policy(_load("dynamic", *overrides), policy)),
                               **ADMISSION_VARIANTS[variant])
    cfg = with_policy(_load("dynamic", *overrides), policy)
    r = simulate_spec(spec, policy_from_config(cfg), seed=seed, policy_name=policy)
    return {"wall_s": r.wall_clock_s, "aborted_tokens": r.waste.aborted_tokens,
            "reprefill_tokens": r.waste.reprefilled_tokens, "lends": sum(s.activated for s in r.steps)}


def bench_admission(workers: int = 2) -> str:
    """Length-aware admission and routing on the dynamic seed preset (468 steps, seeds 0-4), with
    `predictive` and the overlapped hybrid sync, and with `static_fully_async` (never lending)."""
    t0 = time.perf_counter()
    setups = [("predictive, overlapped hybrid sync", (OVERLAP_KEY,), "predictive"),
              ("never lending (static_fully_async)", (), NEVER_LEND)]
    jobs = [(v, o, p, s) for _, o, p in setups for v in ADMISSION_VARIANTS for s in SEEDS]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        out = iter(pool.map(_admission_job, jobs, chunksize=1))
    rows, figures = [], {}
    for label, _, policy in setups:
        base = None
        for variant in ADMISSION_VARIANTS:
            runs = [next(out) for _ in SEEDS]
            mean = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
            base = base or mean
            figures[f"{policy}|{variant}"] = mean
            rows.append(f"| {label} | {variant} | {_h(mean['wall_s'])} | {_pct(mean['wall_s'] / base['wall_s'])} | "
                        f"{mean['aborted_tokens'] / 1e6:.0f} | {mean['reprefill_tokens'] / 1e6:.0f} | {mean['lends']:.0f} |")
    took = time.perf_counter() - t0
    FIGURES["admission"] = {"variants": figures, "seeds": len(SEEDS), "wall_s": took}
    return "\n".join([
        "A twin study (issue 45 item 3): the dynamic seed preset (16 + 16, 468 steps), mean over seeds "
        f"0–{len(SEEDS) - 1}, with the twin's `SimSpec.admission_lookahead` (the rollouter draws one step's 64 "
        "prompts ahead and starts the one predicted to run longest first), `admission_predict_sigma` (the "
        "prediction's log-normal error: 0 = exact, an upper bound of what earlier epochs' measurements give) and "
        "`route_by_length` (while hybrids are lent, samples predicted longer than the length model's mean go to "
        "standalones, shorter ones to lent hybrids). Predictions are available for every prompt from step 1 "
        "(the preset runs 1.7 epochs, so a real run would have them for the last 0.7 only): an upper bound. "
        f"{took:.0f} s on {workers} worker processes, {_machine()}.",
        "",
        "| setup | admission / routing | wall clock h | vs first come | aborted M tokens | re-prefilled M tokens | lends |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
    ])


# --------------------------------------------------------------------------------------------

SECTIONS: dict[str, tuple[str, Callable[[argparse.Namespace], str]]] = {
    "speed": ("Speed: 400 steps on 32 GPUs", lambda args: bench_speed()),
    "sweep": ("A 100-configuration sweep", lambda args: bench_sweep()),
    "seed": ("The seed experiment", lambda args: bench_seed(args.plots)),
    "grid": ("Every policy against never lending, over 36 scenarios", lambda args: bench_grid()),
    "ceiling": ("How far lending can take the seed preset", lambda args: bench_ceiling()),
    "random": ("The lending promise on randomly drawn scenarios",
               lambda args: bench_random(args.n, args.seed, args.workers, args.steps)),
    "oracle": ("The best lend schedule in hindsight", lambda args: bench_oracle(args)),
    "draws": ("The lending promise on draws other than the benchmark's",
              lambda args: bench_draws(args.draws, args.workers)),
    "admission": ("Length-aware admission and routing (a twin study)", lambda args: bench_admission(args.workers)),
    "sensitivity": (
        "How much the dynamic prediction depends on the cost model's shape",
        lambda args: bench_sensitivity(),
    ),
}
def write_section(path: Path, name: str, body: str, command: str, date: str, title: str | None = None) -> None:
    """Replace (or append) the ``name`` section of ``path`` (``results_io``'s markers)."""
    from results_io import write_section as write_block

    title = SECTIONS[name][0] if title is None else title
    write_block(f"bench_sim:{name}", f"## {title}\n\nCommand: `{command}` ({date})\n\n{body}", path,
                after=NEW_SECTION_AFTER.get(name))


NEW_SECTION_AFTER = {"random_64": "bench_sim:random", "draws": "bench_sim:random_64", "oracle": "bench_sim:random_64",
                     "admission": "bench_sim:oracle"}
"""Where a section goes the first time it is written (beside its kin)."""


def _section_name(args: argparse.Namespace) -> tuple[str, str]:
    """The section (and figures key) a run writes, and its title: ``random`` at other than the
    default 16 steps is ``random_STEPS``."""
    name, title = args.section, SECTIONS[args.section][0]
    if name == "random" and args.steps not in (None, 16):
        return f"random_{args.steps}", f"{title}, {args.steps} steps"
    return name, title


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--write", metavar="RESULTS_MD", help="replace this section in the file")
    parser.add_argument("--plots", default="benchmarks/plots", help="where `seed` writes its PNGs")
    parser.add_argument("--n", type=int, default=200, help="`random`: scenarios to draw")
    parser.add_argument("--seed", type=int, default=0, help="`random`: the draw's seed")
    parser.add_argument("--workers", type=int, default=2, help="`random`, `oracle`: worker processes")
    parser.add_argument("--steps", type=int, default=None, help="`random`: steps per run (default 16)")
    parser.add_argument("--sample", type=int, default=50, help="`oracle`: drawn scenarios to search")
    parser.add_argument("--draws", default=DRAWS, help="`draws`: N:SEED:STEPS[,...] draws to check")
    parser.add_argument("--preset-seeds", type=int, default=5, help="`oracle`: seed preset seeds 0..N-1")
    parser.add_argument("--results", default=str(Path(__file__).resolve().parent / "results.json"),
                        help="the merged results file whose sim_SECTION key --write replaces")
    args = parser.parse_args()
    # what made the figures and when, kept with them (results.json, RESULTS.md) so a re-run keeps both
    command = shlex.join(["python", "benchmarks/bench_sim.py", *sys.argv[1:]])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = SECTIONS[args.section][1](args)
    print(body)
    name, title = _section_name(args)
    if name in FIGURES:
        FIGURES[name].update(command=command, date=date)
    if args.section == "random":  # its own file only: results.json and RESULTS.md are merged by hand
        from results_io import write_json

        write_json(f"sim_{name}", {**FIGURES[name], "load_average": os.getloadavg()[0]})
    if args.write:
        write_section(Path(args.write), name, body, command, date, title)
        if name in FIGURES:
            publish(name, FIGURES[name], Path(args.results))


def publish(name: str, figures: dict, results_json: Path) -> None:
    """Save ``figures`` as ``benchmarks/results/sim_NAME.json`` and under ``sim_NAME`` of
    ``results_json`` (its other keys kept)."""
    from results_io import write_json

    write_json(f"sim_{name}", {**figures, "load_average": os.getloadavg()[0]})
    data = json.loads(results_json.read_text(encoding="utf-8")) if results_json.exists() else {}
    data[f"sim_{name}"] = figures
    results_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
