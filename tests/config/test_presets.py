"""Every shipped preset parses; the loader's overrides, `extends:` and resolved output work."""

from __future__ import annotations

import json

import pytest

from config import PRESETS_DIR, ConfigError, TidalConfig, load_config, write_resolved
from config.loader import RESOLVED_FILENAME
from policies import resolve_policy_class

PRESET_FILES = sorted(PRESETS_DIR.rglob("*.yaml"))


def test_there_are_presets_to_check():
    names = {p.relative_to(PRESETS_DIR).as_posix() for p in PRESET_FILES}
    assert "tiny-cpu.yaml" in names


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.relative_to(PRESETS_DIR).as_posix())
def test_every_shipped_preset_validates_and_names_a_known_policy(path):
    cfg = load_config(path)
    assert isinstance(cfg, TidalConfig)
    resolve_policy_class(cfg.async_training.dynamic_schedule_policy)


def test_tiny_cpu_derives_the_staleness_bound_from_the_reference_formula():
    cfg = load_config("tiny-cpu")
    # required = ppo_mini_batch_size 8 × require_batches 1 = 8; trigger 2 → 16 per step;
    # max_required = 8 × (1 + 0.5) × 2 = 24; buffer = 16 × 0.5 = 8.
    assert (cfg.required_samples, cfg.step_required_samples) == (8, 16)
    assert (cfg.max_required_samples, cfg.buffer_samples) == (24, 8)
    assert (cfg.hybrid_replicas, cfg.standalone_replicas, cfg.only_hybrid) == (1, 1, False)


def test_set_overrides_parse_yaml_scalars_into_nested_keys():
    cfg = load_config(
        "tiny-cpu",
        ["async_training.staleness_threshold=1.5", "rollout.nnodes=0", "prefect.api_url=null"],
    )
    assert cfg.async_training.staleness_threshold == 1.5
    assert cfg.only_hybrid is True
    assert cfg.prefect.api_url is None


def test_extends_merges_the_base_file_key_by_key(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  seed: 7\n  experiment_name: base\nrollout:\n  nnodes: 2\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ntrainer:\n  experiment_name: child\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.trainer.seed, cfg.trainer.experiment_name, cfg.rollout.nnodes) == (7, "child", 2)


def test_an_extends_cycle_is_a_config_error(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_resolved_config_is_written_as_json_with_every_default(tmp_path):
    cfg = load_config("tiny-cpu")
    path = write_resolved(cfg, tmp_path / "run")
    assert path.name == RESOLVED_FILENAME
    data = json.loads(path.read_text())
    assert data["async_training"]["trigger_parameter_sync_step"] == 2
    assert data["actor_rollout_ref"]["actor"]["clip_ratio"] == 0.2  # a default, not in the preset
    assert TidalConfig.model_validate(data) == cfg
    assert [p.name for p in path.parent.iterdir()] == [RESOLVED_FILENAME]  # no temp file left


def test_every_schema_field_has_a_docstring():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            yield f"{prefix}{name}", field
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, TidalConfig.__mro__[1]) and ann.model_fields:
                yield from walk(ann, f"{prefix}{name}.")

    missing = [key for key, field in walk(TidalConfig) if not field.description]
    assert missing == []
