"""Trainer throughput on the tiny-cpu shape: torch vs DeepSpeed backends, side by side, one thread.

Measures, per backend: samples/s (a sample = one prompt with its n responses), responses/s,
trained tokens/s, ms per train_step and its phase split, and checkpoint save/load time.

The batch is synthetic but shaped like the preset's micro-step: ``required_samples`` samples of
``n`` responses each, response lengths drawn uniformly from 1..response_length (training cost
depends on shapes only, so no engine is needed).

Usage:
    .venv/bin/python benchmarks/bench_train.py [--config tiny-cpu] [--steps 20] [--threads 1]
        [--repeats 3] [--zero-stages 0,1,2,3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cluster.backends import (  # noqa: E402
    TIMING_KEYS,
    DeepSpeedBackend,
    TorchBackend,
    backend_kwargs,
    deepspeed_available,
)
from cluster.model import TinyLMConfig  # noqa: E402
from cluster.problems import EOS, CharTokenizer, make_problems  # noqa: E402
from cluster.types import Response, Sample  # noqa: E402
from config import load_config  # noqa: E402


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
            info = backend.save_checkpoint(path)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny-cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed windows per backend; the fastest counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--zero-stages", default="0,1,2,3", help="DeepSpeed ZeRO stages to run ('' = none)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    cfg = load_config(args.config)
    torch.set_num_threads(args.threads)
    tokenizer = CharTokenizer()
    problems = make_problems(cfg.task.name, cfg.task.num_prompts, cfg.task.seed)
    model_cfg = TinyLMConfig(
        vocab_size=tokenizer.vocab_size,
        n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head,
        n_embd=cfg.model.n_embd,
        max_seq_len=cfg.model.max_seq_len,
    )
    kwargs = {**backend_kwargs(cfg), "device": "cpu", "threads": args.threads}
    batch = make_batch(cfg, tokenizer, problems)
    t = time.perf_counter()
    torch_backend = TorchBackend(model_cfg, tokenizer, problems, **kwargs)
    init_s = time.perf_counter() - t
    results = [{**bench_backend("torch", torch_backend, batch, args.steps, args.warmup, args.repeats), "init_s": init_s}]
    stages = [int(s) for s in args.zero_stages.split(",") if s.strip()]
    skipped = None
    if stages and not deepspeed_available():
        skipped = "deepspeed not installed"
    for stage in stages if skipped is None else []:
        t = time.perf_counter()
        backend = DeepSpeedBackend(model_cfg, tokenizer, problems, zero_stage=stage, **kwargs)
        init_s = time.perf_counter() - t
        row = bench_backend(f"deepspeed zero-{stage}", backend, batch, args.steps, args.warmup, args.repeats)
        row["init_s"] = init_s
        results.append(row)
        backend.close()

    n_params = sum(p.numel() for p in torch_backend.model.parameters())
    header = (
        f"config {args.config}: {len(batch)} samples x n={cfg.actor_rollout_ref.rollout.n}, "
        f"response_length {cfg.actor_rollout_ref.rollout.response_length}, model {cfg.model.n_layer}L/"
        f"{cfg.model.n_embd}d ({n_params} params), {args.threads} thread(s), best of {args.repeats} x "
        f"{args.steps} steps, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cpus"
    )
    print(header)
    if skipped:
        print(f"DeepSpeed skipped: {skipped}")
    print()
    print(
        "| backend | ms/step | CPU ms/step | samples/s | responses/s | tokens/s | phases ms (reward/old/ref/adv/update) "
        "| ckpt save ms | ckpt load ms | ckpt MB | init s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ph = "/".join(f"{r['phase_ms'].get(k, 0.0):.2f}" for k in TIMING_KEYS)
        print(
            f"| {r['backend']} | {r['ms_per_step']:.1f} | {r['cpu_ms_per_step']:.1f} | {r['samples_per_s']:.1f} | {r['responses_per_s']:.0f} | "
            f"{r['tokens_per_s']:.0f} | {ph} | {r['ckpt_save_ms']:.1f} | {r['ckpt_load_ms']:.1f} | "
            f"{r['ckpt_bytes'] / 1e6:.2f} | {r['init_s']:.2f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
