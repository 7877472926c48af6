"""`tidal run tiny-cpu --set trainer.n_gpus_per_node=2` on a real local Ray cluster: the trainer is
two rank actors over a gloo group (FSDP2), its two hybrids are lent and taken back with the
trainer's state moved out of their way, every step leaves one DCP shard per rank and rank 0's
commit marker, and the run ends exactly where an uninterrupted one ends after a driver SIGKILL,
a background checkpoint write cut off, and a rank killed mid-step (exit 3, one line)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from driver_support import config_args, final_state, run_tidal, store_url, switch_kinds

from tasks.faults import KILL_RANK_ENV

pytestmark = pytest.mark.slow

STEPS = 4
RANKS = ["--set", "trainer.n_gpus_per_node=2"]
LEND, TAKE_BACK = ["hybrid_sync", "activate", "rebalance"], ["deactivate"]
SHARDS = {".metadata", "__0_0.distcp", "__1_0.distcp", "tidal-commit.json"}


def _phases(url: str) -> dict[tuple[int, str], list[str]]:
    import sqlalchemy as sa

    from storage import make_engine
    from storage.models import SwitchEvent

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(SwitchEvent.step, SwitchEvent.kind, SwitchEvent.phases_json)).all()
    finally:
        engine.dispose()
    return {(step, kind): list(phases) for step, kind, phases in rows}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, ray_address):
    tmp = tmp_path_factory.mktemp("ranks")
    code, log = run_tidal(["run", "tiny-cpu", *config_args(tmp, ray_address, "straight", STEPS), *RANKS], tmp)
    assert code == 0, log[-3000:]
    return tmp


def test_two_ranks_lend_and_take_back_their_hybrids_and_leave_a_shard_per_rank(straight):
    url = store_url(straight, "straight")
    summary, state, rows, prompts = final_state(url)
    assert summary.status == "finished" and [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the step-counting policy lends after odd steps; both hybrids live on the trainer's ranks
    assert switch_kinds(url) == {1: LEND, 2: TAKE_BACK, 3: LEND, 4: TAKE_BACK}
    phases = _phases(url)
    assert phases[(1, "hybrid_sync")][:2] == ["offload", "wake_up"]  # room made before they wake
    assert phases[(2, "deactivate")][-2:] == ["sleep", "reload"]  # and given back after they sleep
    run_dir = Path(state.checkpoint.path).parents[3]  # <run>/checkpoints/global_step_N/actor/marker
    for step in range(1, STEPS + 1):
        folder = run_dir / "checkpoints" / f"global_step_{step}" / "actor"
        assert {p.name for p in folder.iterdir()} == SHARDS, step
        marker = json.loads((folder / "tidal-commit.json").read_text())
        assert marker["world"] == 2 and marker["updates"] == step * 2  # trigger_parameter_sync_step=2
    assert state.checkpoint.path.endswith(f"global_step_{STEPS}/actor/tidal-commit.json")
    assert len(prompts) == len(set(prompts)) == STEPS * 2 * 8  # every prompt trained once


def test_killed_cut_off_and_a_rank_lost_the_run_resumes_to_the_uninterrupted_result(straight, ray_address):
    tmp = straight
    crashed = store_url(tmp, "crashed")
    store = ["--storage", crashed]
    # 1. the driver SIGKILLed while step 2 trains (step 1's checkpoint may still be being written)
    code, log = run_tidal(["run", "tiny-cpu", *config_args(tmp, ray_address, "crashed", STEPS), *RANKS], tmp,
                          crash="train:2")
    assert code == -signal.SIGKILL, log[-3000:]
    summary, *_ = final_state(crashed)
    # 2. resumed, SIGKILLed after step 3 committed, and step 3's background write taken as cut off
    code, log = run_tidal(["resume", summary.uid, *store], tmp, crash="broadcast_sync:4")
    assert code == -signal.SIGKILL, log[-3000:]
    _, state, *_ = final_state(crashed)
    assert state.step == 3
    (Path(state.checkpoint.path)).unlink()  # its commit marker never written: incomplete
    # 3. resumed: step 3 is dropped and trained again; rank 1 is killed in step 4's training
    code, log = run_tidal(["resume", summary.uid, *store], tmp, extra={KILL_RANK_ENV: "train:4"})
    assert code == 3, log[-3000:]
    assert "was still being written" in log
    last = log.strip().splitlines()[-1]
    assert "an actor of the run died" in last and f"tidal resume {summary.uid}" in last
    # 4. resumed to the end
    code, log = run_tidal(["resume", summary.uid, *store], tmp)
    assert code == 0, log[-3000:]

    want_summary, want_state, want_rows, want_prompts = final_state(store_url(tmp, "straight"))
    got_summary, got_state, got_rows, got_prompts = final_state(crashed)
    assert got_summary.status == want_summary.status == "finished"
    assert [r["step"] for r in got_rows] == list(range(1, STEPS + 1))
    assert got_state.policy_state == want_state.policy_state
    assert sorted(got_prompts) == sorted(want_prompts) and len(got_prompts) == len(set(got_prompts))
    # the last resume began with the hybrids lent (step 3 lent them): it lends them again before
    # step 4 takes them back, a recorded guard decision of the resumed process
    assert switch_kinds(crashed) == {1: LEND, 2: TAKE_BACK, 3: LEND, 4: [*LEND, *TAKE_BACK]}
