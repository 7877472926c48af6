"""Weight sync on CPU: trainer to standalone replicas over Ray or gloo, to a hybrid in-process, sleep / wake.

Owns: a local Ray cluster of its own (stopped at the end, nothing else) and the timings, end to end
from the driver. Must not: touch any other Ray cluster. What each path does: ``docs/benchmarks.md``.

Usage:
    .venv/bin/python benchmarks/bench_weight_sync.py [--sizes tiny,10x,100x] [--replicas 1,2]
        [--repeats 20] [--warmup 3] [--results PATH | --no-results] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402

from cluster.model import TinyLMConfig  # noqa: E402
from cluster.problems import CharTokenizer, make_problems  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from cluster.ray_cluster import LocalRayCluster, _ray_env  # noqa: E402
from config import load_config  # noqa: E402

# name → (n_layer, n_head, n_embd); "tiny" is taken from the preset at run time.
SIZES = {"10x": (4, 4, 160), "100x": (8, 8, 320)}


def model_cfg(size: str, preset) -> TinyLMConfig:
    vocab = CharTokenizer().vocab_size
    m = preset.model
    if size == "tiny":
        return TinyLMConfig(vocab, m.n_layer, m.n_head, m.n_embd, m.max_seq_len)
    n_layer, n_head, n_embd = SIZES[size]
    return TinyLMConfig(vocab, n_layer, n_head, n_embd, m.max_seq_len)


def make_backend(cfg: TinyLMConfig):
    from cluster.backends.torch_backend import TorchBackend

    tok = CharTokenizer()
    return TorchBackend(cfg, tok, make_problems("count", 8, 0), lr=1e-3, threads=1)


def make_engine(cfg: TinyLMConfig, max_batch: int):
    from cluster.engines.torch_engine import TorchEngine

    return TorchEngine(cfg, max_batch=max_batch, threads=1, eos_id=CharTokenizer().eos_id)


def _init_group(port: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


@ray.remote(num_cpus=0)
class SyncTrainer:
    """The trainer side: a real `TorchBackend` (its weights are what gets sent)."""

    def __init__(self, cfg: TinyLMConfig):
        self.backend = make_backend(cfg)

    def weights(self) -> dict[str, torch.Tensor]:  # same as TrainerActor.weights
        return self.backend.state_dict_for_rollout()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.backend.state_dict_for_rollout().values())

    def init_group(self, port: int, world: int) -> None:
        _init_group(port, 0, world)

    def gloo_send(self, bucket: bool) -> float:
        import torch.distributed as dist

        t0 = time.perf_counter()
        state = self.backend.state_dict_for_rollout()
        tensors = [state[k] for k in sorted(state)]
        if bucket:
            dist.broadcast(_flat(tensors), src=0)
        else:
            for t in tensors:
                dist.broadcast(t, src=0)
        return time.perf_counter() - t0

    def close_group(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@ray.remote(num_cpus=0)
class SyncReplica:
    """A standalone replica: a real `TorchEngine` that loads whatever arrives."""

    def __init__(self, cfg: TinyLMConfig, max_batch: int):
        self.engine = make_engine(cfg, max_batch)
        shapes = make_backend(cfg).state_dict_for_rollout()
        self.names = sorted(shapes)
        self.buffers = {k: torch.empty_like(shapes[k]) for k in self.names}
        self.flat = torch.empty(sum(t.numel() for t in self.buffers.values()))

    async def load_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        await self.engine.load_weights(state, version)
        return time.perf_counter() - t0

    def init_group(self, port: int, rank: int, world: int) -> None:
        _init_group(port, rank, world)

    async def gloo_recv(self, bucket: bool, version: int) -> float:
        import torch.distributed as dist

        t0 = time.perf_counter()
        if bucket:
            dist.broadcast(self.flat, src=0)
            offset = 0
            for k in self.names:
                n = self.buffers[k].numel()
                self.buffers[k].copy_(self.flat[offset:offset + n].view_as(self.buffers[k]))
                offset += n
        else:
            for k in self.names:
                dist.broadcast(self.buffers[k], src=0)
        await self.engine.load_weights(self.buffers, version)
        return time.perf_counter() - t0

    def version(self) -> int:
        return self.engine.param_version

    def close_group(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * xs[min(len(xs) - 1, int(0.9 * len(xs)))],
            "min_ms": 1e3 * xs[0], "n": len(xs)}


def bench_standalone(cfg: TinyLMConfig, replicas: int, max_batch: int, repeats: int, warmup: int) -> dict:
    trainer = SyncTrainer.remote(cfg)
    reps = [SyncReplica.remote(cfg, max_batch) for _ in range(replicas)]
    nbytes = ray.get(trainer.nbytes.remote())
    port = free_port()
    ray.get([trainer.init_group.remote(port, replicas + 1),
             *(r.init_group.remote(port, i + 1, replicas + 1) for i, r in enumerate(reps))])
    version = 0
    out: dict[str, dict] = {}
    # Interleave the methods round by round so that load from other jobs hits them alike.
    times: dict[str, list[float]] = {"ray": [], "gloo/tensor": [], "gloo/bucket": []}
    loads: list[float] = []
    for i in range(warmup + repeats):
        for method in times:
            version += 1
            t0 = time.perf_counter()
            if method == "ray":
                ref = trainer.weights.remote()
                per = ray.get([r.load_weights.remote(ref, version) for r in reps])
            else:
                bucket = method == "gloo/bucket"
                per = ray.get([trainer.gloo_send.remote(bucket), *(r.gloo_recv.remote(bucket, version) for r in reps)])
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[method].append(dt)
                if method == "ray":
                    loads.append(max(per))
    assert all(v == version for v in ray.get([r.version.remote() for r in reps]))
    for method, xs in times.items():
        out[method] = stats(xs)
    out["engine_load_in_replica"] = stats(loads)
    ray.get([trainer.close_group.remote(), *(r.close_group.remote() for r in reps)])
    for h in (trainer, *reps):
        ray.kill(h, no_restart=True)
    return {"bytes": nbytes, **out}


def failure_check(cfg: TinyLMConfig, max_batch: int) -> dict[str, str]:
    """Kill one of two replicas, then sync once each way: what does each method do?"""
    trainer = SyncTrainer.remote(cfg)
    reps = [SyncReplica.remote(cfg, max_batch) for _ in range(2)]
    port = free_port()
    ray.get([trainer.init_group.remote(port, 3), *(r.init_group.remote(port, i + 1, 3) for i, r in enumerate(reps))])
    ray.get([trainer.gloo_send.remote(True), *(r.gloo_recv.remote(True, 1) for r in reps)])
    ray.kill(reps[1], no_restart=True)
    time.sleep(1.0)

    def outcome(ref) -> str:
        try:
            ray.get(ref, timeout=60)
            return "ok"
        except ray.exceptions.GetTimeoutError:
            return "hung (> 60 s)"
        except Exception as exc:  # noqa: BLE001 - we report what happened
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
            last = re.sub(r"\[/[^\]]*\]\s*", "", last)  # gloo's source path
            return f"{type(exc).__name__}: {last[:120]}"

    out = {}
    # Ray first: a gloo receive that hangs blocks the survivor's event loop, and any call after it.
    t0 = time.perf_counter()
    ref = trainer.weights.remote()
    calls = [r.load_weights.remote(ref, 2) for r in reps]
    out["ray: surviving replica"], out["ray: killed replica"] = outcome(calls[0]), outcome(calls[1])
    out["ray: seconds"] = f"{time.perf_counter() - t0:.2f}"
    t0 = time.perf_counter()
    sender, survivor = trainer.gloo_send.remote(True), reps[0].gloo_recv.remote(True, 3)
    out["gloo: trainer"], out["gloo: surviving replica"] = outcome(sender), outcome(survivor)
    out["gloo: seconds"] = f"{time.perf_counter() - t0:.2f}"
    for h in (trainer, reps[0]):
        ray.kill(h, no_restart=True)
    return out


async def bench_in_process(cfg: TinyLMConfig, max_batch: int, repeats: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    backend = make_backend(cfg)
    engine = make_engine(cfg, max_batch)
    hybrid, sleep, wake, wake_load = [], [], [], []
    version = 0
    for i in range(warmup + repeats):
        version += 1
        t0 = time.perf_counter()
        await engine.load_weights(backend.state_dict_for_rollout(), version)
        t1 = time.perf_counter()
        await engine.sleep()
        t2 = time.perf_counter()
        await engine.wake_up()
        t3 = time.perf_counter()
        await engine.load_weights(backend.state_dict_for_rollout(), version)
        t4 = time.perf_counter()
        if i >= warmup:
            hybrid.append(t1 - t0)
            sleep.append(t2 - t1)
            wake.append(t3 - t2)
            wake_load.append(t4 - t2)
    kv = engine.kv_cache_bytes
    await engine.shutdown()
    return {"hybrid_load": stats(hybrid), "sleep": stats(sleep), "wake_up": stats(wake),
            "wake_up+load": stats(wake_load), "kv_cache_bytes": kv}


def params(cfg: TinyLMConfig) -> int:
    return sum(t.numel() for t in make_backend(cfg).state_dict_for_rollout().values())


def fmt_ms(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def markdown(res: dict, args, cmd_line: str, load: tuple[float, float, float]) -> str:
    lines = [
        "",
        "## Weight sync, hybrid load, sleep/wake (`bench_weight_sync.py`)",
        "",
        f"Command: `{cmd_line}`",
        f"Machine: {os.cpu_count()}-core {platform.machine()} CPU VM shared with other jobs (load average "
        f"{load[0]:.1f} at the start), torch {torch.__version__}, Ray {ray.__version__}; one torch thread per "
        f"actor; a local Ray cluster started by the script. Each number is the median (p90 in brackets) of "
        f"{args.repeats} syncs after {args.warmup} warm-up ones, the three methods interleaved round by round, "
        f"timed end to end from the driver (actor calls included) until every replica's engine has loaded "
        f"the new version.",
        "",
        "Trainer → standalone replicas, ms per sync:",
        "",
        "| model | params | MiB | replicas | Ray object store | gloo, per tensor | gloo, one bucket | "
        "engine copy inside the replica |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, r in res["sizes"].items():
        for n, s in r["standalone"].items():
            def cell(k):
                return f"{fmt_ms(s[k]['median_ms'])} ({fmt_ms(s[k]['p90_ms'])})"
            lines.append(f"| {size} ({r['shape']}) | {r['params']:,} | {s['bytes'] / 2**20:.2f} | {n} | "
                         f"{cell('ray')} | {cell('gloo/tensor')} | {cell('gloo/bucket')} | "
                         f"{cell('engine_load_in_replica')} |")
    lines += [
        "",
        "In the trainer's process (hybrid replica) and the engine's memory verbs, ms:",
        "",
        "| model | hybrid load (state_dict_for_rollout + load_weights) | sleep | wake_up | wake_up + load_weights | "
        "KV cache MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for size, r in res["sizes"].items():
        p = r["in_process"]
        lines.append(f"| {size} | {fmt_ms(p['hybrid_load']['median_ms'])} | {fmt_ms(p['sleep']['median_ms'])} | "
                     f"{fmt_ms(p['wake_up']['median_ms'])} | {fmt_ms(p['wake_up+load']['median_ms'])} | "
                     f"{p['kv_cache_bytes'] / 2**20:.1f} |")
    if "failure_check" in res:
        f = res["failure_check"]
        lines += ["", "Failure check (one of two replicas killed, then one sync each way): "
                  + "; ".join(f"{k} → {v}" for k, v in f.items()) + "."]
    lines += ["", res["reading"], ""]
    return "\n".join(lines)


def reading(res: dict) -> str:
    parts = []
    wins = {"ray": 0, "gloo/tensor": 0, "gloo/bucket": 0}
    for size, r in res["sizes"].items():
        for n, s in r["standalone"].items():
            best = min(wins, key=lambda k: s[k]["median_ms"])
            wins[best] += 1
            parts.append(f"{size}×{n}: ray {s['ray']['median_ms']:.1f} / gloo {s['gloo/tensor']['median_ms']:.1f} / "
                         f"bucket {s['gloo/bucket']['median_ms']:.1f} ms")
    res["wins"] = wins
    return "Medians: " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny-cpu", help="preset whose model is the `tiny` size")
    p.add_argument("--sizes", default="tiny,10x,100x")
    p.add_argument("--replicas", default="1,2", help="standalone replica counts to measure")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--no-results", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--no-failure-check", dest="failure_check", action="store_false",
                   help="skip killing a replica to see what each method does then")
    args = p.parse_args(argv)

    preset = load_config(args.config)
    max_batch = preset.async_training.concurrent_samples_per_replica * preset.actor_rollout_ref.rollout.n
    sizes = args.sizes.split(",")
    replica_counts = [int(x) for x in args.replicas.split(",")]
    load = os.getloadavg()
    for k, v in _ray_env().items():
        os.environ.setdefault(k, v)
    cluster = LocalRayCluster(num_cpus=2, gpus=max(replica_counts) + 1, memory_gb=4.0, object_store_memory_gb=0.5)
    cluster.start()
    res: dict = {"sizes": {}, "max_batch": max_batch}
    try:
        ray.init(address=cluster.address, namespace=f"bench-weight-sync-{os.getpid()}", log_to_driver=False,
                 configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        for size in sizes:
            cfg = model_cfg(size, preset)
            shape = f"{cfg.n_layer}×{cfg.n_embd}"
            entry = {"shape": shape, "params": params(cfg), "standalone": {}}
            print(f"[{size}] {shape}, {entry['params']:,} params", flush=True)
            entry["in_process"] = asyncio.run(bench_in_process(cfg, max_batch, args.repeats, args.warmup))
            for n in replica_counts:
                entry["standalone"][n] = bench_standalone(cfg, n, max_batch, args.repeats, args.warmup)
                s = entry["standalone"][n]
                print(f"  {n} replica(s), {s['bytes'] / 2**20:.2f} MiB: "
                      + "  ".join(f"{k} {s[k]['median_ms']:.2f} ms (p90 {s[k]['p90_ms']:.2f})"
                                  for k in ("ray", "gloo/tensor", "gloo/bucket", "engine_load_in_replica")),
                      flush=True)
            ip = entry["in_process"]
            print("  in process: " + "  ".join(f"{k} {ip[k]['median_ms']:.3f} ms"
                                               for k in ("hybrid_load", "sleep", "wake_up", "wake_up+load")),
                  flush=True)
            res["sizes"][size] = entry
        if args.failure_check:
            res["failure_check"] = failure_check(model_cfg(sizes[0], preset), max_batch)
            print("failure check (kill 1 of 2 replicas, then sync):", res["failure_check"], flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
    res["reading"] = reading(res)
    print(res["reading"])
    print("fastest per (size, replicas):", res["wins"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if not args.no_results:
        own = ["benchmarks/bench_weight_sync.py"]
        for flag, default in (("sizes", "tiny,10x,100x"), ("replicas", "1,2"), ("repeats", 20), ("warmup", 3)):
            if getattr(args, flag) != default:
                own += [f"--{flag}", str(getattr(args, flag))]
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(markdown(res, args, ".venv/bin/python " + shlex.join(own), load))
        print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
