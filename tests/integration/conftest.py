"""A real local Ray cluster for the integration tests: own temp dir, ports, memory limits."""

from __future__ import annotations

import pytest
from driver_support import pythonpath, ray_head


@pytest.fixture(scope="session")
def ray_address():
    # Workers import the test-only policy in this folder by `module:Class`.
    with ray_head({"PYTHONPATH": pythonpath()}) as address:
        yield address
