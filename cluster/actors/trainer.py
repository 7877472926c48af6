"""The trainer actor: the train backend and, in the same process, the hybrid replicas' engines.

Lending the trainer's GPU to rollout really time-shares the same device (or core); the weights
of a hybrid sync never leave the process. With N > 1 GPUs the backend is a ``RankGroup`` over
N rank actors (``cluster.actors.trainer_rank``), so the rest of the run still sees one trainer.
Before the hybrids wake, the backend moves its optimizer state and gradients (and parameters, if
configured) to host memory (``offload``), and brings them back once they sleep (``reload``).
Checkpoints may be written in the background: a save first waits for the one before it, and
``close`` waits for the last. Must not: decide when to lend (the controller does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from cluster.actors.names import ROLLOUT_SERVICE
from cluster.actors.replica import generate_each
from cluster.types import GenerationRequest, GenerationResult, Sample


@ray.remote(num_cpus=0, max_concurrency=1000)
class TrainerActor:
    """The train backend and, beside it, the engines of the hybrid replicas it can lend."""

    def __init__(
        self,
        backend_factory: Callable[[], Any],
        hybrid_factories: Mapping[str, Callable[[], Any]],
        *,
        namespace: str,
        required_samples: int,
    ):
        self.backend = backend_factory()
        self.hybrids = {rid: make() for rid, make in hybrid_factories.items()}
        self.namespace = namespace
        self.required_samples = required_samples
        self._train_lock = asyncio.Lock()

    # -- training ---------------------------------------------------------------------------

    async def train_micro_step(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Pull ``required_samples`` from the queue (timed) and run one update.

        Returns the micro-step report: wait seconds and wait samples (for the policy), the
        trained samples' identities and versions (for the store and staleness checks), the
        backend's metrics and timings, and the queue size right after the update (``mq_size``).
        """
        rollout = ray.get_actor(ROLLOUT_SERVICE, namespace=self.namespace)
        async with self._train_lock:
            t0 = time.perf_counter()
            pulled = await rollout.get_batch.remote(self.required_samples, timeout_s)
            samples: list[Sample] | None = pulled["samples"]
            waited = time.perf_counter() - t0
            if samples is None:  # timed out, nothing taken: the caller decides whether to wait on
                return {"samples": None, "timed_out": True, "wait_s": waited,
                        "size_at_start": pulled["size_at_start"], "mq_size": pulled["mq_size"]}
            if not samples:
                return {"samples": [], "wait_s": waited, "wait_samples": pulled["wait_samples"],
                        "mq_size": pulled["mq_size"], "exhausted": True, "allocated_s": waited}
            result = await asyncio.to_thread(self.backend.train_step, samples)
            allocated = time.perf_counter() - t0
            # the reference's mq_size: a snapshot of the queue right after the fit step, i.e. with
            # what the rollout side produced while the trainer trained (reference §4.4)
            mq_size = await rollout.queue_size.remote()
            return {
                "samples": [(s.epoch, s.prompt_index, s.min_version, s.max_version) for s in samples],
                "wait_s": waited,
                "wait_samples": pulled["wait_samples"],
                "mq_size": int(mq_size),
                "exhausted": False,
                "metrics": dict(result.metrics),
                "timing_s": dict(result.timing_s),
                "compute_s": result.compute_s,
                "allocated_s": allocated,
            }

    def weights(self) -> dict[str, Any]:
        """Current weights for the broadcast (Ray puts the return value in the object store)."""
        return self.backend.state_dict_for_rollout()

    async def save_checkpoint(self, path: str, export_hf: bool = True, async_save: bool = False) -> dict[str, Any]:
        """Write this step's checkpoint (after the previous save is on disk). ``async_save``: return
        once the state is copied to host memory, with an empty ``sha256`` (the checkpoint is
        complete when its file, or its commit marker, exists)."""
        t0 = time.perf_counter()
        kwargs = {"async_save": async_save} if async_save else {}
        info = await asyncio.to_thread(self.backend.save_checkpoint, path, export_hf=export_hf, **kwargs)
        return {"path": info.path, "sha256": info.sha256, "size_bytes": info.size_bytes,
                "blocking_s": time.perf_counter() - t0}

    async def load_checkpoint(self, path: str, sha256: str | None = None) -> int:
        await asyncio.to_thread(self.backend.load_checkpoint, path, expected_sha256=sha256)
        return self.backend.updates

    # -- room for the hybrids ------------------------------------------------------------------

    async def offload(self) -> dict[str, float]:
        """Move the trainer's state out of the hybrids' way (seconds and GB of each move)."""
        move = getattr(self.backend, "offload", None)
        return dict(await asyncio.to_thread(move)) if move is not None else {}

    async def reload(self) -> dict[str, float]:
        """Bring it back for the next update."""
        move = getattr(self.backend, "reload", None)
        return dict(await asyncio.to_thread(move)) if move is not None else {}

    # -- hybrid engines (same process: the weights never leave it) ----------------------------

    async def hybrid_generate_batch(
        self, replica_id: str, requests: Sequence[GenerationRequest]
    ) -> list[GenerationResult | BaseException]:
        return await generate_each(self.hybrids[replica_id], requests)

    async def hybrid(self, op: str, replica_ids: Sequence[str]) -> int:
        """Run an engine verb (abort_all, pause, resume, sleep, wake_up) on hybrid engines."""
        if op not in {"abort_all", "pause", "resume", "sleep", "wake_up"}:
            raise ValueError(f"unknown hybrid op {op!r}")
        results = await asyncio.gather(*(getattr(self.hybrids[rid], op)() for rid in replica_ids))
        return int(sum(r or 0 for r in results))

    async def hybrid_load_weights(self, replica_ids: Sequence[str], version: int) -> float:
        t0 = time.perf_counter()
        state = self.backend.state_dict_for_rollout()
        for rid in replica_ids:
            await self.hybrids[rid].load_weights(state, version)
        return time.perf_counter() - t0

    def hybrid_stats(self) -> dict[str, dict[str, float]]:
        return {rid: dict(engine.stats()) for rid, engine in self.hybrids.items()}

    async def close(self) -> None:
        """Shut the hybrid engines and the backend down (the save in flight finishes first)."""
        await asyncio.gather(*(engine.shutdown() for engine in self.hybrids.values()))
        await asyncio.to_thread(self.backend.close)

    def ping(self) -> str:
        return "ok"
