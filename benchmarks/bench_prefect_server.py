"""Prefect's cost per step flow run on Tidal's own server: Prefect's settings against Tidal's.

An empty step (a subflow of ``--tasks`` no-op tasks on the thread runner, called in a loop inside
a parent flow, with the step loop's settings and client: ``flows.runners``) against a
``flows.prefect_server.LocalPrefectServer`` on a fresh home, in two variants, alternated round by
round so the machine's load drifts over both alike:

    prefect   Prefect 3.9's server settings: one transaction per task-run event, asyncio's loop
              and h11 (uvloop and httptools hidden from the server: their import fails)
    tidal     ``BATCHED_WRITES`` and uvloop + httptools (what ``tidal run`` starts)

Per variant: the median wall time of a step flow run, and the server's and the client's CPU per
step (``/proc``). Owns the measurement; must not touch any other Prefect server or home.

Usage:
    .venv/bin/python benchmarks/bench_prefect_server.py [--steps 30] [--tasks 7] [--rounds 3]
        [--write benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from as_before import hide, prefect_default_writes  # noqa: E402

MARK = "bench_prefect_server"


def child(steps: int, tasks: int) -> dict[str, Any]:
    """One variant, in this process (its environment chosen by the parent)."""
    sys.path.insert(0, str(ROOT))
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.prefect_server import LocalPrefectServer
    from flows.runners import step_flow_client, step_flow_settings

    @task(cache_policy=NO_CACHE, persist_result=False)
    def phase(i: int) -> int:
        return i

    @flow(name="bench-step", flow_run_name="step-{n:05d}", validate_parameters=False)
    def step(n: int) -> int:
        for i in range(tasks):
            phase.submit(i).result()
        return n

    def cpu_s(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @flow(name="bench-run")
    def run(n: int, server_pid: int) -> dict[str, Any]:
        one = step.with_options(task_runner=ThreadPoolTaskRunner(max_workers=4))
        walls = []
        with step_flow_settings(), step_flow_client():
            for warm in range(2):
                one(warm)
            c0, s0 = sum(os.times()[:2]), cpu_s(server_pid)
            for k in range(n):
                t = time.perf_counter()
                one(k)
                walls.append(time.perf_counter() - t)
            c1, s1 = sum(os.times()[:2]), cpu_s(server_pid)
        return {"median_s": statistics.median(walls), "client_cpu_s": (c1 - c0) / n, "server_cpu_s": (s1 - s0) / n}

    server = LocalPrefectServer(home=os.environ["PREFECT_HOME"]).start(timeout_s=180)
    try:
        os.environ["PREFECT_API_URL"] = server.api_url
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            return run(steps, server.pid)
    finally:
        server.stop()


def run_variant(variant: str, steps: int, tasks: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tidal-bps-hide-") as hidden, \
            tempfile.TemporaryDirectory(prefix="tidal-bps-home-") as home, \
            tempfile.NamedTemporaryFile(suffix=".json", prefix="tidal-bps-") as out:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=home, PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PYTHONPATH=str(ROOT))
        if variant == "prefect":
            env.update(prefect_default_writes(), PYTHONPATH=os.pathsep.join((hide(hidden, MARK), str(ROOT))))
        cmd = [sys.executable, __file__, "--child", out.name, "--steps", str(steps), "--tasks", str(tasks)]
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, timeout=1800)
        return json.loads(Path(out.name).read_text(encoding="utf-8"))


def markdown(rows: dict[str, list[dict[str, Any]]], command: str, tasks: int, steps: int) -> str:
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in rows.items()}
    lines = [
        "## Prefect's cost per step flow run: Prefect's server settings against Tidal's", "",
        f"Command: `{command}`", "",
        f"An empty step flow ({tasks} no-op tasks on the thread runner, the step loop's settings and client) "
        f"called {steps} times per round against a fresh `LocalPrefectServer`, the two variants alternated for "
        f"{len(rows['tidal'])} rounds (medians over rounds of each round's median). *prefect*: Prefect 3.9's "
        "write batching (one transaction per task-run event), asyncio + h11; *tidal*: "
        "`flows.prefect_server.BATCHED_WRITES`, uvloop + httptools. "
        f"{platform.machine()}, {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at the end); "
        f"{time.strftime('%Y-%m-%d')}.", "",
        "| variant | s per step flow run | server CPU s per step | client CPU s per step |",
        "|---|---:|---:|---:|",
    ]
    for v in ("prefect", "tidal"):
        lines.append(f"| {v} | {med[v]['median_s']:.3f} | {med[v]['server_cpu_s']:.3f} | {med[v]['client_cpu_s']:.3f} |")
    p, t = med["prefect"], med["tidal"]
    lines += ["", f"Change: {t['median_s'] / p['median_s'] - 1:+.0%} per step flow run, "
                  f"{t['server_cpu_s'] / p['server_cpu_s'] - 1:+.0%} server CPU."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="step flow runs per variant and round")
    parser.add_argument("--tasks", type=int, default=7, help="tasks per step flow run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", type=Path, help="update this RESULTS.md's section and results/prefect_server.json")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.child.write_text(json.dumps(child(args.steps, args.tasks)), encoding="utf-8")
        return 0
    rows: dict[str, list[dict[str, Any]]] = {"prefect": [], "tidal": []}
    for k in range(args.rounds):
        for variant in rows:
            rows[variant].append(run_variant(variant, args.steps, args.tasks))
            r = rows[variant][-1]
            print(f"round {k + 1} {variant}: {r['median_s']:.3f} s/step, server CPU {r['server_cpu_s']:.3f} s",
                  flush=True)
    command = "python benchmarks/bench_prefect_server.py" + "".join(
        f" --{n} {getattr(args, n)}" for n, d in (("steps", 30), ("tasks", 7), ("rounds", 3)) if getattr(args, n) != d)
    section = markdown(rows, command + (f" --write {args.write}" if args.write else ""), args.tasks, args.steps)
    print(section)
    if args.write:
        from results_io import write_json, write_section

        write_section(MARK, section, args.write, after="bench_control_plane")
        write_json("prefect_server", {"rounds": rows, "command": command})
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
