"""The trainer's checkpoint file: its format, the atomic write, the safe read, the HF export beside it.

Checkpoint file (one file, written atomically: temp file in the same folder → fsync → rename):
a dict of tensors and plain Python values only, so it loads with ``torch.load(weights_only=True)``::

    {"format": "tidal-train/1", "backend": str, "updates": int,
     "model": {name: tensor},                                # full fp32 weights
     "optim": {"hparams": {...}, "state": {name: {"step", "exp_avg", "exp_avg_sq"}}},
     "rng": {"torch": ByteTensor, "python": tuple}, "extra": {...}}

Optimizer state is keyed by parameter name, not by position, so a checkpoint written by the torch
backend loads into the DeepSpeed backend and back.

A backend training a Hugging Face model also writes ``huggingface/`` beside the checkpoint file
(``save_pretrained`` of the model and of its tokenizer), so that with the commit's layout
``<run>/checkpoints/global_step_<N>/actor.pt`` the folder is ``global_step_<N>/huggingface/``.

Importing this module loads no torch (the driver checks and names checkpoints without it); the
functions that write or read tensors import it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import random
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

CHECKPOINT_FORMAT = "tidal-train/1"

HF_DIRNAME = "huggingface"
"""The Hugging Face export folder, a sibling of the checkpoint file."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    sha256: str
    size_bytes: int


class CheckpointError(ValueError):
    """A checkpoint file that is not ours, is corrupt, or does not match the backend."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint whose pickle holds more than tensors and plain values: loading it whole could
    run arbitrary code, so it is refused (``torch.load(weights_only=True)`` stopped at it)."""


def checkpoint_complete(path: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint recorded at ``path`` is whole on disk: a single file appears only by
    an atomic rename, a sharded one's commit marker only once every shard is written."""
    return Path(path).is_file()


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""What a write fails with when the disk (or the user's quota) is full."""


def as_disk_full(exc: BaseException, path: str | os.PathLike[str]) -> OSError | None:
    """A plain ``OSError(ENOSPC, ..., path)`` when ``exc`` or what it was raised from is a full
    disk, else None. ``torch.save`` reports one as ``RuntimeError: ... unexpected pos`` with the
    ``OSError`` only as its context, which a Ray task error does not carry back; this one does."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return OSError(e.errno, os.strerror(e.errno), str(path))
        e = e.__cause__ or e.__context__
    return None


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """``write`` into a temp file beside ``path``, fsync, rename over ``path`` (and fsync the folder):
    a reader sees either the old file or the complete new one, never a partial one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if (full := as_disk_full(exc, target)) is not None:
            raise full from exc
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        pass
    else:
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)
    return target


def write_checkpoint(payload: Mapping[str, Any], path: str | os.PathLike[str]) -> CheckpointInfo:
    """``torch.save`` the checkpoint atomically (``write_atomically``)."""
    import torch

    target = write_atomically(path, lambda fh: torch.save(dict(payload), fh))
    return CheckpointInfo(str(target), sha256_file(target), target.stat().st_size)


def read_checkpoint(path: str | os.PathLike[str], *, expected_sha256: str | None = None) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (no arbitrary pickled objects) and check it."""
    if expected_sha256 is not None:
        got = sha256_file(path)
        if got != expected_sha256:
            raise CheckpointError(f"{path}: sha256 {got} does not match the expected {expected_sha256}")
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a page of advice; its first line names what was refused.
        what = next((line.strip() for line in str(exc).splitlines() if "Unsupported" in line), "")
        what = what.split(" Please", 1)[0]  # drop torch's "allowlist it if you trust it" advice
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the checkpoint holds pickled objects besides tensors and plain values "
            f"(they could run code when loaded; loading uses weights_only=True){': ' + what if what else ''}"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a {CHECKPOINT_FORMAT} checkpoint")
    return payload


def write_hf_folder(model: Any, tokenizer: Any, directory: str | os.PathLike[str]) -> Path:
    """``save_pretrained`` the model (and the tokenizer, when it has ``save_pretrained``) into a
    temp folder beside ``directory``, then swap it in: a reader sees the old export or the whole
    new one."""
    import shutil

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if (full := as_disk_full(exc, target)) is not None:
            raise full from exc
        raise
    return target


def rng_state() -> dict[str, Any]:
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: Mapping[str, Any]) -> None:
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
