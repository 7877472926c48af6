"""`trainer.max_actor_ckpt_to_keep`: the newest step folders stay, older ones go, others are left."""

from __future__ import annotations

from config import load_config
from tasks.commit import checkpoint_path, prune_checkpoints
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
