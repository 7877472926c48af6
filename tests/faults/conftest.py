"""Fault-campaign fixtures shared by the files of this folder (helpers: ``pg_support.py``, the
preset the runs are built from: ``fault_preset.py``)."""

from __future__ import annotations

import pytest
from fault_preset import FaultPreset, build_preset, preset_name
from pg_support import running_postgres


@pytest.fixture(scope="module")
def stoppable_pg():
    """A real PostgreSQL (trust auth on loopback) that the module's tests may stop and restart."""
    with running_postgres() as pg:
        yield pg


@pytest.fixture(scope="session")
def fault_preset(tmp_path_factory) -> FaultPreset:
    """The preset ``TIDAL_FAULT_PRESET`` names (``tiny-cpu`` by default), its files built once."""
    return build_preset(preset_name(), tmp_path_factory)
