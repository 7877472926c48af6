"""Fault campaign, the trainer's ranks: a 2-rank trainer (`trainer.n_gpus_per_node=2`, FSDP2 over
gloo) whose run is hit, one process after another, by a driver SIGKILL mid-step, a driver SIGKILL
with the broadcast in flight (the weight-sync group torn down mid-sync: the resume must build a
new one; ``test_fault_resume_sync_group.py`` is the campaign's longer look at it), a background
checkpoint write cut off (the last committed step's commit marker never written), a rank killed
mid-step and a rank killed mid-commit. Each lost rank stops the driver with exit 3 and one line
naming the resume command, within the test's timeout (no collective left hanging); `tidal
resume` continues each time, and the run ends exactly where an uninterrupted run ends: steps
1..STEPS committed once each, the same policy state, the same prompts with none trained twice.

In CI (no ``TIDAL_FAULT_REPORT``) the run starts with the mid-broadcast kill, and its rank dies in
training only: three drivers instead of five (each ~80 s at CI's load); the fault campaign
(``benchmarks/fault_campaign.py``) runs all five."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from driver_support import assert_resumed_exactly, config_args, final_state, run_tidal, store_url
from fault_report import ENV as REPORT_ENV
from fault_report import record

from flows.runners import CRASH_DURING_ENV
from tasks.faults import KILL_RANK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 5  # the uninterrupted run is the session's, shared with tests/integration/test_rank_group_run.py
RANKS = ["--set", "trainer.n_gpus_per_node=2"]
CAMPAIGN = bool(os.environ.get(REPORT_ENV))  # all five faults; CI: three (the module docstring)


def _lost_rank(code: int, log: str, uid: str) -> None:
    assert code == 3, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert "an actor of the run died" in last and f"tidal resume {uid}" in last, last


def test_killed_drivers_cut_off_writes_and_lost_ranks_resume_to_the_uninterrupted_result(tmp_path, ray_address,
                                                                                         uninterrupted):
    straight = store_url(uninterrupted(STEPS, *RANKS), "straight")
    crashed = store_url(tmp_path, "crashed")
    store = ["--storage", crashed]
    run = ["run", "tiny-cpu", *config_args(tmp_path, ray_address, "crashed", STEPS), *RANKS]
    uid = None
    if CAMPAIGN:  # 1. the driver SIGKILLed while step 2 trains (step 1's checkpoint may still be being written)
        code, log = run_tidal(run, tmp_path, crash="train:2")
        assert code == -signal.SIGKILL, log[-3000:]
        uid = final_state(crashed)[0].uid
    # 2. SIGKILLed with step 4's broadcast in flight (step 3 committed); step 3's background write
    # then taken as cut off
    code, log = run_tidal(run if uid is None else ["resume", uid, *store], tmp_path,
                          extra={CRASH_DURING_ENV: "broadcast_sync:4"})
    assert code == -signal.SIGKILL, log[-3000:]
    uid = uid or final_state(crashed)[0].uid
    assert f"{CRASH_DURING_ENV}=broadcast_sync:4: SIGKILL with the phase's call in flight" in log, log[-3000:]
    _, state, *_ = final_state(crashed)
    assert state.step == 3
    Path(state.checkpoint.path).unlink()  # its commit marker never written: incomplete
    # 3. step 3 is dropped and trained again; then rank 1 dies while step 4 trains
    code, log = run_tidal(["resume", uid, *store], tmp_path, extra={KILL_RANK_ENV: "train:4"})
    assert "step 3's checkpoint was still being written" in log
    _lost_rank(code, log, uid)
    assert final_state(crashed)[1].step == 3
    if CAMPAIGN:  # 4. rank 1 dies in step 4's commit, before the step is recorded
        code, log = run_tidal(["resume", uid, *store], tmp_path, extra={KILL_RANK_ENV: "commit:4"})
        _lost_rank(code, log, uid)
        assert final_state(crashed)[1].step == 3
    # 5. to the end
    code, log = run_tidal(["resume", uid, *store], tmp_path)
    assert code == 0, log[-3000:]

    # every step after the mid-broadcast kill went over a rebuilt collective group, at the first try
    rows = final_state(crashed)[2]
    assert all(r["weight_sync/collective/gb"] > 0 and r["weight_sync/collective/retries"] == 0
               for r in rows if r["step"] >= 4), rows
    lost, duplicated = assert_resumed_exactly(straight, crashed, STEPS)
    record("sync_group_rebuild", injected=1, survived=1, samples_lost=lost, samples_duplicated=duplicated,
           point="broadcast_sync:4 in flight", ranks=2, transport="collective")
    points = ["train:4", "commit:4"] if CAMPAIGN else ["train:4"]
    record("rank_death", injected=len(points), survived=len(points), samples_lost=lost, samples_duplicated=duplicated,
           points=points)
    record("checkpoint_cut_off", injected=1, survived=1, samples_lost=lost, samples_duplicated=duplicated)
