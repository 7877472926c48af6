"""Emulated cluster vs the simulator: the real control plane at 32 emulated GPUs, against `tidal simulate`.

Owns: the emulated runs (real flows, actors and policy; simulated engine and backend), the
simulator's predictions of the same runs, and their RESULTS.md section and ``results/emulated.json``.
Must not: tune the simulator to the run it is compared with. Per-step accounting and the three
predictions: ``docs/benchmarks.md``.

Usage:
    .venv/bin/python benchmarks/bench_emulated.py [--setups static-8-24,static-16-16,dynamic,tp8-static-8-24,...]
        [--steps N] [--seed 0] [--workdir DIR] [--plot PATH] [--no-write] [--reuse]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.procs import wait_or_stop  # noqa: E402
from benchmarks.results_io import read_json, write_json, write_section  # noqa: E402
from config import TidalConfig, load_config  # noqa: E402
from policies import policy_from_config  # noqa: E402
from sim import Simulator, spec_from_config  # noqa: E402

SETUPS = {
    "static-8-24": "static 8+24",
    "static-16-16": "static 16+16",
    "dynamic": "dynamic 16+16 default, no rebalance",
    # the faithful seed shape (TP 8, n = 16; issue 16), where lending pays, with `predictive`
    "tp8-static-8-24": "TP 8 static 8+24",
    "tp8-static-16-16": "TP 8 static 16+16",
    "tp8-dynamic": "TP 8 dynamic 16+16 predictive, no rebalance",
    # issue 16 item 6: the rebalance drains now (routing is held while it does); predictive asks for it
    "tp8-dynamic-rebalance": "TP 8 dynamic 16+16 predictive, rebalance when it asks",
    # issue 16 item 5: the lent hybrids wake and load during the broadcast (opt-in key)
    "tp8-dynamic-overlap": "TP 8 dynamic 16+16 predictive, no rebalance, hybrid sync during the broadcast",
}
PRESETS = {"tp8-dynamic-rebalance": "tp8-dynamic", "tp8-dynamic-overlap": "tp8-dynamic"}
"""Setups that run another setup's preset (with other overrides)."""
PRESET = "sim/qwen35-35b-emulated-{}"
DEFAULT_SETUPS = "static-8-24,static-16-16,dynamic"
"""What a bare run measures (the old shape); ``--setups`` with only ``tp8-*`` setups measures the
faithful one into a section and JSON of their own (``emulated_tp8``)."""
OVERRIDES = {key: ["async_training.dynamic_schedule_enable_rebalance=false"] for key in ("dynamic", "tp8-dynamic")}
"""Applied to the emulated run and the simulation alike. The seed experiment rebalances; the old
shape's dynamic setup runs without (a supported setting), as it was measured when Tidal's drain
could not finish at this scale (the rollouter re-sent the aborted requests to the paused
replicas, drains grew 5.7 → 44 s, then hit the 60 s timeout). Routing is now held while a
rebalance drains (``LoadBalancer.hold``); ``tp8-dynamic-rebalance`` measures it, beside
``tp8-dynamic`` without."""
OVERRIDES["tp8-dynamic-overlap"] = [*OVERRIDES["tp8-dynamic"], "async_training.dynamic_schedule_overlap_hybrid_sync=true"]
TARGET = 0.10
MQ_SIZE = "dynamic_resource/mq_size"


# ------------------------------------------------------------------------------------------------
# watching the run: CPU and the engines' counters
# ------------------------------------------------------------------------------------------------


ROLES = ("ReplicaActor", "TrainRankActor", "TrainerActor", "RolloutService", "ControllerActor")


def _role(pid: int) -> str:
    """What a process of the run is: one of the actors, the driver (`tidal run`), or other Ray."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    for role in ROLES:
        if cmd.startswith(f"ray::{role}"):
            return role
    return "driver" if "flows.cli" in cmd or "/tidal " in cmd else "Ray itself"


def _cpu_ticks_by_session(sessions: set[int]) -> dict[int, int]:
    """pid → utime + stime (clock ticks) of every live process whose session is in ``sessions``."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # after "pid (comm)": state ppid pgrp session ... utime(14) stime(15), 1-based from pid
        if int(fields[3]) in sessions:
            out[int(entry.name)] = int(fields[11]) + int(fields[12])
    return out


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


class Monitor(threading.Thread):
    """Samples the CPU of the run's processes every second and the engines' stats every 2 s."""

    def __init__(self, sessions: set[int], *, poll_engines: bool = True):
        super().__init__(daemon=True)
        self.sessions, self.poll_engines = sessions, poll_engines
        self.cpu_s = self.wall_s = self.machine_busy = 0.0
        self.cpu_by_role: dict[str, float] = {}
        self.engines: dict[str, dict[str, float]] = {}
        self._roles: dict[int, str] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        last = _cpu_ticks_by_session(self.sessions)
        busy0, total0 = _machine_ticks()
        t0 = time.monotonic()
        n = 0
        while not self._halt.wait(1.0):
            now = _cpu_ticks_by_session(self.sessions)
            for pid, v in now.items():
                used = max(0, v - last.get(pid, 0)) / tick
                role = self._roles.get(pid)
                if role is None or role == "Ray itself":  # a pooled idle worker may become an actor
                    role = self._roles[pid] = _role(pid)
                self.cpu_by_role[role] = self.cpu_by_role.get(role, 0.0) + used
                self.cpu_s += used
            last = now
            n += 1
            if self.poll_engines and n % 2 == 0:
                self._poll()
        busy1, total1 = _machine_ticks()
        self.wall_s = time.monotonic() - t0
        self.machine_busy = (busy1 - busy0) / max(1, total1 - total0)

    def _poll(self) -> None:
        import ray

        try:
            actors = ray.util.list_named_actors(all_namespaces=True)
        except Exception:  # noqa: BLE001 - the cluster is busy or the run is ending
            return
        for actor in actors:
            name, namespace = actor["name"], actor["namespace"]
            try:
                handle = ray.get_actor(name, namespace=namespace)
                if name.startswith("replica:"):
                    self.engines[name.removeprefix("replica:")] = ray.get(handle.engine_stats.remote(), timeout=5)
                elif name == "trainer":
                    self.engines.update(ray.get(handle.hybrid_stats.remote(), timeout=5))
            except Exception:  # noqa: BLE001 - an actor that just ended
                continue

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


# ------------------------------------------------------------------------------------------------
# the emulated run
# ------------------------------------------------------------------------------------------------


@dataclass
class Emulated:
    command: list[str]
    process_s: float
    rows: list[dict[str, Any]]
    switches: list[tuple[int, str, float, float]]  # (step, kind, started_at, duration_s)
    cpu_cores: float
    cpu_by_role: dict[str, float]
    machine_busy: float
    engines: dict[str, dict[str, float]]


def run_emulated(preset: str, overrides: list[str], steps: int | None, work: Path, ray_address: str | None,
                 ray_session: int | None, timeout_s: float) -> Emulated:
    work.mkdir(parents=True, exist_ok=True)
    sets = [*overrides, f"storage.url=sqlite:///{work / 'tidal.db'}", f"trainer.default_local_dir={work / 'runs'}"]
    if steps is not None:
        sets.append(f"trainer.total_training_steps={steps}")
    if ray_address:
        sets.append(f"ray.address={ray_address}")
    tidal = Path(sys.executable).parent / "tidal"
    base = [str(tidal)] if tidal.exists() else [sys.executable, "-m", "flows.cli"]
    cmd = [*base, "run", preset, *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_PROFILE")}
    env.update(PREFECT_HOME=str(work / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_LEVEL="WARNING", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log = work / "run.log"
    print(f"  running: {shlex.join(cmd)}\n  (PREFECT_HOME={env['PREFECT_HOME']}, log {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        monitor = Monitor({proc.pid} | ({ray_session} if ray_session else set()), poll_engines=bool(ray_address))
        monitor.start()
        try:
            code = wait_or_stop(proc, timeout_s)
        finally:
            monitor.stop()
    process_s = time.perf_counter() - t0
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"`tidal run {preset}` exited with {code} after {process_s:.0f} s; last lines of {log}:\n{tail}")
    rows, switches = read_store(work / "tidal.db")
    wall = max(monitor.wall_s, 1e-9)
    return Emulated(cmd, process_s, rows, switches, monitor.cpu_s / wall,
                    {k: v / wall for k, v in sorted(monitor.cpu_by_role.items())}, monitor.machine_busy,
                    monitor.engines)


def read_store(db: Path) -> tuple[list[dict[str, Any]], list[tuple[int, str, float, float]]]:
    import sqlalchemy as sa

    from storage import make_engine, read_step_metrics, run_summaries, session_scope
    from storage.models import Run, SwitchEvent

    engine = make_engine(f"sqlite:///{db}")
    try:
        with session_scope(engine) as s:
            uid = run_summaries(s)[-1].uid
            rows = read_step_metrics(s, uid)
            switches = s.execute(
                sa.select(SwitchEvent.step, SwitchEvent.kind, SwitchEvent.started_at, SwitchEvent.duration_s)
                .join(Run, Run.id == SwitchEvent.run_id).where(Run.uid == uid).order_by(SwitchEvent.id)
            ).all()
        return rows, [(int(a), str(b), float(c), float(d)) for a, b, c, d in switches]
    finally:
        engine.dispose()


def _secs(t: Any) -> float:
    return t.timestamp() if hasattr(t, "timestamp") else float(t)


def modelled_switch_s(cfg: TidalConfig) -> dict[str, float]:
    """What the simulator charges per switch kind (the hybrid engines' wake-up holds the activation)."""
    m = cfg.sim
    return {"deactivate": m.deactivate_s, "hybrid_sync": m.hybrid_sync_s + m.activate_s, "activate": 0.0,
            "rebalance": m.rebalance_s}


def emulated_timeline(emu: Emulated, cfg: TidalConfig) -> dict[str, Any]:
    """Per-step cycles, modelled data-plane seconds and control-plane overhead of the emulated run.

    The data plane of a step is what the simulator models, at the simulator's prices: the trainer's
    pulls (its waits for samples) and updates, the wait before a deactivation, and the weight sync
    and every switch of the step at their modelled seconds. What the sync and the switches took
    beyond those (Ray round trips, the controller's calls) is control-plane time like the rest.
    """
    rows = emu.rows
    start = [_secs(r["started_at"]) for r in rows]
    commit = [_secs(r["finished_at"]) for r in rows]
    cycles = [b - a for a, b in zip(start, start[1:])] + [commit[-1] - start[-1]]
    priced = modelled_switch_s(cfg)
    measured = {k: 0.0 for k in range(1, len(rows) + 1)}  # switches inside the train turn (allocated)
    deactivate = dict(measured)
    modelled = dict(measured)
    for step, kind, began, took in emu.switches:
        if step not in measured or began < start[step - 1]:  # the warm-up's, drained with step 1
            continue
        if kind == "deactivate":
            deactivate[step] += took
        else:
            measured[step] += took
        modelled[step] += priced.get(kind, 0.0)
    data = []
    for r in rows:
        k = r["step"]
        micro = (float(r.get("dynamic_resource/train_allocated_time_s") or 0.0)
                 - float(r.get("timing_s/param_sync") or 0.0) - measured[k])
        data.append(micro + float(r.get("timing_s/wait_for_enough_samples") or 0.0) + cfg.sim.broadcast_sync_s
                    + modelled[k])
    overhead = [c - d for c, d in zip(cycles, data)]
    tails = [b - a for a, b in zip(commit, start[1:])]
    complete = overhead[:-1] or overhead
    # where it is spent: inside the step timer (per Prefect task) and between flow runs
    timers = [float(r["wall_s"]) for r in rows]
    deactivated = {step for step, kind, began, _ in emu.switches
                   if kind == "deactivate" and step in measured and began >= start[step - 1]}
    tasks = [3 + cfg.async_training.trigger_parameter_sync_step + (r["step"] in deactivated)
             + 2 * bool(r.get("dynamic_resource/hybrid_active")) + 1 for r in rows]
    n = max(1, len(rows) - 1)
    in_step = sum(t - d for t, d in zip(timers[:n], data[:n]))
    return {
        "cycles": cycles,
        "data": data,
        "overhead": overhead,
        "overhead_s": statistics.fmean(complete),
        "overhead_median_s": statistics.median(complete),
        "task_overhead_s": in_step / sum(tasks[:n]),
        "between_flows_s": statistics.fmean(c - t for c, t in zip(cycles[:n], timers[:n])),
        "tail_s": statistics.median(tails[1:] or tails) if tails else 0.0,
        "final_s": commit[-1] - start[0],
        "step_timer_sum_s": sum(float(r["wall_s"]) for r in rows),
    }


# ------------------------------------------------------------------------------------------------
# the prediction
# ------------------------------------------------------------------------------------------------


def predict(cfg: TidalConfig, steps: int, seed: int, overhead_s: float, **spec_changes: Any) -> tuple[Any, float]:
    """(SimResult, mean trained response length) of ``cfg`` with ``sim.step_overhead_s = overhead_s``
    (and ``spec_changes``: the ``SimSpec`` fields that are not config keys)."""
    cfg = cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"step_overhead_s": overhead_s})})
    spec = dataclasses.replace(spec_from_config(cfg, steps), **spec_changes)
    simulator = Simulator(spec, policy_from_config(cfg), seed=seed,
                          policy_name=cfg.async_training.dynamic_schedule_policy)
    result = simulator.run()
    responses = len(result.trained_ids) * spec.n
    return result, simulator.trained_response_tokens / max(1, responses)


def predicted_cycles(result: Any, tail_s: float) -> list[float]:
    cycles = [s.end_s - s.start_s for s in result.steps]
    cycles[-1] -= min(tail_s, result.steps[-1].end_s - result.steps[-1].start_s)
    return cycles


# ------------------------------------------------------------------------------------------------
# comparing
# ------------------------------------------------------------------------------------------------


def _pctl(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def compare(label: str, preset: str, overrides: list[str], emu: Emulated, seed: int) -> dict[str, Any]:
    cfg = load_config(preset, overrides)
    steps = len(emu.rows)
    tl = emulated_timeline(emu, cfg)
    bare, _ = predict(cfg, steps, seed, 0.0)
    with_oh, oh_len = predict(cfg, steps, seed, tl["overhead_s"])
    tidal, _ = predict(cfg, steps, seed, tl["between_flows_s"], task_overhead_s=tl["task_overhead_s"],
                       sync_aborts=False)
    pred_bare = predicted_cycles(bare, 0.0)
    pred = predicted_cycles(with_oh, tl["tail_s"])
    pred_tidal = predicted_cycles(tidal, tl["tail_s"])
    final_tidal = sum(pred_tidal)
    abs_err_tidal = [abs(e - p) / p for e, p in zip(tl["cycles"], pred_tidal)]
    emu_cycles = tl["cycles"]
    err = [(e - p) / p for e, p in zip(emu_cycles, pred)]
    abs_err = [abs(x) for x in err]
    final_pred = sum(pred)
    final_bare = sum(pred_bare)
    switches_emu = sum(1 for _, kind, _, _ in emu.switches if kind in ("activate", "deactivate"))
    rows = emu.rows
    engines = emu.engines
    busy = sum(e.get("busy_s", 0.0) for e in engines.values())
    stretch = sum(e.get("stretch_s", 0.0) for e in engines.values())
    n = cfg.actor_rollout_ref.rollout.n
    emu_len = (sum(float(r.get("train/response_tokens") or 0) for r in rows)
               / max(1.0, sum(float(r.get("train/samples") or 0) for r in rows) * n))
    phases = {
        "train compute s/step": (_mean([float(r.get("dynamic_resource/train_compute_time_s") or 0) for r in rows]),
                                 _mean([s.train_compute_s for s in with_oh.steps])),
        "trainer wait for samples s/step": (
            _mean([float(r.get("timing_s/wait_for_samples_in_train") or 0) for r in rows]),
            _mean([sum(s.micro_wait_s) for s in with_oh.steps])),
        "wait before deactivation s/step": (_mean([float(r.get("timing_s/wait_for_enough_samples") or 0) for r in rows]),
                                            _mean([s.wait_for_samples_s for s in with_oh.steps])),
        "weight sync s/step": (_mean([float(r.get("timing_s/param_sync") or 0) for r in rows]),
                               cfg.sim.broadcast_sync_s),
        "switch s/step": (_mean([float(r.get("waste/switch_s") or 0) for r in rows]),
                          _mean([s.waste.switch_s for s in with_oh.steps])),
        "samples generated/step": (
            _mean([float(r.get("fully_async/rollouter/step_generated_samples") or 0) for r in rows]),
            _mean([float(s.step_generated_samples) for s in with_oh.steps])),
        "re-prefilled tokens/step": (_mean([float(r.get("waste/reprefilled_tokens") or 0) for r in rows]),
                                     _mean([float(s.waste.reprefilled_tokens) for s in with_oh.steps])),
        "response length (tokens)": (emu_len, oh_len),
    }
    # what one switch costs: the emulated run's (its rank group's round trips included) against
    # what the simulator charges; and the last step, which waits for the run's longest samples
    dynamic = cfg.async_training.use_dynamic_resource_scheduling
    lends: dict[int, float] = {}
    for step, kind, _, took in emu.switches:
        if kind in ("hybrid_sync", "activate"):
            lends[step] = lends.get(step, 0.0) + took
    phases["lend s (each)"] = (_mean(list(lends.values())),
                               cfg.sim.hybrid_sync_s + cfg.sim.activate_s if dynamic else math.nan)
    phases["take-back s (each)"] = (_mean([took for _, kind, _, took in emu.switches if kind == "deactivate"]),
                                    cfg.sim.deactivate_s if dynamic else math.nan)
    phases["last step s (cycle)"] = (emu_cycles[-1], pred[-1])
    return {
        "label": label,
        "preset": preset,
        "steps": steps,
        "command": shlex.join([Path(emu.command[0]).name, *emu.command[1:]]),
        "emulated_final_s": tl["final_s"],
        "emulated_step_timer_sum_s": tl["step_timer_sum_s"],
        "emulated_process_s": emu.process_s,
        "predicted_final_s": final_pred,
        "predicted_final_no_overhead_s": final_bare,
        "relative_error": (tl["final_s"] - final_pred) / final_pred,
        "relative_error_no_overhead": (tl["final_s"] - final_bare) / final_bare,
        "predicted_final_tidal_model_s": final_tidal,
        "relative_error_tidal_model": (tl["final_s"] - final_tidal) / final_tidal,
        "predicted_cycles_tidal_model": pred_tidal,
        "step_abs_error_median_tidal_model": statistics.median(abs_err_tidal),
        "step_abs_error_p90_tidal_model": _pctl(abs_err_tidal, 0.9),
        "switches_tidal_model": tidal.switches,
        "mq_size_mean_tidal_model": _mean([s.mq_size for s in tidal.steps]),
        "task_overhead_s": tl["task_overhead_s"],
        "between_flows_s": tl["between_flows_s"],
        "overrides": overrides,
        "step_timer_sum_vs_no_overhead": (tl["step_timer_sum_s"] - final_bare) / final_bare,
        "overhead_s": tl["overhead_s"],
        "overhead_median_s": tl["overhead_median_s"],
        "overhead_tail_s": tl["tail_s"],
        "overhead_per_step": tl["overhead"],
        "emulated_cycles": emu_cycles,
        "predicted_cycles": pred,
        "predicted_cycles_no_overhead": pred_bare,
        "step_mean_s": (_mean(emu_cycles), _mean(pred)),
        "step_median_s": (statistics.median(emu_cycles), statistics.median(pred)),
        "step_abs_error_median": statistics.median(abs_err),
        "step_abs_error_p90": _pctl(abs_err, 0.9),
        "step_error_mean": _mean(err),
        "switches": (switches_emu, with_oh.switches),
        "switches_no_overhead": bare.switches,
        "mq_size_mean": (_mean([float(r.get(MQ_SIZE, math.nan)) for r in rows]), _mean([s.mq_size for s in with_oh.steps])),
        "phases": phases,
        "phase_order": list(phases),
        "cpu_cores": emu.cpu_cores,
        "cpu_cores_by_process": emu.cpu_by_role,
        "machine_busy": emu.machine_busy,
        "engine_busy_s": busy,
        "engine_stretch_s": stretch,
        "engines_seen": len(engines),
        "engine_stats": engines,
    }


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        steps = list(range(1, r["steps"] + 1))
        ax.plot(steps, r["emulated_cycles"], "o-", ms=3, lw=1.2, label="emulated (real control plane)")
        ax.plot(steps, r["predicted_cycles"], "s-", ms=3, lw=1.2, label=f"simulated, overhead {r['overhead_s']:.2f} s")
        ax.plot(steps, r["predicted_cycles_tidal_model"], "^-", ms=3, lw=1, alpha=0.7, label="simulated, Tidal model")
        ax.plot(steps, r["predicted_cycles_no_overhead"], ":", lw=1.2, color="grey", label="simulated, no overhead")
        ax.set_title(f"{r['label']}: final {r['emulated_final_s']:.0f} s vs {r['predicted_final_s']:.0f} s "
                     f"({r['relative_error']:+.1%})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("seconds per step (start to next start)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _f(x: float, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(results: list[dict[str, Any]], command: str, plot_path: Path) -> str:
    worst = max(abs(r["relative_error"]) for r in results)
    worst_tidal = max(abs(r["relative_error_tidal_model"]) for r in results)
    try:
        rel_plot = plot_path.resolve().relative_to(ROOT / "benchmarks")
    except ValueError:
        rel_plot = plot_path
    overridden = [f"{r['label']}: `{'`, `'.join(r['overrides'])}`" for r in results if r["overrides"]]
    lines = [
        "## Emulated cluster vs the simulator (`bench_emulated.py`)"
        + (", the faithful seed shape (TP 8)" if results_name(results) == "emulated_tp8" else ""),
        "",
        f"Command: `{command}`",
        "",
        "Each setup runs the real system (`tidal run`: a Prefect flow per step, the Ray actors, controller and policy) "
        "with the simulated engine and backend spending the cost model's time (the trainer as its rank group: one rank "
        "actor per emulated trainer GPU over a gloo group, each hybrid on its ranks, loaded in-rank; the TP 8 presets "
        "send the standalones' weights by the collective transport, which the simulated engines join), on the seed experiment scaled down in "
        "tokens (`config/presets/sim/qwen35-35b-emulated-*.yaml`: 32 emulated GPUs; TP 4 and n = 8 as the old seed "
        "shape ÷ 20, ~3 s of data-plane work per step, or TP 8 and n = 16 as the faithful one ÷ 10 (`-tp8-`, with "
        "`predictive`), ~4 s), then the simulator (`tidal simulate`'s) on the same preset, steps and seed: as the preset stands "
        "(*no overhead*), with `sim.step_overhead_s` = the control-plane overhead measured in that run (*with "
        "overhead*: mean over its complete cycles of cycle − data-plane seconds, median alongside; see the module "
        "docstring), and as the *Tidal model*: that overhead where Tidal spends it (per Prefect task before each "
        "phase, the rest between flow runs) and Tidal's weight sync (the standalones stall while loading instead "
        "of verl's abort + re-prefill of everything in flight, which the presets are calibrated with). Final wall "
        "clock = first step's start → last step's commit. "
        + (f"Overrides on both sides — {'; '.join(overridden)} (see `OVERRIDES` in the script). " if overridden else "")
        + f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs; {time.strftime('%Y-%m-%d')}.",
        "",
        f"**Worst |relative error| of the final wall clock: {worst_tidal:.1%}** against the Tidal model (`tidal "
        f"simulate` with Tidal's control plane: `sim.task_overhead_s`, `sim.step_overhead_s`, `sim.sync_aborts`; the "
        f"headline, target ≤ {TARGET:.0%}); {worst:.1%} against `tidal simulate` with the measured overhead at the "
        "end of each step, where a lent hybrid generates through it (see docs/benchmarks.md).",
        "",
        "| setup | steps | emulated final s | Σ step timers s | predicted s, no overhead | error | overhead s/step "
        "mean (median) | predicted s, with overhead | error | predicted s, Tidal model | **error** | "
        "step mean s emu / sim | step median s emu / sim | per-step abs error median / p90 | switches emu / sim | "
        "mq_size mean emu / sim |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['steps']} | {r['emulated_final_s']:.1f} | {r['emulated_step_timer_sum_s']:.1f} | "
            f"{r['predicted_final_no_overhead_s']:.1f} | {r['relative_error_no_overhead']:+.1%} | "
            f"{r['overhead_s']:.2f} ({r['overhead_median_s']:.2f}) | {r['predicted_final_s']:.1f} | "
            f"{r['relative_error']:+.1%} | {r['predicted_final_tidal_model_s']:.1f} | "
            f"**{r['relative_error_tidal_model']:+.1%}** | "
            f"{r['step_mean_s'][0]:.2f} / {r['step_mean_s'][1]:.2f} | "
            f"{r['step_median_s'][0]:.2f} / {r['step_median_s'][1]:.2f} | "
            f"{r['step_abs_error_median']:.1%} / {r['step_abs_error_p90']:.1%} | "
            f"{r['switches'][0]} / {r['switches'][1]} | "
            f"{_f(r['mq_size_mean'][0], '.1f')} / {_f(r['mq_size_mean'][1], '.1f')} |"
        )
    lines += ["", "The Tidal model in detail (overhead per Prefect task and between flow runs as measured; "
              "per-step errors against it):", "",
              "| setup | task overhead s | between flow runs s | per-step abs error median / p90 | switches emu / model "
              "| mq_size mean emu / model |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['label']} | {r['task_overhead_s']:.3f} | {r['between_flows_s']:.2f} | "
                     f"{r['step_abs_error_median_tidal_model']:.1%} / {r['step_abs_error_p90_tidal_model']:.1%} | "
                     f"{r['switches'][0]} / {r['switches_tidal_model']} | "
                     f"{_f(r['mq_size_mean'][0], '.1f')} / {_f(r['mq_size_mean_tidal_model'], '.1f')} |")
    lines += ["", "`mq_size`: the queue right after the update, in Tidal's trainer as in the simulator and the "
              "reference (§4.4)."]
    lines += ["", "Per phase, mean per step, emulated / simulated (with overhead); the last three columns are one "
              "lend (hybrid sync + activation) and one take-back, mean seconds each, emulated (the rank group's round "
              "trips included) / what the simulator charges, and the last step's cycle, which waits for the run's "
              "longest samples (the two sides draw their lengths independently):", "",
              "| setup | " + " | ".join(phases := phase_order(results[0])) + " |",
              "|---|" + "---:|" * len(phases)]
    for r in results:
        lines.append(f"| {r['label']} | " + " | ".join(f"{_f(r['phases'][p][0])} / {_f(r['phases'][p][1])}"
                                                    for p in phases) + " |")
    lines += ["", "Faithfulness of the emulation (does Python keep up with the emulated clocks?):", "",
              "| setup | CPU cores used by the run | of which (cores) | machine busy (all users) | "
              "engines' modelled busy s | engines' stretch s (clock ran slow) | whole `tidal run` process s |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        share = r["engine_stretch_s"] / r["engine_busy_s"] if r["engine_busy_s"] else math.nan
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_cores_by_process"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['label']} | {r['cpu_cores']:.2f} | {parts} | {r['machine_busy']:.0%} | {r['engine_busy_s']:.0f} "
                     f"({r['engines_seen']} engines) | {r['engine_stretch_s']:.2f} ({_f(share * 100, '.2f')} %) | "
                     f"{r['emulated_process_s']:.0f} |")
    lines += ["", f"Plot: `{rel_plot}` (seconds per step, emulated vs predicted, one panel per setup).", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=DEFAULT_SETUPS, help=f"comma-separated subset of {', '.join(SETUPS)}")
    p.add_argument("--steps", type=int, default=None, help="steps per setup (default: the presets' 30)")
    p.add_argument("--seed", type=int, default=0, help="simulator seed (default 0)")
    p.add_argument("--workdir", default=None, help="scratch dir (default: a fresh temp dir, removed at the end)")
    p.add_argument("--plot", default=None, help="PNG path (default: benchmarks/plots/emulated_vs_sim.png, "
                   "emulated_tp8_vs_sim.png for the TP 8 setups)")
    p.add_argument("--timeout", type=float, default=900.0, help="kill a run after this many seconds")
    p.add_argument("--no-write", action="store_true", help="do not write RESULTS.md / results/emulated.json")
    p.add_argument("--reuse", action="store_true",
                   help="run nothing: render RESULTS.md, results/emulated.json and the plot again from the last run's JSON")
    args = p.parse_args(argv)
    unknown = [s for s in args.setups.split(",") if s not in SETUPS]
    if unknown:
        p.error(f"unknown setups {unknown}; known: {', '.join(SETUPS)}")
    # only TP 8 setups: a section, JSON and plot of their own
    args.results_name = "emulated_tp8" if all(k.startswith("tp8-") for k in args.setups.split(",")) else "emulated"
    if args.plot is None:
        args.plot = str(ROOT / "benchmarks" / "plots" / f"{args.results_name}_vs_sim.png")
    if args.steps is not None and args.steps < 4:
        p.error("--steps must be at least 4")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reuse:
        return rerender(Path(args.plot), args.results_name)
    import ray

    from cluster.ray_cluster import LocalRayCluster

    own = ["benchmarks/bench_emulated.py"]
    if args.setups != DEFAULT_SETUPS:
        own += ["--setups", args.setups]
    if args.steps is not None:
        own += ["--steps", str(args.steps)]
    if args.seed:
        own += ["--seed", str(args.seed)]
    command = ".venv/bin/python " + shlex.join(own)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tidal-emu-", dir="/tmp")).resolve()
    cluster = LocalRayCluster(num_cpus=2, gpus=32, memory_gb=4.0, object_store_memory_gb=0.5,
                              env={"PYTHONPATH": str(ROOT)})
    results = []
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False, namespace="bench-emulated")
        assert cluster._proc is not None
        for key in args.setups.split(","):
            preset = PRESET.format(PRESETS.get(key, key))
            print(f"{SETUPS[key]}: {preset}", flush=True)
            overrides = OVERRIDES.get(key, [])
            emu = run_emulated(preset, overrides, args.steps, work / key, cluster.address, cluster._proc.pid,
                               args.timeout)
            r = compare(SETUPS[key], preset, overrides, emu, args.seed)
            results.append(r)
            print(f"  emulated {r['emulated_final_s']:.1f} s, predicted {r['predicted_final_s']:.1f} s "
                  f"({r['relative_error']:+.1%}; without overhead {r['predicted_final_no_overhead_s']:.1f} s, "
                  f"{r['relative_error_no_overhead']:+.1%}); overhead {r['overhead_s']:.2f} s/step; "
                  f"CPU {r['cpu_cores']:.2f} cores, stretch {r['engine_stretch_s']:.2f} s", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    plot_path = Path(args.plot)
    plot(results, plot_path)
    section = markdown(results, command, plot_path)
    print(section)
    if not args.no_write:
        write(results, command, section)
    return 0


def results_name(results: list[dict[str, Any]]) -> str:
    """``emulated_tp8`` when every setup is of the faithful shape, else ``emulated``."""
    return "emulated_tp8" if all(r["label"].startswith("TP 8") for r in results) else "emulated"


def write(results: list[dict[str, Any]], command: str, section: str) -> None:
    name = results_name(results)
    write_section(f"bench_{name}", section, after="bench_emulated" if name != "emulated" else None)
    dynamic = [r for r in results if "dynamic" in r["label"]]
    write_json(name, {
        "dynamic_relative_error_vs_sim": max((abs(r["relative_error_tidal_model"]) for r in dynamic), default=None),
        "command": command,
        "relative_error_vs_sim": max(abs(r["relative_error_tidal_model"]) for r in results),
        "relative_error_vs_sim_step_end_overhead": max(abs(r["relative_error"]) for r in results),
        "relative_error_vs_sim_no_overhead": max(abs(r["relative_error_no_overhead"]) for r in results),
        "target": TARGET,
        "setups": {r["label"]: r for r in results},
    })
    print(f"wrote benchmarks/RESULTS.md (bench_{name}) and benchmarks/results/{name}.json")


def phase_order(result: dict[str, Any]) -> list[str]:
    """The per-phase table's columns in the order ``summarize`` built them (a reread JSON has its keys
    sorted; ``phase_order`` keeps the order, and results saved before it have the sorted one)."""
    return list(result.get("phase_order") or result["phases"])


def rerender(plot_path: Path, name: str) -> int:
    """``--reuse``: render the section, JSON and plot again from ``benchmarks/results/NAME.json``."""
    saved = read_json(name)
    if not saved or not saved.get("setups"):
        print(f"error: --reuse needs benchmarks/results/{name}.json from an earlier run", file=sys.stderr)
        return 2
    order = list(SETUPS.values())  # the JSON's keys are sorted; the section keeps the setups' order
    results = sorted(saved["setups"].values(), key=lambda r: order.index(r["label"]) if r["label"] in order else len(order))
    plot(results, plot_path)
    write(results, saved["command"], markdown(results, saved["command"], plot_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
