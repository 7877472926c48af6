"""Loading a config the way every entry point does: the CLI, ``flows.serve`` and the flow itself.

Owns: ``load_checked`` (the schema's validation plus what it cannot check alone: the policy name
resolves; the datasets load and the reward function exists, ``cluster.data_builders.check_data``) and the one-line summary of a config. Must not: import Ray, Prefect, or any flow or task
module (so that every entry point can import it without pulling in the run).
"""

from __future__ import annotations

import sys
from pathlib import Path

from cluster.data_builders import check_data
from cluster.placement import check_hybrid_memory
from config import ConfigError, TidalConfig, load_config
from data.datasets import DatasetError
from data.reward import RewardConfigError
from models.hf import TINY_PRESETS, TinyFolderError, ensure_tiny
from models.smollm2 import SMOLLM2_PRESET, SMOLLM2_ROOT, SmolLM2Error, ensure_smollm2
from policies import UnknownPolicyError, policy_from_config, resolve_policy_class


def load_checked(config: str, overrides: list[str] | None) -> TidalConfig:
    """Load a config and check what the schema alone cannot (the policy name resolves). The
    ``tiny-hf`` presets first get their files (``models.hf.ensure_tiny``), built once; so does
    ``smollm2-gsm8k`` (``models.smollm2.ensure_smollm2``)."""
    if config in TINY_PRESETS and not Path(config).exists():
        _ensure_tiny_hf(*TINY_PRESETS[config])
    if config == SMOLLM2_PRESET and not Path(config).exists():
        _ensure_smollm2()
    cfg = load_config(config, overrides or [])
    name = cfg.async_training.dynamic_schedule_policy
    try:
        resolve_policy_class(name)
    except UnknownPolicyError as exc:
        raise ConfigError(f"async_training.dynamic_schedule_policy: {exc}") from None
    try:
        policy_from_config(cfg)
    except UnknownPolicyError as exc:
        raise ConfigError(str(exc)) from None
    try:
        check_data(cfg)
    except (DatasetError, RewardConfigError) as exc:
        raise ConfigError(" ".join(str(exc).split())) from None
    check_hybrid_memory(cfg)
    return cfg


def _ensure_tiny_hf(root: str, n_head: int) -> None:
    try:
        built = ensure_tiny(root, n_head=n_head)
    except TinyFolderError as exc:
        raise ConfigError(str(exc)) from None
    if built:
        print(f"tidal: built the tiny-hf model and data in {root}/ (once; `tidal data make-tiny DIR` "
              "builds them anywhere)", file=sys.stderr)


def _ensure_smollm2() -> None:
    try:
        built = ensure_smollm2(SMOLLM2_ROOT)
    except SmolLM2Error as exc:
        raise ConfigError(str(exc)) from None
    if built:
        print(f"tidal: built {', '.join(built)} in {SMOLLM2_ROOT}/ (once; `tidal data smollm2 DIR` converts the "
              "model anywhere)", file=sys.stderr)


def summarize_config(cfg: TidalConfig) -> str:
    """One line saying what the config will run."""
    a = cfg.async_training
    mode = "only-hybrid" if cfg.only_hybrid else ("dynamic" if a.use_dynamic_resource_scheduling else "static")
    return (
        f"{mode}: {cfg.trainer_gpus} trainer GPU(s) ({cfg.hybrid_replicas} hybrid replica(s)) + "
        f"{cfg.standalone_gpus} rollout GPU(s) ({cfg.standalone_replicas} standalone replica(s)); "
        f"policy {a.dynamic_schedule_policy}; {cfg.step_required_samples} samples/step; "
        f"queue capacity {cfg.max_required_samples}"
    )
