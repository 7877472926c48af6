"""Learning unharmed: does lending the trainer's GPUs to rollout change the reward curve?

Owns: `tidal run` per preset, policy and seed (never lending, `predictive`, `default`), one after
the other, each in a scratch directory of its own; the never-lending band per step (min, mean and
max over its seeds) and, per lending policy, whether its per-step seed mean stays inside that band;
``benchmarks/results/learning.json``, the markdown fragment ``benchmarks/results/learning.md`` and
one plot per preset ``benchmarks/plots/learning_<preset>.png``. Must not: let the runs of a preset
differ in anything but the policy and the seed, or write RESULTS.md / results.json (merged by hand).

Usage:
    .venv/bin/python benchmarks/learning.py [--presets main,tiny-hf] [--seeds 0,1,2] [--steps N]
        [--workdir DIR] [--no-write]
A run whose ``rows.json`` is already in ``--workdir`` is read back, not run again (to resume or re-render).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from bench_compare import SETUPS as COMPARE_SETUPS  # noqa: E402
from results_io import RESULTS_DIR, write_json  # noqa: E402
from train_curve import REWARD, read_steps, run_training  # noqa: E402

from config import ConfigError, load_config  # noqa: E402
from flows.compare import LAST_REWARDS, NEVER_LEND, setup_overrides  # noqa: E402
from metrics import lent_steps  # noqa: E402

NEVER = "never lend"
POLICIES: dict[str, list[str]] = {
    # what `tidal compare` runs for never lending (static_fully_async refuses a switch-cost prior)
    NEVER: setup_overrides(NEVER),
    # bench_compare's setups: the CPU switch-cost prior, without which neither policy lends here
    "predictive": COMPARE_SETUPS["predictive"],
    "default": COMPARE_SETUPS["default"],
}
VAL_PREFIX = "val-core/"
BEFORE = "/before_train"
PRESETS = ("main", "tiny-hf")
SEEDS = (0, 1, 2)
TIMEOUT_S = 900.0
EPS = 1e-12
"""Rounding room at the band's edges (a mean of equal values may land an ulp outside them)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"error: {message}\n")


# ------------------------------------------------------------------------------------------
# Pure parts: bands and excursions over per-step numbers
# ------------------------------------------------------------------------------------------

def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def per_step(rows: Sequence[Mapping[str, Any]], key: str = REWARD) -> dict[int, float]:
    """``key`` per committed step of one run, the steps where it is a finite number."""
    return {int(r["step"]): float(r[key]) for r in rows if _finite(r.get(key))}


def band(seed_curves: Sequence[Mapping[int, float]]) -> dict[int, tuple[float, float, float]]:
    """Per step present in every curve: (min, mean, max) over the curves (one per seed)."""
    steps = sorted(set.intersection(*(set(c) for c in seed_curves))) if seed_curves else []
    return {s: (min(c[s] for c in seed_curves), statistics.fmean(c[s] for c in seed_curves),
                max(c[s] for c in seed_curves)) for s in steps}


def against_band(curve: Mapping[int, float], ref: Mapping[int, tuple[float, float, float]]) -> dict[str, Any]:
    """Where ``curve`` (a policy's per-step seed mean) leaves ``ref`` (never lending's band), over
    the steps both have: which steps lie outside, how many below (worse than every never-lending
    seed) and above, and the largest distance outside (signed: negative below the band, positive
    above; 0 when always inside)."""
    steps = sorted(set(curve) & set(ref))
    outside, below, worst = [], 0, 0.0
    for s in steps:
        lo, _, hi = ref[s]
        gap = curve[s] - hi if curve[s] > hi + EPS else curve[s] - lo if curve[s] < lo - EPS else 0.0
        if gap:
            outside.append(s)
            below += gap < 0
            if abs(gap) > abs(worst):
                worst = gap
    return {"steps_compared": len(steps), "steps_outside": outside, "n_outside": len(outside), "n_below": below,
            "n_above": len(outside) - below, "max_excursion": worst, "inside": not outside}


def final_reward(curve: Mapping[int, float], last: int = LAST_REWARDS) -> float:
    """The mean of the last ``last`` steps' values (one step's mean reward is noisy)."""
    tail = [curve[s] for s in sorted(curve)[-last:]]
    return statistics.fmean(tail) if tail else math.nan


def summarize_policy(seed_curves: Mapping[int, Mapping[int, float]], ref: Mapping[int, tuple[float, float, float]],
                     last: int = LAST_REWARDS) -> dict[str, Any]:
    """One policy over its seeds: its per-step band, its final reward (per seed and their mean) and
    where its seed mean leaves ``ref``."""
    own = band(list(seed_curves.values()))
    finals = {seed: final_reward(c, last) for seed, c in seed_curves.items()}
    return {
        "final_reward": statistics.fmean(finals.values()) if finals else math.nan,
        "final_reward_per_seed": finals,
        "band": {s: list(v) for s, v in own.items()},
        **against_band({s: m for s, (_, m, _) in own.items()}, ref),
    }


def validation_summary(key: str, curves: Mapping[str, Mapping[int, Mapping[int, float]]]) -> dict[str, Any]:
    """The validation reward per policy: its band over seeds per validated step and, for a lending
    policy, where its seed mean leaves never lending's band."""
    bands = {p: band(list(c.values())) for p, c in curves.items()}
    return {"metric": key, "band": {p: {s: list(v) for s, v in b.items()} for p, b in bands.items()},
            "against_never_lend": {p: against_band({s: m for s, (_, m, _) in b.items()}, bands[NEVER])
                                   for p, b in bands.items() if p != NEVER}}


def plot(preset: str, curves: Mapping[str, Mapping[int, Mapping[int, float]]], path: Path,
         val: Mapping[str, Mapping[int, Mapping[int, float]]] | None = None) -> Path:
    """Per policy its seed mean per step, its min–max over seeds shaded; a second panel for the
    validation reward when ``val`` has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mean train reward per step", curves)]
    if val and any(any(c.values()) for c in val.values()):
        panels.append(("validation reward", val))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, (title, data) in zip(axes[0], panels):
        for i, (policy, per_seed) in enumerate(data.items()):
            b = band(list(per_seed.values()))
            if not b:
                continue
            steps = list(b)
            color = f"C{i}"
            ax.fill_between(steps, [b[s][0] for s in steps], [b[s][2] for s in steps], color=color, alpha=0.2, lw=0)
            ax.plot(steps, [b[s][1] for s in steps], color=color, lw=1.8, marker="o" if len(steps) < 8 else None,
                    label=f"{policy} (mean of {len(per_seed)} seeds; band min–max)")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{preset}: never lending vs lending, same seeds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------

def preset_config(preset: str, work: Path) -> tuple[str, list[str]]:
    """What to pass `tidal run` for ``preset``: a tiny-hf preset's model and data are built once
    into ``work`` and named by absolute path (each run has a working directory of its own)."""
    from models.hf import TINY_PRESETS, ensure_tiny

    if preset not in TINY_PRESETS:
        return preset, []
    root = work / preset.replace("/", "_") / "files"
    ensure_tiny(root, n_head=TINY_PRESETS[preset][1])
    return str(ROOT / "config" / "presets" / f"{preset}.yaml"), [
        f"actor_rollout_ref.model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}"]


def checked_config(preset: str, work: Path, steps: list[str]) -> tuple[str, list[str]]:
    """``preset_config``, after every policy's config has loaded (``ConfigError`` otherwise)."""
    config, files = preset_config(preset, work)
    for extra in POLICIES.values():
        load_config(config, [*files, *steps, *extra])
    return config, files


def one_run(config: str, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One `tidal run` in ``run_dir`` (or its saved ``rows.json``): its uid, wall seconds, rows."""
    saved = run_dir / "rows.json"
    if saved.exists():
        return json.loads(saved.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(config=config, steps=None, overrides=overrides, timeout=TIMEOUT_S)
    _, wall_s, code, log = run_training(ns, run_dir)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"`tidal run` exited with {code} after {wall_s:.0f} s ({log}):\n{tail}")
    uid, rows = read_steps(run_dir)
    out = {"uid": uid, "wall_s": wall_s, "rows": rows}
    saved.write_text(json.dumps(out, default=str))
    return out


def val_keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The validation reward metrics of a run (``val-core/<source>/reward/mean@<n>``)."""
    return sorted({k.removesuffix(BEFORE) for r in rows for k in r if k.startswith(VAL_PREFIX) and "/reward/" in k})


def val_curve(rows: Sequence[Mapping[str, Any]], key: str) -> dict[int, float]:
    """``key`` per validated step, with the validation before training (stored on step 1) as step 0."""
    before = per_step(rows, key + BEFORE)
    return {**({0: next(iter(before.values()))} if before else {}), **per_step(rows, key)}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(command: str, date: str, commit: str, n_runs: int, wall_s: float, results: Mapping[str, Any],
             plots: Sequence[Path]) -> str:
    """The RESULTS.md-style section; ``date`` when the last run finished, ``wall_s`` the runs' summed wall."""
    lines = [
        "## Learning unharmed: never lending vs `predictive` vs `default` (`learning.py`)",
        "",
        f"Command: `{command}` (runs finished {date}, commit `{commit[:10]}`; {n_runs} `tidal run`s one at a time, "
        f"{wall_s / 60:.0f} min together on the 2-core VM shared with other jobs). Each run is `tidal run PRESET` "
        "in a scratch directory of its own, differing only "
        f"in `trainer.seed` and the policy (never lending = `{NEVER_LEND}`; `predictive` and `default` with "
        "bench_compare's CPU switch-cost prior, without which they never lend here). The band is never "
        "lending's min–max over its seeds, per step; a lending policy is inside when its per-step mean over "
        f"seeds lies in that band at every step. Final reward: mean of the last {LAST_REWARDS} steps, mean over "
        "seeds.",
        "",
        "| preset | policy | seeds | steps | steps lent (per seed) | final reward (per seed) | inside the band | "
        "steps outside | largest excursion |",
        "|---|---|---|---:|---|---|---|---:|---:|",
    ]
    verdicts = []
    for preset, p in results.items():
        for policy, r in p["policies"].items():
            per_seed = ", ".join(f"{v:.3f}" for v in r["final_reward_per_seed"].values())
            lent = ", ".join(str(v) for v in r["lent_steps_per_seed"].values())
            inside = "—" if policy == NEVER else ("yes" if r["inside"] else "no")
            outside = "—" if policy == NEVER else (f"{r['n_outside']} of {r['steps_compared']} "
                                                    f"({r['n_below']} below, {r['n_above']} above)")
            exc = "—" if policy == NEVER else f"{r['max_excursion']:+.3f}"
            lines.append(f"| {preset} | `{policy}` | {len(r['seeds'])} | {r['steps']} | {lent} | "
                         f"**{r['final_reward']:.3f}** ({per_seed}) | {inside} | {outside} | {exc} |")
            if policy != NEVER:
                verdicts.append((preset, policy, r))
    for preset, p in results.items():
        if (v := p.get("validation")) is None:
            lines += ["", f"{preset}: {p['validation_note']}."]
            continue
        lines += ["", f"{preset}, validation `{v['metric']}` (greedy; step 0 = before training), mean [min–max] "
                  "over seeds:", ""]
        for pol, b in v["band"].items():
            where = v["against_never_lend"].get(pol)
            verdict = "" if where is None else (" — inside the never-lending band" if where["inside"] else
                                                f" — outside at {where['n_outside']} of {where['steps_compared']} "
                                                f"validations (largest {where['max_excursion']:+.3f})")
            lines.append(f"- `{pol}`: " + ", ".join(f"step {s}: {m:.3f} [{lo:.3f}–{hi:.3f}]"
                                                    for s, (lo, m, hi) in b.items()) + verdict)
    lines.append("")
    outside = [f"`{pol}` on {pre} ({r['n_outside']} of {r['steps_compared']} steps: {r['n_below']} below the band, "
               f"{r['n_above']} above; largest excursion {r['max_excursion']:+.3f})"
               for pre, pol, r in verdicts if not r["inside"]]
    if not outside:
        lines.append("**Every lending run's per-step seed mean stays inside the never-lending band at every step.**")
    else:
        inside = [f"`{pol}` on {pre}" for pre, pol, r in verdicts if r["inside"]]
        lines.append("**Outside the never-lending band:** " + "; ".join(outside) + "."
                     + (" Inside at every step: " + ", ".join(inside) + "." if inside else ""))
    idle = [f"`{pol}` on {pre}" for pre, pol, r in verdicts if not any(r["lent_steps_per_seed"].values())]
    if idle:
        lines.append("")
        lines.append(", ".join(idle) + " lent on no step: a second never-lending run with the same seeds, so its "
                     "steps outside the band measure how far two runs of one seed land apart here, not lending.")
    rel = [p.relative_to(BENCH) if p.is_relative_to(BENCH) else p for p in plots]
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in rel), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated (default main,tiny-hf)")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="trainer.seed values (default 0,1,2)")
    ap.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps (default: the preset's)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a fresh temp dir); "
                    "runs already finished there are read back")
    ap.add_argument("--no-write", action="store_true", help="print only; plots go to the scratch dir")
    args = ap.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        ap.error(f"--seeds must be integers separated by commas; got {args.seeds!r}")
    if not args.presets or len(args.seeds) < 2:
        ap.error("give at least one preset and two seeds (a band needs two)")
    if args.steps is not None and args.steps < 2:
        ap.error(f"--steps {args.steps}: must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = [] if args.steps is None else [f"trainer.total_training_steps={args.steps}"]
    work = (args.workdir or Path(tempfile.gettempdir()) / f"tidal-learning-{os.getpid()}").resolve()
    try:  # every preset and policy loads before anything runs
        configs = {preset: checked_config(preset, work, steps) for preset in args.presets}
    except ConfigError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"scratch: {work}", flush=True)
    started, total = time.perf_counter(), len(args.presets) * len(POLICIES) * len(args.seeds)
    results: dict[str, Any] = {}
    plots: list[Path] = []
    k, wall_s, finished = 0, 0.0, 0.0
    for preset, (config, files) in configs.items():
        runs: dict[str, dict[int, dict]] = {p: {} for p in POLICIES}
        for i, seed in enumerate(args.seeds):
            for policy in (list(POLICIES) if i % 2 == 0 else list(POLICIES)[::-1]):  # drift favours no policy
                k += 1
                run_dir = work / preset.replace("/", "_") / f"{policy.replace(' ', '-')}-s{seed}"
                run = one_run(config, [*files, *steps, f"trainer.seed={seed}", *POLICIES[policy]], run_dir)
                rows = run["rows"]
                curve = per_step(rows)
                print(f"[{k}/{total}] {preset} {policy} seed {seed}: {len(rows)} steps, {run['wall_s']:.0f} s, "
                      f"lent {len(lent_steps(rows))}, reward {final_reward(curve):.3f} (last {LAST_REWARDS}) "
                      f"[{time.perf_counter() - started:.0f} s so far]", flush=True)
                runs[policy][seed] = run
                wall_s += run["wall_s"]
                finished = max(finished, float(rows[-1]["finished_at"]))
        curves = {p: {s: per_step(r["rows"]) for s, r in per_seed.items()} for p, per_seed in runs.items()}
        ref = band(list(curves[NEVER].values()))
        keys = sorted({key for per_seed in runs.values() for r in per_seed.values() for key in val_keys(r["rows"])})
        val_curves = {p: {s: val_curve(r["rows"], keys[0]) for s, r in per_seed.items()}
                      for p, per_seed in runs.items()} if keys else None
        policies = {}
        for p, per_seed in curves.items():
            s = summarize_policy(per_seed, ref)
            s.update(seeds=list(per_seed), steps=len(ref),
                     lent_steps_per_seed={seed: len(lent_steps(r["rows"])) for seed, r in runs[p].items()},
                     uids={seed: r["uid"] for seed, r in runs[p].items()},
                     wall_s={seed: round(r["wall_s"], 1) for seed, r in runs[p].items()})
            if p == NEVER:
                for key in ("inside", "n_outside", "n_below", "n_above", "steps_outside", "max_excursion",
                            "steps_compared"):
                    s.pop(key)
            policies[p] = s
        results[preset] = {
            "config": config,
            "policies": policies,
            "never_lend_band": {st: list(v) for st, v in ref.items()},
            "validation": validation_summary(keys[0], val_curves) if keys else None,
            "validation_note": None if keys else "the preset does not validate (no val-core/ metric in its steps)",
        }
        plot_dir = work / "plots" if args.no_write else BENCH / "plots"
        plots.append(plot(preset, curves, plot_dir / f"learning_{preset.replace('/', '_')}.png", val_curves))
    own = ["benchmarks/learning.py"]
    if args.presets != list(PRESETS):
        own += ["--presets", ",".join(args.presets)]
    if args.seeds != list(SEEDS):
        own += ["--seeds", ",".join(map(str, args.seeds))]
    if args.steps is not None:
        own += ["--steps", str(args.steps)]
    command = ".venv/bin/python " + shlex.join(own)
    date, commit = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(finished)), git_commit()
    text = markdown(command, date, commit, k, wall_s, results, plots)
    print(text)
    if not args.no_write:
        (RESULTS_DIR / "learning.md").write_text(f"<!-- learning -->\n{text.rstrip()}\n<!-- /learning -->\n")
        data = {"command": command, "date": date, "git_commit": commit, "runs_wall_s": round(wall_s, 1),
                "last_rewards": LAST_REWARDS, "policies": {p: o for p, o in POLICIES.items()}, "presets": results}
        print(f"wrote {write_json('learning', data)}, {RESULTS_DIR / 'learning.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
