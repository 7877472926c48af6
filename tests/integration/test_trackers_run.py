"""A real `tidal run` killed mid-run and resumed feeds its trackers every committed step exactly
once, on the global step axis, under the stored metric names; `tidal runs` then shows the real
wall clock of both sessions beside the summed step times."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from driver_support import config_args, final_state, run_tidal, store_url

pytestmark = pytest.mark.slow
STEPS = 4


def test_a_killed_and_resumed_run_logs_every_committed_step_once_to_file_and_tensorboard(tmp_path, ray_address):
    pytest.importorskip("tensorboard", reason="the tensorboard tracker needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [*config_args(tmp_path, ray_address, "tracked", STEPS), "--set", "trainer.logger=[console,file,tensorboard]"]
    code, log = run_tidal(["run", "tiny-cpu", *args], tmp_path, crash="train:3")
    assert code == -signal.SIGKILL, log[-3000:]
    url = store_url(tmp_path, "tracked")
    summary, *_ = final_state(url)
    code, log = run_tidal(["resume", summary.uid, "--storage", url], tmp_path)
    assert code == 0, log[-3000:]
    _, _, rows, _ = final_state(url)
    out = Path(tmp_path) / "tracked" / summary.uid

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [line["data"]["timing_s/step"] for line in lines] == [r["timing_s/step"] for r in rows]
    names = set(lines[0]["data"])
    for prefix in ("dynamic_resource/", "fully_async/", "actor/", "timing_s/"):
        assert any(n.startswith(prefix) for n in names), prefix

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("timing_s/step")] == [1, 2, 3, 4]  # both sessions' event files

    sessions = json.loads((out / "sessions.json").read_text())
    assert len(sessions) == 2
    code, shown = run_tidal(["runs", "--storage", url], tmp_path)
    assert code == 0, shown
    row = re.split(r"\s{2,}", shown.strip().splitlines()[-1].strip())
    assert row[:4] == [summary.uid, "finished", "step_counting_policy:StepCountingPolicy", "4/4"]
    assert row[5] != "-"  # the real elapsed time, from both sessions
