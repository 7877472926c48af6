"""Trainer throughput on the tiny-cpu shape: torch vs DeepSpeed backends on one thread, and the
torch backend as a rank group (``train_ranks``): 1 rank against 2 FSDP2 ranks over gloo.

Owns: the trainer's own costs on CPU, measured with no engine, no Ray and no store. Must not: start
Ray, or touch a process it did not start.

``backends`` (per backend, one thread): samples/s (a sample = one prompt with its n responses),
responses/s, trained tokens/s, ms per train_step and its phase split, and checkpoint save/load time.

``train_ranks`` (``docs/benchmarks.md``): the torch backend at 1 rank and at 2 ranks (one process
each, started with ``torch.multiprocessing`` ``spawn``, joined in a gloo group through a
``file://`` store, ``torch.set_num_threads(1)`` per rank), the two alternated for ``--rounds``
rounds in this one invocation. Per rank count: the median ms per ``train_step`` (each rank on its
``split`` share of the micro-step; warm-up excluded; a step's time is its slowest rank's), the
checkpoint written synchronously against ``async_save`` (the time until ``save_checkpoint``
returns, what the step waits for, and until ``wait_checkpoint`` returns; 1 rank: one file, 2 ranks:
a DCP shard per rank and rank 0's commit marker), and ``offload()`` / ``reload()`` with what they
return (``{}`` on CPU: the state is in host memory already), the bytes they would move on a GPU
(optimizer state + grads, params apart: each rank's local shards) and, as the CPU stand-in figure,
a host-memory copy of those bytes there and back (``torch.empty_like`` + ``copy_``).

The batch is synthetic but shaped like the preset's micro-step: ``required_samples`` samples of
``n`` responses each, response lengths drawn uniformly from 1..response_length (training cost
depends on shapes only, so no engine is needed). ``--config tiny-hf`` trains the preset's tiny
Qwen2 (built once under ``runs/tiny-hf`` as ``tidal run tiny-hf`` does) on random token ids with
random 0/1 scores.

Usage:
    .venv/bin/python benchmarks/bench_train.py [--config tiny-cpu[,tiny-hf]] [--sections backends,train_ranks]
        [--steps 20] [--threads 1] [--repeats 3] [--zero-stages 0,1,2,3] [--rounds 3] [--rank-steps 20]
        [--ckpt-repeats 5] [--json PATH] [--write benchmarks/RESULTS.md] [--json-out FILE]

``--write PATH`` replaces this script's section of PATH (RESULTS.md) and writes
``benchmarks/results/train_ranks.json`` (``--json-out`` elsewhere); ``run_all.py`` merges it into
``benchmarks/results.json`` as ``train_ranks.*``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cluster.backends import (  # noqa: E402
    TIMING_KEYS,
    DeepSpeedBackend,
    TorchBackend,
    backend_kwargs,
    deepspeed_available,
)
from cluster.backends import distributed as dp  # noqa: E402
from cluster.data_builders import prompt_length, response_length, tokenizer_for  # noqa: E402
from config import load_config  # noqa: E402
from data.problems import EOS, CharTokenizer, make_problems  # noqa: E402
from data.types import Response, Sample  # noqa: E402
from models.model import TinyLMConfig  # noqa: E402

MARK = "bench_train"
"""This script's section of RESULTS.md."""
RANKS = (1, 2)
DEFAULTS = {"config": "tiny-cpu", "sections": "backends,train_ranks", "steps": 20, "warmup": 2, "repeats": 3,
            "threads": 1, "zero_stages": "0,1,2,3", "rounds": 3, "rank_steps": 20, "rank_warmup": 3,
            "ckpt_repeats": 5, "copy_repeats": 5}
OFFLOAD_NOTE = ("offload() and reload() return {} on CPU: nothing moves, the optimizer state, grads and params are "
                "in host memory already. `would_move_bytes` is what they would move on a GPU (optimizer_and_grads by "
                "default, params with param_offload=True), counted from the backend's tensors (each rank's local "
                "shards); `host_copy` is the CPU stand-in: a host-memory copy of those bytes there and back "
                "(torch.empty_like + copy_), not a device transfer.")


def make_batch(cfg, tokenizer: CharTokenizer, problems, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    rollout, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    required = actor.ppo_mini_batch_size * cfg.async_training.require_batches
    samples = []
    for i in range(required):
        p = problems[i % len(problems)]
        prompt = tokenizer.encode(p.prompt)
        responses = []
        for _ in range(rollout.n):
            length = rng.randint(1, rollout.response_length)
            tokens = [rng.randrange(3, tokenizer.vocab_size) for _ in range(length - 1)] + [EOS]
            logprobs = [-rng.uniform(2.0, 5.0) for _ in tokens]
            responses.append(Response(tokens=tokens, logprobs=logprobs, finish_reason="stop"))
        samples.append(Sample(f"e0-p{p.index}", 0, p.index, prompt, responses, started_version=0))
    return samples


def make_hf_batch(cfg, tokenizer, seed: int = 0) -> list[Sample]:
    """The same shape for an HF model: random token ids (no special token but the closing EOS),
    prompts of 4..max_prompt_length tokens, responses of 1..max_response_length, random 0/1 scores."""
    rng = random.Random(seed)
    rollout, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    required = actor.ppo_mini_batch_size * cfg.async_training.require_batches
    eos = tokenizer.eos_token_id
    ids = [i for i in range(len(tokenizer)) if i not in set(tokenizer.all_special_ids)]
    samples = []
    for i in range(required):
        prompt = [rng.choice(ids) for _ in range(rng.randint(4, prompt_length(cfg)))]
        responses = []
        for _ in range(rollout.n):
            length = rng.randint(1, response_length(cfg))
            tokens = [rng.choice(ids) for _ in range(length - 1)] + [eos]
            responses.append(Response(tokens=tokens, logprobs=[-rng.uniform(2.0, 5.0) for _ in tokens],
                                      finish_reason="stop"))
        scores = [float(rng.random() < 0.3) for _ in responses]
        samples.append(Sample(f"e0-p{i}", 0, i, prompt, responses, started_version=0, scores=scores))
    return samples


def load_preset(name: str):
    """The preset's config; the tiny HF presets first get their files, as ``tidal run`` does."""
    from models.hf import TINY_PRESETS, ensure_tiny

    if name in TINY_PRESETS and not Path(name).exists():
        root, heads = TINY_PRESETS[name]
        ensure_tiny(root, n_head=heads)
    return load_config(name)


class Parts:
    """What every backend of a preset is built from: tokenizer, problems, the model (a fresh one per
    backend) and the micro-step's batch."""

    def __init__(self, config: str):
        self.config = config
        self.cfg = cfg = load_preset(config)
        self.tokenizer = tokenizer_for(cfg)
        self.problems = make_problems(cfg.task.name, cfg.task.num_prompts, cfg.task.seed)
        self.hf_path = cfg.actor_rollout_ref.model.path
        if self.hf_path is None:
            self.model_cfg = TinyLMConfig(vocab_size=self.tokenizer.vocab_size, n_layer=cfg.model.n_layer,
                                          n_head=cfg.model.n_head, n_embd=cfg.model.n_embd,
                                          max_seq_len=cfg.model.max_seq_len)
            self.batch = make_batch(cfg, self.tokenizer, self.problems)
        else:
            self.model_cfg = None
            self.batch = make_hf_batch(cfg, self.tokenizer)

    def backend(self, threads: int | None, zero_stage: int | None = None) -> TorchBackend:
        kwargs = {**backend_kwargs(self.cfg), "device": "cpu", "threads": threads}
        if self.hf_path is not None:
            from transformers.utils import logging as hf_logging

            from models.hf import load_model

            hf_logging.disable_progress_bar()  # "Loading weights" on every load is noise here
            kwargs["model"] = load_model(self.hf_path, dtype="float32")
        if zero_stage is None:
            return TorchBackend(self.model_cfg, self.tokenizer, self.problems, **kwargs)
        return DeepSpeedBackend(self.model_cfg, self.tokenizer, self.problems, zero_stage=zero_stage, **kwargs)

    def describe(self, n_params: int) -> str:
        rollout = self.cfg.actor_rollout_ref.rollout
        responses = sum(len(s.responses) for s in self.batch)
        tokens = sum(len(s.prompt_tokens) + len(r.tokens) for s in self.batch for r in s.responses)
        model = (f"model {self.cfg.model.n_layer}L/{self.cfg.model.n_embd}d" if self.hf_path is None
                 else f"HF model {os.path.relpath(self.hf_path)}")
        return (f"config {self.config}: {len(self.batch)} samples x n={rollout.n} ({responses} responses, "
                f"{tokens} tokens), response_length {response_length(self.cfg)}, {model} ({n_params} params)")


# ------------------------------------------------------------------------------ backends


def bench_backend(name: str, backend, batch: list[Sample], steps: int, warmup: int, repeats: int) -> dict:
    """The fastest of ``repeats`` windows of ``steps`` train steps (a shared machine adds noise
    only ever upwards)."""
    for _ in range(warmup):
        backend.train_step(batch)
    best = None
    for _ in range(repeats):
        phases = {k: 0.0 for k in TIMING_KEYS}
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            result = backend.train_step(batch)
            for k, v in result.timing_s.items():
                phases[k] += v
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or wall < best[0]:
            best = (wall, phases, cpu)
    wall, phases, cpu = best
    m = result.metrics
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        saves, loads = [], []
        for _ in range(5):
            t = time.perf_counter()
            info = backend.save_checkpoint(path, export_hf=False)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            backend.load_checkpoint(path)
            loads.append(time.perf_counter() - t)
    return {
        "backend": name,
        "steps": steps,
        "ms_per_step": 1000 * wall / steps,
        "cpu_ms_per_step": 1000 * cpu / steps,
        "samples_per_s": m["samples"] * steps / wall,
        "responses_per_s": m["responses"] * steps / wall,
        "tokens_per_s": m["tokens"] * steps / wall,
        "phase_ms": {k: 1000 * v / steps for k, v in phases.items() if v > 0},
        "ckpt_save_ms": 1000 * statistics.median(saves),
        "ckpt_load_ms": 1000 * statistics.median(loads),
        "ckpt_bytes": info.size_bytes,
    }


def backends(parts: Parts, *, steps: int, warmup: int, repeats: int, threads: int,
             zero_stages: list[int]) -> dict[str, Any]:
    """The torch backend and DeepSpeed at each ZeRO stage, one after the other, in this process."""
    torch.set_num_threads(threads)
    t = time.perf_counter()
    torch_backend = parts.backend(threads)
    init_s = time.perf_counter() - t
    results = [{**bench_backend("torch", torch_backend, parts.batch, steps, warmup, repeats), "init_s": init_s}]
    skipped = None
    if zero_stages and not deepspeed_available():
        skipped = "deepspeed not installed"
    for stage in zero_stages if skipped is None else []:
        name = f"deepspeed zero-{stage}"
        t = time.perf_counter()
        backend = parts.backend(threads, zero_stage=stage)
        init_s = time.perf_counter() - t
        try:
            row = bench_backend(name, backend, parts.batch, steps, warmup, repeats)
        except Exception as exc:  # a row that failed says why; the others still run
            row = {"backend": name, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            backend.close()
        row["init_s"] = init_s
        results.append(row)
    n_params = sum(p.numel() for p in torch_backend.model.parameters())
    torch_backend.close()
    header = (f"{parts.describe(n_params)}, {threads} thread(s), best of {repeats} x {steps} steps, "
              f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cpus")
    return {"header": header, "results": results, "skipped": skipped}


def backends_table(data: dict[str, Any]) -> list[str]:
    lines = [data["header"], ""]
    if data["skipped"]:
        lines += [f"DeepSpeed skipped: {data['skipped']}", ""]
    lines += [
        "| backend | ms/step | CPU ms/step | samples/s | responses/s | tokens/s | phases ms (reward/old/ref/adv/update) "
        "| ckpt save ms | ckpt load ms | ckpt MB | init s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: `{r['error']}` |" + " |" * 9)
            continue
        ph = "/".join(f"{r['phase_ms'].get(k, 0.0):.2f}" for k in TIMING_KEYS)
        lines.append(
            f"| {r['backend']} | {r['ms_per_step']:.1f} | {r['cpu_ms_per_step']:.1f} | {r['samples_per_s']:.1f} | "
            f"{r['responses_per_s']:.0f} | {r['tokens_per_s']:.0f} | {ph} | {r['ckpt_save_ms']:.1f} | "
            f"{r['ckpt_load_ms']:.1f} | {r['ckpt_bytes'] / 1e6:.2f} | {r['init_s']:.2f} |"
        )
    return lines


# ---------------------------------------------------------------------------- train_ranks


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is its own)."""
    local = getattr(t, "to_local", None)
    return local() if local is not None else t


def state_tensors(backend: TorchBackend) -> dict[str, list[torch.Tensor]]:
    """This rank's tensors ``offload`` would move on a GPU, as ``cluster.backends.distributed``'s
    moves count them: AdamW's state but its step counts, the grads that exist, the params."""
    optim = [_local(v) for state in backend.optimizer.state.values() for k, v in state.items()
             if isinstance(v, torch.Tensor) and k != "step"]
    grads = [_local(p.grad) for p in backend.model.parameters() if p.grad is not None]
    params = [_local(p.detach()) for p in backend.model.parameters()]
    return {"optimizer": optim, "grads": grads, "params": params}


@torch.no_grad()
def host_copy(tensors: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """The CPU stand-in for a move to host memory and back: ``empty_like`` + ``copy_`` of every
    tensor out, then ``copy_`` back in place; the median of ``repeats`` round trips."""
    out_s, back_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copies = [torch.empty_like(t).copy_(t) for t in tensors]
        out_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t, c in zip(tensors, copies):
            t.copy_(c)
        back_s.append(time.perf_counter() - t0)
        del copies
    return {"out_ms": 1000 * statistics.median(out_s), "back_ms": 1000 * statistics.median(back_s)}


def _sync() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def measure_rank(config: str, rank: int, world: int, workdir: str, *, steps: int, warmup: int,
                 ckpt_repeats: int, copy_repeats: int) -> dict[str, Any]:
    """What one rank of ``world`` measures (in a group already joined): its share's step times,
    its checkpoint saves, its offload / reload and its host copies. Every rank runs the same calls."""
    parts = Parts(config)
    share = dp.split(parts.batch, world)[rank]
    t0 = time.perf_counter()
    backend = parts.backend(1)
    out: dict[str, Any] = {"rank": rank, "init_s": time.perf_counter() - t0, "samples": len(share),
                           "params": sum(_local(p).numel() for p in backend.model.parameters())}
    try:
        for _ in range(warmup):
            backend.train_step(share)
        walls, cpus = [], []
        for _ in range(steps):
            _sync()
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = backend.train_step(share).metrics
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        out.update(step_s=walls, step_cpu_s=cpus, tokens=metrics["tokens"], responses=metrics["responses"])

        root = Path(workdir)
        ckpt: dict[str, list[float]] = {"sync_s": [], "async_return_s": [], "async_done_s": []}
        for i in range(ckpt_repeats):
            _sync()
            t0 = time.perf_counter()
            backend.save_checkpoint(root / f"sync-{i}" / "actor.pt", export_hf=False)
            ckpt["sync_s"].append(time.perf_counter() - t0)
        for i in range(ckpt_repeats):
            _sync()
            t0 = time.perf_counter()
            backend.save_checkpoint(root / f"async-{i}" / "actor.pt", export_hf=False, async_save=True)
            ckpt["async_return_s"].append(time.perf_counter() - t0)
            backend.wait_checkpoint()
            ckpt["async_done_s"].append(time.perf_counter() - t0)
        out["ckpt"] = ckpt

        _sync()
        t0 = time.perf_counter()
        offload = backend.offload()
        offload_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reload = backend.reload()
        reload_s = time.perf_counter() - t0
        tensors = state_tensors(backend)
        sizes = {k: dp.tensor_bytes(v) for k, v in tensors.items()}
        _sync()
        out["offload"] = {
            "offload_returned": offload, "reload_returned": reload,
            "offload_call_s": offload_s, "reload_call_s": reload_s,
            "bytes": sizes,
            "host_copy": {"optimizer_and_grads": host_copy(tensors["optimizer"] + tensors["grads"], copy_repeats),
                          "params": host_copy(tensors["params"], copy_repeats)},
        }
        del tensors
        out["trains_after_reload"] = bool(backend.train_step(share).metrics["responses"] > 0)
    finally:
        backend.close()
    return out


def _rank_main(rank: int, world: int, workdir: str, config: str, options: dict[str, int]) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's and DeepSpeed's deprecations
    torch.set_num_threads(1)
    dp.init_group(rank=rank, world=world, master_addr="127.0.0.1", master_port=0, device=torch.device("cpu"),
                  timeout_s=300, init_method=f"file://{workdir}/store")
    try:
        result = measure_rank(config, rank, world, f"{workdir}/ckpt", **options)
        Path(f"{workdir}/rank.{rank}.json").write_text(json.dumps(result))
    except BaseException:
        dp.leave_group()
        raise
    dp.leave_and_exit()


def files_of(path: Path) -> dict[str, int]:
    """Every file a checkpoint wrote (a single file, or a DCP folder's), by name, with its size."""
    if path.is_file():
        return {path.name: path.stat().st_size}
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


def run_ranks(config: str, world: int, **options: int) -> dict[str, Any]:
    """``world`` processes, one rank each (``spawn``; 1 thread each), joined in a gloo group, each
    running ``measure_rank``; returns every rank's figures and the files the first saves wrote."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tidal-bench-train-") as tmp:
        mp.start_processes(_rank_main, args=(world, tmp, config, options), nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(f"{tmp}/rank.{r}.json").read_text()) for r in range(world)]
        target = "actor.pt" if world == 1 else "actor"  # one rank: the file; a group: the DCP folder
        files = {kind: files_of(Path(tmp) / "ckpt" / f"{kind}-0" / target) for kind in ("sync", "async")}
    return {"world": world, "ranks": ranks, "files": files}


def _ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank count's figures over its rounds: a step's (or a save's) time is its slowest rank's;
    medians over every measured step (save) of every round; CPU is summed over the ranks."""
    world = runs[0]["world"]
    steps = [max(col) for run in runs for col in zip(*(r["step_s"] for r in run["ranks"]))]
    cpu = [sum(col) for run in runs for col in zip(*(r["step_cpu_s"] for r in run["ranks"]))]
    ckpt = {k: [max(col) for run in runs for col in zip(*(r["ckpt"][k] for r in run["ranks"]))]
            for k in ("sync_s", "async_return_s", "async_done_s")}
    files = runs[-1]["files"]
    first = runs[-1]["ranks"]
    per_rank = [r["offload"] for r in first]
    kinds = ("optimizer", "grads", "params")
    moved = {k: sum(o["bytes"][k] for o in per_rank) for k in kinds}
    copy = {}
    for group in ("optimizer_and_grads", "params"):
        out_ms = max(o["host_copy"][group]["out_ms"] for o in per_rank)
        back_ms = max(o["host_copy"][group]["back_ms"] for o in per_rank)
        nbytes = moved["optimizer"] + moved["grads"] if group == "optimizer_and_grads" else moved["params"]
        copy[group] = {"bytes": nbytes, "out_ms": out_ms, "back_ms": back_ms,
                       "gb_per_s_out": nbytes / 1e9 / (out_ms / 1000) if out_ms > 0 else None,
                       "gb_per_s_back": nbytes / 1e9 / (back_ms / 1000) if back_ms > 0 else None}
    return {
        "world": world,
        "rounds": len(runs),
        "steps_measured": len(steps),
        "step_ms": 1000 * statistics.median(steps),
        "step_ms_min": 1000 * min(steps),
        "step_ms_max": 1000 * max(steps),
        "cpu_ms_per_step": 1000 * statistics.median(cpu),
        "round_step_ms": [_ms([max(col) for col in zip(*(r["step_s"] for r in run["ranks"]))]) for run in runs],
        "per_rank_step_ms": [_ms([s for run in runs for s in run["ranks"][r]["step_s"]]) for r in range(world)],
        "per_rank_cpu_ms_per_step": [_ms([s for run in runs for s in run["ranks"][r]["step_cpu_s"]])
                                     for r in range(world)],
        "samples_per_rank": [r["samples"] for r in first],
        "tokens": first[0]["tokens"],
        "responses": first[0]["responses"],
        "params_per_rank": [r["params"] for r in first],
        "init_s": max(r["init_s"] for run in runs for r in run["ranks"]),
        "ckpt": {
            "sync_ms": _ms(ckpt["sync_s"]),
            "async_return_ms": _ms(ckpt["async_return_s"]),
            "async_done_ms": _ms(ckpt["async_done_s"]),
            "saves_measured": len(ckpt["sync_s"]),
            "bytes_written": sum(files["sync"].values()),
            "async_bytes_written": sum(files["async"].values()),
            "files": files["sync"],
            "async_files": files["async"],
        },
        "offload": {
            "offload_returned": [o["offload_returned"] for o in per_rank],
            "reload_returned": [o["reload_returned"] for o in per_rank],
            "offload_call_ms": max(1000 * o["offload_call_s"] for o in per_rank),
            "reload_call_ms": max(1000 * o["reload_call_s"] for o in per_rank),
            "would_move_bytes": {"optimizer_and_grads": moved["optimizer"] + moved["grads"], **moved},
            "would_move_bytes_per_rank": [o["bytes"] for o in per_rank],
            "host_copy": copy,
        },
        "trains_after_reload": all(r["trains_after_reload"] for r in first),
    }


def train_ranks(config: str = "tiny-cpu", *, ranks: tuple[int, ...] = RANKS, rounds: int = 3, steps: int = 20,
                warmup: int = 3, ckpt_repeats: int = 5, copy_repeats: int = 5, log=print) -> dict[str, Any]:
    """Every rank count of ``ranks`` measured ``rounds`` times, alternated (1, 2, 1, 2, …: a drift
    in the machine's load falls on both alike); the figures by rank count and the headline keys."""
    options = dict(steps=steps, warmup=warmup, ckpt_repeats=ckpt_repeats, copy_repeats=copy_repeats)
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in ranks}
    for k in range(rounds):
        for world in ranks:
            t0 = time.perf_counter()
            runs[world].append(run_ranks(config, world, **options))
            step = statistics.median(max(c) for c in zip(*(r["step_s"] for r in runs[world][-1]["ranks"])))
            log(f"round {k + 1}, {world} rank(s): {1000 * step:.1f} ms/step ({time.perf_counter() - t0:.1f} s)")
    by = {str(w): combine(runs[w]) for w in ranks}
    out: dict[str, Any] = {"config": config, "rounds": rounds, "steps": steps, "warmup": warmup,
                           "ckpt_repeats": ckpt_repeats, "copy_repeats": copy_repeats, "by_ranks": by,
                           "offload_note": OFFLOAD_NOTE}
    for w in ranks:
        b, tag = by[str(w)], f"{w}_rank" if w == 1 else f"{w}_ranks"
        out.update({
            f"step_ms_{tag}": b["step_ms"],
            f"cpu_ms_per_step_{tag}": b["cpu_ms_per_step"],
            f"ckpt_sync_ms_{tag}": b["ckpt"]["sync_ms"],
            f"ckpt_async_return_ms_{tag}": b["ckpt"]["async_return_ms"],
            f"ckpt_async_done_ms_{tag}": b["ckpt"]["async_done_ms"],
            f"ckpt_bytes_{tag}": b["ckpt"]["bytes_written"],
            f"offload_returned_{tag}": b["offload"]["offload_returned"][0],
            f"offload_would_move_bytes_{tag}": b["offload"]["would_move_bytes"]["optimizer_and_grads"],
            f"host_copy_round_trip_ms_{tag}": (b["offload"]["host_copy"]["optimizer_and_grads"]["out_ms"]
                                              + b["offload"]["host_copy"]["optimizer_and_grads"]["back_ms"]),
        })
    if 1 in ranks and 2 in ranks:
        one, two = by["1"]["step_ms"], by["2"]["step_ms"]
        out["step_ratio_2_over_1"] = two / one
        out["step_overhead_ms_2_ranks"] = two - one / 2  # beyond a perfect halving of the compute
    return out


def train_ranks_lines(data: dict[str, Any]) -> list[str]:
    """The markdown table of one preset's ``train_ranks`` figures, a column per rank count."""
    by = data["by_ranks"]
    worlds = sorted(by, key=int)

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(by[w]) for w in worlds) + " |"

    def numbers(xs: list[float], fmt: str = ".1f") -> str:
        return ", ".join(format(x, fmt) for x in xs)

    def mb(x: float) -> str:
        return f"{x / 1e6:.3f}"

    def copy(group: str):
        return lambda b: "{out_ms:.2f} / {back_ms:.2f}".format(**b["offload"]["host_copy"][group])

    return [
        "| figure | " + " | ".join(f"{w} rank{'s' if w != '1' else ''}" for w in worlds) + " |",
        "|---|" + "---:|" * len(worlds),
        row("samples per rank (of the micro-step)", lambda b: numbers(b["samples_per_rank"], "d")),
        row("params per rank (local shard)", lambda b: numbers(b["params_per_rank"], ",")),
        row("**train_step ms** (median; min–max)",
            lambda b: f"**{b['step_ms']:.1f}** ({b['step_ms_min']:.1f}–{b['step_ms_max']:.1f})"),
        row("per-round median ms", lambda b: numbers(b["round_step_ms"])),
        row("per-rank median ms", lambda b: numbers(b["per_rank_step_ms"])),
        row("CPU ms per step, all ranks (per rank)",
            lambda b: f"{b['cpu_ms_per_step']:.1f} ({numbers(b['per_rank_cpu_ms_per_step'])})"),
        row("checkpoint: synchronous save ms", lambda b: f"{b['ckpt']['sync_ms']:.1f}"),
        row("checkpoint: async_save returns after ms", lambda b: f"{b['ckpt']['async_return_ms']:.1f}"),
        row("checkpoint: async written (wait_checkpoint) ms", lambda b: f"{b['ckpt']['async_done_ms']:.1f}"),
        row("checkpoint MB written (sync / async)",
            lambda b: f"{mb(b['ckpt']['bytes_written'])} / {mb(b['ckpt']['async_bytes_written'])}"),
        row("checkpoint files", lambda b: ", ".join(f"`{n}`" for n in b["ckpt"]["files"])),
        row("offload() / reload() returned", lambda b: f"`{json.dumps(b['offload']['offload_returned'][0])}` / "
                                                       f"`{json.dumps(b['offload']['reload_returned'][0])}`"),
        row("offload() + reload() call ms",
            lambda b: f"{b['offload']['offload_call_ms']:.3f} + {b['offload']['reload_call_ms']:.3f}"),
        row("would move MB: optimizer state / grads / params",
            lambda b: " / ".join(mb(b["offload"]["would_move_bytes"][k]) for k in ("optimizer", "grads", "params"))),
        row("host copy (CPU stand-in) ms out / back: optimizer + grads", copy("optimizer_and_grads")),
        row("host copy (CPU stand-in) ms out / back: params", copy("params")),
        *(["", f"2 ranks / 1 rank step time: **{data['step_ratio_2_over_1']:.2f}×** "
               f"({data['step_overhead_ms_2_ranks']:+.1f} ms per step beyond half the 1-rank step)."]
          if "step_ratio_2_over_1" in data else []),
    ]


# ---------------------------------------------------------------------------------- output


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, without the defaults (and with the output options)."""
    parts = ["python benchmarks/bench_train.py"]
    for key, default in DEFAULTS.items():
        value = getattr(args, key)
        if value != default:
            parts.append(f"--{key.replace('_', '-')} {shlex.quote(str(value))}")
    if args.write:
        parts.append(f"--write {args.write}")
    return " ".join(parts)


def markdown(command: str, backend_data: dict[str, dict[str, Any]], ranks: dict[str, dict[str, Any]],
             load: tuple[float, float]) -> str:
    lines = [
        "## The trainer on CPU: torch vs DeepSpeed, and 1 rank vs 2 FSDP2 ranks (`bench_train.py`)", "",
        f"Command: `.venv/bin/{command}` ({time.strftime('%Y-%m-%d')}; "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after; torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs).", "",
    ]
    for config, data in backend_data.items():
        lines += [f"### torch vs DeepSpeed ({config}), one process", "", *backends_table(data), ""]
        if any("error" in r for r in data["results"]):
            lines += ["A failed row: that backend raised in this benchmark (warm-up and timed steps, then five "
                      "saves and loads of its checkpoint); the error is the one it raised.", ""]
    for config, data in ranks.items():
        lines += [f"### `train_ranks` ({config}): 1 rank vs 2 ranks (FSDP2 over gloo), checkpoints, offload", "",
                  *train_ranks_lines(data), ""]
    if ranks:
        data = next(iter(ranks.values()))
        lines += [
            f"How: each rank a process of its own (`spawn`, one thread), the rank counts alternated for "
            f"{data['rounds']} rounds; {data['steps']} timed `train_step`s per round after {data['warmup']} warm-up "
            "ones (a step's time is its slowest rank's; each rank trains its `split` share of the same micro-step); "
            f"{data['ckpt_repeats']} saves of each kind per round, medians. 1 rank writes one file (`actor.pt`), "
            "2 ranks a DCP folder (a shard per rank, `.metadata`, rank 0's `tidal-commit.json`); the async times "
            "run from the call, `wait_checkpoint` called as soon as it returns. Figures: "
            "`benchmarks/results/train_ranks.json` (`results.json` `train_ranks.*`).", "",
            "What the ratio means here: this machine has 2 cores, so 1 rank computes the whole micro-step on one "
            "core and each of 2 ranks half of it on a core of its own. A perfect split would be 0.50×; what it "
            "costs beyond that is FSDP2's sharding (an all-gather of each layer's parameters in every forward and "
            "backward, a reduce-scatter of the gradients) and the collectives over gloo on one host (the global "
            "token counts, the metrics, the clip norm), not a GPU speed-up: on a GPU the collectives go over "
            "NCCL and each rank's compute is a GPU's. The CPU row is summed over the ranks: what a rank "
            "spends short of its wall time it spends waiting for the other. Other jobs on the machine slow "
            "2 ranks more than 1 (they need both cores at once): read the per-round medians beside the load "
            "average above.", "",
            f"Offload: {OFFLOAD_NOTE} Bytes are summed over the ranks. Grads are 0 bytes: the backend frees them "
            "after each update (`zero_grad(set_to_none=True)`) and `offload()` runs between steps (`gpu_check.py`'s "
            "trainer keeps them, so its optimizer_and_grads includes them). The GPU figures to read this against: "
            "`gpu_check.py --sections offload,checkpoint` (`docs/gpu.md`).", "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DEFAULTS["config"], help="preset(s), comma-separated (tiny-cpu, tiny-hf)")
    ap.add_argument("--sections", default=DEFAULTS["sections"], help="backends, train_ranks, or both")
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    ap.add_argument("--repeats", type=int, default=DEFAULTS["repeats"],
                    help="timed windows per backend; the fastest counts")
    ap.add_argument("--threads", type=int, default=DEFAULTS["threads"])
    ap.add_argument("--zero-stages", default=DEFAULTS["zero_stages"], help="DeepSpeed ZeRO stages to run ('' = none)")
    ap.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="train_ranks: rounds of 1 rank then 2 ranks")
    ap.add_argument("--rank-steps", type=int, default=DEFAULTS["rank_steps"], help="train_ranks: timed steps per round")
    ap.add_argument("--rank-warmup", type=int, default=DEFAULTS["rank_warmup"])
    ap.add_argument("--ckpt-repeats", type=int, default=DEFAULTS["ckpt_repeats"],
                    help="train_ranks: saves of each kind per round")
    ap.add_argument("--copy-repeats", type=int, default=DEFAULTS["copy_repeats"], help="train_ranks: host copies")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument("--write", type=Path, help="replace this script's section of this RESULTS.md and write "
                    "benchmarks/results/train_ranks.json")
    ap.add_argument("--json-out", type=Path, help="with --write: the train_ranks JSON here instead")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    sections = {s for s in args.sections.split(",") if s}
    unknown = sections - {"backends", "train_ranks"}
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}")
    configs = [c for c in args.config.split(",") if c]
    load_before = os.getloadavg()[0]
    backend_data: dict[str, dict[str, Any]] = {}
    ranks: dict[str, dict[str, Any]] = {}
    for config in configs:
        if "backends" in sections:
            stages = [int(s) for s in args.zero_stages.split(",") if s.strip()]
            data = backends(Parts(config), steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                            threads=args.threads, zero_stages=stages)
            backend_data[config] = data
            print("\n".join(backends_table(data)), "", sep="\n", flush=True)
        if "train_ranks" in sections:
            ranks[config] = train_ranks(config, rounds=args.rounds, steps=args.rank_steps, warmup=args.rank_warmup,
                                        ckpt_repeats=args.ckpt_repeats, copy_repeats=args.copy_repeats,
                                        log=lambda line: print(line, flush=True))
            print("\n".join(train_ranks_lines(ranks[config])), "", sep="\n", flush=True)
    command = command_line(args)
    load = (load_before, os.getloadavg()[0])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "backends": backend_data, "train_ranks": ranks},
                                        indent=2) + "\n")
    if args.write:
        from results_io import write_json, write_section

        write_section(MARK, markdown(command, backend_data, ranks, load), args.write, after="multinode")
        if ranks:
            first, *others = configs
            figures = {**ranks[first], "command": command, "load_average": list(load)}
            if others:
                figures["other_configs"] = {c: ranks[c] for c in others}
            print(f"wrote {write_json('train_ranks', figures, args.json_out)}")
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
