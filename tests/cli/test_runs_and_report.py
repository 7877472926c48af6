"""`tidal runs` (a header; status, policy, steps done / total, start, the real wall clock beside
the summed step times, last reward) and `tidal report` (from the store alone, the paths written),
on a store seeded through the store functions: no Ray, no Prefect."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from flows.cli import duration, main
from flows.report import report_data
from flows.run_clock import SESSIONS_FILE
from metrics import StepSplit, lending_gain
from storage import open_store, read_step_metrics, session_scope
from tests.seeded_runs import seeded_store

ROOT = Path(__file__).resolve().parents[2]


def test_runs_prints_a_header_and_the_real_wall_clock_beside_the_summed_step_times(tmp_path, capsys):
    url, folders = seeded_store(tmp_path, {
        "tiny-a": {"steps": 3, "total": 5, "status": "running"},
        "tiny-b": {"steps": 2, "policy": "predictive", "status": "finished"},
        "tiny-c": {"steps": 0},
    })
    # tiny-a ran twice (a start and a resume): 40 s + 20 s of real time
    (folders["tiny-a"] / SESSIONS_FILE).write_text(json.dumps([
        {"started_at": 100.0, "ended_at": 140.0}, {"started_at": 500.0, "ended_at": 520.0}]))
    assert main(["runs", "--storage", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    assert [row[4][:10] for row in cells[1:]] == [today] * 3
    assert [row[:4] + row[5:] for row in cells] == [
        ["run id", "status", "policy", "steps", "elapsed", "step sum", "reward"],
        # stored as running, but no driver holds their lease: `interrupted` (storage.run_statuses)
        ["tiny-a", "interrupted", "default", "3/5", "1m 00s", "12.0s", "0.300"],
        ["tiny-b", "finished", "predictive", "2/2", "-", "7.0s", "0.200"],
        ["tiny-c", "interrupted", "default", "0/?", "-", "0.0s", "-"],
    ]
    assert len({len(line) for line in lines[:3]}) == 1  # aligned columns


def test_durations_read_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (9.54, 187.0, 7530.0)] == ["9.5s", "3m 07s", "2h 05m"]


def test_report_writes_the_markdown_and_png_and_prints_only_their_paths(tmp_path):
    url, folders = seeded_store(tmp_path, {"tiny-a": {"steps": 4, "lent": {1, 2}}})
    started = time.perf_counter()
    # a fresh interpreter, as a user runs it: no warnings, no Prefect server, no Ray
    done = subprocess.run([sys.executable, "-m", "flows.cli", "report", "tiny-a", "--storage", url],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    elapsed = time.perf_counter() - started
    out = folders["tiny-a"]
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [f"wrote {out / 'report.md'}", f"wrote {out / 'report.png'}"]
    assert (out / "report.png").stat().st_size > 20_000
    assert "| 3 | 5.00 | 1.00 | 1.00 | 0.50 | 0.12 | 0.300 | 12 | 0.50 | lent |" in (out / "report.md").read_text()
    assert elapsed < 30, f"tidal report took {elapsed:.1f}s"


def test_the_report_is_drawn_from_the_split_and_the_lent_steps(tmp_path):
    url, _ = seeded_store(tmp_path, {"tiny-a": {"steps": 4, "lent": {1, 2}}})
    with session_scope(open_store(url)) as session:
        rows = read_step_metrics(session, "tiny-a")
    data = report_data("tiny-a", "default", rows)
    assert data.title == "Tidal run tiny-a · policy default, hybrid lent in 2 of 4 steps (bought ≈ 3.0 s, estimated)"
    assert data.gain == lending_gain(rows)  # seeded: every step waits 1 s; two switches of 0.5 s
    assert data.steps == [1, 2, 3, 4]
    assert data.lent == [2, 3]  # lent after steps 1 and 2: it generated during steps 2 and 3
    assert data.lent_spans() == [(1.5, 3.5)]
    assert data.split[2] == StepSplit(train=1.0, wait=1.0, switch=0.5, sync=0.125, other=2.375)
    assert [s.total for s in data.split] == [3.0, 4.0, 5.0, 6.0]  # = timing_s/step
    assert data.series["train/reward_mean"] == [0.1, 0.2, 0.30000000000000004, 0.4]


def test_report_of_an_unknown_run_is_one_line_and_exit_2(tmp_path, capsys):
    url, _ = seeded_store(tmp_path, {"tiny-a": {"steps": 1}})
    assert main(["report", "nope", "--storage", url]) == 2
    assert capsys.readouterr().err == f"tidal: error: run 'nope': no such run in {url}\n"
