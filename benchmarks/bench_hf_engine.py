"""The torch engine serving a Hugging Face model against transformers' own batched ``generate``.

One run, side by side, on the same tiny Qwen2 model built offline (``models.hf.make_tiny_model``,
random weights, 4 layers × 256 hidden by default): at concurrency c, ``--per-slot`` × c requests
(``--requests`` fixes the number instead) whose response budgets are drawn (seeded) from
``[--min-len, --max-len]``, sampled at temperature 1 with EOS ignored so both sides generate
exactly the budgets. The engine keeps c requests in flight (continuous batching: a finished
request's slot is refilled at once); ``generate`` takes the requests c at a time, left-padded, and
runs each batch to its longest budget (static batching). With few requests per slot most of the
engine's run is its ramp-down, when fewer than c are left in flight: 8 per slot keeps that tail
small. Throughput = useful tokens (the sum of the budgets) / the best wall seconds of
``--repeats`` interleaved runs of each side. Target: engine ≥ 2× at 32.

Usage:
    .venv/bin/python benchmarks/bench_hf_engine.py [--concurrency 1,8,32] [--per-slot 8 | --requests N]
        [--layers 4] [--hidden 256] [--min-len 16] [--max-len 128] [--threads 1] [--repeats 3]
        [--json-out PATH] [--write]

``--json-out`` writes the figures (``as_json``) to PATH.

``--write`` replaces the ``hf_engine`` section of ``benchmarks/RESULTS.md`` and writes
``benchmarks/results/hf_engine.json`` (merged into ``results.json`` as ``hf_engine.*``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cluster.engines.hf_runner import HFRunner  # noqa: E402
from cluster.engines.torch_engine import TorchEngine  # noqa: E402
from data.types import GenerationRequest, SamplingSpec  # noqa: E402
from models.hf import load_model, load_tokenizer, make_tiny_model  # noqa: E402

TEXTS = ("what is 12 + 7?", "count to ten", "3 * 4 =", "the answer is", "copy abc", "what is 39 - 21? Let's think")


def workload(tok, count: int, min_len: int, max_len: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, response budget) per request: chat-formatted prompts, seeded budgets."""
    rng = random.Random(seed)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
               for t in TEXTS]
    return [(tok.encode(prompts[i % len(prompts)]), rng.randint(min_len, max_len)) for i in range(count)]


async def engine_run(engine: TorchEngine, work: list[tuple[list[int], int]], concurrency: int, tag: str) -> float:
    """Wall seconds for the engine to finish ``work`` with at most ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: list[int], budget: int) -> int:
        async with gate:
            spec = SamplingSpec(budget, temperature=1.0, seed=i, ignore_eos=True)
            return len((await engine.generate(GenerationRequest(f"{tag}-{i}", prompt, spec))).tokens)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, b) for i, (p, b) in enumerate(work)))
    wall = time.perf_counter() - start
    assert counts == [b for _, b in work], "the engine did not generate the budgets"
    return wall


@torch.inference_mode()
def generate_run(model, tok, work: list[tuple[list[int], int]], concurrency: int) -> float:
    """Wall seconds for ``model.generate`` to serve ``work`` in left-padded batches of ``concurrency``."""
    tok.padding_side = "left"
    start = time.perf_counter()
    for lo in range(0, len(work), concurrency):
        batch = work[lo:lo + concurrency]
        enc = tok.pad({"input_ids": [p for p, _ in batch]}, return_tensors="pt")
        longest = max(b for _, b in batch)
        model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=True, temperature=1.0,
                       top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id)
    return time.perf_counter() - start


async def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-hf-")) / "qwen2", "qwen2", n_layer=args.layers,
                             n_embd=args.hidden, n_head=args.heads, max_seq_len=1024)
    tok, model = load_tokenizer(folder), load_model(folder)
    rows = []
    for c in args.concurrency:
        work = workload(tok, args.requests or args.per_slot * c, args.min_len, args.max_len, seed=0)
        useful = sum(b for _, b in work)
        engine = TorchEngine(HFRunner(load_model(folder)), max_batch=c, threads=None, eos_id=tok.eos_token_id)
        await engine.load_weights(model.state_dict(), 1)
        await engine_run(engine, work[:c], c, "warm")  # first-call costs out of the measurement
        generate_run(model, tok, work[:c], c)
        engine_walls, generate_walls = [], []
        for r in range(args.repeats):  # interleaved, so a busy spell on the machine hits both sides
            engine_walls.append(await engine_run(engine, work, c, f"c{c}-{r}"))
            generate_walls.append(generate_run(model, tok, work, c))
        await engine.shutdown()
        engine_s, generate_s = min(engine_walls), min(generate_walls)
        rows.append({"concurrency": c, "requests": len(work), "useful_tokens": useful,
                     "engine_tok_s": useful / engine_s, "generate_tok_s": useful / generate_s,
                     "speedup": generate_s / engine_s})
        print(f"c={c}: engine {useful / engine_s:,.0f} tok/s, generate {useful / generate_s:,.0f} tok/s "
              f"({generate_s / engine_s:.2f}×; walls {_walls(engine_walls)} vs {_walls(generate_walls)})", flush=True)
    return {
        "model": f"Qwen2 {args.layers} layers × {args.hidden} hidden", "params": sum(p.numel() for p in model.parameters()),
        "requests": args.requests or f"{args.per_slot} per slot", "lengths": [args.min_len, args.max_len],
        "threads": args.threads, "repeats": args.repeats, "machine": f"{platform.machine()}, torch {torch.__version__}", "rows": rows,
    }


def _walls(walls: list[float]) -> str:
    return "/".join(f"{w:.2f}" for w in walls) + " s"


def report(result: dict, command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        f"{result['model']} ({result['params']:,} params, random weights), {result['requests']} requests "
        f"(budgets in {result['lengths']}), temperature 1, EOS ignored, "
        f"{result['threads']} thread(s), best of {result['repeats']} interleaved runs, {result['machine']}",
        "",
        "| concurrent requests | requests (tokens) | torch engine tok/s | transformers `generate` tok/s | engine / generate |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} ({r['useful_tokens']:,}) | {r['engine_tok_s']:,.0f} | {r['generate_tok_s']:,.0f} | {r['speedup']:.2f}× |")
    return "\n".join(lines)


def as_json(result: dict) -> dict:
    """The ``hf_engine.*`` figures: per concurrency c, ``c{c}_engine_tok_s`` / ``_generate_tok_s`` / ``_speedup``."""
    out = {k: result[k] for k in ("model", "params", "requests", "threads", "machine")}
    for r in result["rows"]:
        c = r["concurrency"]
        out.update({f"c{c}_requests": r["requests"], f"c{c}_engine_tok_s": r["engine_tok_s"], f"c{c}_generate_tok_s": r["generate_tok_s"],
                    f"c{c}_speedup": r["speedup"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--per-slot", type=int, default=8, help="requests per concurrent slot (default 8)")
    parser.add_argument("--requests", type=int, default=None, help="a fixed number of requests at every concurrency")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", type=Path, default=None, help="write the figures as JSON to this file")
    parser.add_argument("--write", action="store_true", help="write the RESULTS.md section and results/hf_engine.json")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if (not args.concurrency or min(args.concurrency) < 1 or (args.requests is not None and args.requests < 1)
            or args.per_slot < 1 or args.repeats < 1 or not 1 <= args.min_len <= args.max_len):
        parser.error("need concurrency >= 1, requests >= 1, per-slot >= 1, repeats >= 1 and 1 <= min-len <= max-len")
    if args.json_out is not None and not args.json_out.parent.is_dir():
        parser.error(f"--json-out: no folder {args.json_out.parent}")
    result = asyncio.run(measure(args))
    command = "benchmarks/bench_hf_engine.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(result, command.strip()))
    if args.json_out is not None:
        tmp = args.json_out.with_name(f".{args.json_out.name}.tmp")
        tmp.write_text(json.dumps(as_json(result), indent=2) + "\n", encoding="utf-8")
        tmp.replace(args.json_out)  # whole or not at all
    if args.write:
        from results_io import write_json, write_section

        write_section("hf_engine", "## HF models on the torch engine vs transformers `generate`\n\n" + report(result, command.strip()))
        write_json("hf_engine", as_json(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
