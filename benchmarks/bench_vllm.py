"""vLLM engine next to the torch engine on the same TinyLM shape and weights, one process at a time.

Measures, per engine: start-up (construct until ready), generated tokens/s with 1, 8 and 32
concurrent requests (temperature 1, EOS ignored so each response runs its full
``response_length``, prompts from the preset's task; median of ``--repeats``), and the median
time of ``load_weights``, ``sleep`` and ``wake_up``. vLLM on CPU needs ``n_embd / n_head >= 32``,
so the model defaults to the preset with ``model.n_head=2`` for *both* engines.

Usage (the vLLM venv has both engines; docs/engines.md):
    .venv-vllm/bin/python benchmarks/bench_vllm.py [--config tiny-cpu] [--set model.n_head=2]
        [--engines torch,vllm] [--batches 1,8,32] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def timed(call) -> float:
    start = time.perf_counter()
    await call
    return time.perf_counter() - start


async def bench(kind: str, args: argparse.Namespace) -> dict:
    import torch

    from config import load_config
    from data.problems import CharTokenizer, make_problems
    from data.types import GenerationRequest, SamplingSpec
    from models.model import TinyLM, TinyLMConfig

    cfg = load_config(args.config, args.set)
    tok = CharTokenizer()
    m = cfg.model
    model_cfg = TinyLMConfig(tok.vocab_size, m.n_layer, m.n_head, m.n_embd, m.max_seq_len)
    batches = [int(b) for b in args.batches.split(",")]
    budget = cfg.actor_rollout_ref.rollout.response_length
    prompts = [tok.encode(p.prompt) for p in make_problems(cfg.task.name, 64, seed=0)]
    torch.manual_seed(0)
    state = TinyLM(model_cfg).state_dict()

    t0 = time.perf_counter()
    if kind == "torch":
        from cluster.engines.torch_engine import TorchEngine

        engine = TorchEngine(model_cfg, max_batch=max(batches), threads=args.threads, eos_id=tok.eos_id)
    else:
        from cluster.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_cfg, max_batch=max(batches), threads=args.threads, eos_id=tok.eos_id)
    start_s = time.perf_counter() - t0
    try:
        await engine.load_weights(state, 0)

        async def throughput(batch: int, rnd: int) -> float:
            spec = SamplingSpec(budget, temperature=1.0, ignore_eos=True)
            reqs = [GenerationRequest(f"b{batch}-{rnd}-{i}", prompts[i % len(prompts)], spec) for i in range(batch)]
            before = engine.stats()["generated_tokens"]
            wall = await timed(asyncio.gather(*(engine.generate(r) for r in reqs)))
            return (engine.stats()["generated_tokens"] - before) / wall

        await throughput(max(batches), -1)  # warm-up
        rows = [{"batch": b, "tokens_per_s": statistics.median([await throughput(b, r) for r in range(args.repeats)])}
                for b in batches]
        sleeps, wakes, loads = [], [], []
        for version in range(1, args.repeats + 1):
            loads.append(await timed(engine.load_weights(state, version)))
        for version in range(args.repeats):
            sleeps.append(await timed(engine.sleep()))
            wakes.append(await timed(engine.wake_up()))
            await engine.load_weights(state, 100 + version)
    finally:
        t0 = time.perf_counter()
        await engine.shutdown()
        shutdown_s = time.perf_counter() - t0
    return {
        "engine": kind,
        "model": {**m.model_dump(), "vocab": tok.vocab_size},
        "params": sum(t.numel() for t in state.values()),
        "response_tokens": budget,
        "start_s": start_s,
        "shutdown_s": shutdown_s,
        "throughput": rows,
        "load_weights_ms": 1e3 * statistics.median(loads),
        "sleep_ms": 1e3 * statistics.median(sleeps),
        "wake_up_ms": 1e3 * statistics.median(wakes),
    }


def report(results: list[dict], args: argparse.Namespace) -> str:
    import torch

    first = results[0]
    try:
        import vllm

        vllm_version = f", vllm {vllm.__version__}"
    except ImportError:
        vllm_version = ""
    batches = [row["batch"] for row in first["throughput"]]
    lines = [
        f"model {first['model']} ({first['params']:,} params), {args.threads} thread(s), "
        f"{first['response_tokens']} tokens per response, {platform.machine()}, torch {torch.__version__}{vllm_version}, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "",
        "| engine | start s | " + " | ".join(f"tokens/s @ {b}" for b in batches)
        + " | load_weights ms | sleep ms | wake_up ms | shutdown s |",
        "|---|---:|" + "---:|" * len(batches) + "---:|---:|---:|---:|",
    ]
    for r in results:
        tps = " | ".join(f"{row['tokens_per_s']:,.0f}" for row in r["throughput"])
        lines.append(f"| {r['engine']} | {r['start_s']:.1f} | {tps} | {r['load_weights_ms']:.1f} | "
                     f"{r['sleep_ms']:.2f} | {r['wake_up_ms']:.2f} | {r['shutdown_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--set", action="append", default=None, help="config override (repeatable)")
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.set = args.set if args.set is not None else ["model.n_head=2"]
    results = [asyncio.run(bench(kind, args)) for kind in args.engines.split(",")]
    print(report(results, args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":  # vLLM spawns its processes: this guard is required
    main()
