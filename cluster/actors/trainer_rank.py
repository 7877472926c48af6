"""The trainer as a group of rank actors, one per GPU, and the one backend the trainer actor sees.

``TrainRankActor`` is one rank: it joins the group's ``torch.distributed`` group and holds that
rank's train backend (FSDP2 or ZeRO shards). ``RankGroup`` lives in the trainer actor and drives
the ranks: it forms the group the way Ray Train and verl do (rank 0 picks its node's address and
a free port, every rank is handed it through its actor), deals each micro-step's samples to the
ranks, and answers the train-backend calls (``cluster.backends.base.TrainBackend``) with rank 0's
results, so the controller, the flows and the step API still see one trainer.

A rank that dies fails the call at once (``ray.wait`` on the ranks, not a collective's timeout):
the ``RayActorError`` reaches the driver, which stops with exit 3 and a resume line.
Must not: decide anything about lending, or read the config (``cluster/builders.py`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray

from cluster.types import Sample

if TYPE_CHECKING:  # torch is imported where a backend runs, not where the actors are named
    from cluster.backends.base import CheckpointInfo, StepResult

RANK_PREFIX = "trainer-rank-"


def rank_name(rank: int) -> str:
    """A rank actor's name in the run's namespace."""
    return f"{RANK_PREFIX}{rank}"


@ray.remote(num_cpus=0)
class TrainRankActor:
    """One rank of the trainer: its share of every micro-step, its shard of the state."""

    def __init__(self, rank: int, world: int, local_rank: int, backend_factory: Callable[[], Any], device: str):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self._factory, self._device = backend_factory, device
        self.backend: Any = None

    def address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port on it, for the group's TCP store."""
        from cluster.ports import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(self, master_addr: str, master_port: int, timeout_s: float) -> dict[str, Any]:
        """Join the group, then build this rank's backend (which shards over it)."""
        import torch

        from cluster.backends import distributed as dp
        from cluster.backends.torch_backend import resolve_device

        device = resolve_device(self._device)
        if device.type == "cuda":
            device = torch.device("cuda", 0)  # Ray's num_gpus=1 leaves this rank its own GPU alone
        backend = dp.init_group(rank=self.rank, world=self.world, local_rank=self.local_rank,
                                master_addr=master_addr, master_port=master_port, device=device, timeout_s=timeout_s)
        self.backend = self._factory()
        return {"rank": self.rank, "backend": backend, "device": str(self.backend.device),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "node": ray.get_runtime_context().get_node_id()}

    def train_step(self, samples: Sequence[Sample]) -> tuple[StepResult, int]:
        result = self.backend.train_step(samples)
        return result, self.backend.updates

    def weights(self) -> dict[str, Any]:
        return self.backend.state_dict_for_rollout()

    def save_checkpoint(self, path: str, export_hf: bool, async_save: bool) -> CheckpointInfo:
        return self.backend.save_checkpoint(path, export_hf=export_hf, async_save=async_save)

    def load_checkpoint(self, path: str, sha256: str | None) -> int:
        self.backend.load_checkpoint(path, expected_sha256=sha256)
        return self.backend.updates

    def offload(self) -> dict[str, float]:
        return self.backend.offload()

    def reload(self) -> dict[str, float]:
        return self.backend.reload()

    def close(self) -> None:
        from cluster.backends import distributed as dp

        try:
            if self.backend is not None:
                self.backend.close()
        finally:
            dp.leave_group()

    def ping(self) -> str:
        return "ok"


def gather(refs: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
    """The results of one call on every rank, failing as soon as any rank fails (the others may
    be blocked in a collective that the dead rank will never join)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"{len(pending)} trainer rank(s) did not answer within {timeout_s:g}s")
        ray.get(ready[0])  # raises the rank's error (RayActorError when it died)
    return ray.get(list(refs))


def merge_moves(reports: Sequence[dict[str, float]]) -> dict[str, float]:
    """Offload/reload reports of every rank as one: the slowest rank's seconds, the sum of GB."""
    out: dict[str, float] = {}
    for report in reports:
        for key, value in report.items():
            out[key] = out.get(key, 0.0) + value if key.endswith("_gb") else max(out.get(key, 0.0), value)
    return out


class RankGroup:
    """The train backend of a trainer of N rank actors, as the trainer actor drives it."""

    def __init__(self, ranks: Sequence[Any], *, setup_timeout_s: float = 600.0):
        from cluster.backends import distributed as dp

        self.ranks = list(ranks)
        self._dp = dp
        master = ray.get(self.ranks[0].address.remote(), timeout=setup_timeout_s)
        self.info = gather([r.setup.remote(*master, setup_timeout_s) for r in self.ranks])
        self._updates = 0

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def updates(self) -> int:
        return self._updates

    def train_step(self, samples: Sequence[Sample]) -> StepResult:
        from cluster.backends.base import StepResult

        shares = self._dp.split(list(samples), self.world)
        results = gather([r.train_step.remote(share) for r, share in zip(self.ranks, shares, strict=True)])
        (first, updates), *_ = results
        self._updates = updates
        timing = {key: max(res.timing_s.get(key, 0.0) for res, _ in results) for key in first.timing_s}
        return StepResult(metrics=dict(first.metrics), timing_s=timing)  # the metrics are the group's already

    def state_dict_for_rollout(self) -> dict[str, Any]:
        return gather([r.weights.remote() for r in self.ranks])[0]

    def save_checkpoint(self, path: Any, *, export_hf: bool = True, async_save: bool = False) -> CheckpointInfo:
        return gather([r.save_checkpoint.remote(str(path), export_hf, async_save) for r in self.ranks])[0]

    def load_checkpoint(self, path: Any, *, expected_sha256: str | None = None) -> None:
        self._updates = gather([r.load_checkpoint.remote(str(path), expected_sha256) for r in self.ranks])[0]

    def offload(self) -> dict[str, float]:
        return merge_moves(gather([r.offload.remote() for r in self.ranks]))

    def reload(self) -> dict[str, float]:
        return merge_moves(gather([r.reload.remote() for r in self.ranks]))

    def close(self) -> None:
        """Finish the save in flight on every rank and leave the group (best effort)."""
        try:
            gather([r.close.remote() for r in self.ranks], timeout_s=120)
        except Exception:  # noqa: BLE001 - a dead rank has nothing left to close
            pass
