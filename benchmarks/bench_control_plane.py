"""Control-plane cost per training step, before and after: this tree against a baseline revision.

Runs `tidal run tiny-cpu` under three setups (in-process runner with embedded Prefect, the same
against a server, the Ray runner) for a baseline revision (a temporary `git worktree`) and for
this tree, each in a subprocess with its own code on PYTHONPATH, and prints both side by side.
Owns the measurement; what each figure means and how it is read back: ``docs/benchmarks.md``.
Must not: import a measured tree's flows or actors (every run is a subprocess on that tree's code).

Usage:
    .venv/bin/python benchmarks/bench_control_plane.py [--steps 10] [--rounds 1] [--baseline f691818|none]
        [--baseline-server as-before|same] [--json-out-results PATH] [--write benchmarks/RESULTS.md]

``--baseline-server same`` measures the baseline on the same Prefect server as this tree (for a
change that does not touch the server); the default runs it as the server ran before it was tuned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(BENCH))

from as_before import hide, prefect_default_writes  # noqa: E402
from flows.prefect_server import LocalPrefectServer  # noqa: E402

# Task names of this tree, of the tree before the phases took the users' names (165e346) and of the
# baseline before the typed step API (f691818), which a side-by-side run may also measure.
DATA_PLANE = {"wait_for_samples", "train", "broadcast_sync", "hybrid_sync", "activate", "wait_and_deactivate", "lend"}
POLICY = {"should_deactivate", "should_activate", "update_after_step", "begin_step", "after_sync", "end_step",
          "update_policy"}
STORE = {"commit", "commit_step"}
MARK = "bench_control_plane"
TARGET_STEP_S = 60.0
BASELINE = "f691818"  # main before issue 14's restructuring
HIDE_ENV = "TIDAL_BCP_HIDE_DIR"
"""The baseline's: a folder (``as_before.hide``) first on its runs' PYTHONPATH, so that the packages
this tree's Prefect server runs on and the baseline did not depend on fail to import there."""
COUNTER = BENCH / "ray_call_counter.py"
CALLS_FILE = "ray-calls.json"


@dataclass
class Setup:
    label: str
    runner: str  # prefect.task_runner
    server: bool

    @property
    def key(self) -> str:
        return f"{self.runner}-{'server' if self.server else 'embedded'}"


SETUPS = [
    Setup("in-process, embedded Prefect (default)", "thread", False),
    Setup("in-process, Prefect server", "thread", True),
    Setup("RayTaskRunner, Prefect server", "ray", True),
]
IN_PROCESS, RAY_RUNNER = SETUPS[0], SETUPS[2]


# ------------------------------------------------------------------------------------------------
# running (in the child: one tree)
# ------------------------------------------------------------------------------------------------


def kill_processes_mentioning(marker: str) -> None:
    """SIGKILL what a run left behind (its Ray cluster), found by the run's own temp dir."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def tidal_run(setup: Setup, steps: int, tree: Path, work: Path, env: dict[str, str], timeout_s: float) -> float:
    """``tidal run`` of ``tree``'s code, its driver's actor calls counted into ``CALLS_FILE``."""
    out = work / setup.key
    out.mkdir(parents=True)
    sets = [f"trainer.total_training_steps={steps}", f"prefect.task_runner={setup.runner}",
            f"storage.url=sqlite:///{out / 'tidal.db'}", f"trainer.default_local_dir={out / 'runs'}",
            f"ray.temp_dir={out / 'ray'}", "ray.memory_gb=3", "ray.object_store_memory_gb=0.3"]
    cmd = [sys.executable, str(COUNTER), "flows.cli", "run", "tiny-cpu", *[a for s in sets for a in ("--set", s)]]
    path = os.pathsep.join(p for p in (env.get(HIDE_ENV), str(tree)) if p)
    env = {**env, "PYTHONPATH": path, "TIDAL_COUNT_RAY_CALLS": str(out / CALLS_FILE)}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        raise SystemExit(f"{setup.label}: timed out after {timeout_s:.0f}s\n{stdout[-3000:]}") from None
    finally:
        kill_processes_mentioning(str(out))
    if proc.returncode != 0:
        raise SystemExit(f"{setup.label}: tidal run exited {proc.returncode}\n{stdout[-3000:]}")
    return time.monotonic() - started


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_PROFILE")}
    env.update(PREFECT_HOME=str(home), PREFECT_LOGGING_LEVEL="WARNING", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               # the baseline's Prefect-started temporary server migrates a fresh home first: 20 s is
               # Prefect's default, too short on a slow 2-core host
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    return env


# ------------------------------------------------------------------------------------------------
# reading back
# ------------------------------------------------------------------------------------------------


@dataclass
class StepTimes:
    step: int
    start: float
    tasks: dict[str, float]  # phase → summed task-run seconds
    counts: dict[str, int]  # phase → task runs

    @property
    def n_tasks(self) -> int:
        return sum(self.counts.values())

    def complete(self) -> bool:
        """The step's task runs have arrived (asynchronously): it trained and committed once. The
        other phases vary with the step (the last one asks no lend) and with the tree measured."""
        return (self.counts.get("commit") or self.counts.get("commit_step")) == 1 and self.counts.get("train", 0) >= 1


async def _read_runs(api_url: str) -> dict[str, list[StepTimes]]:
    """training-run flow run id → its steps, oldest run first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            parents = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["training-run"])))
            out: dict[str, list[StepTimes]] = {}
            for parent in sorted(parents, key=lambda p: p.created):
                children = await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])))
                steps = []
                for fr in sorted(children, key=lambda f: f.name):
                    runs = await client.read_task_runs(
                        task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[fr.id])))
                    tasks: dict[str, float] = {}
                    counts: dict[str, int] = {}
                    for tr in runs:
                        phase = tr.name.rsplit("-", 1)[0]
                        if tr.start_time and tr.end_time:
                            tasks[phase] = tasks.get(phase, 0.0) + (tr.end_time - tr.start_time).total_seconds()
                        counts[phase] = counts.get(phase, 0) + 1
                    steps.append(StepTimes(int(fr.name.rsplit("step-", 1)[1]), fr.start_time.timestamp(), tasks, counts))
                out[str(parent.id)] = steps
            return out


def read_runs(api_url: str, steps: int, timeout_s: float = 120.0) -> dict[str, list[StepTimes]]:
    """Task runs reach the database through the server's event pipeline (slow on a busy machine):
    read until every run has all its steps, each with a commit, and two reads agree."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        runs = asyncio.run(_read_runs(api_url))
        counts = {rid: [s.n_tasks for s in st] for rid, st in runs.items()}
        complete = all(len(st) == steps and all(s.complete() for s in st) for st in runs.values())
        if complete and counts == previous:
            return runs
        if time.monotonic() > deadline:
            raise SystemExit(f"task runs still incomplete after {timeout_s:.0f}s: {counts}")
        previous = counts
        time.sleep(2.0)


def policy_compute_s(db: Path) -> float:
    """Mean per step of the policy's own compute time, as the controller timed each decision."""
    import sqlalchemy as sa

    from storage import make_engine
    from storage.models import Decision

    engine = make_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        rows = conn.execute(sa.select(Decision.step, sa.func.sum(Decision.duration_s)).group_by(Decision.step)).all()
    engine.dispose()
    return statistics.mean(v for _, v in rows) if rows else 0.0


def summarize(steps: list[StepTimes]) -> dict[str, Any]:
    steps = sorted(steps, key=lambda s: s.step)
    rows = []
    for cur, nxt in measured_steps(steps):
        cycle = nxt.start - cur.start
        data = sum(v for k, v in cur.tasks.items() if k in DATA_PLANE)
        store = sum(v for k, v in cur.tasks.items() if k in STORE)
        policy = sum(v for k, v in cur.tasks.items() if k in POLICY)
        prefect = cycle - sum(cur.tasks.values())
        rows.append({"cycle": cycle, "data": data, "store": store, "policy": policy, "prefect": prefect,
                     "control": prefect + policy, "tasks": cur.n_tasks})
    mean = {k: statistics.median(r[k] for r in rows) for k in rows[0]}  # robust to a busy machine's spikes
    mean["n"] = len(rows)
    mean["first_cycle"] = steps[1].start - steps[0].start
    return mean


def measured_steps(steps: list[StepTimes]) -> list[tuple[StepTimes, StepTimes]]:
    """(step, next step) for every step but the first (one-off start-up) and the last (no successor)."""
    steps = sorted(steps, key=lambda s: s.step)
    return [(cur, nxt) for cur, nxt in zip(steps, steps[1:]) if cur.step != 1]


def ray_calls(calls: list[list[Any]], steps: list[StepTimes]) -> dict[str, Any]:
    """Actor method calls the driver made per measured step (counted in the step's cycle:
    from its flow run's start to the next one's), median over steps, and one step's calls by method."""
    per_step = [Counter(name for t, name in calls if cur.start <= t < nxt.start) for cur, nxt in measured_steps(steps)]
    totals = [sum(c.values()) for c in per_step]
    median = statistics.median(totals)
    typical = next(c for c in per_step if sum(c.values()) == min(totals, key=lambda n: abs(n - median)))
    return {"per_step": median, "each_step": totals, "by_method": dict(sorted(typical.items()))}


def measure(tree: Path, steps: int, timeout_s: float) -> dict[str, Any]:
    """Every setup on ``tree``'s code; JSON-able figures per setup."""
    work = Path(tempfile.mkdtemp(prefix="tidal-bcp-", dir="/tmp"))
    home = work / "prefect-home"
    if os.environ.get(HIDE_ENV):  # the baseline: the private server (this tree's harness) as it ran then too
        os.environ["PYTHONPATH"] = os.pathsep.join((os.environ[HIDE_ENV], os.environ.get("PYTHONPATH", "")))
        sys.path.insert(0, os.environ[HIDE_ENV])  # and its command line, built here (flows.prefect_app)
        os.environ.update(prefect_default_writes())  # and Prefect's own write batching
    server = LocalPrefectServer(home=str(home))
    try:
        embedded, served = [s for s in SETUPS if not s.server], [s for s in SETUPS if s.server]
        walls = {}
        for setup in embedded:
            print(f"  running: {setup.label}", flush=True)
            walls[setup.key] = tidal_run(setup, steps, tree, work, base_env(home), timeout_s)
        server.start()  # on the embedded runs' home: their flow runs are in its database
        for setup in served:
            print(f"  running: {setup.label}", flush=True)
            walls[setup.key] = tidal_run(setup, steps, tree, work, server.env(base_env(home)), timeout_s)
        runs = list(read_runs(server.api_url, steps).values())
        assert len(runs) == len(SETUPS), f"expected {len(SETUPS)} training-run flow runs, found {len(runs)}"
        setups = {}
        for setup, times in zip(embedded + served, runs):
            calls = json.loads((work / setup.key / CALLS_FILE).read_text(encoding="utf-8"))
            setups[setup.key] = {**summarize(times), "label": setup.label, "runner": setup.runner,
                                 "server": setup.server, "wall_s": walls[setup.key],
                                 "policy_compute_s": policy_compute_s(work / setup.key / "tidal.db"),
                                 "ray_calls": ray_calls(calls, times)}
    finally:
        server.stop()
        kill_processes_mentioning(str(work))
        shutil.rmtree(work, ignore_errors=True)
    return {"setups": setups, "steps": steps, "load_average": os.getloadavg()[0]}


def headline(result: dict[str, Any]) -> dict[str, float]:
    """The three figures results.json keeps (DESIGN's targets: ≤ 10 calls, ≤ 0.15 s in-process)."""
    setups = result["setups"]
    return {"ray_calls_per_step": setups[IN_PROCESS.key]["ray_calls"]["per_step"],
            "seconds_per_step_in_process": setups[IN_PROCESS.key]["control"],
            "seconds_per_step_ray_runner": setups[RAY_RUNNER.key]["control"]}


# ------------------------------------------------------------------------------------------------
# before / after (in the parent: one child per tree)
# ------------------------------------------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def this_tree_label() -> str:
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"this tree ({git('rev-parse', '--short', 'HEAD')}{' + changes' if dirty else ''})"


def measure_in_child(tree: Path, steps: int, timeout_s: float, as_before: bool = False) -> dict[str, Any]:
    """``measure(tree)`` in a subprocess with ``tree`` on PYTHONPATH (its runs import only its code);
    ``as_before``: with Prefect's server as it ran before it was tuned (``benchmarks/as_before.py``)."""
    with tempfile.NamedTemporaryFile(suffix=".json", prefix="tidal-bcp-") as out, \
            tempfile.TemporaryDirectory(prefix="tidal-bcp-hide-") as hidden:
        cmd = [sys.executable, __file__, "--measure", str(tree), "--json-out", out.name, "--steps", str(steps),
               "--timeout", str(timeout_s)]
        env = {**os.environ, "PYTHONPATH": str(tree), **({HIDE_ENV: hide(hidden, MARK)} if as_before else {})}
        subprocess.run(cmd, check=True, env=env)
        return json.loads(Path(out.name).read_text(encoding="utf-8"))


def before_and_after(baseline: str | None, steps: int, timeout_s: float, rounds: int = 1,
                     as_before: bool = True) -> dict[str, dict[str, Any]]:
    """Label → result: the baseline revision's (from a temporary worktree, removed after) and this
    tree's, alternated ``rounds`` times (baseline first in each), each figure the median over rounds.
    ``as_before``: the baseline on Prefect's server as it ran before it was tuned, else as this tree's."""
    measured: dict[str, list[dict[str, Any]]] = {}
    label = this_tree_label()
    scratch = Path(tempfile.mkdtemp(prefix="tidal-bcp-base-", dir="/tmp"))
    trees: list[tuple[str, Path, bool]] = []
    if baseline:
        rev = git("rev-parse", "--short", baseline)
        git("worktree", "add", "--detach", str(scratch / "tree"), rev)
        trees.append((f"baseline {rev}", scratch / "tree", as_before))
    trees.append((label, ROOT, False))
    try:
        for k in range(rounds):
            for name, tree, as_before in trees:
                print(f"measuring {name} (round {k + 1} of {rounds}) in {tree}", flush=True)
                measured.setdefault(name, []).append(measure_in_child(tree, steps, timeout_s, as_before=as_before))
    finally:
        if baseline:
            git("worktree", "remove", "--force", str(scratch / "tree"))
        shutil.rmtree(scratch, ignore_errors=True)
    return {name: over_rounds(runs) for name, runs in measured.items()}


def over_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One tree's rounds as one result: every per-setup number the median over rounds (the other
    fields from the last round), and each round's headline kept under ``rounds``."""
    last = runs[-1]
    setups = {}
    for key, m in last["setups"].items():
        per = [r["setups"][key] for r in runs]
        setups[key] = {**m, **{f: statistics.median(p[f] for p in per) for f, v in m.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)},
                       "ray_calls": {**m["ray_calls"], "per_step": statistics.median(p["ray_calls"]["per_step"] for p in per)}}
    return {**last, "setups": setups, "rounds": [headline(r) for r in runs]}


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def side_by_side(results: dict[str, dict[str, Any]]) -> list[str]:
    """The headline figures of every tree measured, one column each (and the change, for two)."""
    labels = list(results)
    heads = {label: headline(r) for label, r in results.items()}
    change = len(labels) == 2
    lines = ["| figure | " + " | ".join(labels) + (" | change |" if change else " |"),
             "|---|" + "---:|" * (len(labels) + change)]
    for key in heads[labels[0]]:
        values = [heads[label][key] for label in labels]
        fmt = "{:.0f}" if key == "ray_calls_per_step" else "{:.3f}"
        row = f"| `overhead.{key}` | " + " | ".join(fmt.format(v) for v in values)
        if change:
            row += " | " + (f"{values[1] / values[0] - 1:+.0%}" if values[0] else "n/a")
        lines.append(row + " |")
    return lines


def per_round(results: dict[str, dict[str, Any]]) -> list[str]:
    """With several rounds: each round's in-process overhead, per tree (the table shows medians)."""
    if len(next(iter(results.values())).get("rounds", [])) < 2:
        return []
    rows = "; ".join(f"{label} " + ", ".join(f"{h['seconds_per_step_in_process']:.3f}" for h in r["rounds"])
                     for label, r in results.items())
    return [f"Rounds, baseline and this tree alternated (medians above), in-process overhead s per round: {rows}.", ""]


def markdown(results: dict[str, dict[str, Any]], command: str) -> str:
    label, current = list(results.items())[-1]
    steps, rounds = current["steps"], len(current.get("rounds", [])) or 1
    setups = current["setups"]
    lines = [
        "## Control-plane overhead per step (Prefect + policy + controller)",
        "",
        f"Command: `{command}`",
        "",
        f"`tidal run tiny-cpu` for {steps} steps per setup and per tree, one after the other in one invocation"
        f"{f', {rounds} rounds' if rounds > 1 else ''}; "
        "every time is read back from the Prefect API (flow-run and task-run timestamps), every Ray call counted in "
        "the driver (`benchmarks/ray_call_counter.py`; what each column means: `docs/benchmarks.md`). Medians over "
        f"steps 2…{steps - 1}. {platform.machine()}, {os.cpu_count()} CPUs shared with other jobs (load average "
        f"{current['load_average']:.1f} at the end), so expect ±20 %.",
        "",
        *side_by_side(results),
        "",
        *per_round(results),
        f"Per setup, {label}:",
        "",
        "| setup | tasks/step | Ray calls/step | cycle s | data plane s | store s | policy + controller s | Prefect s "
        "| **overhead s** | share of this cycle | share of a 60 s step | step-1 cycle s | policy compute ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in setups.values():
        lines.append(
            f"| {m['label']} | {m['tasks']:.1f} | {m['ray_calls']['per_step']:.0f} | {m['cycle']:.2f} | "
            f"{m['data']:.2f} | {m['store']:.2f} | {m['policy']:.3f} | {m['prefect']:.3f} | **{m['control']:.2f}** | "
            f"{m['control'] / m['cycle']:.0%} | {m['control'] / TARGET_STEP_S:.1%} | {m['first_cycle']:.2f} | "
            f"{m['policy_compute_s'] * 1e3:.2f} |"
        )
    ray, thread = setups[RAY_RUNNER.key], setups[SETUPS[1].key]
    dispatch_ms = (ray["prefect"] - thread["prefect"]) / ray["tasks"] * 1e3
    by_method = ", ".join(f"{name} {n}" for name, n in setups[IN_PROCESS.key]["ray_calls"]["by_method"].items())
    lines += [
        "",
        f"Ray calls of one in-process step by method: {by_method}. The control plane is a fixed cost per step, so at "
        f"DESIGN's 60 s step it comes to {setups[IN_PROCESS.key]['control'] / TARGET_STEP_S:.1%} in-process and "
        f"{ray['control'] / TARGET_STEP_S:.1%} with the Ray runner (target ≤ 2 %); the Ray runner costs "
        f"{dispatch_ms:+.0f} ms per phase against the in-process runner on the same server.",
    ]
    return "\n".join(lines) + "\n"


def before_after_figures(results: dict[str, dict[str, Any]], command: str) -> dict[str, Any]:
    """The command, the date, each tree's headline (the first tree is "before", the last "after")
    and after/before per headline figure: what ``--json-out-results`` writes."""
    labels = list(results)
    before, after = labels[0], labels[-1]
    last = results[after]
    heads = {label: headline(r) for label, r in results.items()}
    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average": last["load_average"],
            "steps": last["steps"], "before_tree": before, "after_tree": after,
            "before": heads[before], "after": heads[after],
            "ratio": {k: heads[after][k] / v if v else None for k, v in heads[before].items()},
            "rounds": {label: r.get("rounds", [heads[label]]) for label, r in results.items()},
            "setups": {label: r["setups"] for label, r in results.items()}}


def write_figures(results: dict[str, dict[str, Any]], command: str) -> None:
    """``benchmarks/results/overhead.json``, then ``benchmarks/results.json`` merged from all results."""
    from results_io import write_json
    from run_all import write_summary

    (label, current), *_ = reversed(results.items())
    setups = {m["label"]: {**m, "fraction_at_60s_step": m["control"] / TARGET_STEP_S}
              for m in current["setups"].values()}
    print("wrote", write_json("overhead", {
        "command": command, "tree": label, "setups": setups, "load_average": current["load_average"],
        **headline(current),
        "before": {other: headline(r) for other, r in results.items() if other != label},
        "rounds": {name: r.get("rounds", [headline(r)]) for name, r in results.items()},
        # the default path (embedded Prefect, in-process runner) is the headline; the worst is kept too
        "fraction_at_60s_step": setups[IN_PROCESS.label]["fraction_at_60s_step"],
        "worst_fraction_at_60s_step": max(v["fraction_at_60s_step"] for v in setups.values()),
    }))
    print("wrote", write_summary())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per setup (≥ 3: step 2 is the first measured)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate the baseline and this tree this many times; figures are medians over rounds")
    parser.add_argument("--baseline", default=BASELINE,
                        help=f"revision to measure first, in a temporary git worktree (default {BASELINE}; none: skip)")
    parser.add_argument("--baseline-server", choices=("as-before", "same"), default="as-before",
                        help="the baseline's Prefect server: as before it was tuned (default), or this tree's")
    parser.add_argument("--json-out-results", type=Path,
                        help="also write the command and every tree's headline figures to this JSON file")
    parser.add_argument("--write", type=Path, help="update this RESULTS.md's section, results/overhead.json and "
                                                   "results.json")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child: measure this tree only
    parser.add_argument("--json-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    if args.measure:
        args.json_out.write_text(json.dumps(measure(args.measure, args.steps, args.timeout)), encoding="utf-8")
        return 0
    baseline = None if args.baseline.lower() in ("", "none") else args.baseline
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    command = "python benchmarks/bench_control_plane.py" + (f" --steps {args.steps}" if args.steps != 10 else "") + (
        f" --rounds {args.rounds}" if args.rounds != 1 else "") + (
        f" --baseline {args.baseline}" if args.baseline != BASELINE else "") + (
        f" --baseline-server {args.baseline_server}" if args.baseline_server != "as-before" else "") + (
        f" --json-out-results {args.json_out_results}" if args.json_out_results else "") + (
        f" --write {args.write}" if args.write else "")
    results = before_and_after(baseline, args.steps, args.timeout, args.rounds,
                               as_before=args.baseline_server == "as-before")
    section = markdown(results, command)
    print(section)
    if args.json_out_results:
        from results_io import write_json

        print("wrote", write_json("", before_after_figures(results, command), args.json_out_results))
    if args.write:
        from results_io import write_section

        write_section(MARK, section, args.write)
        print(f"wrote {args.write}")
        write_figures(results, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
