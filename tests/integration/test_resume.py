"""Kill the driver (SIGKILL) at several points of a run; `tidal resume` must end exactly where an
uninterrupted run with the same seed ends: same policy state, step count and trained prompts,
no step committed twice."""

from __future__ import annotations

import signal

import pytest
from driver_support import config_args, final_state, run_tidal, store_url, switch_kinds

pytestmark = pytest.mark.slow
STEPS = 5
# (crash point, step) for each successive process of the interrupted run; the last one finishes.
CRASHES = ["wait_for_samples:2", "train:3", "broadcast_sync:3", "commit:4"]


def test_a_run_killed_at_every_phase_resumes_to_the_uninterrupted_result(tmp_path, ray_address, uninterrupted):
    straight = store_url(uninterrupted(STEPS), "straight")  # the session's, shared with test_fault_disk_full
    args = config_args(tmp_path, ray_address, "crashed", STEPS)
    code, log = run_tidal(["run", "tiny-cpu", *args], tmp_path, crash=CRASHES[0])
    assert code == -signal.SIGKILL, log[-3000:]
    summary, *_ = final_state(store_url(tmp_path, "crashed"))
    store = ["--storage", store_url(tmp_path, "crashed")]
    for crash in [*CRASHES[1:], None]:
        code, log = run_tidal(["resume", summary.uid, *store], tmp_path, crash=crash)
        assert code == (-signal.SIGKILL if crash else 0), log[-3000:]

    want_summary, want_state, want_rows, want_prompts = final_state(straight)
    got_summary, got_state, got_rows, got_prompts = final_state(store_url(tmp_path, "crashed"))
    assert got_summary.status == want_summary.status == "finished"
    assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows] == list(range(1, STEPS + 1))
    assert got_state.policy_state == want_state.policy_state
    assert got_state.policy_state["steps_seen"] == list(range(1, STEPS + 1))
    assert sorted(got_prompts) == sorted(want_prompts)
    assert len(got_prompts) == len(set(got_prompts))


def test_a_run_with_overlap_killed_after_its_combined_broadcast_resumes_to_the_uninterrupted_result(
        tmp_path, ray_address):
    """``dynamic_schedule_overlap_hybrid_sync``: killed right after step 3's broadcast, which
    synced the hybrid it was about to lend (not yet activated, nothing committed), the resumed
    run redoes step 3 from the last commit and ends where an uninterrupted run ends."""
    steps, overlap = 4, ["--set", "async_training.dynamic_schedule_overlap_hybrid_sync=true"]
    code, log = run_tidal(["run", "tiny-cpu", *config_args(tmp_path, ray_address, "straight", steps), *overlap],
                          tmp_path)
    assert code == 0, log[-3000:]
    lend, take_back = ["hybrid_sync", "activate", "rebalance"], ["deactivate"]
    # the step-counting policy lends after odd steps; the last step asks nothing
    assert switch_kinds(store_url(tmp_path, "straight")) == {1: lend, 2: take_back, 3: lend, 4: take_back}

    code, log = run_tidal(["run", "tiny-cpu", *config_args(tmp_path, ray_address, "crashed", steps), *overlap],
                          tmp_path, crash="broadcast_sync:3")
    assert code == -signal.SIGKILL, log[-3000:]
    crashed = store_url(tmp_path, "crashed")
    summary, state, *_ = final_state(crashed)
    assert state.step == 2
    code, log = run_tidal(["resume", summary.uid, "--storage", crashed], tmp_path)
    assert code == 0, log[-3000:]

    want_summary, want_state, want_rows, want_prompts = final_state(store_url(tmp_path, "straight"))
    got_summary, got_state, got_rows, got_prompts = final_state(crashed)
    assert got_summary.status == want_summary.status == "finished"
    assert [r["step"] for r in got_rows] == list(range(1, steps + 1))
    assert got_state.policy_state == want_state.policy_state
    assert sorted(got_prompts) == sorted(want_prompts) and len(got_prompts) == len(set(got_prompts))
    assert switch_kinds(crashed) == {1: lend, 2: take_back, 3: lend, 4: take_back}


def test_a_resume_continues_the_committed_replacement_state(tmp_path, ray_address):
    """`tidal resume` hands the last committed step's replacement state (replacements spent per
    standalone slot, and joined) to the new data plane: the resumed steps commit it again. A
    resume that started the replacer afresh would commit ``spent 0, joined 0`` instead, and give
    a slot whose budget was spent before the crash a new budget and reused replica ids."""
    import sqlalchemy as sa

    from storage import make_engine, session_scope
    from storage.models import Step

    args = [*config_args(tmp_path, ray_address, "replaced", 4),
            "--set", "rollout.replace_failed_replicas=true", "--set", "rollout.max_replacements=3"]
    code, log = run_tidal(["run", "tiny-cpu", *args], tmp_path, crash="train:3")
    assert code == -signal.SIGKILL, log[-3000:]
    url = store_url(tmp_path, "replaced")
    summary, state, *_ = final_state(url)
    assert state.step == 2
    assert state.data_position["replacements"] == {"spent": {"standalone-0": 0}, "joined": 0}

    # As if standalone-0 had died twice before the crash and both replacements had joined.
    before_crash = {"spent": {"standalone-0": 2}, "joined": 2}
    engine = make_engine(url)
    try:
        with session_scope(engine) as session:
            step = session.scalars(sa.select(Step).where(Step.step == 2)).one()
            step.data_position_json = {**step.data_position_json, "replacements": before_crash}
    finally:
        engine.dispose()

    code, log = run_tidal(["resume", summary.uid, "--storage", url], tmp_path)
    assert code == 0, log[-3000:]
    summary, state, rows, _ = final_state(url)
    assert summary.status == "finished" and state.step == 4
    assert state.data_position["replacements"] == before_crash
