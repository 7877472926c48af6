"""Rollout engines: one replica's generator behind the ``RolloutEngine`` contract (``base``).

- ``TorchEngine`` (``torch_engine``): continuous batching of the tiny LM on a KV cache, CPU or CUDA;
- ``SimulatedEngine`` (``simulated``): the same contract, time spent by a cost model, no compute.

Imports only ``cluster.types`` and ``cluster.model``: never Ray, the other actors, or anything
above ``cluster``. Importing this package does not load torch: ``TorchEngine`` is imported on
first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.engines.base import RolloutEngine
from cluster.engines.simulated import SimulatedEngine

if TYPE_CHECKING:
    from cluster.engines.torch_engine import TorchEngine

__all__ = ["RolloutEngine", "SimulatedEngine", "TorchEngine"]


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from cluster.engines.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
