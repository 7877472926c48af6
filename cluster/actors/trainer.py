"""The trainer actor: the train backend and, in the same process, the hybrid replicas' engines.

Lending the trainer's GPU to rollout really time-shares the same device (or core); the weights
of a hybrid sync never leave the process. With N > 1 GPUs the backend is a ``RankGroup`` over
N rank actors (``cluster.actors.trainer_rank``), so the rest of the run still sees one trainer.
Before the hybrids wake, the backend moves its optimizer state and gradients (and parameters, if
configured) to host memory (``offload``), and brings them back once they sleep (``reload``).
Checkpoints may be written in the background: a save first waits for the one before it, and
``close`` waits for the last. With N ranks the hybrid engines live on the ranks that host them
(``trainer_rank.hybrid_hosts``) and this actor forwards their verbs there. Weights leave by the
transports of ``cluster.weight_sync``: ``send_weights`` (collective, to standalones) and
``hybrid_load_weights`` (in-rank or object store, to hybrids); every use of the backend
(training, syncs, moves) takes one lock, so the ranks see their collectives in one order.
Must not: decide when to lend (the controller does).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray

from cluster import weight_sync as ws
from cluster.actors.names import ROLLOUT_SERVICE
from cluster.actors.trainer_rank import HybridHost, RankGroup, load_in_rank, rollout_shapes, send_from
from data.types import MicroReport, Sample

if TYPE_CHECKING:
    from cluster.actors.rollout_service import PulledBatch


@ray.remote(num_cpus=0, max_concurrency=1000)
class TrainerActor(HybridHost):
    """The train backend and, beside it (or on its ranks), the engines of the hybrid replicas it
    can lend."""

    def __init__(
        self,
        backend_factory: Callable[[], Any],
        hybrid_factories: Mapping[str, Callable[[], Any]],
        *,
        namespace: str,
        required_samples: int,
        hybrid_transport: str = ws.IN_RANK,
        sync_dtype: str = "float32",
        bucket_bytes: int = 512 << 20,
    ):
        """``sync_dtype`` and ``bucket_bytes``: the collective sync's wire dtype (the engines') and
        bucket size, planned into its manifest once, when the sender is built (``weight_sender``)."""
        if hybrid_transport not in ws.HYBRID_TRANSPORTS:
            raise ValueError(f"hybrid transport {hybrid_transport!r}: expected one of {ws.HYBRID_TRANSPORTS}")
        self.backend = backend_factory()
        self.ranks: list[Any] = list(self.backend.ranks) if isinstance(self.backend, RankGroup) else []
        # the rank hosting each hybrid when the ranks host them (they built their engines in setup)
        infos = self.backend.info if isinstance(self.backend, RankGroup) else ()
        hosted = {rid: i for i, info in enumerate(infos) for rid in info.hybrids}
        self._host_rank = hosted
        self.hybrids = {rid: make() for rid, make in hybrid_factories.items() if rid not in hosted}
        self.namespace = namespace
        self.required_samples = required_samples
        self.hybrid_transport = hybrid_transport
        self._train_lock = asyncio.Lock()
        self._sync_plan = (sync_dtype, int(bucket_bytes))
        self._sender: ws.Sender | None = None
        self._endpoint: ws.SenderEndpoint | None = None

    # -- training ---------------------------------------------------------------------------

    async def train_micro_step(self, timeout_s: float | None = None) -> MicroReport:
        """Pull ``required_samples`` from the queue (timed) and run one update (``MicroReport``;
        ``mq_size`` is the queue right after the update)."""
        rollout = self._rollout_service()
        async with self._train_lock:
            t0 = time.perf_counter()
            pulled: PulledBatch = await rollout.get_batch.remote(self.required_samples, timeout_s)
            waited = time.perf_counter() - t0
            at_start = pulled.pull.queue_size_at_start
            if pulled.samples is None:  # timed out, nothing taken: the caller decides whether to wait on
                return MicroReport(samples=0, timed_out=True, wait_s=waited, queue_size_at_start=at_start,
                                   mq_size=pulled.mq_size)
            if not pulled.samples:
                return MicroReport(samples=0, wait_s=waited, wait_samples=pulled.pull.wait_samples,
                                   mq_size=pulled.mq_size, exhausted=True, allocated_s=waited,
                                   queue_size_at_start=at_start)
            samples: list[Sample] = pulled.samples
            result = await asyncio.to_thread(self.backend.train_step, samples)
            allocated = time.perf_counter() - t0
            # the reference's mq_size: a snapshot of the queue right after the fit step, i.e. with
            # what the rollout side produced while the trainer trained (reference §4.4)
            mq_size = await rollout.queue_size.remote()
            return MicroReport(
                samples=len(samples),
                prompts=tuple((s.epoch, s.prompt_index) for s in samples),
                versions=tuple((s.min_version, s.max_version) for s in samples),
                wait_s=waited,
                wait_samples=pulled.pull.wait_samples,
                mq_size=int(mq_size),
                exhausted=False,
                metrics={k: float(v) for k, v in result.metrics.items()},
                timing_s={k: float(v) for k, v in result.timing_s.items()},
                compute_s=float(result.compute_s),
                allocated_s=allocated,
                queue_size_at_start=at_start,
            )

    def _rollout_service(self) -> Any:
        """The run's rollout service, looked up by name each time (a replaced one is found)."""
        return ray.get_actor(ROLLOUT_SERVICE, namespace=self.namespace)

    async def weights(self) -> dict[str, Any]:
        """Current weights for the object-store broadcast (Ray puts the return value there)."""
        async with self._train_lock:
            return await asyncio.to_thread(self.backend.state_dict_for_rollout)

    # -- the collective transport (cluster.weight_sync) -----------------------------------------

    async def weight_sender(self) -> ws.SenderEndpoint:
        """The collective sync's sender, built on the first call (on rank 0, or in this process)
        with the manifest of the trainer's shapes in ``sync_dtype`` buckets of ``bucket_bytes``:
        where it hosts the group's store, the group's backend, and that manifest (the controller
        forms each generation's group on it and hands the manifest to the receivers)."""
        async with self._train_lock:
            if self._endpoint is None:
                dtype, bucket_bytes = self._sync_plan
                shapes = await asyncio.to_thread(
                    self.backend.rollout_shapes if self.ranks else functools.partial(rollout_shapes, self.backend))
                manifest = ws.plan(shapes, dtype=dtype, bucket_bytes=bucket_bytes)
                if self.ranks:
                    self._endpoint = await asyncio.to_thread(self.backend.open_sender, manifest)
                else:
                    from cluster.ports import free_port

                    host = ray.util.get_node_ip_address()
                    self._sender = ws.Sender(host, free_port(host), getattr(self.backend, "device", "cpu"),
                                             manifest=manifest)
                    self._endpoint = self._sender.endpoint
            return self._endpoint

    async def send_weights(self, spec: ws.GroupSpec) -> ws.SendReport:
        """Broadcast the current weights to the group ``spec`` (its receivers call in concurrently);
        between micro-steps, never during one (``weight_sender`` first)."""
        async with self._train_lock:
            if self.ranks:
                return await asyncio.to_thread(self.backend.send_weights, spec)
            assert self._sender is not None and self._sender.manifest is not None, "weight_sender() first"
            return await asyncio.to_thread(send_from, self.backend, self._sender.manifest, self._sender, spec)

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

    def _has_moves(self) -> bool:
        """Whether the backend moves anything out of the hybrids' way (not when it has no
        ``offload``, or is a rank group none of whose backends has one): otherwise a switch neither
        waits for the train lock (a broadcast may hold it) nor calls the ranks."""
        return bool(getattr(self.backend, "moves", True)) and callable(getattr(self.backend, "offload", None))

    async def offload(self) -> dict[str, float]:
        """Move the trainer's state out of the hybrids' way (seconds and GB of each move)."""
        if not self._has_moves():
            return {}
        async with self._train_lock:
            return dict(await asyncio.to_thread(self.backend.offload))

    async def reload(self) -> dict[str, float]:
        """Bring it back for the next update."""
        if not self._has_moves():
            return {}
        async with self._train_lock:
            return dict(await asyncio.to_thread(self.backend.reload))

    # -- hybrid engines: here, or on the ranks that host them ----------------------------------

    def hybrid_handles(self) -> dict[str, Any]:
        """The rank actor each rank-hosted hybrid's ``generate`` calls go to (the others are here)."""
        return {rid: self.ranks[r] for rid, r in self._host_rank.items()}

    async def _across(self, replica_ids: Sequence[str], verb: Callable[[Any, Sequence[str]], Awaitable[int]]) -> int:
        """A ``HybridHost`` verb (``HybridHost.hybrid_sleep``, …) on the hybrids here and, through
        the same verb of their rank actors, on the ranks hosting the others."""
        here = [rid for rid in replica_ids if rid not in self._host_rank]
        by_rank: dict[int, list[str]] = {}
        for rid in replica_ids:
            if rid in self._host_rank:
                by_rank.setdefault(self._host_rank[rid], []).append(rid)
        remote = [getattr(self.ranks[r], verb.__name__).remote(ids) for r, ids in by_rank.items()]
        total = await verb(self, here) if here else 0
        return int(total + sum(await asyncio.gather(*remote)))

    async def hybrid_pause(self, replica_ids: Sequence[str]) -> int:
        return await self._across(replica_ids, HybridHost.hybrid_pause)

    async def hybrid_abort_all(self, replica_ids: Sequence[str]) -> int:
        return await self._across(replica_ids, HybridHost.hybrid_abort_all)

    async def hybrid_resume(self, replica_ids: Sequence[str]) -> int:
        return await self._across(replica_ids, HybridHost.hybrid_resume)

    async def hybrid_sleep(self, replica_ids: Sequence[str]) -> int:
        return await self._across(replica_ids, HybridHost.hybrid_sleep)

    async def hybrid_wake_up(self, replica_ids: Sequence[str]) -> int:
        return await self._across(replica_ids, HybridHost.hybrid_wake_up)

    async def hybrid_load_weights(self, replica_ids: Sequence[str], version: int) -> float:
        """Load ``version`` into the hybrids: in their rank's process (``in_rank``), or one
        gathered copy through the object store (``object_store``)."""
        t0 = time.perf_counter()
        async with self._train_lock:
            if self.hybrid_transport == ws.IN_RANK and self.ranks:
                return await asyncio.to_thread(self.backend.hybrid_load, list(replica_ids), version)
            if self.hybrid_transport == ws.IN_RANK:
                return await load_in_rank(self.backend, [self.hybrids[rid] for rid in replica_ids], version)
            state = await asyncio.to_thread(self.backend.state_dict_for_rollout)
        ref = ray.put(state)
        hosted = [rid for rid in replica_ids if rid in self._host_rank]
        await self.hybrid_load_state([rid for rid in replica_ids if rid not in self._host_rank], state, version)
        await asyncio.gather(*(self.ranks[self._host_rank[rid]].hybrid_load_state.remote([rid], ref, version)
                               for rid in hosted))
        return time.perf_counter() - t0

    async def hybrid_stats(self) -> dict[str, dict[str, float]]:
        stats = HybridHost.hybrid_stats(self)
        for part in await asyncio.gather(*(rank.hybrid_stats.remote() for rank in self.ranks)):
            stats.update(part)
        return stats

    async def close(self) -> None:
        """Shut the hybrid engines and the backend down (the save in flight finishes first)."""
        await self.close_hybrids()
        if self._sender is not None:
            self._sender.leave()
        await asyncio.to_thread(self.backend.close)

    def ping(self) -> str:
        return "ok"
