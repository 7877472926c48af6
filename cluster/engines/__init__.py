"""Rollout engines: one replica's generator behind the ``RolloutEngine`` contract (``base``).

``TorchEngine`` (a model runner on a KV cache: the tiny LM, or a Hugging Face model through
``hf_runner.HFRunner``) and ``SimulatedEngine`` (a cost model, no compute) share one
continuous-batching core (``batching``); ``VLLMEngine`` lets vLLM schedule. Imports only
``data.types`` and ``models.model`` of ours: never Ray, the other actors, or anything above
``cluster``; importing this package loads neither torch nor transformers. Details: ``docs/engines.md``.
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
