"""Bad input to the CLI: exit 2, one line naming the key and the rule, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flows.cli import main

GOOD = textwrap.dedent(
    """\
    async_training:
      use_dynamic_resource_scheduling: true
      trigger_parameter_sync_step: 2
    rollout:
      nnodes: 1
    trainer:
      nnodes: 1
    """
)

# (test id, YAML text or None for "no file", --set overrides, text the one-line reason must contain)
BAD_CONFIGS = [
    ("unknown-top-level-section", "bogus: {}\n", [], "bogus: unknown key"),
    ("unknown-nested-key", "async_training:\n  staleness: 0.5\n", [], "async_training.staleness: unknown key"),
    ("negative-staleness", "async_training:\n  staleness_threshold: -0.1\n", [], "staleness_threshold"),
    ("zero-trigger", "async_training:\n  trigger_parameter_sync_step: 0\n", [], "trigger_parameter_sync_step"),
    ("ratio-above-one", "async_training:\n  dynamic_schedule_deactivate_ratio: 1.5\n", [], "dynamic_schedule_deactivate_ratio"),
    ("ratio-negative", "async_training:\n  dynamic_schedule_deactivate_ratio: -0.2\n", [], "dynamic_schedule_deactivate_ratio"),
    ("ratio-wrong-type", "async_training:\n  dynamic_schedule_deactivate_ratio: lots\n", [], "dynamic_schedule_deactivate_ratio"),
    ("bool-wrong-type", "async_training:\n  partial_rollout: maybe\n", [], "partial_rollout"),
    ("negative-dwell", "async_training:\n  dynamic_schedule_min_dwell_s: -1\n", [], "dynamic_schedule_min_dwell_s"),
    ("negative-rollout-nodes", "rollout:\n  nnodes: -1\n", [], "rollout.nnodes"),
    ("zero-trainer-nodes", "trainer:\n  nnodes: 0\n", [], "trainer.nnodes"),
    ("zero-group-size", "actor_rollout_ref:\n  rollout:\n    n: 0\n", [], "actor_rollout_ref.rollout.n"),
    ("zero-mini-batch", "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 0\n", [], "ppo_mini_batch_size"),
    ("zero-response-length", "actor_rollout_ref:\n  rollout:\n    response_length: 0\n", [], "response_length"),
    ("only-hybrid-without-dynamic", "rollout:\n  nnodes: 0\n", [], "rollout.nnodes=0"),
    ("dynamic-needs-trainer-gpus-for-a-replica",
     "async_training:\n  use_dynamic_resource_scheduling: true\nactor_rollout_ref:\n  rollout:\n    tensor_model_parallel_size: 2\n"
     "rollout:\n  n_gpus_per_node: 2\n", [], "use_dynamic_resource_scheduling needs trainer GPUs"),
    ("rollout-gpus-not-multiple-of-tp",
     "actor_rollout_ref:\n  rollout:\n    tensor_model_parallel_size: 2\nrollout:\n  n_gpus_per_node: 3\n", [], "multiple"),
    ("hybrid-tp-does-not-divide-a-node",
     "async_training:\n  use_dynamic_resource_scheduling: true\nactor_rollout_ref:\n  rollout:\n    tensor_model_parallel_size: 2\n"
     "rollout:\n  n_gpus_per_node: 2\ntrainer:\n  nnodes: 2\n  n_gpus_per_node: 3\n", [],
     "trainer.n_gpus_per_node=3 is not a multiple of it"),
    ("hybrid-asks-more-memory-than-the-trainer-leaves",
     "async_training:\n  use_dynamic_resource_scheduling: true\nengines:\n  rollout: vllm\nmodel:\n  n_head: 2\n"
     "actor_rollout_ref:\n  rollout:\n    gpu_memory_utilization: 0.9\n  actor:\n    fsdp_config:\n"
     "      optimizer_offload: false\ntrainer:\n  gpu_memory_gb: 0.004\n", [],
     "lower it to 0.51 or less"),
    ("heads-do-not-divide-width", "model:\n  n_embd: 65\n  n_head: 4\n", [], "n_embd=65"),
    ("sequence-too-long-for-model",
     "actor_rollout_ref:\n  rollout:\n    prompt_length: 200\n    response_length: 200\nmodel:\n  max_seq_len: 256\n", [],
     "max_seq_len"),
    ("unknown-engine", "engines:\n  rollout: tensorrt\n", [], "engines.rollout"),
    ("unknown-policy", "async_training:\n  dynamic_schedule_policy: greedy\n", [], "unknown dynamic scheduling policy 'greedy'"),
    ("policy-module-missing", "async_training:\n  dynamic_schedule_policy: 'no_such_mod:Pol'\n", [], "cannot import module"),
    ("bad-storage-url", "storage:\n  url: mysql://x\n", [], "storage.url"),
    ("malformed-yaml", "async_training: [1, 2\n", [], "line"),
    ("yaml-is-a-list", "- 1\n- 2\n", [], "mapping"),
    ("section-is-a-scalar", "async_training: 3\n", [], "async_training"),
    ("missing-file", None, [], "no file or preset named"),
    ("both-spellings-of-lr", "actor_rollout_ref:\n  actor:\n    lr: 0.01\n    optim:\n      lr: 0.02\n", [],
     "actor_rollout_ref.actor: both lr and optim.lr are set"),
    ("both-spellings-of-a-scheduling-key",
     "async_training:\n  dynamic_schedule_policy: default\n  dynamic_scaling_policy: default\n", [],
     "async_training: both dynamic_scaling_policy and dynamic_schedule_policy are set"),
    ("unknown-loss-agg-mode", "actor_rollout_ref:\n  actor:\n    loss_agg_mode: token-sum\n", [], "loss_agg_mode"),
    ("dual-clip-not-above-one", "actor_rollout_ref:\n  actor:\n    clip_ratio_c: 1.0\n", [], "clip_ratio_c"),
    ("unknown-kl-type", "actor_rollout_ref:\n  actor:\n    kl_loss_type: full\n", [], "kl_loss_type"),
    ("unknown-is-level", "algorithm:\n  rollout_correction:\n    rollout_is: geometric\n", [], "rollout_is"),
    ("override-without-equals", GOOD, ["async_training.staleness_threshold"], "expected key.path=value"),
    ("override-unknown-key", GOOD, ["async_training.nope=1"], "async_training.nope: unknown key"),
    ("override-out-of-range", GOOD, ["async_training.trigger_parameter_sync_step=0"], "trigger_parameter_sync_step"),
    ("override-through-a-value", GOOD, ["trainer.nnodes.x=1"], "is a value, not a section"),
    ("extends-missing-file", "extends: nowhere.yaml\n", [], "extends"),
]


@pytest.mark.parametrize(("yaml_text", "overrides", "expected"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_config_exits_2_with_one_line_naming_the_key(tmp_path, capsys, yaml_text, overrides, expected):
    path = tmp_path / "cfg.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text)
    argv = ["config", "check", str(path)]
    for item in overrides:
        argv += ["--set", item]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("tidal: error: ")
    assert expected in err
    assert "Traceback" not in err


def test_the_good_config_used_as_a_base_really_is_good(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD)
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


@pytest.mark.parametrize(
    "argv",
    [["config", "frobnicate"], ["config", "check"], ["simulate", "tiny-cpu", "--steps", "0"], ["--no-such-flag"]],
    ids=["unknown-command", "missing-argument", "steps-out-of-range", "unknown-flag"],
)
def test_bad_command_lines_exit_2_with_one_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tidal: error: ")


def test_config_show_prints_every_key_of_a_preset_with_overrides(capsys):
    assert main(["config", "show", "tiny-cpu", "--set", "trainer.seed=5"]) == 0
    out = capsys.readouterr().out
    assert "seed: 5" in out
    assert "clip_ratio: 0.2" in out  # a default the preset does not set


def test_the_installed_console_script_reports_bad_input_without_a_traceback(tmp_path):
    script = Path(sys.executable).with_name("tidal")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "flows.cli"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("async_training:\n  staleness_threshold: -3\n")
    proc = subprocess.run(
        [*cmd, "config", "check", str(bad)], capture_output=True, text=True, timeout=120, env={**os.environ}
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "tidal: error: async_training.staleness_threshold: Input should be greater than or equal to 0 (got -3)"
    ]


@pytest.mark.parametrize(
    "overrides",
    [["async_training.staleness_threshold=-1"], ["async_training.dynamic_schedule_policy=nope"],
     ["rollout.nnodes=0", "async_training.use_dynamic_resource_scheduling=false"], ["storage.url=oracle://x"]],
    ids=["range", "unknown-policy", "contradictory-sections", "bad-db-url"],
)
def test_tidal_run_with_bad_input_starts_nothing_and_writes_no_run(tmp_path, capsys, overrides):
    db = tmp_path / "store.db"
    argv = ["run", "tiny-cpu", "--set", f"storage.url=sqlite:///{db}", "--set", f"trainer.default_local_dir={tmp_path}/runs"]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tidal: error: ")
    assert not db.exists()
    assert not (tmp_path / "runs").exists()


def test_resume_of_an_unknown_run_exits_2(tmp_path, capsys):
    from storage import make_engine, migrate

    url = f"sqlite:///{tmp_path}/store.db"
    migrate(make_engine(url))
    assert main(["resume", "no-such-run", "--storage", url]) == 2
    assert "no such run" in capsys.readouterr().err
