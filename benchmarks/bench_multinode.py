"""Multi-node Ray on one machine: weight sync across nodes against within one node, and step time.

Owns: a Ray cluster of its own (``cluster.ray_cluster.LocalMultiNodeCluster``: a head, a trainer
node with 2 emulated GPUs, a rollout node with 1, each a raylet with its own object store), ended at
the end, nothing else. Must not: touch any other Ray cluster, or write RESULTS.md (the lead does).

Two placements of the same run, through the real ``DataPlane`` and its placement groups:
``cross-node``: the standalone replica on the rollout node, so every broadcast moves the weights
from the trainer node's object store to the rollout node's; ``one-node``: ``ray.placement.rollout_role
=trainer`` puts the replica on the trainer's node, where the weights never leave its object store.
Each placement: ``--repeats`` timed broadcasts (``ControllerActor.broadcast_sync``, what a step's
broadcast_sync does) per model size, then (unless ``--steps 0``) a `tidal run` of ``--steps``
steps attached to the cluster, whose step wall times come from its store.

Usage:
    .venv/bin/python benchmarks/bench_multinode.py [--sizes tiny,100x] [--repeats 20] [--warmup 3]
        [--steps 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.ray_cluster import LocalMultiNodeCluster, NodeSpec  # noqa: E402
from config import load_config  # noqa: E402

ROLE = "tidal.io/role"
SIZES = {"tiny": [], "100x": ["model.n_layer=8", "model.n_head=8", "model.n_embd=320"]}
"""Model sizes by overrides of tiny-cpu (100x: ~100 times the tiny LM's parameters)."""
PLACEMENTS = {"cross-node": [], "one-node": ["ray.placement.rollout_role=trainer"]}
BASE = ["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.n_gpus_per_node=1"]


def stats(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def broadcast_times(address: str, overrides: list[str], repeats: int, warmup: int) -> dict:
    """Build the run's actors where ``overrides`` place them; time ``repeats`` broadcasts."""
    import ray

    from cluster.actors import replica_name
    from cluster.builders import DataPlane

    cfg = load_config("tiny-cpu", [f"ray.address={address}", *overrides])
    namespace = f"bench-mn-{uuid.uuid4().hex[:6]}"
    plane = DataPlane.build(cfg, namespace)
    try:
        nodes = {a["Name"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                 if a["State"] == "ALIVE" and a["Name"] in ("trainer", replica_name("standalone-0"))}
        total, load = [], []
        for version in range(warmup + repeats):
            report = ray.get(plane.controller.broadcast_sync.remote(version, False))
            if version >= warmup:
                total.append(report.broadcast_s)
                load.append(report.max_replica_load_s)
        params = sum(v.numel() for v in ray.get(plane.trainer.weights.remote()).values())
        return {"params": params, "broadcast": stats(total), "replica_load": stats(load),
                "same_node": nodes["trainer"] == nodes[replica_name("standalone-0")]}
    finally:
        plane.shutdown()


def step_times(address: str, overrides: list[str], steps: int, work: Path) -> dict:
    """A `tidal run` of ``steps`` steps attached to the cluster; the step wall times from its store."""
    from storage import make_engine, run_summaries, session_scope
    from storage.store import read_step_metrics

    url = f"sqlite:///{work}/bench.db"
    args = ["run", "tiny-cpu", *(a for o in [f"storage.url={url}", f"trainer.default_local_dir={work}/runs",
                                             f"ray.address={address}", f"trainer.total_training_steps={steps}",
                                             *overrides] for a in ("--set", o))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    t0 = time.perf_counter()
    cli = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"]
    proc = subprocess.run([*cli, *args], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"tidal run exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    engine = make_engine(url)
    with session_scope(engine) as s:
        (summary,) = run_summaries(s)
        rows = read_step_metrics(s, summary.uid)
    engine.dispose()
    walls = [r["wall_s"] for r in rows]
    syncs = [r["timing_s/param_sync"] for r in rows]
    return {"steps": len(rows), "step_wall": stats(walls[1:] or walls), "param_sync": stats(syncs),
            "run_s": time.perf_counter() - t0}


def table(res: dict) -> str:
    out = ["| placement | model (params) | broadcast median (min–max) | replica load median | same node |",
           "|---|---|---|---|---|"]
    for place, by_size in res["broadcast"].items():
        for size, r in by_size.items():
            b, load = r["broadcast"], r["replica_load"]
            out.append(f"| {place} | {size} ({r['params']:,}) | {b['median_s'] * 1e3:.1f} ms "
                       f"({b['min_s'] * 1e3:.1f}–{b['max_s'] * 1e3:.1f}) | {load['median_s'] * 1e3:.1f} ms | "
                       f"{r['same_node']} |")
    if res["steps"]:
        out += ["", "| placement | steps | step wall median (min–max), first step excluded | param_sync median |",
                "|---|---|---|---|"]
        for place, r in res["steps"].items():
            w = r["step_wall"]
            out.append(f"| {place} | {r['steps']} | {w['median_s']:.2f} s ({w['min_s']:.2f}–{w['max_s']:.2f}) | "
                       f"{r['param_sync']['median_s'] * 1e3:.1f} ms |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,100x", help=f"model sizes among {', '.join(SIZES)}")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps of the `tidal run` per placement (0 = none)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.repeats < 1 or args.warmup < 0 or args.steps < 0:
        print(f"bench_multinode: error: bad --sizes {unknown} / --repeats / --warmup / --steps", file=sys.stderr)
        return 2
    import ray

    cluster = LocalMultiNodeCluster(NodeSpec(gpus=0, num_cpus=2, memory_gb=2.0),
                                    [NodeSpec(gpus=2, labels={ROLE: "trainer"}, memory_gb=2.0),
                                     NodeSpec(labels={ROLE: "rollout"})], object_store_mb=300)
    res: dict = {"broadcast": {}, "steps": {}, "load_before": os.getloadavg(),
                 "command": shlex.join([sys.executable, *sys.argv])}
    with cluster, tempfile.TemporaryDirectory(prefix="bench-mn-") as work:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        try:
            for place, extra in PLACEMENTS.items():
                res["broadcast"][place] = {size: broadcast_times(cluster.address, [*BASE, *extra, *SIZES[size]],
                                                                 args.repeats, args.warmup) for size in sizes}
        finally:
            ray.shutdown()  # the runs below are drivers of their own
        for place, extra in PLACEMENTS.items():
            if args.steps:
                folder = Path(work) / place
                folder.mkdir()
                res["steps"][place] = step_times(cluster.address, [*BASE, *extra], args.steps, folder)
    res["load_after"] = os.getloadavg()
    print(table(res))
    print(f"load average before {res['load_before']}, after {res['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
