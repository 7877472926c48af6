"""CPU per generated response: the torch engine alone vs the same engine in a ``ReplicaActor`` over Ray.

Both serve the same seeded requests (the `count` task's prompts, 16-token budget, EOS honoured) with
up to ``requests_per_replica`` in flight, as the rollouter keeps them. The engine alone runs in
this process; the actor runs in a local Ray cluster of its own and is called from this process the
way the rollout service used to call it (one ``generate`` call per response) and the way it calls
it now (through ``cluster.actors.RemoteEngine``: a sample's ``n`` responses start together and
travel as one ``generate_batch`` call). Reported: CPU milliseconds per response in the engine
alone, in the actor's process, and in the caller; wall per response.

Usage:
    .venv/bin/python benchmarks/bench_replica_call.py [--preset bench/rollout-bound] [--responses 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config import ConfigError, load_config  # noqa: E402


async def _drive(generate, prompts, n: int, concurrency: int, group: int = 1) -> None:
    """Send ``n`` seeded requests through ``generate`` with up to ``concurrency`` in flight,
    ``group`` at a time starting together with request ids of one sample (``g{k}-r{i}``, as
    ``rollout.rollouter.response_request_id`` makes them)."""
    from data.types import GenerationRequest, SamplingSpec
    from rollout.rollouter import response_request_id

    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < n:
            first, sent = sent, min(n, sent + group)
            await asyncio.gather(*(
                generate(GenerationRequest(response_request_id(f"g{first}", i), prompts[i % len(prompts)], SamplingSpec(16, temperature=1.0, seed=i)))
                for i in range(first + 1, sent + 1)
            ))

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency // group))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench/rollout-bound")
    ap.add_argument("--responses", type=int, default=1024)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.preset)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import psutil
    import ray
    import torch

    from cluster.actors import RemoteEngine, ReplicaActor
    from cluster.builders import engine_factory, model_config, requests_per_replica
    from cluster.ray_cluster import LocalRayCluster
    from data.problems import CharTokenizer, make_problems
    from models.model import TinyLM

    tok = CharTokenizer()
    state = TinyLM(model_config(cfg, tok)).state_dict()
    prompts = [tok.encode(p.prompt) for p in make_problems(cfg.task.name, 256, seed=1)]
    conc, n = requests_per_replica(cfg), args.responses

    torch.set_num_threads(1)
    engine = engine_factory(cfg, tok, hybrid=False, seed=0)()

    async def alone() -> tuple[float, float]:
        await engine.load_weights(state, 0)
        c0, t0 = time.process_time(), time.perf_counter()
        await _drive(engine.generate, prompts, n, conc)
        return time.process_time() - c0, time.perf_counter() - t0

    cpu, wall = asyncio.run(alone())
    print(f"{args.preset}: {n} responses, up to {conc} in flight, 16-token budget")
    print(f"engine alone:          {1e3 * cpu / n:.2f} ms CPU per response, {1e3 * wall / n:.2f} ms wall")

    with LocalRayCluster(num_cpus=2, gpus=2) as head:
        ray.init(address=head.address, log_to_driver=False, configure_logging=False)
        try:
            actor = ReplicaActor.remote("r0", engine_factory(cfg, tok, hybrid=False, seed=0))
            ray.get(actor.load_weights.remote(state, 0))
            proc = psutil.Process(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())))

            async def generate(request):
                return await actor.generate.remote(request)

            def over_ray(generate, group: int) -> tuple[float, float, float]:
                """CPU seconds in the actor and in this process, and wall seconds, for the n responses."""
                a0, c0, t0 = sum(proc.cpu_times()[:2]), time.process_time(), time.perf_counter()
                asyncio.run(_drive(generate, prompts, n, conc, group))
                return sum(proc.cpu_times()[:2]) - a0, time.process_time() - c0, time.perf_counter() - t0

            actor_cpu, caller_cpu, wall = over_ray(generate, 1)
            print(f"ReplicaActor over Ray, one call per response: {1e3 * actor_cpu / n:.2f} ms CPU per "
                  f"response in the actor, {1e3 * caller_cpu / n:.2f} ms in the caller, {1e3 * wall / n:.2f} ms wall")

            remote, group = RemoteEngine("r0", actor, hybrid=False), cfg.actor_rollout_ref.rollout.n
            actor_cpu, caller_cpu, wall = over_ray(remote.generate, group)
            print(f"ReplicaActor over Ray, one call per sample ({group} responses, "
                  f"{remote.calls} calls): {1e3 * actor_cpu / n:.2f} ms CPU per response in the actor, "
                  f"{1e3 * caller_cpu / n:.2f} ms in the caller, {1e3 * wall / n:.2f} ms wall")
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
