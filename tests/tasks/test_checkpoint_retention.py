"""`trainer.save_freq` and `trainer.max_actor_ckpt_to_keep`: the newest kept step folders and the
latest step stay, older ones go, other folders are left."""

from __future__ import annotations

from config import load_config
from tasks.commit import checkpoint_path, is_kept_step, prune_checkpoints
from tasks.run_ref import RunRef


def make_steps(root, steps):
    for n in steps:
        d = root / f"global_step_{n}" / "huggingface"
        d.mkdir(parents=True)
        (d.parent / "actor.pt").write_bytes(b"x")


def test_only_the_newest_step_folders_are_kept_by_step_number_not_by_name(tmp_path):
    make_steps(tmp_path, [1, 2, 9, 10])
    (tmp_path / "notes").mkdir()
    assert prune_checkpoints(tmp_path, 2) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_10", "global_step_9", "notes"]


def test_none_keeps_every_checkpoint(tmp_path):
    make_steps(tmp_path, [1, 2, 3])
    assert prune_checkpoints(tmp_path, None) == []
    assert len(list(tmp_path.iterdir())) == 3


def test_the_run_ref_carries_the_key_and_the_step_checkpoint_sits_in_its_global_step_folder(tmp_path):
    cfg = load_config("tiny-cpu", ["trainer.max_actor_ckpt_to_keep=3"])
    run = RunRef.from_config(cfg, uid="u", output_dir=str(tmp_path), ray_address=None)
    assert run.max_actor_ckpt_to_keep == 3
    assert checkpoint_path(run, 7) == tmp_path / "checkpoints" / "global_step_7" / "actor.pt"


def test_save_freq_keeps_its_multiples_and_the_last_step_and_the_latest_stays_for_resume(tmp_path):
    make_steps(tmp_path, [1, 2, 3, 4, 5, 6, 7])
    assert prune_checkpoints(tmp_path, None, save_freq=3, total_steps=10, latest=7) == [1, 2, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "global_step_6", "global_step_7"]
    make_steps(tmp_path, [8, 9, 10])
    assert prune_checkpoints(tmp_path, 2, save_freq=3, total_steps=10, latest=10) == [3, 6, 7, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_10", "global_step_9"]


def test_save_freq_minus_one_keeps_only_the_latest_step(tmp_path):
    make_steps(tmp_path, [4, 5])
    assert prune_checkpoints(tmp_path, None, save_freq=-1, total_steps=5, latest=5) == [4]
    assert [is_kept_step(s, -1, 5) for s in (4, 5)] == [False, False]
    assert [is_kept_step(s, 2, 5) for s in (1, 2, 3, 4, 5)] == [False, True, False, True, True]


def test_the_run_ref_carries_save_freq_and_the_last_step(tmp_path):
    cfg = load_config("tiny-cpu", ["trainer.save_freq=5", "trainer.total_training_steps=12"])
    run = RunRef.from_config(cfg, uid="u", output_dir=str(tmp_path), ray_address=None)
    assert (run.save_freq, run.total_steps) == (5, 12)
