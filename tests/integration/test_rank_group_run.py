"""`tidal run tiny-cpu --set trainer.n_gpus_per_node=2` on a real local Ray cluster: the trainer is
two rank actors over a gloo group (FSDP2), its two hybrids are lent and taken back with the
trainer's state moved out of their way, and every step leaves one DCP shard per rank and rank 0's
commit marker. (Killed drivers, cut-off writes and lost ranks: tests/faults/test_fault_rank_kill.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from driver_support import final_state, store_url, switch_kinds


pytestmark = pytest.mark.slow

STEPS = 5  # the run is the session's uninterrupted one, shared with tests/faults/test_fault_rank_kill.py
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


def test_two_ranks_lend_and_take_back_their_hybrids_and_leave_a_shard_per_rank(uninterrupted):
    url = store_url(uninterrupted(STEPS, *RANKS), "straight")
    summary, state, rows, prompts = final_state(url)
    assert summary.status == "finished" and [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the step-counting policy lends after odd steps, the last step asks nothing; both hybrids live
    # on the trainer's ranks
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
    # the standalones' weights went by the collective (one send per step, whatever the replicas)
    assert all(r["weight_sync/collective/gb"] > 0 and r["weight_sync/collective/retries"] == 0 for r in rows)
