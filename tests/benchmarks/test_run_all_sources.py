"""`run_all.written_at`: a results file's date is its last commit's while the working tree holds that
content (a fresh clone resets mtimes), and its mtime once it was written again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import run_all  # noqa: E402

COMMITTED = 1764460800  # 2025-11-30 00:00 UTC


def _repo(tmp_path: Path) -> Path:
    env = {**os.environ, "GIT_AUTHOR_DATE": f"@{COMMITTED}", "GIT_COMMITTER_DATE": f"@{COMMITTED}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    (tmp_path / "r.json").write_text("{}\n")
    for cmd in (["init", "-q"], ["add", "r.json"], ["commit", "-q", "-m", "r"]):
        subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True, env=env)
    return tmp_path / "r.json"


def test_an_unchanged_results_file_is_dated_by_its_commit_not_its_fresh_mtime(tmp_path, monkeypatch):
    path = _repo(tmp_path)
    monkeypatch.setattr(run_all, "ROOT", tmp_path)
    os.utime(path, (time.time(), time.time()))  # what a fresh clone does
    assert run_all.written_at(path) == "2025-11-30 00:00"


def test_a_results_file_written_again_is_dated_by_its_mtime(tmp_path, monkeypatch):
    path = _repo(tmp_path)
    monkeypatch.setattr(run_all, "ROOT", tmp_path)
    path.write_text('{"a": 1}\n')
    os.utime(path, (COMMITTED + 86400, COMMITTED + 86400))
    assert run_all.written_at(path) == "2025-12-01 00:00"
