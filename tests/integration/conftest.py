"""A real local Ray cluster for the integration tests: own temp dir, ports, memory limits."""

from __future__ import annotations

import pytest
import ray
from driver_support import pythonpath

from cluster.ray_cluster import LocalRayCluster


@pytest.fixture(scope="session")
def ray_address():
    # Workers import the test-only policy in this folder by `module:Class`.
    cluster = LocalRayCluster(num_cpus=2, gpus=4, memory_gb=4.0, object_store_memory_gb=0.5,
                              env={"PYTHONPATH": pythonpath()}).start()
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
