"""Helpers of the data-parallel tests: a group of real ``torch.distributed`` ranks (gloo, one
process each, started with ``torch.multiprocessing``) training a backend on their shares."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from cluster.backends import distributed as dp


def _rank_main(rank: int, world: int, store: str, make: Callable[[], Any], samples: Sequence[Any], updates: int,
               then: Callable[[Any, int], Any] | None, out: str) -> None:
    torch.set_num_threads(1)
    dp.init_group(rank=rank, world=world, master_addr="127.0.0.1", master_port=0, device=torch.device("cpu"),
                  timeout_s=120, init_method=f"file://{store}")
    try:
        backend = make()
        share = dp.split(samples, world)[rank]
        metrics = [backend.train_step(share).metrics for _ in range(updates)]
        extra = then(backend, rank) if then is not None else None
        weights = backend.state_dict_for_rollout()
        backend.close()
        torch.save({"metrics": metrics, "weights": weights, "extra": extra}, f"{out}.{rank}")
    except BaseException:
        dp.leave_group()
        raise
    dp.leave_and_exit()


def train_on_ranks(world: int, make: Callable[[], Any], samples: Sequence[Any], updates: int,
                   then: Callable[[Any, int], Any] | None = None) -> list[dict[str, Any]]:
    """Each of ``world`` ranks builds ``make()`` and runs ``updates`` micro-steps on its share of
    ``samples``; returns every rank's metrics, weights (rank 0's whole, the others' ``{}``) and
    what ``then(backend, rank)`` returned."""
    with tempfile.TemporaryDirectory(prefix="tidal-dp-") as tmp:
        out = os.path.join(tmp, "rank")
        mp.start_processes(_rank_main, args=(world, os.path.join(tmp, "store"), make, samples, updates, then, out), nprocs=world,
                           start_method="spawn")
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
