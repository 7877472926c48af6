"""Torch rollout engine throughput on the tiny-cpu model shape, one thread by default.

Measures: generated tokens/s with 1, 8 and 32 concurrent requests (continuous batching,
temperature 1, responses of the preset's ``response_length`` with EOS ignored so every request
runs its full budget, prompts from the preset's task), ms per engine step, and the time of
``sleep()``, ``wake_up()`` and ``load_weights()``. Each number is the median of ``--repeats``.

Usage:
    .venv/bin/python benchmarks/bench_engine.py [--config tiny-cpu] [--threads 1]
        [--batches 1,8,32] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cluster.engines.torch_engine import TorchEngine  # noqa: E402
from config import load_config  # noqa: E402
from data.problems import CharTokenizer, make_problems  # noqa: E402
from data.types import GenerationRequest, SamplingSpec  # noqa: E402
from models.model import TinyLM, TinyLMConfig  # noqa: E402


async def timed(call) -> float:
    start = time.perf_counter()
    await call
    return time.perf_counter() - start


async def throughput(engine: TorchEngine, prompts: list[list[int]], batch: int, budget: int, rnd: int) -> dict:
    before = engine.stats()
    spec = SamplingSpec(budget, temperature=1.0, ignore_eos=True)
    requests = [GenerationRequest(f"b{batch}-{rnd}-{i}", prompts[i % len(prompts)], spec) for i in range(batch)]
    wall = await timed(asyncio.gather(*(engine.generate(r) for r in requests)))
    after = engine.stats()
    tokens = after["generated_tokens"] - before["generated_tokens"]
    steps = after["decode_steps"] - before["decode_steps"] + 1  # + the prefill step
    busy = after["busy_s"] - before["busy_s"]
    return {"tokens_per_s": tokens / wall, "ms_per_step": 1e3 * wall / steps, "busy_share": busy / wall}


async def main(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config)
    tokenizer = CharTokenizer()
    m = cfg.model
    model_cfg = TinyLMConfig(tokenizer.vocab_size, m.n_layer, m.n_head, m.n_embd, m.max_seq_len)
    batches = [int(b) for b in args.batches.split(",")]
    budget = cfg.actor_rollout_ref.rollout.response_length
    prompts = [tokenizer.encode(p.prompt) for p in make_problems(cfg.task.name, 64, seed=0)]

    engine = TorchEngine(model_cfg, max_batch=max(batches), threads=args.threads, eos_id=tokenizer.eos_id)
    torch.manual_seed(0)
    state = TinyLM(model_cfg).state_dict()
    await engine.load_weights(state, 0)
    await throughput(engine, prompts, max(batches), budget, rnd=-1)  # warm-up

    rows = []
    for batch in batches:
        runs = [await throughput(engine, prompts, batch, budget, rnd) for rnd in range(args.repeats)]
        rows.append({"batch": batch, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})

    sleeps, wakes, loads = [], [], []
    for version in range(1, args.repeats + 1):
        sleeps.append(await timed(engine.sleep()))
        wakes.append(await timed(engine.wake_up()))
        loads.append(await timed(engine.load_weights(state, version)))
    await engine.shutdown()
    return {
        "config": args.config,
        "model": {**m.model_dump(), "vocab": tokenizer.vocab_size},
        "params": sum(t.numel() for t in state.values()),
        "threads": args.threads,
        "response_tokens": budget,
        "throughput": rows,
        "sleep_ms": 1e3 * statistics.median(sleeps),
        "wake_up_ms": 1e3 * statistics.median(wakes),
        "load_weights_ms": 1e3 * statistics.median(loads),
        "kv_cache_bytes": engine.cfg.n_layer * 2 * 4 * max(batches) * m.n_head * m.max_seq_len * (m.n_embd // m.n_head),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
    }


def report(result: dict) -> str:
    lines = [
        f"model {result['model']} ({result['params']:,} params), {result['threads']} thread(s), "
        f"{result['response_tokens']} tokens per response, {result['machine']}",
        "",
        "| concurrent requests | tokens/s | ms per engine step | share of wall inside steps |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["throughput"]:
        lines.append(f"| {row['batch']} | {row['tokens_per_s']:,.0f} | {row['ms_per_step']:.2f} | {row['busy_share']:.0%} |")
    lines += [
        "",
        f"sleep {result['sleep_ms']:.2f} ms · wake_up {result['wake_up_ms']:.2f} ms · "
        f"load_weights {result['load_weights_ms']:.2f} ms (KV cache of {max(r['batch'] for r in result['throughput'])} slots: "
        f"{result['kv_cache_bytes'] / 2**20:.1f} MiB)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
