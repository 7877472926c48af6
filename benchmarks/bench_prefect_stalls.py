"""Step transitions over 1 s on Prefect's SQLite, before and after ``flows.prefect_app``.

Runs `tidal run tiny-cpu` (in-process task runner) twice in one invocation, each on a private
Prefect server of ``flows.prefect_app`` (the app Tidal serves its temporary servers with): once
with Prefect's own SQLite begin modes (before), once with writes begun IMMEDIATE (after). Counts
the 503s each server answered (``TIDAL_PREFECT_503_LOG``), then reads every task run back from
the API and counts the transitions (one task run's end to the next one's start, across step
boundaries too) over 1 s: the stalls of Prefect's 503 + fixed 2 s client retry, and any other.
Owns this measurement; docs/benchmarks.md says how to read it.
Must not: import the measured runs' code (each run is a `tidal run` subprocess).

Usage:
    .venv/bin/python benchmarks/bench_prefect_stalls.py [--steps 110] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_control_plane import Setup, base_env, kill_processes_mentioning, tidal_run  # noqa: E402
from flows.prefect_app import IMMEDIATE_ENV, RETRY_LOG_ENV  # noqa: E402
from flows.prefect_server import LocalPrefectServer  # noqa: E402

STALL_S = 1.0
SETUPS = [("prefect-modes", "private server, Prefect's SQLite begin modes (before)", "0"),
          ("immediate", "private server, writes begun IMMEDIATE (flows.prefect_app)", "1")]


async def _task_intervals(api_url: str) -> list[list[tuple[float, float]]]:
    """Per training-run flow run (oldest first): its task runs' (start, end), in start order."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, TaskRunFilter
    from prefect.client.schemas.filters import FlowRunFilterParentFlowRunId as ByParent
    from prefect.client.schemas.filters import TaskRunFilterFlowRunId as ByFlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["training-run"])))
            timelines = []
            for run in sorted(runs, key=lambda r: r.created):
                steps = await client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=ByParent(any_=[run.id])))
                ids = [s.id for s in steps]
                tasks = []
                for offset in range(0, 10**6, 200):  # the API pages at 200
                    page = await client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=ByFlowRun(any_=ids)),
                                                       limit=200, offset=offset)
                    tasks += page
                    if len(page) < 200:
                        break
                timelines.append(sorted((t.start_time.timestamp(), t.end_time.timestamp())
                                        for t in tasks if t.start_time and t.end_time))
            return timelines


def transitions(intervals: list[tuple[float, float]]) -> list[float]:
    """Seconds from each task run's end to the next one's start."""
    return [max(0.0, nxt[0] - cur[1]) for cur, nxt in zip(intervals, intervals[1:])]


def figures(gaps: list[float]) -> dict[str, Any]:
    slow = sorted(g for g in gaps if g > STALL_S)
    return {"transitions": len(gaps), "over_1s": len(slow), "median_s": statistics.median(gaps),
            "p99_s": sorted(gaps)[int(0.99 * (len(gaps) - 1))], "max_s": max(gaps),
            "slow_s": [round(g, 2) for g in slow]}


def measure(steps: int, timeout_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tbps-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    home = work / "prefect-home"
    home.mkdir()
    results: dict[str, Any] = {}
    try:
        for i, (key, label, immediate) in enumerate(SETUPS):
            print(f"  running: {label}", flush=True)
            retries = work / f"503-{key}.log"
            retries.touch()
            saved = {k: os.environ.get(k) for k in (IMMEDIATE_ENV, RETRY_LOG_ENV)}
            os.environ.update({IMMEDIATE_ENV: immediate, RETRY_LOG_ENV: str(retries)})
            try:
                with LocalPrefectServer(home=str(home)) as server:
                    wall = tidal_run(Setup(label, "thread", True), steps, ROOT, work / str(i),
                                     server.env(base_env(home)), timeout_s)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            answered = retries.read_text(encoding="utf-8").splitlines()
            results[key] = {"label": label, "wall_s": wall, "answered_503": len(answered),
                            "answered_503_by_path": dict(Counter(answered))}
        with LocalPrefectServer(home=str(home)) as server:  # every run's records are in this home's database
            time.sleep(5)  # the last run's task runs reach the database through the event pipeline
            timelines = asyncio.run(_task_intervals(server.api_url))
        assert len(timelines) == len(SETUPS), f"expected {len(SETUPS)} training runs, found {len(timelines)}"
        for (key, _, _), timeline in zip(SETUPS, timelines):
            results[key].update(figures(transitions(timeline)))
    finally:
        kill_processes_mentioning(str(work))
        shutil.rmtree(work, ignore_errors=True)
    return {"setups": results, "steps": steps, "load_average": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps per run (≈ 7 transitions each)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before giving up")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    result = measure(args.steps, args.timeout)
    print(f"\n| setup | 503s answered | transitions | over {STALL_S:.0f} s | median s | p99 s | max s |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for row in result["setups"].values():
        print(f"| {row['label']} | {row['answered_503']} | {row['transitions']} | {row['over_1s']} | "
              f"{row['median_s']:.3f} | {row['p99_s']:.3f} | {row['max_s']:.2f} |")
    print(f"\nload average at the end: {result['load_average']:.1f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
