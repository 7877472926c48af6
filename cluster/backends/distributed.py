"""The data-parallel side of a train backend: the rank's view of its process group, FSDP2 sharding,
the reductions a global GRPO loss needs, moving state to host memory and back, and sharded
checkpoints with ``torch.distributed.checkpoint`` (DCP).

Owns: what one rank of a group does with ``torch.distributed``. Must not: start processes or
actors, or know of Ray (``cluster/actors/trainer_rank.py`` starts the ranks and forms the group
the way Ray Train does: rank 0's address handed to every rank through the actors).

A backend that is one rank of ``world`` ranks trains on its share of a micro-step's samples. The
loss each rank computes is its share of the *global* loss (every normaliser — response tokens,
sequences — is summed over the ranks first, ``global_counts``), and FSDP2 averages gradients over
the ranks, so each rank scales its loss by ``world`` (``loss_scale``): the reduced gradient is then
exactly the one-rank gradient of the whole micro-step. Every rank must run the same number of
forward/backward passes (FSDP2 all-gathers in each forward and reduce-scatters in each backward):
``agree_max`` gives the count, and a rank with fewer micro-batches runs zero-weighted ones.

Sharded checkpoint layout (a folder per step's checkpoint)::

    actor/__<rank>_0.distcp     one DCP shard per rank (model and AdamW state, sharded)
    actor/.metadata             DCP's index
    actor/tidal-commit.json     the commit marker, written last and atomically by rank 0: format,
                                world size, backend, updates, and each file's size

A checkpoint without its marker is incomplete (a save that was cut off) and is never loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SHARDED_FORMAT = "tidal-train-sharded/1"
COMMIT_MARKER = "tidal-commit.json"
"""The file a sharded checkpoint's folder holds once every shard is on disk."""


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the trainer's group (rank 0 of 1 when there is no group)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> RankInfo:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def sharded(self) -> bool:
        return self.world > 1


def init_group(*, rank: int, world: int, master_addr: str, master_port: int, device: torch.device,
               local_rank: int | None = None, timeout_s: float = 600.0, init_method: str | None = None) -> str:
    """Join the trainer's process group (NCCL on CUDA, gloo on CPU) through rank 0's TCP store at
    ``master_addr:master_port``; returns the backend's name. Sets the launcher's variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) as torchrun and
    Ray Train do: DeepSpeed reads them."""
    from datetime import timedelta

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank if local_rank is None else local_rank),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if init_method is not None:  # a file:// store in tests: no port to race for
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        return backend
    # rank 0's store listens on its node's address only (a server TCPStore binds every interface)
    from cluster.ports import listen_on

    listen = {"master_listen_fd": listen_on(master_addr, master_port)} if rank == 0 else {}
    store = dist.TCPStore(master_addr, master_port, world, rank == 0, timeout, **listen)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return backend


def leave_and_exit() -> None:
    """End a rank process whose work is done and saved (the test and benchmark harnesses' spawned
    ranks): wait for every rank, leave the group, and exit 0 without the interpreter's teardown.
    On a loaded 2-core machine a finished rank's teardown once aborted in gloo ("terminate called
    without an active exception", SIGABRT) in about one group of twenty; nothing is left to tear
    down that matters once the results are on disk."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    leave_group()
    os._exit(0)


# ------------------------------------------------------------------------------------- sharding


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: TinyLM's ``blocks``, an HF causal LM's
    ``model.layers`` (Qwen2, Llama, Mistral…) or ``transformer.h`` (GPT-2 style); [] when none."""
    for path in ("blocks", "model.layers", "transformer.h", "gpt_neox.layers"):
        node: Any = model
        for name in path.split("."):
            node = getattr(node, name, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList):
            return list(node)
    return []


def param_dtype_of(name: str, device: torch.device) -> torch.dtype | None:
    """``fsdp_config.mixed_precision.param_dtype`` → the dtype FSDP2 computes in; None = the
    parameters' own (fp32). CPU always computes in fp32 (bf16 matmuls there are slow or missing)."""
    if device.type != "cuda" or name in ("fp32", "float32"):
        return None
    if name in ("bf16", "bfloat16"):
        return torch.bfloat16
    if name in ("fp16", "float16"):
        return torch.float16
    raise ValueError(f"unknown param_dtype {name!r}; known: bf16, fp16, fp32")


def shard(model: torch.nn.Module, *, device: torch.device, param_dtype: torch.dtype | None,
          reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, head, tied weights).
    Gradients are reduced in fp32 whatever the compute dtype."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


_CHECKPOINT_GROUP: Any = None


def checkpoint_group() -> Any:
    """A gloo group of its own for the checkpoints' coordination (None when alone), so that an
    async save's background thread never interleaves its collectives with training's on the
    default group (torch's advice for ``async_save``). Every rank creates it at its first save."""
    global _CHECKPOINT_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _CHECKPOINT_GROUP is None:
        _CHECKPOINT_GROUP = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUP


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=checkpoint_group())


def leave_group() -> None:
    """Destroy this process's group (and the checkpoint group with it)."""
    global _CHECKPOINT_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CHECKPOINT_GROUP = None


def split(items: Sequence[Any], world: int) -> list[list[Any]]:
    """A micro-step's samples dealt to ``world`` ranks: contiguous shares in order, sizes differing
    by at most one (a sample's responses stay together: GRPO groups never straddle ranks)."""
    q, extra = divmod(len(items), world)
    out, lo = [], 0
    for r in range(world):
        hi = lo + q + (1 if r < extra else 0)
        out.append(list(items[lo:hi]))
        lo = hi
    return out


# ----------------------------------------------------------------------------------- reductions


def all_reduce(values: Sequence[float], op: str = "sum") -> list[float]:
    """Sum (or max) plain numbers over the group, in float64; the values themselves when alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return [float(v) for v in t.cpu()]


def global_counts(tokens: float, seqs: float) -> tuple[float, float]:
    """The micro-step's response tokens and sequences over every rank (token-mean normalisers)."""
    tok, seq = all_reduce([tokens, seqs])
    return tok, seq


def agree_max(n: int) -> int:
    """The largest ``n`` over the ranks (the forward/backward count every rank must run)."""
    return int(all_reduce([n], op="max")[0])


def loss_scale() -> float:
    """What each rank multiplies its share of the loss by so that FSDP2's gradient average over
    the ranks becomes the sum of the shares (the one-rank gradient)."""
    return float(RankInfo.current().world)


def full_norm(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s total norm as a number (a DTensor on a sharded model)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


# ----------------------------------------------------------------------- host memory and back


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move every tensor of the optimizer's state to ``device``; returns the bytes moved."""
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device) and key != "step":
                state[key] = value.to(device, non_blocking=True)
                moved += value.numel() * value.element_size()
    return moved


def move_grads(params: Iterable[torch.nn.Parameter], device: torch.device | str) -> int:
    moved = 0
    for p in params:
        if p.grad is not None and p.grad.device != torch.device(device):
            moved += p.grad.numel() * p.grad.element_size()
            p.grad = p.grad.to(device, non_blocking=True)
    return moved


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------ checkpoints


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimizer's sharded state dicts (DTensors: each rank holds its shard)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def load_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | os.PathLike[str]) -> None:
    """Load a sharded checkpoint into this rank's shards (DCP reshards when the group's size
    differs from the one that saved it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls it; rank 0 gets the whole fp32 weights on CPU, the others ``{}``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def shard_sizes(folder: str | os.PathLike[str]) -> dict[str, int]:
    """The size of every file DCP wrote in ``folder`` (the marker and temp files excluded). Sizes,
    not digests: hashing every shard of a 35 B model at every step would cost more than the save."""
    return {path.name: path.stat().st_size for path in sorted(Path(folder).iterdir())
            if path.name != COMMIT_MARKER and not path.name.startswith(".tidal")}


def write_marker(folder: str | os.PathLike[str], info: Mapping[str, Any]) -> Path:
    """Write the commit marker atomically: the checkpoint is complete from here on."""
    from cluster.checkpoint_file import write_atomically

    body = json.dumps(dict(info), indent=1, sort_keys=True).encode()
    return write_atomically(Path(folder) / COMMIT_MARKER, lambda fh: fh.write(body))


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The commit marker at ``path`` (the marker file or its folder); ``FileNotFoundError`` when the
    checkpoint is incomplete, ``ValueError`` when it is not ours."""
    path = Path(path)
    if path.is_dir():
        path = path / COMMIT_MARKER
    info = json.loads(path.read_text())
    if info.get("format") != SHARDED_FORMAT:
        raise ValueError(f"{path}: not a {SHARDED_FORMAT} commit marker")
    return info


_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # any of DCP's own metadata classes
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}
"""What DCP's ``.metadata`` pickle may name: its index classes, torch's sizes, dtypes and layouts,
paths. DCP reads that file with a plain ``pickle.load``; Tidal checks it first (as it loads
single-file checkpoints with ``weights_only=True``), so a planted file cannot run code."""


def check_metadata(folder: str | os.PathLike[str]) -> None:
    """Raise ``pickle.UnpicklingError`` (one line, naming the global) when the DCP metadata in
    ``folder`` names anything outside ``_METADATA_GLOBALS`` (nothing of it is run)."""
    import pickle

    class _Allowlisted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            allowed = _METADATA_GLOBALS.get(module, ())
            value = getattr(torch, name, None) if module == "torch" else None
            torch_value = name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
            if not ((module == "torch" and torch_value) or (module in _METADATA_GLOBALS and (allowed is None or name in allowed))):
                raise pickle.UnpicklingError(f"{folder}/.metadata names {module}.{name}")
            return super().find_class(module, name)

    with open(Path(folder) / ".metadata", "rb") as fh:
        _Allowlisted(fh).load()


def verify_shards(folder: str | os.PathLike[str], marker: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first file that is missing or whose size differs from what
    the commit marker recorded."""
    got = shard_sizes(folder)
    want = marker.get("files", {})
    for name, size in want.items():
        if name not in got:
            raise ValueError(f"{folder}: {name} is missing (the commit marker lists it)")
        if got[name] != size:
            raise ValueError(f"{folder}/{name}: {got[name]} bytes, the commit marker recorded {size}")
