"""Only-hybrid (colocated) mode in a real run: with no standalone replica, the hybrids are lent
before step 1 as a recorded guard decision, so the run trains instead of waiting for samples that
nothing generates (it hung there once the step-0 policy question was gone)."""

from __future__ import annotations

import pytest
from driver_support import config_args, final_state, run_tidal, store_url

pytestmark = pytest.mark.slow


def _decisions(url: str) -> list[tuple[int, str, object]]:
    import sqlalchemy as sa

    from storage import make_engine
    from storage.models import Decision

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(Decision.step, Decision.hook, Decision.answer_json).order_by(Decision.id))
            return [tuple(row) for row in rows]
    finally:
        engine.dispose()


@pytest.mark.parametrize("policy", ["default", "static_fully_async"])
def test_an_only_hybrid_run_lends_its_hybrids_before_step_1_and_trains(tmp_path, ray_address, policy):
    args = [*config_args(tmp_path, ray_address, policy, 2), "--set", "rollout.nnodes=0",
            "--set", "trainer.n_gpus_per_node=2", "--set", f"async_training.dynamic_schedule_policy={policy}"]
    code, log = run_tidal(["run", "tiny-cpu", *args], tmp_path, timeout=200)
    assert code == 0, log[-3000:]
    _, _, rows, prompts = final_state(store_url(tmp_path, policy))
    assert len(rows) == 2 and prompts
    decisions = _decisions(store_url(tmp_path, policy))
    assert decisions[0][1:] == ("only_hybrid_start", 2)
    assert [hook for _, hook, _ in decisions].count("only_hybrid_start") == 1
