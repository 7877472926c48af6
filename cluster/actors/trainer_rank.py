"""The trainer as a group of rank actors, one per GPU, and the one backend the trainer actor sees.

``TrainRankActor`` is one rank: it joins the group's ``torch.distributed`` group and holds that
rank's train backend (FSDP2 or ZeRO shards). ``RankGroup`` lives in the trainer actor and drives
the ranks: it forms the group the way Ray Train and verl do (rank 0 picks its node's address and
a free port, every rank is handed it through its actor), deals each micro-step's samples to the
ranks, and answers the train-backend calls (``cluster.backends.base.TrainBackend``) with rank 0's
results, so the controller, the flows and the step API still see one trainer.

Weights leave a rank two ways (``cluster.weight_sync``): rank 0 hosts the collective group's
store and sends the buckets to the standalone replicas while every rank gathers its shards one
parameter at a time (``send_weights``); and each rank loads the hybrid replica it hosts in its own
process (``hybrid_load``, the in-rank transport). A hybrid replica of ``tensor_model_parallel_size``
t spans t ranks of one node (``hybrid_hosts``). A torch engine lives on the first of them. A vLLM
hybrid is one engine over t workers, one in each of those ranks' processes beside its training
shard (``cluster.engines.vllm_ranks``): every rank starts its worker in ``setup``, then the first
rank of each hybrid builds the engine that drives them (``build_hybrids``, all hybrids at once:
vLLM forms its groups over every rank), and each rank loads its own worker from its own shard.

A rank that dies fails the call at once (``ray.wait`` on the ranks, not a collective's timeout):
the ``RayActorError`` reaches the driver, which stops with exit 3 and a resume line.
Must not: decide anything about lending, or read the config (``cluster/builders.py`` does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from cluster.actors.replica import generate_each
from data.types import GenerationRequest, GenerationResult, Sample

if TYPE_CHECKING:  # torch is imported where a backend runs, not where the actors are named
    from cluster import weight_sync as ws
    from cluster.backends.base import StepResult
    from cluster.checkpoint_file import CheckpointInfo

RANK_PREFIX = "trainer-rank-"
ENGINE_BUILD_TIMEOUT_S = 1800.0
"""Seconds the vLLM hybrids over the ranks' workers may take to start (minutes on a busy CPU host,
a model's load on a GPU one)."""


@dataclass(frozen=True)
class HostedWorker:
    """A vLLM hybrid's TP worker in a rank's process: the hybrid it serves and where it listens."""

    replica: str
    address: str


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports once set up (``TrainRankActor.setup``)."""

    rank: int
    backend: str
    """The training group's ``torch.distributed`` backend."""
    device: str
    gpu_ids: tuple[str, ...]
    node: str
    hybrids: tuple[str, ...]
    """The hybrid replicas whose engines this rank builds (sorted)."""
    worker: HostedWorker | None
    pid: int
    moves: bool = True
    """Whether its backend moves state out of the hybrids' way (has ``offload``/``reload``)."""
    replicated: bool = False
    """Whether it holds the whole state (``replicated_state``), so one rank can answer a read."""


def engines_of(info: RankInfo) -> tuple[str, ...]:
    """The hybrids whose engines a rank hosts."""
    return info.hybrids


def workers_of(info: RankInfo) -> tuple[str, ...]:
    """The hybrid whose vLLM worker a rank's process hosts (none, or one)."""
    return (info.worker.replica,) if info.worker is not None else ()


def rank_name(rank: int) -> str:
    """A rank actor's name in the run's namespace."""
    return f"{RANK_PREFIX}{rank}"


def hybrid_hosts(hybrid_ids: Sequence[str], world: int, per_node: int, tp: int) -> dict[str, list[int]]:
    """The trainer ranks each hybrid replica spans: ``tp`` consecutive ranks of one node, in order
    (hybrid k on ranks k·tp … k·tp + tp − 1); its engine lives on the first of them."""
    if tp < 1 or per_node % tp or world % per_node:
        raise ValueError(f"{world} trainer ranks of {per_node} per node cannot host replicas of "
                         f"tensor_model_parallel_size={tp} within one node")
    if len(hybrid_ids) > world // tp:
        raise ValueError(f"{len(hybrid_ids)} hybrid replicas need {len(hybrid_ids) * tp} trainer ranks, "
                         f"the trainer has {world}")
    return {rid: list(range(k * tp, (k + 1) * tp)) for k, rid in enumerate(hybrid_ids)}


def full_tensor(tensor: Any) -> Any:
    """The whole tensor of a (possibly FSDP2-sharded) parameter: a gather over the training group
    that every rank makes in the same order. A plain tensor is itself: a DTensor exists only once
    ``torch.distributed.tensor`` is imported, so it is not imported here (~0.5 s a process: every
    rank would pay it at its first in-rank load, in the first lend's switch)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def rollout_tensors(backend: Any) -> tuple[Mapping[str, Any], bool]:
    """What a sync reads, one tensor at a time, and whether it is a gathered whole copy (a ZeRO
    backend has no per-parameter view: rank 0 holds the whole model for the sync)."""
    live = getattr(backend, "rollout_tensors", None)
    tensors = live() if live is not None else None
    if tensors is not None:
        return tensors, False
    return backend.state_dict_for_rollout(), True


def rollout_shapes(backend: Any) -> list[tuple[str, tuple[int, ...]]]:
    tensors, _ = rollout_tensors(backend)
    return [(name, tuple(t.shape)) for name, t in tensors.items()]


def send_from(backend: Any, manifest: ws.Manifest, sender: ws.Sender | None = None,
              spec: ws.GroupSpec | None = None) -> ws.SendReport | None:
    """One rank's part of a collective sync of ``manifest``: the sender (``sender`` given, with
    the group ``spec``) packs and broadcasts each bucket and reports it; the other ranks gather
    their shards with it, drop the result and report nothing."""
    from cluster import weight_sync as ws

    tensors, gathered = rollout_tensors(backend)
    if sender is None and gathered:
        return None  # it took part in the gather; rank 0 holds the copy
    group = sender.join(spec) if sender is not None else None
    stats = ws.send(group, manifest, lambda name: full_tensor(tensors[name]))
    return ws.SendReport(stats, gathered_whole_model=gathered) if sender is not None else None


def load_worker_in_rank(backend: Any, worker: Any, gpt2_names: bool, drop: Sequence[str]) -> float:
    """The in-rank transport to a vLLM hybrid's worker in this rank's process (``worker``; None on
    a rank whose hybrid is not being loaded, which still takes part in every gather): each
    parameter gathered in turn and handed to the worker's loader as it asks for it, so the peak is
    one whole parameter, and vLLM keeps this worker's TP slice of it."""
    tensors, gathered = rollout_tensors(backend)
    if worker is not None and gathered and not tensors:
        raise RuntimeError(_NO_LOCAL_COPY)
    named = ((name, full_tensor(t)) for name, t in tensors.items())
    if worker is None:
        for _ in named:  # the gathers are collectives of the training group: every rank makes them
            pass
        return 0.0
    from cluster.engines.vllm_engine import checkpoint_named

    return worker.load(checkpoint_named(named, gpt2_names=gpt2_names, drop=frozenset(drop)))


_NO_LOCAL_COPY = ("the hybrids of this rank need its own copy of the weights, but this backend gathers them "
                  "on rank 0 only (ZeRO, or fsdp_config.param_offload while lent): set "
                  "actor_rollout_ref.rollout.weight_sync.hybrid_transport=object_store")


async def load_in_rank(backend: Any, engines: Sequence[Any], version: int) -> float:
    """The in-rank transport: the weights of this rank's process, gathered one parameter at a time
    (every rank takes part), copied into the hybrid engines it hosts (``engines``, maybe none)."""
    import time

    t0 = time.perf_counter()
    tensors, gathered = rollout_tensors(backend)
    if engines and gathered and not tensors:
        raise RuntimeError(_NO_LOCAL_COPY)
    state = {name: full_tensor(t) for name, t in tensors.items()}
    for engine in engines:
        await engine.load_weights(state, version)
    return time.perf_counter() - t0


class HybridHost:
    """The hybrid engines one process hosts (the trainer actor, or a rank actor), and the engine
    verbs on them."""

    hybrids: dict[str, Any]

    async def hybrid_generate_batch(
        self, replica_id: str, requests: Sequence[GenerationRequest]
    ) -> list[GenerationResult | BaseException]:
        return await generate_each(self.hybrids[replica_id], requests)

    async def _on_hybrids(self, replica_ids: Sequence[str], verb: Callable[[Any], Awaitable[Any]]) -> int:
        """``verb(engine)`` on each hybrid engine here, concurrently; the sum of what they return."""
        results = await asyncio.gather(*(verb(self.hybrids[rid]) for rid in replica_ids))
        return int(sum(r or 0 for r in results))

    async def hybrid_pause(self, replica_ids: Sequence[str]) -> int:
        return await self._on_hybrids(replica_ids, lambda engine: engine.pause())

    async def hybrid_abort_all(self, replica_ids: Sequence[str]) -> int:
        """Abort the in-flight requests; how many were aborted."""
        return await self._on_hybrids(replica_ids, lambda engine: engine.abort_all())

    async def hybrid_resume(self, replica_ids: Sequence[str]) -> int:
        return await self._on_hybrids(replica_ids, lambda engine: engine.resume())

    async def hybrid_sleep(self, replica_ids: Sequence[str]) -> int:
        return await self._on_hybrids(replica_ids, lambda engine: engine.sleep())

    async def hybrid_wake_up(self, replica_ids: Sequence[str]) -> int:
        return await self._on_hybrids(replica_ids, lambda engine: engine.wake_up())

    async def hybrid_load_state(self, replica_ids: Sequence[str], state: Mapping[str, Any], version: int) -> None:
        """The object-store transport for hybrids: a whole state dict (a Ray reference resolved)."""
        for rid in replica_ids:
            await self.hybrids[rid].load_weights(state, version)

    def hybrid_stats(self) -> dict[str, dict[str, float]]:
        return {rid: dict(engine.stats()) for rid, engine in self.hybrids.items()}

    async def close_hybrids(self) -> None:
        await asyncio.gather(*(engine.shutdown() for engine in self.hybrids.values()))


@ray.remote(num_cpus=0, max_concurrency=1000)
class TrainRankActor(HybridHost):
    """One rank of the trainer: its share of every micro-step, its shard of the state, and the
    hybrid engines it hosts. Backend calls run one at a time, in the order they arrive."""

    def __init__(self, rank: int, world: int, local_rank: int, backend_factory: Callable[[], Any], device: str,
                 hybrid_factories: Mapping[str, Callable[[], Any]] | None = None, worker_of: str | None = None):
        """``hybrid_factories``: the engines this rank hosts; ``worker_of``: the vLLM hybrid whose
        TP worker this rank's process hosts (its engine is built by ``build_hybrids``)."""
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self._factory, self._device = backend_factory, device
        self._hybrid_factories = dict(hybrid_factories or {})
        self._worker_of = worker_of
        self._worker: Any = None
        self._naming: tuple[bool, list[str]] = (False, [])
        self.hybrids = {}
        self.backend: Any = None
        self._sender: ws.Sender | None = None
        self._manifest: ws.Manifest | None = None
        self._lock = asyncio.Lock()

    async def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        async with self._lock:
            return await asyncio.to_thread(fn, *args)

    def address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port on it, for the group's TCP store."""
        from cluster.ports import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    async def setup(self, master_addr: str, master_port: int, timeout_s: float) -> RankInfo:
        return await self._locked(self._setup, master_addr, master_port, timeout_s)

    def _setup(self, master_addr: str, master_port: int, timeout_s: float) -> RankInfo:
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
        worker = None
        if self._worker_of is not None:
            from cluster.engines.vllm_ranks import RankWorker

            self._worker = RankWorker(host=ray.util.get_node_ip_address(), local_rank=0)  # Ray's GPU is index 0 here
            worker = HostedWorker(self._worker_of, self._worker.address)
        else:
            self.hybrids = {rid: make() for rid, make in self._hybrid_factories.items()}
        return RankInfo(rank=self.rank, backend=str(backend), device=str(self.backend.device),
                        gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
                        node=ray.get_runtime_context().get_node_id(),
                        hybrids=tuple(sorted(self._hybrid_factories)), worker=worker, pid=os.getpid(),
                        # what the group may skip: moves of a backend without any, collectives of a
                        # read that every rank could answer alone (``RankGroup``)
                        moves=callable(getattr(self.backend, "offload", None)),
                        replicated=bool(getattr(self.backend, "replicated_state", False)))

    async def build_hybrids(self, workers: Mapping[str, Sequence[str]], ident: str) -> dict[str, tuple[bool, list[str]]]:
        """Build the vLLM engines this rank hosts over their ranks' workers (``workers``: replica →
        addresses in TP rank order); returns each one's naming of the trainer's weights (GPT-2
        names, names not loaded) for the ranks that load its workers."""
        def build() -> dict[str, tuple[bool, list[str]]]:
            self.hybrids = {rid: make(rank_workers=list(workers[rid]), rank_ident=ident)
                            for rid, make in self._hybrid_factories.items()}
            return {rid: (engine.model.gpt2_names, sorted(engine.model.drop)) for rid, engine in self.hybrids.items()}

        return await asyncio.to_thread(build)

    def adopt_naming(self, naming: tuple[bool, list[str]]) -> None:
        """How this rank's worker names the trainer's weights (its engine's ``build_hybrids`` answer)."""
        self._naming = (bool(naming[0]), list(naming[1]))

    async def worker_where(self) -> dict[str, Any]:
        """Where this rank's vLLM worker runs (pid, device, TP rank) next to this process's pid and
        training device: the check that the worker is in the rank's own process."""
        info = await asyncio.to_thread(self._worker.where)
        return {**dataclasses.asdict(info), "rank_pid": os.getpid(), "rank_device": str(self.backend.device)}

    async def train_step(self, samples: Sequence[Sample]) -> tuple[StepResult, int]:
        result = await self._locked(self.backend.train_step, samples)
        return result, self.backend.updates

    async def weights(self) -> dict[str, Any]:
        return await self._locked(self.backend.state_dict_for_rollout)

    # -- weight sync (cluster.weight_sync) ------------------------------------------------------

    async def rollout_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return await self._locked(rollout_shapes, self.backend)

    def open_sender(self, manifest: ws.Manifest) -> ws.SenderEndpoint | None:
        """Keep ``manifest`` for every sync of the run; rank 0 also builds the sender with it (the
        group's store on its node, NCCL from a GPU, gloo from a CPU) and returns its endpoint."""
        from cluster import weight_sync as ws
        from cluster.ports import free_port

        self._manifest = manifest
        if self.rank != 0:
            return None
        if self._sender is None:
            host = ray.util.get_node_ip_address()
            self._sender = ws.Sender(host, free_port(host), self.backend.device, manifest=manifest)
        return self._sender.endpoint

    async def send_weights(self, spec: ws.GroupSpec) -> ws.SendReport | None:
        """This rank's part of a sync to the group ``spec`` (``open_sender`` first)."""
        assert self._manifest is not None, "open_sender() first"
        return await self._locked(send_from, self.backend, self._manifest, self._sender, spec)

    async def hybrid_load(self, replica_ids: Sequence[str], version: int) -> float:
        """In-rank: every rank gathers (a collective); the ones hosting ``replica_ids`` (their
        engine, or their vLLM worker) load."""
        async with self._lock:
            if self._worker is not None:
                worker = self._worker if self._worker_of in replica_ids else None
                return await asyncio.to_thread(load_worker_in_rank, self.backend, worker, *self._naming)
            engines = [self.hybrids[rid] for rid in replica_ids if rid in self.hybrids]
            return await load_in_rank(self.backend, engines, version)

    async def hybrid_loaded(self, replica_ids: Sequence[str], version: int, worker_s: float) -> None:
        """The engines of ``replica_ids`` here had their workers loaded in place: they take ``version``."""
        await asyncio.gather(*(self.hybrids[rid].weights_loaded(version, worker_s) for rid in replica_ids))

    # -- checkpoints and room ------------------------------------------------------------------

    async def save_checkpoint(self, path: str, export_hf: bool, async_save: bool) -> CheckpointInfo:
        return await self._locked(lambda: self.backend.save_checkpoint(path, export_hf=export_hf,
                                                                        async_save=async_save))

    async def load_checkpoint(self, path: str, sha256: str | None) -> int:
        await self._locked(lambda: self.backend.load_checkpoint(path, expected_sha256=sha256))
        return self.backend.updates

    async def offload(self) -> dict[str, float]:
        """Move this rank's state out of the hybrids' way (nothing to move for a backend without
        ``offload``: the simulated one, whose engines' switch costs include the moves)."""
        move = getattr(self.backend, "offload", None)
        return dict(await self._locked(move)) if move is not None else {}

    async def reload(self) -> dict[str, float]:
        move = getattr(self.backend, "reload", None)
        return dict(await self._locked(move)) if move is not None else {}

    async def close(self) -> None:
        from cluster.backends import distributed as dp

        try:
            await self.close_hybrids()
            if self._worker is not None:
                await asyncio.to_thread(self._worker.close)
            if self._sender is not None:
                self._sender.leave()
            if self.backend is not None:
                await self._locked(self.backend.close)
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
    """The train backend of a trainer of N rank actors, as the trainer actor drives it.

    A call goes to every rank when each must take part (a micro-step, a gather of sharded
    weights, a sharded save, a load); to fewer when the ranks' setup said they need not: no rank
    is called for a move when no backend moves anything (``moves``), and when every rank holds
    the whole state (``replicated_state``, the simulated backend's) a read of the weights or a
    save is rank 0's alone and a hybrid load the hosting ranks' alone. A switch then costs one round trip to the ranks that
    do something, as on a GPU trainer whose ranks answer in parallel, not one per rank.
    """

    def __init__(self, ranks: Sequence[Any], *, setup_timeout_s: float = 600.0):
        from cluster.backends import distributed as dp

        self.ranks = list(ranks)
        self._dp = dp
        master = ray.get(self.ranks[0].address.remote(), timeout=setup_timeout_s)
        self.info: list[RankInfo] = gather([r.setup.remote(*master, setup_timeout_s) for r in self.ranks])
        self._build_rank_engines(ident=str(master[1]))
        self._updates = 0
        self.moves = any(info.moves for info in self.info)
        """Whether any rank's backend moves state for the hybrids (``offload``/``reload``)."""
        self.replicated = all(info.replicated for info in self.info)
        """Whether every rank holds the whole state, so one rank can answer a read of it."""

    def _build_rank_engines(self, *, ident: str, timeout_s: float = ENGINE_BUILD_TIMEOUT_S) -> None:
        """The vLLM hybrids over the ranks' workers: every engine at once (vLLM forms its groups
        over every rank of the trainer), then each rank learns how its worker names the weights.
        ``ident``: the training group's port, unique on a host while the run lives. A rank that
        dies fails this at once; an engine that never comes up, after ``timeout_s``."""
        workers: dict[str, list[str]] = {}
        for info in self.info:
            if info.worker is not None:
                workers.setdefault(info.worker.replica, []).append(info.worker.address)
        if not workers:
            return
        hosts = [(rank, info.hybrids) for rank, info in zip(self.ranks, self.info, strict=True) if info.hybrids]
        naming: dict[str, tuple[bool, list[str]]] = {}
        for answer in gather([rank.build_hybrids.remote({rid: workers[rid] for rid in rids}, ident)
                              for rank, rids in hosts], timeout_s=timeout_s):
            naming.update(answer)
        gather([rank.adopt_naming.remote(naming[info.worker.replica])
                for rank, info in zip(self.ranks, self.info, strict=True) if info.worker is not None])

    def _hosting(self, replica_ids: Sequence[str],
                 hosted: Callable[[RankInfo], Sequence[str]]) -> list[tuple[Any, list[str]]]:
        """The ranks that host one of ``replica_ids`` as ``hosted`` says (``engines_of``: their
        engines; ``workers_of``: a vLLM worker), each with those replicas."""
        wanted, out = set(replica_ids), []
        for rank, info in zip(self.ranks, self.info, strict=True):
            if mine := wanted & set(hosted(info)):
                out.append((rank, sorted(mine)))
        return out

    def _readers(self, replica_ids: Sequence[str] | None = None) -> list[Any]:
        """The ranks a read of the state calls (a sync, a hybrid load, a save): all of them (each
        takes part in the gather, or writes its shard), or, with replicated state, rank 0
        (``replica_ids`` None) or the ranks hosting those hybrids."""
        if not self.replicated:
            return self.ranks
        if replica_ids is None:
            return self.ranks[:1]
        loading = {id(rank) for hosted in (engines_of, workers_of) for rank, _ in self._hosting(replica_ids, hosted)}
        return [rank for rank in self.ranks if id(rank) in loading]

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
        return gather([r.weights.remote() for r in self._readers()])[0]

    def rollout_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return gather([r.rollout_shapes.remote() for r in self._readers()])[0]

    def open_sender(self, manifest: ws.Manifest) -> ws.SenderEndpoint:
        """The readers of a sync keep ``manifest``; rank 0 builds the sender with it."""
        return gather([r.open_sender.remote(manifest) for r in self._readers()])[0]

    def send_weights(self, spec: ws.GroupSpec) -> ws.SendReport:
        """Every rank gathers, rank 0 sends (``send_from``); with replicated state rank 0 alone."""
        return gather([r.send_weights.remote(spec) for r in self._readers()])[0]

    def hybrid_load(self, replica_ids: Sequence[str], version: int) -> float:
        """Every reader loads what it hosts; then the engines whose workers were loaded in their
        ranks' processes take the version (and drop their stale prefix cache)."""
        ranks = self._readers(replica_ids)
        seconds = max(gather([r.hybrid_load.remote(list(replica_ids), version) for r in ranks]), default=0.0)
        in_place = {rid for _, rids in self._hosting(replica_ids, workers_of) for rid in rids}
        gather([rank.hybrid_loaded.remote([rid for rid in rids if rid in in_place], version, seconds)
                for rank, rids in self._hosting(replica_ids, engines_of) if in_place & set(rids)])
        return seconds

    def save_checkpoint(self, path: Any, *, export_hf: bool = True, async_save: bool = False) -> CheckpointInfo:
        return gather([r.save_checkpoint.remote(str(path), export_hf, async_save) for r in self._readers()])[0]

    def load_checkpoint(self, path: Any, *, expected_sha256: str | None = None) -> None:
        self._updates = gather([r.load_checkpoint.remote(str(path), expected_sha256) for r in self.ranks])[0]

    def offload(self) -> dict[str, float]:
        return merge_moves(gather([r.offload.remote() for r in self.ranks])) if self.moves else {}

    def reload(self) -> dict[str, float]:
        return merge_moves(gather([r.reload.remote() for r in self.ranks])) if self.moves else {}

    def close(self) -> None:
        """Finish the save in flight on every rank and leave the group (best effort)."""
        try:
            gather([r.close.remote() for r in self.ranks], timeout_s=120)
        except Exception:  # noqa: BLE001 - a dead rank has nothing left to close
            pass
