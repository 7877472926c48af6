"""Fault campaign, a resume that must rebuild the weight-sync group: the driver of a 2-rank
trainer (`trainer.n_gpus_per_node=2`) on the collective weight transport (tiny-cpu's `auto`: a
torch trainer and rollout engine, so gloo buckets over a group of the trainer and the replicas)
is SIGKILLed while step 3's `broadcast_sync` runs: the phase's call to the controller submitted
and not yet answered (`flows.runners.CRASH_DURING_ENV`; `tasks.faults`' `broadcast_sync` point
fires only after the broadcast returned). Ray ends the dead driver's actors, the group's members
among them, mid-broadcast. `tidal resume` builds new actors, whose trainer forms a new group on a
new store (its first generation) for the warm-up broadcast and every step after: the steps after
the resume each show a collective broadcast that needed no retry (no stale member met), and the
run ends exactly where an uninterrupted run of the same config ends: steps 1..STEPS committed
once each, the same policy state, the same prompts with none trained twice."""

from __future__ import annotations

import os
import signal

import pytest
from driver_support import assert_resumed_exactly, config_args, final_state, run_tidal, store_url
from fault_report import record

from flows.runners import CRASH_DURING_ENV

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(not (os.environ.get("TIDAL_FAULT_REPORT") or os.environ.get("TIDAL_SYNC_GROUP_TEST")),
                       reason="runs with the fault campaign (benchmarks/fault_campaign.py --platform, which sets "
                              "TIDAL_FAULT_REPORT; or TIDAL_SYNC_GROUP_TEST=1), not in CI: 2-3 min beyond the "
                              "session's uninterrupted 2-rank run (330 s in all here, load 13)"),
]

STEPS = 5  # the uninterrupted run is the session's, shared with test_fault_rank_kill.py and test_rank_group_run.py
RANKS = ["--set", "trainer.n_gpus_per_node=2"]
KILLED_IN = 3


def test_a_driver_killed_mid_broadcast_resumes_on_a_rebuilt_sync_group_to_the_uninterrupted_result(
        tmp_path, ray_address, uninterrupted):
    straight = store_url(uninterrupted(STEPS, *RANKS), "straight")
    crashed = store_url(tmp_path, "crashed")
    code, log = run_tidal(["run", "tiny-cpu", *config_args(tmp_path, ray_address, "crashed", STEPS), *RANKS],
                          tmp_path, extra={CRASH_DURING_ENV: f"broadcast_sync:{KILLED_IN}"})
    assert code == -signal.SIGKILL, log[-3000:]
    assert f"{CRASH_DURING_ENV}=broadcast_sync:{KILLED_IN}: SIGKILL with the phase's call in flight" in log, log[-3000:]
    summary, state, rows, _ = final_state(crashed)
    assert state.step == KILLED_IN - 1  # step 3 never committed
    assert all(r["weight_sync/collective/gb"] > 0 for r in rows)  # the collective transport, 2 ranks

    code, log = run_tidal(["resume", summary.uid, "--storage", crashed], tmp_path)
    assert code == 0, log[-3000:]
    _, _, rows, _ = final_state(crashed)
    resumed = [r for r in rows if r["step"] >= KILLED_IN]
    assert [r["step"] for r in resumed] == list(range(KILLED_IN, STEPS + 1))
    # each step after the resume broadcast over the rebuilt group, at the first try
    assert all(r["weight_sync/collective/gb"] > 0 and r["weight_sync/collective/retries"] == 0 for r in resumed)

    lost, duplicated = assert_resumed_exactly(straight, crashed, STEPS)
    record("sync_group_rebuild", injected=1, survived=1, samples_lost=lost, samples_duplicated=duplicated,
           point=f"broadcast_sync:{KILLED_IN} in flight", ranks=2, transport="collective")
