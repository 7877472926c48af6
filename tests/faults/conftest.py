"""Fault-campaign fixtures shared by the files of this folder (helpers: ``pg_support.py``)."""

from __future__ import annotations

import pytest
from pg_support import running_postgres


@pytest.fixture(scope="module")
def stoppable_pg():
    """A real PostgreSQL (trust auth on loopback) that the module's tests may stop and restart."""
    with running_postgres() as pg:
        yield pg
