"""The preset the fault tests run on (``fault_preset.py``): read from ``TIDAL_FAULT_PRESET``, and
``tiny-hf`` loads from any working directory with the session's files, in process and for a driver."""

from __future__ import annotations

import pytest
from fault_preset import RANKS_ENV, TRANSPORT_ENV, FaultPreset, build_preset, compute_plane, preset_name

from config import load_config


def test_the_preset_is_tiny_cpu_unless_the_variable_names_tiny_hf():
    assert [preset_name({}), preset_name({"TIDAL_FAULT_PRESET": ""}),
            preset_name({"TIDAL_FAULT_PRESET": " tiny-hf "})] == ["tiny-cpu", "tiny-cpu", "tiny-hf"]


def test_an_unknown_preset_is_a_one_line_usage_error():
    with pytest.raises(pytest.UsageError) as raised:
        preset_name({"TIDAL_FAULT_PRESET": "gpu-vllm"})
    assert str(raised.value) == "TIDAL_FAULT_PRESET='gpu-vllm': choose one of tiny-cpu, tiny-hf"


def test_tiny_cpu_keeps_the_tests_own_engine_and_needs_no_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv(RANKS_ENV, raising=False)  # a campaign's compute plane aside (next test)
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    preset = FaultPreset("tiny-cpu")
    assert (preset.overrides(), preset.rollout_overrides(["engines.rollout=simulated"]),
            preset.cli_args(tmp_path)) == ([], ["engines.rollout=simulated"], ["tiny-cpu"])
    assert not (tmp_path / "runs").exists()


def test_the_campaigns_compute_plane_reaches_every_run_built_from_the_preset(tmp_path, monkeypatch):
    monkeypatch.setenv(RANKS_ENV, "2")
    monkeypatch.setenv(TRANSPORT_ENV, "object_store")
    preset = FaultPreset("tiny-cpu")
    cfg = load_config(preset.name, preset.overrides())
    assert (cfg.trainer.n_gpus_per_node, cfg.hybrid_replicas, cfg.standalone_transport) == (2, 2, "object_store")
    assert preset.cli_args(tmp_path) == ["tiny-cpu", "--set", "trainer.n_gpus_per_node=2", "--set",
                                         "actor_rollout_ref.rollout.weight_sync.transport=object_store"]
    for name, bad in ((RANKS_ENV, "two"), (RANKS_ENV, "0"), (TRANSPORT_ENV, "nccl")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(pytest.UsageError, match=name):
            compute_plane()
        monkeypatch.setenv(name, "2" if name == RANKS_ENV else "collective")


def test_tiny_hf_loads_its_session_files_from_another_working_directory(tmp_path, tmp_path_factory, monkeypatch):
    preset = build_preset("tiny-hf", tmp_path_factory)
    monkeypatch.chdir(tmp_path)  # nothing of tiny-hf here
    cfg = load_config(preset.name, [*preset.overrides(), *preset.rollout_overrides(["engines.rollout=simulated"])])
    assert (cfg.actor_rollout_ref.model.path, cfg.data.train_files, cfg.engines.rollout) == (
        str(preset.files / "model"), [str(preset.files / "data" / "train.parquet")], "torch")


def test_a_tiny_hf_driver_finds_the_session_files_in_its_working_directory(tmp_path, tmp_path_factory):
    preset = build_preset("tiny-hf", tmp_path_factory)
    args = preset.cli_args(tmp_path)
    assert args == ["tiny-hf", *(a for o in preset.overrides() for a in ("--set", o))]
    assert (tmp_path / "runs" / "tiny-hf").resolve() == preset.files
    assert preset.cli_args(tmp_path) == args  # a second driver in the same folder: the link stays
