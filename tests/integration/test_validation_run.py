"""Validation in a real run: `val-core/<data_source>/reward/mean@<n>` lands in the store's step
metrics before training and every `test_freq` steps; a reward function that hangs ends the run
with exit 4 and one line naming the function and the sample."""

from __future__ import annotations

import pytest
from driver_support import config_args, final_state, run_tidal, store_url

from data.datasets import task_rows, write_rows

pytestmark = pytest.mark.slow
KEY = "val-core/tidal/arith/reward/mean@2"


def val_args(tmp_path, ray_address, name, *extra):
    val = write_rows(task_rows("arith", 6, seed=1), tmp_path / "val.parquet")
    return [*config_args(tmp_path, ray_address, name, 2), "--set", f"data.val_files={val}",
            "--set", "actor_rollout_ref.rollout.val_kwargs.n=2", "--set", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            *extra]


def test_validation_metrics_are_committed_with_the_steps(tmp_path, ray_address):
    code, log = run_tidal(["run", "tiny-cpu", *val_args(tmp_path, ray_address, "val", "--set", "trainer.test_freq=2")],
                          tmp_path)
    assert code == 0, log[-3000:]
    _, _, rows, _ = final_state(store_url(tmp_path, "val"))
    assert [sorted(k for k in r if k.startswith("val-core/")) for r in rows] == [[f"{KEY}/before_train"], [KEY]]
    assert all(0.0 <= r[k] <= 1.0 for r in rows for k in r if k.startswith("val-core/"))


def test_a_hanging_reward_function_ends_the_run_with_exit_4_in_one_line(tmp_path, ray_address):
    hang = tmp_path / "hang.py"
    hang.write_text("import time\n\ndef compute_score(*args):\n    time.sleep(600)\n")
    args = val_args(tmp_path, ray_address, "hang", "--set", f"custom_reward_function.path={hang}",
                    "--set", "custom_reward_function.timeout_s=1")
    code, log = run_tidal(["run", "tiny-cpu", *args], tmp_path)
    assert code == 4, log[-3000:]
    assert log.strip().splitlines()[-1] == (
        f"tidal: error: reward function {hang}:compute_score on sample val1b-p0 response 0 hung: "
        "no answer within 1 s (custom_reward_function.timeout_s)")
    assert "Traceback" not in log
