"""Does the tiny model learn? Run `tidal run` on CPU and show the per-step mean reward rising.

Owns: one end-to-end run in a scratch directory, its reward table and plot, and the ``train_curve``
section. Exit 0 when the last window beats the first by ``--min-gain``, 1 when not, 2 when the run
failed. Must not: reuse a store or Prefect home of anyone else. Details: ``docs/benchmarks.md``.

Usage:
    .venv/bin/python benchmarks/train_curve.py [--config tiny-cpu] [--steps N] [--set k=v ...]
        [--window 5] [--min-gain 0.1] [--workdir DIR] [--plot PATH] [--results PATH | --no-results]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.procs import wait_or_stop  # noqa: E402
from benchmarks.results_io import write_section  # noqa: E402
from config import load_config  # noqa: E402
from storage import make_engine, read_step_metrics, run_summaries, session_scope  # noqa: E402

REWARD = "train/reward_mean"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny-cpu", help="preset name or YAML path (default tiny-cpu)")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps (default: the preset's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override, passed to `tidal run --set` (repeatable)")
    p.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end (default 5)")
    p.add_argument("--min-gain", type=float, default=0.1,
                   help="required rise of the mean reward, last window minus first window (default 0.1)")
    p.add_argument("--workdir", default=None, help="scratch dir for the store, run outputs and PREFECT_HOME "
                   "(default: a fresh temp dir)")
    p.add_argument("--plot", default=str(ROOT / "benchmarks" / "plots" / "reward_curve.png"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-results", action="store_true", help="do not write to RESULTS.md")
    p.add_argument("--timeout", type=float, default=1800.0, help="kill the run after this many seconds")
    return p.parse_args(argv)


def run_training(args: argparse.Namespace, workdir: Path) -> tuple[list[str], float, int, Path]:
    """`tidal run` in ``workdir``; returns (command, wall seconds, exit code, log path)."""
    overrides = [f"storage.url=sqlite:///{workdir / 'tidal.db'}", f"trainer.default_local_dir={workdir / 'runs'}"]
    if args.steps is not None:
        overrides.append(f"trainer.total_training_steps={args.steps}")
    overrides += args.overrides
    tidal = Path(sys.executable).parent / "tidal"
    base = [str(tidal)] if tidal.exists() else [sys.executable, "-m", "flows.cli"]
    cmd = [*base, "run", args.config]
    for o in overrides:
        cmd += ["--set", o]
    env = dict(os.environ, PREFECT_HOME=str(workdir / "prefect"))
    env.pop("PREFECT_API_URL", None)  # ephemeral Prefect + in-process task runner: no shared server
    # the ephemeral server's telemetry heartbeat races the first flow run for its SQLite file and
    # logs "database is locked" tracebacks (harmless; the machines are offline anyway)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log = workdir / "run.log"
    print(f"running: {shlex.join(cmd)}\n  (PREFECT_HOME={env['PREFECT_HOME']}, log {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        code = wait_or_stop(proc, args.timeout)
    return cmd, time.perf_counter() - t0, code, log


def read_steps(workdir: Path) -> tuple[str, list[dict]]:
    engine = make_engine(f"sqlite:///{workdir / 'tidal.db'}")
    try:
        with session_scope(engine) as s:
            runs = run_summaries(s)
            if not runs:
                raise RuntimeError(f"no run in the store at {workdir / 'tidal.db'}")
            uid = runs[-1].uid
            return uid, read_step_metrics(s, uid)
    finally:
        engine.dispose()


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def summarize(rows: list[dict], window: int) -> dict:
    rewards = [float(r.get(REWARD, math.nan)) for r in rows]
    trained = [r for r, x in zip(rows, rewards) if not math.isnan(x)]
    vals = [float(r[REWARD]) for r in trained]
    w = max(1, min(window, len(vals) // 2 or 1))
    first, last = _mean(vals[:w]), _mean(vals[-w:])
    return {
        "steps": len(trained),
        "window": w,
        "first": first,
        "last": last,
        "gain": last - first,
        "max": max(vals, default=math.nan),
        "step_wall_s": sum(float(r.get("wall_s") or 0.0) for r in rows),
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'step':>5} {'version':>7} {'step s':>7} {'reward':>7} {'r std':>6} {'resp len':>8} "
          f"{'staleness':>9} {'hybrid':>6}")
    for r in rows:
        print(f"{r['step']:>5} {r.get('param_version', 0):>7} {float(r.get('wall_s') or 0):>7.2f} "
              f"{r.get(REWARD, math.nan):>7.3f} {r.get('train/reward_std', math.nan):>6.3f} "
              f"{r.get('train/response_length_mean', math.nan):>8.2f} "
              f"{r.get('fully_async/max_staleness', math.nan):>9.0f} "
              f"{'lent' if r.get('hybrid_active_after') else '-':>6}")


def plot(rows: list[dict], summary: dict, wall_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r.get(REWARD, math.nan) for r in rows]
    w = summary["window"]
    smooth = [_mean(rewards[max(0, i - w + 1): i + 1]) for i in range(len(rewards))]
    def secs(t) -> float:  # the store keeps epoch seconds; accept datetimes too
        return t.timestamp() if hasattr(t, "timestamp") else float(t)

    t0 = min(secs(r["started_at"]) for r in rows)
    elapsed = [secs(r["finished_at"]) - t0 for r in rows]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    a1.plot(steps, rewards, "o", ms=3, alpha=0.5, label="per step")
    a1.plot(steps, smooth, "-", lw=2, label=f"mean of last {w}")
    a1.axhline(summary["first"], color="grey", ls=":", lw=1)
    a1.axhline(summary["last"], color="grey", ls="--", lw=1)
    a1.set_xlabel("step (one weight sync)")
    a1.set_ylabel("mean reward (train/reward_mean)")
    a1.set_ylim(bottom=0)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a2.plot(elapsed, smooth, "-", lw=2)
    a2.set_xlabel("seconds since step 1 started (wall)")
    a2.set_ylabel(f"mean reward (last {w} steps)")
    a2.set_ylim(bottom=0)
    a2.grid(alpha=0.3)
    fig.suptitle(f"{title}: first {w} steps {summary['first']:.3f} → last {w} {summary['last']:.3f}; "
                 f"whole run {wall_s:.0f} s wall", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def results_section(args, cmd_line: str, cfg, uid: str, rows: list[dict], s: dict, wall_s: float,
                    plot_path: Path) -> str:
    r, a, m = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor, cfg.model
    every = max(1, len(rows) // 10)
    picked = [row for i, row in enumerate(rows) if i % every == 0 or i == len(rows) - 1]
    try:
        rel_plot = plot_path.resolve().relative_to(ROOT / "benchmarks")
    except ValueError:
        rel_plot = plot_path
    lines = [
        "",
        "## Reward curve: the tiny model learns on CPU (`train_curve.py`)",
        "",
        f"Command: `{cmd_line}`",
        f"(it runs `tidal run {args.config}` with its own store, run dir and `PREFECT_HOME` in a scratch dir).",
        f"Machine: {os.cpu_count()}-core {platform.machine()} CPU VM shared with other jobs; "
        f"run `{uid}`, {time.strftime('%Y-%m-%d')}.",
        "",
        f"Config: task `{cfg.task.name}`, TinyLM {m.n_layer} layers × {m.n_embd} wide ({m.n_head} heads, "
        f"max_seq_len {m.max_seq_len}), GRPO n={r.n} responses per prompt, {cfg.required_samples} prompts per "
        f"micro-step × {cfg.async_training.trigger_parameter_sync_step} micro-steps per step, AdamW lr {a.lr}, "
        f"response_length {r.response_length}, temperature {r.temperature}; 1 trainer GPU (lent as a hybrid) + "
        f"1 rollout GPU, policy `{cfg.async_training.dynamic_schedule_policy}`.",
        "",
        f"**Mean reward, first {s['window']} steps → last {s['window']} steps: {s['first']:.3f} → {s['last']:.3f}** "
        f"(+{s['gain']:.3f}; best step {s['max']:.3f}) over {s['steps']} steps. "
        f"Wall time of the whole `tidal run`: {wall_s:.0f} s ({wall_s / 60:.1f} min), of which "
        f"{s['step_wall_s']:.0f} s inside the steps' own timers (the rest: Ray + actor start-up, one Prefect "
        f"subflow per step, report).",
        "",
        "| step | step s | mean reward | reward std | response length |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in picked:
        lines.append(f"| {row['step']} | {float(row.get('wall_s') or 0):.2f} | {row.get(REWARD, math.nan):.3f} | "
                     f"{row.get('train/reward_std', math.nan):.3f} | "
                     f"{row.get('train/response_length_mean', math.nan):.2f} |")
    lines += ["", f"Plot: `{rel_plot}`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tidal-curve-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    steps = [] if args.steps is None else [f"trainer.total_training_steps={args.steps}"]
    cfg = load_config(args.config, [*steps, *args.overrides])
    cmd, wall_s, code, log = run_training(args, workdir)
    if code != 0:
        print(f"`tidal run` exited with {code} after {wall_s:.0f} s; last lines of {log}:", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
        return 2
    uid, rows = read_steps(workdir)
    if not rows:
        print(f"run {uid} committed no step", file=sys.stderr)
        return 2
    s = summarize(rows, args.window)
    print_table(rows)
    print(f"\nrun {uid}: {s['steps']} steps in {wall_s:.0f} s wall ({s['step_wall_s']:.0f} s inside steps)")
    print(f"mean reward: first {s['window']} steps {s['first']:.3f}  →  last {s['window']} steps {s['last']:.3f}  "
          f"(gain {s['gain']:+.3f}, best step {s['max']:.3f})")
    plot_path = Path(args.plot)
    plot(rows, s, wall_s, plot_path, f"{args.config} ({cfg.task.name})")
    print(f"plot: {plot_path}")
    if not args.no_results:
        own = ["benchmarks/train_curve.py"]
        if args.config != "tiny-cpu":
            own += ["--config", args.config]
        if args.steps is not None:
            own += ["--steps", str(args.steps)]
        for o in args.overrides:
            own += ["--set", o]
        if args.window != 5:
            own += ["--window", str(args.window)]
        if Path(args.plot).resolve() != (ROOT / "benchmarks" / "plots" / "reward_curve.png"):
            own += ["--plot", args.plot]
        cmd_line = ".venv/bin/python " + shlex.join(own)
        # its own block (replaced on every run, not appended): the notes after it stay
        write_section("train_curve", results_section(args, cmd_line, cfg, uid, rows, s, wall_s, plot_path),
                      Path(args.results))
        print(f"wrote the train_curve section of {args.results}")
    ok = s["gain"] >= args.min_gain
    print("OK: the mean reward rose" if ok else f"FAIL: gain {s['gain']:+.3f} < --min-gain {args.min_gain}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
