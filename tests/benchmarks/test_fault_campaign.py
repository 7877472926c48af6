"""fault_campaign.py's tiny-hf campaign: its files, its own section and JSON (where it is told to
write them), and run_all's merge of ``faults_hf.*`` with its targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import pytest  # noqa: E402
import results_io  # noqa: E402
import run_all  # noqa: E402


@pytest.mark.slow  # a pytest of its own, which imports Ray and Prefect: ~20 s alone, a minute under load
def test_the_tiny_hf_campaign_writes_its_own_section_and_json_where_it_is_told(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- fault_campaign -->\nkept\n<!-- /fault_campaign -->\n")
    out = tmp_path / "faults_hf.json"
    # one cheap store fault: the whole script runs, pytest included, on the tiny-hf file list
    code = subprocess.call(
        [sys.executable, str(BENCH / "fault_campaign.py"), "--preset", "tiny-hf", "--write", str(results),
         "--json-out", str(out), "--", "-k", "blocked_by_another_sqlite_writer"],
        cwd=BENCH.parent, env={**os.environ, "PYTHONPATH": str(BENCH.parent)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert code == 0
    figures = json.loads(out.read_text())
    assert (figures["preset"], figures["command"], figures["tests"]) == (
        "tiny-hf", ".venv/bin/python benchmarks/fault_campaign.py --preset tiny-hf -- -k blocked_by_another_sqlite_writer",
        {"passed": 1, "failed": 0, "skipped": 0})
    assert {k: figures[k] for k in ("injected", "survived", "samples_lost", "samples_duplicated")} == {
        "injected": 1, "survived": 1, "samples_lost": 0, "samples_duplicated": 0}
    text = results.read_text()
    assert "<!-- fault_campaign -->\nkept\n<!-- /fault_campaign -->" in text  # the tiny-cpu section untouched
    section = text.split("<!-- fault_campaign_hf -->\n")[1].split("<!-- /fault_campaign_hf -->")[0]
    assert section.splitlines()[0] == "## Fault campaign on tiny-hf (`fault_campaign.py --preset tiny-hf`)"
    assert "`pytest test_fault_replica_kill.py test_fault_driver_kill.py test_fault_store.py " \
           "test_fault_postgres_run.py` (`TIDAL_FAULT_PRESET=tiny-hf`)" in section
    assert "| store_fault | 1 | 1 | 1 | 0 | 0 |" in section


def test_run_all_merges_the_tiny_hf_campaign_and_checks_its_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(results_io, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(run_all, "RESULTS_DIR", tmp_path)
    (tmp_path / "faults_hf.json").write_text(json.dumps(
        {"injected": 30, "survived": 30, "samples_lost": 0, "samples_duplicated": 1, "records": []}))
    merged = run_all.merge()
    faults_hf = merged["faults_hf"]
    assert {k: faults_hf[k] for k in run_all.FAULT_FIGURES} == {"injected": 30, "survived": 30, "samples_lost": 0,
                                                               "samples_duplicated": 1}
    assert faults_hf["command"] is None or isinstance(faults_hf["command"], str)
    assert faults_hf["date"].endswith(" UTC")  # the file's own write time: its writer records none
    assert "faults" not in merged  # no file, no section
    assert {k: v for k, v in merged["targets"].items() if k.startswith("faults")} == {
        "faults.samples_lost": {"value": None, "target": "<= 0", "met": None},
        "faults.samples_duplicated": {"value": None, "target": "<= 0", "met": None},
        "faults_hf.samples_lost": {"value": 0, "target": "<= 0", "met": True},
        "faults_hf.samples_duplicated": {"value": 1, "target": "<= 0", "met": False},
    }


def test_a_rerun_replaces_the_cases_and_records_of_its_files_and_counts_again(tmp_path):
    import fault_campaign as fc

    recorded = tmp_path / "faults.json"
    before = {"trainer_ranks": 2, "transport": "collective", "seconds": 100.0, "commit": "abc1234",
              "cases": [{"file": "test_fault_driver_kill.py", "name": "t", "outcome": "failed", "time_s": 9.0},
                        {"file": "test_fault_store.py", "name": "s", "outcome": "passed", "time_s": 1.0}],
              "records": [{"test": "tests/faults/test_fault_driver_kill.py::t", "kind": "driver_sigkill",
                           "injected": 20, "survived": 20, "samples_lost": 0, "samples_duplicated": 0}]}
    recorded.write_text(json.dumps(before))
    with pytest.raises(ValueError, match="recorded on"):  # another compute plane: refused
        fc.rerun_paths(recorded, ["test_fault_driver_kill.py"], None, None)
    with pytest.raises(ValueError, match="no such test file"):
        fc.rerun_paths(recorded, ["test_nothing.py"], 2, None)
    got, paths = fc.rerun_paths(recorded, ["test_fault_driver_kill.py"], 2, "collective")
    assert paths == ["tests/faults/test_fault_driver_kill.py"]
    again = [{"test": "tests/faults/test_fault_driver_kill.py::t", "kind": "driver_sigkill", "injected": 20,
              "survived": 20, "samples_lost": 0, "samples_duplicated": 0}]
    records, cases, took, code, reruns = fc.merged(
        got, paths, again, [{"file": "test_fault_driver_kill.py", "name": "t", "outcome": "passed", "time_s": 8.0}],
        50.0, 0)
    t = fc.tally(records, cases)
    assert (t["injected"], t["survived"], t["failed_tests"], t["tests"]) == (
        21, 21, [], {"passed": 2, "failed": 0, "skipped": 0})  # the store case counts once, the rerun's kills once
    assert (took, code, reruns[0]["files"], reruns[0]["campaign_commit"]) == (
        150.0, 0, ["test_fault_driver_kill.py"], "abc1234")
