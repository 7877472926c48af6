"""The preset the fault tests run on: ``TIDAL_FAULT_PRESET`` names it, ``tiny-cpu`` by default (the
built-in character-level LM) or ``tiny-hf`` (a tiny Qwen2 model folder, a BPE tokenizer trained in
code, verl-schema parquet; ``benchmarks/fault_campaign.py --preset tiny-hf`` sets it).

Owns: reading that name (an unknown one is a one-line usage error), the ``--set`` overrides that
point ``tiny-hf`` at the session's files (built once per test session under pytest's base temp
folder by ``tiny_hf_support.tiny_hf_cwd``, never in the repository's ``runs/``), and each preset's
rollout engine for the tests that pick one. Must not: change what a test asserts; only the model,
data and engine a run is built from differ between presets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

ENV = "TIDAL_FAULT_PRESET"
PRESETS = ("tiny-cpu", "tiny-hf")
DEFAULT = "tiny-cpu"
RANKS_ENV = "TIDAL_FAULT_TRAINER_RANKS"
"""The trainer's rank count for every run a fault test builds from the preset (``fault_campaign.py
--ranks``); unset: the preset's own (one rank)."""
TRANSPORT_ENV = "TIDAL_FAULT_TRANSPORT"
"""The standalones' weight transport (``collective`` or ``object_store``; ``fault_campaign.py
--transport``); unset: the preset's own (``auto``: the collective)."""
TRANSPORTS = ("collective", "object_store")


def compute_plane(environ: dict[str, str] | None = None) -> list[str]:
    """The ``--set`` overrides ``TIDAL_FAULT_TRAINER_RANKS`` and ``TIDAL_FAULT_TRANSPORT`` ask for, so
    that a campaign's kills hit a rank group and the transport users run; a bad value is a usage error."""
    env = os.environ if environ is None else environ
    out = []
    ranks = env.get(RANKS_ENV, "").strip()
    if ranks:
        if not ranks.isdigit() or not 1 <= int(ranks) <= 8:
            raise pytest.UsageError(f"{RANKS_ENV}={ranks!r}: a rank count from 1 to 8")
        out.append(f"trainer.n_gpus_per_node={int(ranks)}")
    transport = env.get(TRANSPORT_ENV, "").strip()
    if transport:
        if transport not in TRANSPORTS:
            raise pytest.UsageError(f"{TRANSPORT_ENV}={transport!r}: choose one of {', '.join(TRANSPORTS)}")
        out.append(f"actor_rollout_ref.rollout.weight_sync.transport={transport}")
    return out


def preset_name(environ: dict[str, str] | None = None) -> str:
    """The preset ``TIDAL_FAULT_PRESET`` names (``tiny-cpu`` when unset or empty)."""
    name = (os.environ if environ is None else environ).get(ENV, "").strip() or DEFAULT
    if name not in PRESETS:
        raise pytest.UsageError(f"{ENV}={name!r}: choose one of {', '.join(PRESETS)}")
    return name


@dataclass(frozen=True)
class FaultPreset:
    """One preset as the fault tests use it. ``files``: the ``tiny-hf`` folder (``model/``,
    ``data/``); None for ``tiny-cpu``, whose model and task are built in code."""

    name: str
    files: Path | None = None

    @property
    def hf(self) -> bool:
        return self.files is not None

    def overrides(self) -> list[str]:
        """Dotted ``key=value`` overrides that make the preset load from any working directory:
        ``tiny-hf``'s model and data as absolute paths into the session's folder; then the
        campaign's compute plane (``compute_plane``: the trainer's ranks, the weight transport)."""
        plane = compute_plane()
        if self.files is None:
            return plane
        return [f"actor_rollout_ref.model.path={self.files / 'model'}",
                f"data.train_files={self.files / 'data' / 'train.parquet'}",
                f"data.val_files={self.files / 'data' / 'test.parquet'}", *plane]

    def rollout_overrides(self, simulated: list[str]) -> list[str]:
        """The rollout engine of a test that runs the simulated engine on ``tiny-cpu`` (its
        ``simulated`` overrides, timing knobs included): on ``tiny-hf`` none, so that its replicas
        are the preset's own torch engines serving the HF model, the thing a kill should hit."""
        return [] if self.hf else list(simulated)

    def cli_args(self, cwd: Path) -> list[str]:
        """``tidal run``'s config arguments for a driver started in ``cwd``: the preset's name and
        its overrides. For ``tiny-hf``, ``cwd/runs/tiny-hf`` becomes a link to the session's
        folder, so that `tidal run tiny-hf` finds its files there and builds nothing."""
        if self.files is not None:
            link = cwd / "runs" / "tiny-hf"
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(self.files, target_is_directory=True)
        return [self.name, *(arg for o in self.overrides() for arg in ("--set", o))]


def build_preset(name: str, tmp_path_factory: pytest.TempPathFactory) -> FaultPreset:
    """``name`` with its files: ``tiny-hf``'s are built on first use in this test session."""
    if name != "tiny-hf":
        return FaultPreset(name)
    from tiny_hf_support import tiny_hf_cwd

    from models.hf import TINY_HF_ROOT

    return FaultPreset(name, (tiny_hf_cwd(tmp_path_factory) / TINY_HF_ROOT).resolve())
