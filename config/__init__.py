"""Tidal's config: the pydantic schema (verl-compatible keys), YAML presets and the loader.

Owns: every configurable number and its limits, cross-field rules, preset files, `--set`
overrides, and writing the resolved config next to a run's outputs.
Must not: import anything else of ours, Ray or torch (policies and the CLI import this).
"""

from config.loader import (
    PRESETS_DIR,
    ConfigError,
    apply_overrides,
    list_presets,
    load_config,
    resolve_config_path,
    to_plain,
    validate,
    write_resolved,
)
from config.schema import TidalConfig

__all__ = [
    "PRESETS_DIR",
    "ConfigError",
    "TidalConfig",
    "apply_overrides",
    "list_presets",
    "load_config",
    "resolve_config_path",
    "to_plain",
    "validate",
    "write_resolved",
]
