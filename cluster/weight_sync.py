"""Weights from the trainer to the rollout replicas: one interface, three transports.

- ``collective``: trainer → standalone replicas over a ``torch.distributed`` group of its own
  (never the training group): NCCL on GPU, gloo on CPU. The weights go in buckets of
  ``update_weights_bucket_megabytes``, in the engine's dtype; each bucket is one flat tensor the
  sender packs and broadcasts, and each receiver splits into views and loads at once (vLLM through
  its own weight loader, bucket by bucket). The group is formed on a ``TCPStore`` the sender hosts,
  under a new key prefix per *generation*: a replaced replica or a lost node re-forms it.
  A sharded trainer gathers one parameter at a time (every rank takes part, rank 0 sends), so no
  rank ever holds the whole model.
- ``in_rank``: a trainer rank → the hybrid replica it hosts, in the same process (the tensors are
  copied in place; on GPU the same device, or a CUDA IPC handle for an engine process).
- ``object_store``: the whole state dict through Ray's object store (the fallback, and the
  baseline the benchmark compares with).

This module holds the wire format (``Manifest``), the group (``SyncGroup``, ``GroupSpec``) and the
two ends (``send``, ``receive``). The trainer's ``Sender`` is built once with the run's manifest
(planned from the wire dtype and the bucket size where the sender lives); its ``SenderEndpoint``
is all the other members learn of it. ``cluster/actors`` decide who takes part. Must not: import Ray
or know replicas, membership or the controller.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch itself is imported where a tensor is made or moved: the controller and the
    # rollout service use the wire format (plan, Manifest) only, and start ~2 s sooner without it
    import torch
    import torch.distributed as dist

COLLECTIVE, IN_RANK, OBJECT_STORE = "collective", "in_rank", "object_store"
TRANSPORTS = (COLLECTIVE, IN_RANK, OBJECT_STORE)
STANDALONE_TRANSPORTS = (COLLECTIVE, OBJECT_STORE)
HYBRID_TRANSPORTS = (IN_RANK, OBJECT_STORE)

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def itemsize(name: str) -> int:
    """Bytes per element of the weight-sync dtype ``name``."""
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"weight-sync dtype {name!r}: expected one of {sorted(_ITEMSIZE)}") from None


def torch_dtype(name: str) -> torch.dtype:
    import torch

    itemsize(name)  # an unknown name fails here, in the same words
    return getattr(torch, name)


# ------------------------------------------------------------------------------------------------
# the wire format


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: its name (the trainer's, an engine maps it to its own) and shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Manifest:
    """What a sync sends, in order: buckets of entries, all in ``dtype``. Sender and receivers
    hold the same manifest before the first byte moves, so each receiver knows every bucket's
    size and can check names and shapes against its model before anything changes."""

    buckets: tuple[tuple[Entry, ...], ...]
    dtype: str

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(e for bucket in self.buckets for e in bucket)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {e.name: e.shape for e in self.entries}

    @property
    def nbytes(self) -> int:
        return sum(e.numel for e in self.entries) * itemsize(self.dtype)


def plan(shapes: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]], *, dtype: str,
         bucket_bytes: int) -> Manifest:
    """Buckets of at most ``bucket_bytes`` in the given order (a tensor larger than that gets a
    bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    size_of = itemsize(dtype)
    items = shapes.items() if isinstance(shapes, Mapping) else shapes
    buckets: list[tuple[Entry, ...]] = []
    current: list[Entry] = []
    size = 0
    for name, shape in items:
        entry = Entry(str(name), tuple(int(d) for d in shape))
        nbytes = entry.numel * size_of
        if current and size + nbytes > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        buckets.append(tuple(current))
    return Manifest(tuple(buckets), dtype)


def check_manifest(manifest: Manifest, shapes: Mapping[str, Sequence[int]], *, model: str) -> None:
    """``ValueError`` unless the manifest names exactly ``shapes`` (an engine's), each its shape."""
    sent = manifest.shapes
    want = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
    missing, extra = sorted(set(want) - set(sent)), sorted(set(sent) - set(want))
    wrong = sorted(k for k in set(want) & set(sent) if want[k] != sent[k])
    if missing or extra or wrong:
        raise ValueError(f"weight sync for {model}: missing {missing[:5]}, unexpected {extra[:5]}, "
                         f"wrong shape {[(k, sent[k], want[k]) for k in wrong[:5]]}")


# ------------------------------------------------------------------------------------------------
# the group


@dataclass(frozen=True)
class GroupSpec:
    """A weight-sync group: the sender is rank 0 and hosts the store at ``address:port``; the
    receivers take ranks 1 … ``world`` − 1 (a replica with several workers takes consecutive
    ranks). ``generation`` names the formation: members of another generation never meet."""

    address: str
    port: int
    world: int
    generation: int
    backend: str = "gloo"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ValueError(f"a weight-sync group needs the sender and a receiver, world={self.world}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend {self.backend!r}: expected 'gloo' or 'nccl'")


def backend_for(device: torch.device | str) -> str:
    import torch

    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class SenderEndpoint:
    """What a sync's other members need of its sender, fixed once the sender is built: where it
    hosts the group's store, the group's backend, and the manifest every sync sends (planned
    there, from the trainer's shapes, the wire dtype and the bucket size)."""

    address: str
    port: int
    backend: str
    manifest: Manifest

    def group(self, world: int, generation: int, timeout_s: float) -> GroupSpec:
        """The group of one generation of ``world`` members on this sender's store."""
        return GroupSpec(self.address, self.port, world, generation, self.backend, timeout_s)


def host_store(address: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """The sender's store, kept for the whole run; each generation uses a prefix of it. It listens
    on ``address`` only: a server ``TCPStore`` binds every interface otherwise, and a local run
    must not listen beyond loopback."""
    import torch.distributed as dist

    from cluster.ports import listen_on

    return dist.TCPStore(address, port, None, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listen_on(address, port))


class SyncGroup:
    """One member's end of a weight-sync group (a ``ProcessGroupGloo`` or ``ProcessGroupNCCL``
    built on the store directly, so it lives beside a process's own default group)."""

    def __init__(self, spec: GroupSpec, rank: int, *, store: dist.Store | None = None,
                 device: torch.device | str = "cpu"):
        import torch
        import torch.distributed as dist

        if not 0 <= rank < spec.world:
            raise ValueError(f"rank {rank} outside a weight-sync group of {spec.world}")
        self.spec, self.rank, self.device = spec, rank, torch.device(device)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if store is None:
            store = dist.TCPStore(spec.address, spec.port, None, False, timeout)
        self._store = store
        prefixed = dist.PrefixStore(f"tidal-weight-sync/{spec.generation}", store)
        if spec.backend == "nccl":  # GPU only: not exercised on the CPU machines (DESIGN §8)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.world, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every member's (in place); raises when a member is lost
        (at the latest after ``timeout_s``)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.spec.timeout_s)
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        abort = getattr(self.pg, "abort", None)
        if self.spec.backend == "nccl" and abort is not None:
            abort()
        self.pg = None


# ------------------------------------------------------------------------------------------------
# the two ends


@dataclass(frozen=True)
class SyncStats:
    """What one end of a sync did: bytes on the wire, buckets, seconds."""

    transport: str
    nbytes: int
    buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SendReport:
    """The sender's end of one sync: what went on the wire, and whether it read a gathered whole
    copy of the model (a ZeRO trainer has no per-tensor view) instead of one tensor at a time."""

    stats: SyncStats
    gathered_whole_model: bool = False


def send(group: SyncGroup | None, manifest: Manifest, tensor_of: Callable[[str], torch.Tensor]) -> SyncStats:
    """Pack and broadcast every bucket of ``manifest``. ``tensor_of(name)`` gives one tensor at a
    time (a sharded trainer gathers it there: every rank calls ``send``, only the sender passes a
    group; the others gather and drop), so the peak is one bucket plus one tensor."""
    import torch

    t0 = time.perf_counter()
    dtype = torch_dtype(manifest.dtype)
    device = group.device if group is not None else torch.device("cpu")
    for bucket in manifest.buckets:
        flat = None if group is None else torch.empty(sum(e.numel for e in bucket), dtype=dtype, device=device)
        offset = 0
        for entry in bucket:
            tensor = tensor_of(entry.name)
            if tuple(tensor.shape) != entry.shape:
                raise ValueError(f"{entry.name}: shape {tuple(tensor.shape)}, the manifest says {entry.shape}")
            if flat is not None:
                flat[offset:offset + entry.numel].copy_(tensor.detach().reshape(-1))
            offset += entry.numel
        if group is not None:
            group.broadcast(flat)
    return SyncStats(COLLECTIVE, manifest.nbytes, len(manifest.buckets), time.perf_counter() - t0)


def receive(group: SyncGroup, manifest: Manifest) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each bucket of ``manifest`` as it arrives: (name, tensor) views of one flat buffer, on the
    group's device in the manifest's dtype. Every bucket gets a buffer of its own, so the views
    stay valid while the caller holds them (vLLM's layerwise loader keeps a layer's tensors until
    the layer is whole, which may straddle two buckets)."""
    import torch

    dtype = torch_dtype(manifest.dtype)
    for bucket in manifest.buckets:
        flat = torch.empty(sum(e.numel for e in bucket), dtype=dtype, device=group.device)
        group.broadcast(flat)
        views, offset = [], 0
        for entry in bucket:
            views.append((entry.name, flat[offset:offset + entry.numel].view(entry.shape)))
            offset += entry.numel
        yield views


def copy_into(targets: Mapping[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The in-rank transport: copy each tensor into the engine's own (same device: an in-place
    copy; another dtype: cast on the way). Returns bytes written."""
    import torch

    written = 0
    with torch.no_grad():
        for name, tensor in named:
            target = targets[name]
            target.copy_(tensor.detach().reshape(target.shape))
            written += target.numel() * target.element_size()
    return written


class Receiver:
    """A receiver's standing membership: the group of the current generation, re-formed when a
    sync names another one (a replaced peer, a lost node)."""

    def __init__(self, device: torch.device | str = "cpu"):
        import torch

        self.device = torch.device(device)
        self.group: SyncGroup | None = None

    def join(self, spec: GroupSpec, rank: int) -> SyncGroup:
        if self.group is not None and self.group.spec == spec and self.group.rank == rank:
            return self.group
        self.leave()
        self.group = SyncGroup(spec, rank, device=self.device)
        return self.group

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class Sender:
    """The sender's standing membership: the store it hosts for the run, the current group and,
    when built for a trainer, the ``manifest`` every sync of the run sends."""

    def __init__(self, address: str, port: int, device: torch.device | str = "cpu", *,
                 manifest: Manifest | None = None):
        import torch

        self.address, self.port, self.device = address, port, torch.device(device)
        self.manifest = manifest
        self.store = host_store(address, port)
        self.group: SyncGroup | None = None

    @property
    def endpoint(self) -> SenderEndpoint:
        """What the other members need of this sender (it must have been built with a manifest)."""
        if self.manifest is None:
            raise ValueError("a sender built without a manifest has no endpoint to give")
        return SenderEndpoint(self.address, self.port, backend_for(self.device), self.manifest)

    def join(self, spec: GroupSpec) -> SyncGroup:
        if (spec.address, spec.port) != (self.address, self.port):
            raise ValueError(f"the group's store is {spec.address}:{spec.port}, this sender hosts "
                             f"{self.address}:{self.port}")
        if self.group is not None and self.group.spec == spec:
            return self.group
        self.leave()
        self.group = SyncGroup(spec, 0, store=self.store, device=self.device)
        return self.group

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def named_shapes(state: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(tensor.shape)) for name, tensor in state.items()]
