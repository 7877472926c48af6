"""Real compute on CPU: static split vs dynamic scheduling vs colocated, side by side.

Owns: running `tidal run` per preset, seed and setup on 2 cores, the fluid bound, and its RESULTS.md
section, ``benchmarks/results/compare.json`` and plots. Must not: let the setups differ in anything but
the split and the policy (same samples, seeds, machine). Setups, order and bounds: ``docs/benchmarks.md``.

Usage:
    .venv/bin/python benchmarks/bench_compare.py [--presets rollout-bound,training-bound]
        [--seeds 0,1,2,3,4] [--setups static,default,predictive,fixed_ratio,colocated,static_again] [--steps N]
        [--workdir DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from config import ConfigError, load_config  # noqa: E402
from results_io import write_json, write_section  # noqa: E402

CPU_PRIOR_SWITCH_S = 0.3
"""The switch cost per lend cycle that `default` and `predictive` assume here until they have
measured one. Their own priors (10 s, 6 s) are ~3× and ~2× the ≈ 3.5 s a lend cycle costs on a GPU
node; a lend cycle costs ≈ 0.1 s on these CPUs (the last compare's `switch s` over its 15 lends),
so ~3× that. With the GPU priors neither policy ever lends here (a step's whole wait is 2–4 s),
so it never measures a switch, and the compare would test nothing."""
PRIOR = f"async_training.dynamic_schedule_prior_switch_s={CPU_PRIOR_SWITCH_S}"
SETUPS: dict[str, list[str]] = {
    "static": ["async_training.dynamic_schedule_policy=static_fully_async"],
    "default": ["async_training.dynamic_schedule_policy=default", PRIOR],
    "predictive": ["async_training.dynamic_schedule_policy=predictive", PRIOR],
    "fixed_ratio": ["async_training.dynamic_schedule_policy=fixed_ratio"],
    "colocated": ["rollout.nnodes=0", "trainer.n_gpus_per_node=2", "async_training.dynamic_schedule_policy=default"],
    # static once more, the same seed: how far two identical runs land apart on this machine
    "static_again": ["async_training.dynamic_schedule_policy=static_fully_async"],
}
PRESET_SETUPS = {
    "rollout-bound": ["static", "default", "predictive", "fixed_ratio", "colocated"],
    # the training-bound target (within 2 % of static) is finer than run-to-run noise here: more
    # seeds, and the static run repeated to show how far apart two identical runs land
    "training-bound": ["static", "default", "predictive", "fixed_ratio", "colocated", "static_again"],
}
PRESET_SEEDS = {"rollout-bound": [0, 1, 2, 3, 4], "training-bound": [0, 1, 2, 3, 4]}
DYNAMIC = ("default", "predictive", "fixed_ratio")
REWARD = "train/reward_mean"


# ------------------------------------------------------------------------------------------
# Calibration: per-token costs on one core, measured in this process
# ------------------------------------------------------------------------------------------

async def _gen_cost(cfg, seconds: float) -> float:
    """CPU seconds per generated token: keep the engine's batch full (EOS ignored) for ``seconds``.

    CPU time of this process (the engine's worker thread and the event loop feeding it), so that
    a busy shared machine does not inflate the cost."""
    import torch

    from cluster.builders import model_config, requests_per_replica
    from cluster.engines.torch_engine import TorchEngine
    from models.model import TinyLM
    from data.problems import CharTokenizer, make_problems
    from data.types import GenerationRequest, SamplingSpec

    tok = CharTokenizer()
    mcfg = model_config(cfg, tok)
    batch = requests_per_replica(cfg)
    prompts = [tok.encode(p.prompt) for p in make_problems(cfg.task.name, 256, seed=1)]
    engine = TorchEngine(mcfg, max_batch=batch, threads=1, eos_id=tok.eos_id, seed=0)
    torch.manual_seed(0)
    await engine.load_weights(TinyLM(mcfg).state_dict(), 0)
    r = cfg.actor_rollout_ref.rollout
    spec = SamplingSpec(r.response_length, temperature=r.temperature, ignore_eos=True)
    counter = 0

    async def worker(deadline: float) -> None:
        nonlocal counter
        while time.perf_counter() < deadline:
            counter += 1
            await engine.generate(GenerationRequest(f"c{counter}", prompts[counter % len(prompts)], spec))

    await asyncio.gather(*(worker(time.perf_counter() + 0.5) for _ in range(batch)))  # warm-up
    before = engine.stats()["generated_tokens"]
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(t0 + seconds) for _ in range(batch)))
    cpu = time.process_time() - c0
    tokens = engine.stats()["generated_tokens"] - before
    await engine.shutdown()
    return cpu / tokens


def _train_cost(cfg, repeats: int) -> float:
    """CPU seconds per trained token (prompt + response, every response): the torch backend."""
    import torch

    from bench_train import make_batch
    from cluster.backends import build_backend
    from data.problems import CharTokenizer, make_problems

    torch.set_num_threads(1)
    tok = CharTokenizer()
    problems = make_problems(cfg.task.name, cfg.task.num_prompts, cfg.task.seed)
    cfg = cfg.model_copy(update={"engines": cfg.engines.model_copy(update={"train": "torch"})})
    backend = build_backend(cfg, tok, problems)
    batch = make_batch(cfg, tok, problems)
    backend.train_step(batch)  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.process_time()
        result = backend.train_step(batch)
        best = min(best, time.process_time() - t0)
    return best / float(result.metrics["tokens"])


def calibrate(cfg, gen_seconds: float = 4.0, train_repeats: int = 15) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    return {"gen_s_per_token": asyncio.run(_gen_cost(cfg, gen_seconds)),
            "train_s_per_token": _train_cost(cfg, train_repeats), "at": time.time()}


COST_KEYS = ("gen_s_per_token", "train_s_per_token")


def fold_calibrations(samples: list[dict[str, float]]) -> dict[str, Any]:
    """The per-token costs the fluid bound uses: the lowest of each over ``samples`` (calibrations
    before and after a preset's runs). The host's speed drifts by tens of percent over minutes, and
    a calibration taken in a slow spell would make the bound too loose; the bound is what the
    machine can do at its fastest, so the lowest cost is the right one."""
    return {**{k: min(c[k] for c in samples) for k in COST_KEYS}, "samples": samples}


def fluid_bound_s(gen_tokens: float, train_tokens: float, cal: dict[str, Any]) -> float:
    """Seconds two perfectly shared cores would need for this useful work at the calibrated costs."""
    return (gen_tokens * cal["gen_s_per_token"] + train_tokens * cal["train_s_per_token"]) / 2.0


def apply_calibration(r: dict[str, Any], cal: dict[str, Any]) -> None:
    """(Re)compute a summarized run's isolated fluid bound and its fraction with ``cal``."""
    r["fluid_bound_s"] = fluid_bound_s(r["gen_tokens"], r["train_tokens"], cal)
    r["fraction_of_fluid_bound"] = r["fluid_bound_s"] / r["wall_s"] if r["wall_s"] > 0 else math.nan


# ------------------------------------------------------------------------------------------
# Where the two cores went: CPU seconds per kind of process during a run
# ------------------------------------------------------------------------------------------

CPU_KINDS = (
    ("standalone replica", ("ray::ReplicaActor",)),
    ("trainer + hybrid", ("ray::TrainerActor",)),
    ("rollout service", ("ray::RolloutService",)),
    ("controller", ("ray::ControllerActor",)),
    ("Prefect server", ("prefect.server.api.server", "uvicorn")),
    ("driver", ("bin/tidal", "flows.cli")),
    ("Ray daemons", ("gcs_server", "raylet", "ray::", "ray/dashboard", "ray/_private", "ray/autoscaler")),
)


SHARE_KEYS = (*(kind for kind, _ in CPU_KINDS), "other", "idle")
"""The keys of a CPU-shares dict: every kind, the processes of no kind, and the machine's idle time."""


def _cpu_kind(cmdline: str) -> str:
    for kind, needles in CPU_KINDS:
        if any(n in cmdline for n in needles):
            return kind
    return "other"


class CpuSampler:
    """Samples every process's CPU seconds twice a second while a run lasts; ``shares()`` is each
    kind's CPU time over the window as a fraction of both cores, plus what stayed idle. Processes
    that end between samples lose at most their last half second. ``series`` keeps, per sample,
    the epoch time and each kind's CPU seconds so far (and the machine's idle seconds), so that
    ``window_shares`` can take any part of the run (the steps, without the start-up)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self._stop = interval_s, threading.Event()
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self.series: list[tuple[float, dict[str, float]]] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        for p in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            times = p.info["cpu_times"]
            if times is None:
                continue
            used = times.user + times.system
            pid = p.info["pid"]
            self._first.setdefault(pid, used)
            # the latest title (a Ray worker is ray::IDLE until it becomes an actor); a zombie has
            # no command line left and keeps the kind it had
            cmdline = " ".join(p.info["cmdline"] or [])
            kind = _cpu_kind(cmdline) if cmdline or pid not in self._last else self._last[pid][0]
            self._last[pid] = (kind, used)
        so_far: dict[str, float] = {}
        for pid, (kind, used) in self._last.items():
            so_far[kind] = so_far.get(kind, 0.0) + max(0.0, used - self._first[pid])
        cpu = psutil.cpu_times()
        so_far["idle"] = cpu.idle + getattr(cpu, "iowait", 0.0)
        self.series.append((time.time(), so_far))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._t0, self._cpu0 = time.perf_counter(), psutil.cpu_times()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.wall_s, cpu1 = time.perf_counter() - self._t0, psutil.cpu_times()
        self.idle_s = (cpu1.idle - self._cpu0.idle) + (getattr(cpu1, "iowait", 0.0) - getattr(self._cpu0, "iowait", 0.0))

    def shares(self, cores: int = 2) -> dict[str, float]:
        budget = self.wall_s * cores
        out: dict[str, float] = dict.fromkeys(SHARE_KEYS, 0.0)
        for pid, (kind, used) in self._last.items():
            out[kind] += max(0.0, used - self._first.get(pid, used)) / budget
        out["idle"] = self.idle_s / budget
        return out


def window_shares(series: list, start: float, end: float, cores: int = 2) -> dict[str, float] | None:
    """Each kind's share of ``cores`` between the first sample at or after ``start`` and the last
    at or before ``end`` (epoch seconds); None if fewer than two samples fall inside."""
    inside = [(t, c) for t, c in series if start <= t <= end]
    if len(inside) < 2:
        return None
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    budget = (t1 - t0) * cores
    return {k: max(0.0, c1.get(k, 0.0) - c0.get(k, 0.0)) / budget for k in SHARE_KEYS}


# ------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------

def _save_calibration(cal_file: Path, preset: str, cal: dict[str, Any]) -> None:
    """Put ``preset``'s calibration into ``cal_file`` beside the other presets' (what --reuse reads)."""
    saved = json.loads(cal_file.read_text()) if cal_file.exists() else {}
    cal_file.write_text(json.dumps({**saved, preset: cal}, indent=2))


def _print_costs(c: dict[str, float]) -> None:
    print(f"  c_gen {1e6 * c['gen_s_per_token']:.1f} µs/token, c_train {1e6 * c['train_s_per_token']:.1f} µs/token",
          flush=True)


def tidal_run(preset: str, setup: str, seed: int, work: Path, extra: list[str], ray_address: str | None,
              timeout_s: float) -> tuple[list[str], float, int]:
    """`tidal run bench/PRESET` for one setup and seed in its own store; (command, wall, exit code)."""
    name = f"{preset}-{setup}-s{seed}"
    sets = [f"storage.url=sqlite:///{work / name}.db", f"trainer.default_local_dir={work / name}",
            f"trainer.seed={seed}", f"trainer.experiment_name={name}", *SETUPS[setup], *extra]
    if ray_address:
        sets.append(f"ray.address={ray_address}")
    tidal = Path(sys.executable).parent / "tidal"
    cmd = [str(tidal) if tidal.exists() else sys.executable, *([] if tidal.exists() else ["-m", "flows.cli"]),
           "run", f"bench/{preset}"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PREFECT_HOME=str(work / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log, CpuSampler() as cpu:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = 124
        finally:  # the run's own group only: an ephemeral Prefect server may outlive a killed driver
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    (work / f"{name}.cpu.json").write_text(json.dumps(cpu.shares(), indent=1))
    (work / f"{name}.cpu_series.json").write_text(json.dumps(cpu.series))
    return cmd, time.perf_counter() - t0, code


def read_run(db: Path) -> dict[str, Any]:
    import sqlalchemy as sa

    from storage import make_engine, read_step_metrics, run_summaries, session_scope
    from storage.models import Run, SwitchEvent

    engine = make_engine(f"sqlite:///{db}")
    try:
        with session_scope(engine) as s:
            (summary,) = run_summaries(s)
            rows = read_step_metrics(s, summary.uid)
            run_id = s.scalar(sa.select(Run.id).where(Run.uid == summary.uid))
            kinds = s.execute(sa.select(SwitchEvent.kind, sa.func.count()).where(SwitchEvent.run_id == run_id)
                              .group_by(SwitchEvent.kind)).all()
    finally:
        engine.dispose()
    return {"uid": summary.uid, "status": summary.status, "rows": rows, "switches": dict(kinds)}


def _col(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None]


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def summarize_run(run: dict[str, Any], cal: dict[str, float], process_wall: float, staleness_bound: int) -> dict:
    rows = run["rows"]
    span = float(rows[-1]["finished_at"]) - float(rows[0]["started_at"])
    # train/* are per micro-step means (metrics.aggregate); × micro-steps = the step's total
    micro = [float(r["fully_async/trained_samples"]) / float(r["train/samples"]) for r in rows if r.get("train/samples")]
    gen_tokens = sum(m * float(r["train/response_tokens"]) for m, r in zip(micro, (r for r in rows if r.get("train/samples"))))
    train_tokens = sum(m * float(r["train/tokens"]) for m, r in zip(micro, (r for r in rows if r.get("train/samples"))))
    fluid = fluid_bound_s(gen_tokens, train_tokens, cal)
    return {
        "uid": run["uid"],
        "status": run["status"],
        "steps": len(rows),
        "trained_samples": sum(_col(rows, "fully_async/trained_samples")),
        "wall_s": span,
        "process_wall_s": process_wall,
        "step_s_mean": _mean(_col(rows, "wall_s")),
        "fluid_bound_s": fluid,
        "fraction_of_fluid_bound": fluid / span if span > 0 else math.nan,
        "train_util": _mean(_col(rows, "dynamic_resource/train_resource_utilization")),
        "rollout_util": _mean(_col(rows, "dynamic_resource/rollout_resource_utilization")),
        "cluster_util": _mean(_col(rows, "dynamic_resource/resource_utilization")),
        "mq_size": _col(rows, "dynamic_resource/mq_size"),
        "mq_size_mean": _mean(_col(rows, "dynamic_resource/mq_size")),
        "switches": run["switches"],
        "deactivations": int(run["switches"].get("deactivate", 0)),
        "aborted_tokens": sum(_col(rows, "waste/aborted_tokens")),
        "reprefilled_tokens": sum(_col(rows, "waste/reprefilled_tokens")),
        "switch_s": sum(_col(rows, "waste/switch_s")),
        "reward": _col(rows, REWARD),
        "reward_first3": _mean(_col(rows, REWARD)[:3]),
        "reward_last3": _mean(_col(rows, REWARD)[-3:]),
        "max_staleness": max(_col(rows, "fully_async/max_staleness"), default=math.nan),
        "staleness_bound": staleness_bound,
        "gen_tokens": gen_tokens,
        "train_tokens": train_tokens,
        "train_compute_s": sum(_col(rows, "dynamic_resource/train_compute_time_s")),
    }


def staleness_bound(cfg) -> int:
    """The most versions a trained sample may lag: it was started at most one sync before the
    version that trains it (the started-count cap resets at every sync), plus one for a sample
    started just before a sync and trained after the next one when the queue ran over."""
    return 1 + math.ceil(cfg.async_training.staleness_threshold)


# ------------------------------------------------------------------------------------------
# Summary, plots, report
# ------------------------------------------------------------------------------------------

def _rolling(xs: list[float], w: int = 3) -> list[float]:
    return [_mean(xs[max(0, i - w + 1): i + 1]) for i in range(len(xs))]


def band_check(results: dict[str, dict[int, dict]], setup: str) -> dict[str, Any]:
    """Share of steps where ``setup``'s seed-mean reward (rolling 3) lies inside the static seeds'
    min..max band (rolling 3 each)."""
    static = [_rolling(r["reward"]) for r in results["static"].values()]
    dyn = [_rolling(r["reward"]) for r in results[setup].values()]
    n = min(len(c) for c in static + dyn)
    inside, worst = 0, 0.0
    for i in range(n):
        lo, hi = min(c[i] for c in static), max(c[i] for c in static)
        m = _mean([c[i] for c in dyn])
        if lo - 1e-12 <= m <= hi + 1e-12:
            inside += 1
        else:
            worst = max(worst, lo - m if m < lo else m - hi)
    return {"steps": n, "inside": inside, "share_inside": inside / n if n else math.nan, "worst_outside": worst}


def in_system_bound(static: dict) -> float:
    """The fluid bound with per-sample costs measured inside the system, in the static run of the
    same seed: rollout = the standalone core's busy seconds per trained sample (wall × rollout
    utilization / samples), train = the trainer's compute seconds per sample. It includes what the
    platform itself costs on these shared cores (Ray, the rollout service, Prefect, the driver),
    which the isolated per-token bound does not."""
    n = static["trained_samples"]
    r = static["wall_s"] * static["rollout_util"] / n
    t = static["train_compute_s"] / n
    return n * (r + t) / 2.0


def _train_s_per_token(r: dict) -> float:
    return r["train_compute_s"] / r["train_tokens"] if r["train_tokens"] else math.nan


def summarize_preset(results: dict[str, dict[int, dict]]) -> dict[str, Any]:
    seeds = sorted(results["static"])
    out: dict[str, Any] = {"seeds": seeds, "setups": {}}
    for seed in seeds:
        bound = in_system_bound(results["static"][seed])
        for per_seed in results.values():
            if seed in per_seed:
                per_seed[seed]["in_system_fluid_bound_s"] = bound
                per_seed[seed]["fraction_of_in_system_bound"] = bound / per_seed[seed]["wall_s"]
    for setup, per_seed in results.items():
        ratios = [results["static"][s]["wall_s"] / per_seed[s]["wall_s"] for s in seeds if s in per_seed]
        adjusted = [results["static"][s]["wall_s"] / per_seed[s]["wall_s"]
                    * _train_s_per_token(per_seed[s]) / _train_s_per_token(results["static"][s])
                    for s in seeds if s in per_seed]
        out["setups"][setup] = {
            "wall_s_median": statistics.median(r["wall_s"] for r in per_seed.values()),
            "speedup_vs_static_median": statistics.median(ratios),
            "speedup_vs_static_per_seed": ratios,
            "speedup_speed_adjusted_median": statistics.median(adjusted),
            "speedup_speed_adjusted_per_seed": adjusted,
            "fraction_of_fluid_bound_median": statistics.median(r["fraction_of_fluid_bound"] for r in per_seed.values()),
            "fraction_of_in_system_bound_median": statistics.median(
                r["fraction_of_in_system_bound"] for r in per_seed.values()),
            "train_util": _mean([r["train_util"] for r in per_seed.values()]),
            "rollout_util": _mean([r["rollout_util"] for r in per_seed.values()]),
            "cluster_util": _mean([r["cluster_util"] for r in per_seed.values()]),
            "mq_size_mean": _mean([r["mq_size_mean"] for r in per_seed.values()]),
            "deactivations_mean": _mean([r["deactivations"] for r in per_seed.values()]),
            "aborted_tokens_mean": _mean([r["aborted_tokens"] for r in per_seed.values()]),
            "reprefilled_tokens_mean": _mean([r["reprefilled_tokens"] for r in per_seed.values()]),
            "switch_s_mean": _mean([r["switch_s"] for r in per_seed.values()]),
            "max_staleness": max(r["max_staleness"] for r in per_seed.values()),
            "staleness_bound": next(iter(per_seed.values()))["staleness_bound"],
            "reward_last3_mean": _mean([r["reward_last3"] for r in per_seed.values()]),
        }
        for key in ("cpu_shares", "cpu_shares_steps"):
            cpu = [r[key] for r in per_seed.values() if r.get(key)]
            if cpu:
                out["setups"][setup][key] = {k: _mean([c.get(k, math.nan) for c in cpu]) for k in cpu[0]}
        if setup != "static":
            out["setups"][setup]["reward_band"] = band_check(results, setup)
    best_dyn = max((s for s in DYNAMIC if s in results), key=lambda s: out["setups"][s]["speedup_vs_static_median"],
                   default=None)
    out["best_dynamic"] = best_dyn
    return out


def plot(preset: str, results: dict[str, dict[int, dict]], plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"static": "tab:grey", "default": "tab:blue", "fixed_ratio": "tab:orange", "colocated": "tab:green",
              "static_again": "black", "predictive": "tab:red"}
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    a_rew, a_wall, a_mq = axes
    static = [_rolling(r["reward"]) for r in results["static"].values()]
    n = min(len(c) for c in static)
    steps = list(range(1, n + 1))
    a_rew.fill_between(steps, [min(c[i] for c in static) for i in range(n)], [max(c[i] for c in static) for i in range(n)],
                       color=colors["static"], alpha=0.3, label="static: seed band")
    for setup, per_seed in results.items():
        if setup == "static":
            continue
        curves = [_rolling(r["reward"]) for r in per_seed.values()]
        m = min(len(c) for c in curves)
        a_rew.plot(range(1, m + 1), [_mean([c[i] for c in curves]) for i in range(m)], color=colors.get(setup),
                   lw=2, label=f"{setup}: seed mean")
    a_rew.set_xlabel("step")
    a_rew.set_ylabel("mean reward (rolling 3)")
    a_rew.legend(fontsize=8)
    a_rew.grid(alpha=0.3)
    a_rew.set_title("training quality")
    for setup, per_seed in results.items():  # reward against wall time: the point of the exercise
        for i, r in enumerate(per_seed.values()):
            a_wall.plot(r["_elapsed"], _rolling(r["reward"]), color=colors.get(setup), alpha=0.8, lw=1.5,
                        label=setup if i == 0 else None)
    a_wall.set_xlabel("seconds since step 1 started")
    a_wall.set_ylabel("mean reward (rolling 3)")
    a_wall.legend(fontsize=8)
    a_wall.grid(alpha=0.3)
    a_wall.set_title("reward vs wall clock (every seed)")
    for setup, per_seed in results.items():
        r = per_seed[min(per_seed)]
        a_mq.plot(range(1, len(r["mq_size"]) + 1), r["mq_size"], color=colors.get(setup), marker="o", ms=3, label=setup)
    a_mq.set_xlabel("step")
    a_mq.set_ylabel("samples queued after the step (mq_size)")
    a_mq.legend(fontsize=8)
    a_mq.grid(alpha=0.3)
    a_mq.set_title(f"queue, seed {min(results['static'])}")
    fig.suptitle(f"bench/{preset}: static 1+1 vs dynamic 1+1 vs colocated, real compute on 2 CPU cores")
    fig.tight_layout()
    path = plot_dir / f"compare_{preset.replace('-', '_')}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
    return paths


def markdown(command: str, presets: dict[str, dict], cal: dict[str, dict], runs: dict, load: tuple[float, float],
             plots: list[Path]) -> str:
    lines = [
        "## Real compute on CPU: static vs dynamic vs colocated (`bench_compare.py`)",
        "",
        f"Command: `{command}`",
        "",
        f"2 cores = 2 \"GPUs\"; every run is the whole system (`tidal run`, a Prefect flow per step, Ray actors, torch "
        f"engine, torch GRPO). Setups interleaved seed by seed; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end (the machine is shared: ratios, not absolute times). Wall clock = first step's "
        "start → last step's end; speed-up = static wall / setup wall, median over seeds. Fluid bound = "
        "(generated response tokens × c_gen + trained tokens × c_train) / 2 cores, with per-token costs measured "
        "as CPU seconds in the same benchmark process on one thread before and after the preset's runs, the "
        "lower of the two (the host's speed drifts; the bound is the machine at its fastest) (c_gen: torch engine at the preset's full "
        "concurrency; c_train: torch backend, the preset's PPO epochs); fraction = fluid bound / wall. The "
        "*in-system* bound takes the per-sample costs from the static run of the same seed instead (rollout core "
        "busy seconds and trainer compute seconds per sample), so it includes what Ray, the rollout service, "
        "Prefect and the driver cost on the same two cores.",
        "",
    ]
    for preset, summ in presets.items():
        c = cal[preset]
        lines += [
            f"### bench/{preset}",
            "",
            f"c_gen {1e6 * c['gen_s_per_token']:.1f} µs/token, c_train {1e6 * c['train_s_per_token']:.1f} µs/token"
            + (" (lowest of " + "; ".join(f"{1e6 * x['gen_s_per_token']:.1f} / {1e6 * x['train_s_per_token']:.1f}"
                                          for x in c.get("samples", [])) + ")" if len(c.get("samples", [])) > 1 else "")
            + f"; seeds {summ['seeds']}.",
            "",
            "| setup | wall s (median) | speed-up vs static | per seed | fluid bound / wall (isolated; in-system) "
            "| train / rollout / cluster U "
            "| mean mq_size | deactivations | aborted / re-prefilled tokens | switch s | max staleness (bound) "
            "| reward last 3 | reward in static band |",
            "|---|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|---:|",
        ]
        for setup, s in summ["setups"].items():
            band = s.get("reward_band")
            band_txt = f"{band['inside']}/{band['steps']}" if band else "—"
            lines.append(
                f"| {setup} | {s['wall_s_median']:.1f} | {s['speedup_vs_static_median']:.3f} | "
                f"{', '.join(f'{x:.2f}' for x in s['speedup_vs_static_per_seed'])} | "
                f"{s['fraction_of_fluid_bound_median']:.2f}; {s['fraction_of_in_system_bound_median']:.2f} | "
                f"{s['train_util']:.2f} / {s['rollout_util']:.2f} / "
                f"{s['cluster_util']:.2f} | {s['mq_size_mean']:.1f} | {s['deactivations_mean']:.1f} | "
                f"{s['aborted_tokens_mean']:.0f} / {s['reprefilled_tokens_mean']:.0f} | {s['switch_s_mean']:.2f} | "
                f"{s['max_staleness']:.0f} ({s['staleness_bound']}) | {s['reward_last3_mean']:.3f} | {band_txt} |")
        lines += ["", "Speed-adjusted speed-up vs static (× the run's trainer compute seconds per trained token / "
                  "the static run's, same seed; median, per seed): " + "; ".join(
                      f"{setup} {s['speedup_speed_adjusted_median']:.3f} "
                      f"({', '.join(f'{x:.2f}' for x in s['speedup_speed_adjusted_per_seed'])})"
                      for setup, s in summ["setups"].items() if setup != "static") + "."]
        again = summ["setups"].get("static_again")
        if again:
            spread = [abs(x - 1.0) for x in again["speedup_vs_static_per_seed"]]
            lines += ["", f"Noise floor: `static_again` is the static run repeated with the same seed. The two land "
                      f"{100 * statistics.median(spread):.1f} % apart (median over seeds; largest "
                      f"{100 * max(spread):.1f} %), "
                      f"{100 * statistics.median(abs(x - 1.0) for x in again['speedup_speed_adjusted_per_seed']):.1f} % "
                      "after the speed adjustment."]
        lines.append("")
        for key, what in (("cpu_shares", "over the whole `tidal run` process, start-up included, as a share of "
                                         "2 cores × its wall"),
                          ("cpu_shares_steps", "from step 1's start to the last step's end only (the window the "
                                               "wall clock and the fluid bound are about), as a share of 2 cores")):
            cpu = {setup: s[key] for setup, s in summ["setups"].items() if s.get(key)}
            if not cpu:
                continue
            kinds = list(next(iter(cpu.values())))
            lines += [
                f"Where the two cores went (CPU seconds of each kind of process {what}; mean of seeds; sampled "
                "every 0.5 s with psutil):",
                "",
                "| setup | " + " | ".join(kinds) + " |",
                "|---|" + "---:|" * len(kinds),
            ]
            lines += [f"| {setup} | " + " | ".join(f"{c[k]:.2f}" for k in kinds) + " |" for setup, c in cpu.items()]
            lines.append("")
    lines += ["Plots: " + ", ".join(f"`{p.relative_to(BENCH) if p.is_relative_to(BENCH) else p}`" for p in plots), ""]
    lines += ["Runs (uid, status, steps, trained samples, wall s, whole process s):", ""]
    for key, r in runs.items():
        lines.append(f"- {key}: `{r['uid']}` {r['status']}, {r['steps']} steps, {r['trained_samples']:.0f} samples, "
                     f"{r['wall_s']:.1f} s, {r['process_wall_s']:.1f} s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="rollout-bound,training-bound")
    ap.add_argument("--seeds", default=None, help="for every preset (default: "
                    + "; ".join(f"{p} {','.join(map(str, s))}" for p, s in PRESET_SEEDS.items()) + ")")
    ap.add_argument("--setups", default=None, help="for every preset (default: "
                    + "; ".join(f"{p} {','.join(s)}" for p, s in PRESET_SETUPS.items()) + ")")
    ap.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps (default: the preset's)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--ray-address", default=None, help="use this Ray cluster (default: start one for the benchmark)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per run")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and results/ alone")
    ap.add_argument("--reuse", action="store_true", help="run nothing: read the runs and calibration.json already "
                    "in --workdir (to re-render a finished benchmark)")
    ap.add_argument("--recalibrate", action="store_true", help="with --reuse: calibrate once more now and let "
                    "the bound take the lowest costs of all calibrations (for a benchmark calibrated only before "
                    "its runs)")
    args = ap.parse_args(argv)
    if args.recalibrate and not args.reuse:
        print("error: --recalibrate goes with --reuse (a fresh benchmark calibrates before and after its runs)",
              file=sys.stderr)
        return 2

    presets = [p for p in args.presets.split(",") if p]
    try:
        given_seeds = None if args.seeds is None else [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        print(f"error: --seeds must be integers separated by commas; got {args.seeds!r}", file=sys.stderr)
        return 2
    given_setups = None if args.setups is None else [s for s in args.setups.split(",") if s]
    seeds_of = {p: given_seeds or PRESET_SEEDS.get(p, [0, 1, 2]) for p in presets}
    setups_of = {p: given_setups or PRESET_SETUPS.get(p, PRESET_SETUPS["rollout-bound"]) for p in presets}
    for setups in setups_of.values():
        unknown = [s for s in setups if s not in SETUPS]
        if unknown or "static" not in setups:
            print(f"error: setups must include static and be among {list(SETUPS)}; got {setups}", file=sys.stderr)
            return 2
    extra = list(args.extra) + ([f"trainer.total_training_steps={args.steps}"] if args.steps else [])
    try:  # every preset and --set checked before anything starts
        for preset in presets:
            load_config(f"bench/{preset}", [*extra, *SETUPS["static"]])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="tidal-compare-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"scratch: {work}", flush=True)
    load0 = os.getloadavg()[0]

    cluster = None
    address = args.ray_address
    if address is None and not args.reuse:
        from cluster.ray_cluster import LocalRayCluster

        cluster = LocalRayCluster(num_cpus=2, gpus=2, memory_gb=6.0, object_store_memory_gb=1.0).start()
        address = cluster.address
    try:
        cal, per_preset, runs_flat = {}, {}, {}
        for preset in presets:
            cfg = load_config(f"bench/{preset}", extra)
            cal_file = work / "calibration.json"
            samples = []
            if args.reuse:
                saved = json.loads(cal_file.read_text())[preset]
                samples = list(saved.get("samples") or [saved])
            if not args.reuse or args.recalibrate:
                print(f"calibrating bench/{preset} ...", flush=True)
                samples.append(calibrate(cfg))
                _print_costs(samples[-1])
            cal[preset] = fold_calibrations(samples)
            if not args.reuse or args.recalibrate:
                _save_calibration(cal_file, preset, cal[preset])
            setups = setups_of[preset]
            results: dict[str, dict[int, dict]] = {s: {} for s in setups}
            for k, seed in enumerate(seeds_of[preset]):
                for setup in (setups if k % 2 == 0 else setups[::-1]):  # drift favours no setup
                    name = f"{preset}-{setup}-s{seed}"
                    if args.reuse:
                        pwall, code = float(json.loads((work / f"{name}.wall").read_text())), 0
                    else:
                        cmd, pwall, code = tidal_run(preset, setup, seed, work, extra, address, args.timeout)
                        (work / f"{name}.wall").write_text(json.dumps(pwall))
                    if code != 0:
                        log = (work / f"{name}.log").read_text(errors="replace").splitlines()[-30:]
                        print(f"error: {name} exited with {code}:\n" + "\n".join(log), file=sys.stderr)
                        return 1
                    run = read_run(work / f"{name}.db")
                    r = summarize_run(run, cal[preset], pwall, staleness_bound(cfg))
                    cpu_file = work / f"{name}.cpu.json"
                    r["cpu_shares"] = json.loads(cpu_file.read_text()) if cpu_file.exists() else None
                    series_file = work / f"{name}.cpu_series.json"
                    r["cpu_shares_steps"] = window_shares(
                        json.loads(series_file.read_text()), float(run["rows"][0]["started_at"]),
                        float(run["rows"][-1]["finished_at"])) if series_file.exists() else None
                    t0 = float(run["rows"][0]["started_at"])
                    r["_elapsed"] = [float(x["finished_at"]) - t0 for x in run["rows"]]
                    results[setup][seed] = r
                    runs_flat[name] = r
                    print(f"  {name}: wall {r['wall_s']:.1f} s (process {pwall:.1f} s), fluid {r['fluid_bound_s']:.1f} s "
                          f"({r['fraction_of_fluid_bound']:.2f}), U train/rollout {r['train_util']:.2f}/"
                          f"{r['rollout_util']:.2f}, mq {r['mq_size_mean']:.1f}, deact {r['deactivations']}, "
                          f"reward {r['reward_first3']:.3f}→{r['reward_last3']:.3f}, staleness {r['max_staleness']:.0f}",
                          flush=True)
            if not args.reuse:  # once more after the runs: the bound takes the faster of the two
                print(f"calibrating bench/{preset} again after its runs ...", flush=True)
                samples.append(calibrate(cfg))
                _print_costs(samples[-1])
                cal[preset] = fold_calibrations(samples)
                _save_calibration(cal_file, preset, cal[preset])
            print(f"  bound uses c_gen {1e6 * cal[preset]['gen_s_per_token']:.1f} µs/token, "
                  f"c_train {1e6 * cal[preset]['train_s_per_token']:.1f} µs/token (lowest of {len(samples)})",
                  flush=True)
            for per_seed in results.values():
                for r in per_seed.values():
                    apply_calibration(r, cal[preset])
            per_preset[preset] = summarize_preset(results)
            per_preset[preset]["_results"] = results
    finally:
        if cluster is not None:
            cluster.stop()
    load1 = os.getloadavg()[0]
    meta = work / "load.json"
    if args.reuse and meta.exists():
        load0, load1 = json.loads(meta.read_text())
    elif not args.reuse:
        meta.write_text(json.dumps([load0, load1]))

    plots = []
    # --no-write leaves the committed plots alone too (they go to the scratch directory)
    plot_dir = work / "plots" if args.no_write else BENCH / "plots"
    for preset, summ in per_preset.items():
        plots += plot(preset, summ.pop("_results"), plot_dir)
    own = ["benchmarks/bench_compare.py"]
    if args.presets != "rollout-bound,training-bound":
        own += ["--presets", args.presets]
    if args.seeds is not None:
        own += ["--seeds", args.seeds]
    if args.setups is not None:
        own += ["--setups", args.setups]
    if args.steps:
        own += ["--steps", str(args.steps)]
    for e in args.extra:
        own += ["--set", e]
    command = ".venv/bin/python " + shlex.join(own)
    text = markdown(command, per_preset, cal, runs_flat, (load0, load1), plots)
    print(text)
    if not args.no_write:
        write_section("bench_compare", text)
        data: dict[str, Any] = {"command": command, "calibration": cal, "load_average": [load0, load1]}
        for preset, summ in per_preset.items():
            key = f"cpu_{preset.replace('-', '_')}"
            # the headline is the default policy (chosen before the runs, not the best afterwards)
            head = "default" if "default" in summ["setups"] else summ["best_dynamic"]
            block = {"setups": summ["setups"], "seeds": summ["seeds"], "headline_setup": head,
                     "best_dynamic": summ["best_dynamic"]}
            if head:
                b = summ["setups"][head]
                block["speedup_vs_static"] = b["speedup_vs_static_median"]
                block["fraction_of_fluid_bound"] = b["fraction_of_fluid_bound_median"]
                block["fraction_of_in_system_bound"] = b["fraction_of_in_system_bound_median"]
                block["slowdown_vs_static"] = 1.0 / b["speedup_vs_static_median"] - 1.0
                block["slowdown_vs_static_speed_adjusted"] = 1.0 / b["speedup_speed_adjusted_median"] - 1.0
            if "predictive" in summ["setups"]:  # the recommended policy, beside the reference's
                b = summ["setups"]["predictive"]
                block["predictive_speedup_vs_static"] = b["speedup_vs_static_median"]
                block["predictive_slowdown_vs_static"] = 1.0 / b["speedup_vs_static_median"] - 1.0
            if "static_again" in summ["setups"]:  # two identical static runs, same seed: the noise floor
                block["static_vs_static_spread"] = statistics.median(
                    abs(x - 1.0) for x in summ["setups"]["static_again"]["speedup_vs_static_per_seed"])
            data[key] = block
        data["runs"] = {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in runs_flat.items()}
        print(f"wrote {write_json('compare', data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
