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


def test_the_step_the_data_ends_on_is_exported_and_kept_though_it_is_no_multiple(tmp_path, monkeypatch):
    """A run of 12 steps whose data ends at step 3: its last step is 3, which the flow marks
    ``final``. That step is exported to HF like verl's last step; a step before it is not,
    and the folder of the step before goes once a later one commits."""
    import types
    from pathlib import Path

    import tasks.commit as commit_mod
    from loop import StepOutcome
    from storage import create_run, make_engine, migrate, session_scope, sqlite_url

    exports = []

    def save(path, export_hf=True, async_save=False):
        exports.append((Path(path).parent.name, export_hf))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"w")
        return {"path": path, "sha256": "0" * 64, "size_bytes": 1}

    trainer = types.SimpleNamespace(save_checkpoint=types.SimpleNamespace(remote=save))
    monkeypatch.setattr(commit_mod, "ray", types.SimpleNamespace(get_actor=lambda *a, **k: trainer, get=lambda r: r))
    url = sqlite_url(tmp_path / "store.db")
    engine = make_engine(url)
    migrate(engine)
    with session_scope(engine) as s:
        create_run(s, uid="u", name="u", project="t", policy="default", seed=0, config={}, output_dir="/o")
    engine.dispose()
    cfg = load_config("tiny-cpu", ["trainer.save_freq=5", "trainer.total_training_steps=12", f"storage.url={url}"])
    run = RunRef.from_config(cfg, uid="u", output_dir=str(tmp_path / "out"), ray_address=None)
    assert run.total_steps == 12
    for step, final in ((1, False), (2, False), (3, True)):
        outcome = StepOutcome(step=step, hybrid_active=False, policy_state={}, controller_state={}, decisions=(),
                              switch_events=(), replacements={})
        summary = {"started_at": 1.0, "outcome": outcome, "metrics": {}, "prompts": [(0, step)],
                   "consumed_total": step, "final": final}
        commit_mod.commit(run, step, step, summary, now=2.0)
    assert exports == [("global_step_1", False), ("global_step_2", False), ("global_step_3", True)]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["global_step_3"]


def test_the_run_ref_carries_the_waits_and_the_store_bound_its_tasks_use(tmp_path):
    """What a step's tasks wait for, wherever they run (a Ray worker has only the run ref):
    `async_training.sample_wait_timeout_s` and `storage.reconnect_timeout_s`."""
    cfg = load_config("tiny-cpu", ["async_training.sample_wait_timeout_s=45", "storage.reconnect_timeout_s=3"])
    run = RunRef.from_config(cfg, uid="u", output_dir=str(tmp_path), ray_address=None)
    assert (run.wait_timeout_s, run.reconnect_timeout_s) == (45.0, 3.0)
