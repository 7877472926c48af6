"""Weight sync, trainer → rollout replicas: the object store, the collective and the in-rank path, in one run.

Owns: a Ray cluster of its own (``cluster.ray_cluster.LocalMultiNodeCluster``: node A, the head, and
node B, a worker, each a raylet with its own object store), ended at the end, nothing else; the
timings, end to end from the driver. Must not: touch any other Ray cluster. What each transport
does: ``cluster/weight_sync.py``; what this measures and how to read it: ``docs/benchmarks.md``.

A *trainer* actor holds a transformer-like set of fp32 matrices of N parameters (``--sizes``);
``--replicas`` *replica* actors hold receive targets in the wire dtype (``--dtype``). Per size:

- ``in_rank`` (hybrid): inside the trainer's process, ``weight_sync.copy_into`` from its fp32
  tensors into engine-sized targets of the wire dtype (node A only: a hybrid lives in its trainer rank).
- ``object_store``: the trainer returns its state dict cast to the wire dtype (Ray puts it in node
  A's object store), every replica gets the same ``ObjectRef`` as an argument and copies it into
  its targets (what ``ControllerActor.broadcast_sync`` does).
- ``collective``: the trainer hosts a ``weight_sync.Sender``, the replicas join with a
  ``Receiver`` (group formation, timed apart), then ``send`` and ``receive`` + ``copy_into`` run
  concurrently, bucket by bucket (``--bucket-mb``; also ``--sweep-mb`` at ``--sweep-size``, one node).

The standalone transports run within one node (the replicas on node A) and across two nodes (the
replicas on node B), in rounds: one sync of each per round, the order turned round by round (the
other jobs' load hits them alike); the in-rank path runs first, on its own. Every timed sync starts
from zeroed targets and writes a new version into the first tensor; after each transport's sync of
the last round every receiver's targets are hashed against the trainer's cast tensors (a mismatch
raises ``Mismatch``). Sizes run one after the other; a size's actors are killed before the next.

Usage:
    .venv/bin/python benchmarks/bench_weight_sync.py [--sizes 10m,100m,500m] [--replicas 2]
        [--dtype bfloat16] [--bucket-mb 512] [--sweep-mb 32,128] [--sweep-size 100m] [--repeats 3]
        [--warmup 1] [--threads 1] [--timeout-s 600] [--quick] [--json PATH] [--write benchmarks/RESULTS.md]
        [--json-out FILE]

``--quick``: size 1m, 1 repeat, no warm-up, no sweep (the smoke test). ``--write PATH``
replaces this script's section of PATH (RESULTS.md) and writes ``benchmarks/results/weight_sync.json``
(``--json-out`` elsewhere); ``run_all.py`` merges it into ``benchmarks/results.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import ray  # noqa: E402
import torch  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from cluster import weight_sync as ws  # noqa: E402
from cluster.ray_cluster import LocalMultiNodeCluster, NodeSpec  # noqa: E402

MARK = "weight_sync"
TOPOLOGIES = ("one_node", "two_nodes")
TRANSPORTS = ("object_store", "collective", "in_rank")
DEFAULTS: dict[str, Any] = {"sizes": "10m,100m,500m", "replicas": 2, "dtype": "bfloat16", "bucket_mb": 512,
                            "sweep_mb": "32,128", "sweep_size": "100m", "repeats": 3, "warmup": 1, "threads": 1,
                            "quick": False}
QUICK = {"sizes": "1m", "repeats": 1, "warmup": 0, "sweep_mb": ""}


# ------------------------------------------------------------------------------------------------
# the model


def parse_size(label: str) -> int:
    """``10m`` → 10,000,000 parameters (``k`` and ``m`` suffixes, or a plain count)."""
    label = label.strip().lower()
    scale = {"k": 10**3, "m": 10**6}.get(label[-1:], 1)
    return int(float(label[:-1] if scale > 1 else label) * scale)


def model_shapes(n: int) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer-like list of tensors of exactly ``n`` parameters: an embedding first, then
    layers of q, k, v, o (d × d), up (4d × d) and down (d × 4d) matrices; the width grows with
    ``n``; whatever the layers leave goes to the embedding's rows (and a 1-D tail)."""
    d = 256 if n <= 5 * 10**6 else 512 if n <= 2 * 10**7 else 1024 if n <= 2 * 10**8 else 2048
    layers = n // (12 * d * d)
    rest = n - layers * 12 * d * d
    rows, tail = divmod(rest, d)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    if rows:
        shapes.append(("embed.weight", (rows, d)))
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [(p + "attn.q.weight", (d, d)), (p + "attn.k.weight", (d, d)), (p + "attn.v.weight", (d, d)),
                   (p + "attn.o.weight", (d, d)), (p + "mlp.up.weight", (4 * d, d)),
                   (p + "mlp.down.weight", (d, 4 * d))]
    if tail:
        shapes.append(("norm.weight", (tail,)))
    assert sum(math.prod(s) for _, s in shapes) == n
    return shapes


def digest(tensors) -> str:
    """A hash of the tensors' bytes, in order (contiguous copies, in their own dtype)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _stamp(t: torch.Tensor, version: int) -> None:
    """Write the sync's version into a tensor (exact in bf16: an integer below 256)."""
    with torch.no_grad():
        t.view(-1)[0] = float(version % 251 + 1)


# ------------------------------------------------------------------------------------------------
# the actors (num_cpus=0: the cluster's two cores are shared; one torch thread each by default)


@ray.remote(num_cpus=0)
class Trainer:
    """Rank 0 of the training group as far as the sync is concerned: fp32 weights, the sender."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], threads: int, seed: int = 0):
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(seed)
        self.params = {name: torch.randn(shape, generator=gen) for name, shape in shapes}
        self.first = shapes[0][0]
        self.sender: ws.Sender | None = None
        self.hybrid: dict[str, torch.Tensor] | None = None

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def plan(self, dtype: str, bucket_bytes: int) -> ws.Manifest:
        return ws.plan(ws.named_shapes(self.params), dtype=dtype, bucket_bytes=bucket_bytes)

    def expected(self, dtype: str, version: int) -> str:
        _stamp(self.params[self.first], version)
        wire = ws.torch_dtype(dtype)
        return digest(t.to(wire) for t in self.params.values())

    # object store: the return value goes to this node's object store, the driver hands the ref on
    def wire_state(self, dtype: str, version: int) -> dict[str, torch.Tensor]:
        _stamp(self.params[self.first], version)
        wire = ws.torch_dtype(dtype)
        return {name: t.to(wire) for name, t in self.params.items()}

    # collective
    def host(self) -> int:
        from cluster.ports import free_port

        self.sender = ws.Sender("127.0.0.1", free_port())
        return self.sender.port

    def join(self, spec: ws.GroupSpec) -> float:
        t0 = time.perf_counter()
        self.sender.join(spec)
        return time.perf_counter() - t0

    def send(self, manifest: ws.Manifest, version: int) -> float:
        _stamp(self.params[self.first], version)
        return ws.send(self.sender.group, manifest, self.params.__getitem__).seconds

    def leave(self) -> None:
        if self.sender is not None:
            self.sender.leave()

    # in rank: the hybrid replica this rank hosts, its weights in the wire dtype
    def in_rank(self, dtype: str, version: int) -> float:
        _stamp(self.params[self.first], version)
        if self.hybrid is None:
            wire = ws.torch_dtype(dtype)
            self.hybrid = {name: torch.zeros(t.shape, dtype=wire) for name, t in self.params.items()}
        t0 = time.perf_counter()
        ws.copy_into(self.hybrid, self.params.items())
        return time.perf_counter() - t0

    def reset_hybrid(self) -> None:
        if self.hybrid is not None:
            for t in self.hybrid.values():
                t.zero_()

    def hybrid_digest(self) -> str:
        return digest(self.hybrid.values())

    def drop_hybrid(self) -> None:
        self.hybrid = None


@ray.remote(num_cpus=0)
class Replica:
    """A standalone rollout replica's weights (the engine's own tensors, in the wire dtype)."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], dtype: str, threads: int):
        torch.set_num_threads(threads)
        wire = ws.torch_dtype(dtype)
        self.targets = {name: torch.zeros(shape, dtype=wire) for name, shape in shapes}
        self.receiver = ws.Receiver()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def reset(self) -> None:
        for t in self.targets.values():
            t.zero_()

    def digest(self) -> str:
        return digest(self.targets.values())

    def load(self, state: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        ws.copy_into(self.targets, state.items())
        return time.perf_counter() - t0

    def join(self, spec: ws.GroupSpec, rank: int) -> float:
        t0 = time.perf_counter()
        self.receiver.join(spec, rank)
        return time.perf_counter() - t0

    def receive(self, manifest: ws.Manifest) -> float:
        t0 = time.perf_counter()
        for bucket in ws.receive(self.receiver.group, manifest):
            ws.copy_into(self.targets, bucket)
        return time.perf_counter() - t0

    def leave(self) -> None:
        self.receiver.leave()


# ------------------------------------------------------------------------------------------------
# one size


class Mismatch(AssertionError):
    """A receiver's weights differ from what the trainer sent."""


def on_node(node_id: str) -> dict[str, Any]:
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def median_stats(xs: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "all_s": xs}


class Run:
    """The syncs of one size: a trainer on node A, replicas placed per topology."""

    def __init__(self, args: argparse.Namespace, label: str, nodes: dict[str, str]):
        self.args, self.label, self.nodes = args, label, nodes
        self.n = parse_size(label)
        self.shapes = model_shapes(self.n)
        self.version = 0
        self.generation = 0
        self.trainer = Trainer.options(**on_node(nodes["A"])).remote(self.shapes, args.threads)
        assert ray.get(self.trainer.node.remote()) == nodes["A"]
        self.manifest = ray.get(self.trainer.plan.remote(args.dtype, args.bucket_mb * 2**20))
        self.port = ray.get(self.trainer.host.remote())
        self.replicas: list[Any] = []

    @property
    def wire_bytes(self) -> int:
        return self.manifest.nbytes

    def place(self, topology: str) -> None:
        self.drop_replicas()
        node = self.nodes["A" if topology == "one_node" else "B"]
        self.replicas = [Replica.options(**on_node(node)).remote(self.shapes, self.args.dtype, self.args.threads)
                         for _ in range(self.args.replicas)]
        where = ray.get([r.node.remote() for r in self.replicas])
        assert all(w == node for w in where), (topology, where, node)

    def drop_replicas(self) -> None:
        if self.replicas:
            ray.get([r.leave.remote() for r in self.replicas])
            for r in self.replicas:
                ray.kill(r, no_restart=True)
        self.replicas = []

    def close(self) -> None:
        self.drop_replicas()
        ray.get(self.trainer.leave.remote())
        ray.kill(self.trainer, no_restart=True)

    def form(self) -> float:
        """A new generation of the weight-sync group (every member joins): seconds, from the driver."""
        self.generation += 1
        spec = ws.GroupSpec("127.0.0.1", self.port, len(self.replicas) + 1, self.generation,
                            timeout_s=self.args.timeout_s)
        t0 = time.perf_counter()
        ray.get([self.trainer.join.remote(spec),
                 *(r.join.remote(spec, i + 1) for i, r in enumerate(self.replicas))])
        return time.perf_counter() - t0

    # one sync of each kind: reset the receivers (untimed), then the sync (timed by the caller)

    def reset_replicas(self) -> None:
        ray.get([r.reset.remote() for r in self.replicas])

    def replica_digests(self) -> list[str]:
        return ray.get([r.digest.remote() for r in self.replicas])

    def sync_object_store(self, version: int) -> None:
        ref = self.trainer.wire_state.remote(self.args.dtype, version)
        ray.get([r.load.remote(ref) for r in self.replicas])
        del ref

    def sync_collective(self, manifest_ref, version: int) -> None:
        ray.get([self.trainer.send.remote(manifest_ref, version),
                 *(r.receive.remote(manifest_ref) for r in self.replicas)])

    def sync_in_rank(self, version: int) -> None:
        ray.get(self.trainer.in_rank.remote(self.args.dtype, version))

    def contenders(self, topology: str) -> dict[str, tuple[Any, Any, Any, int]]:
        """name → (sync(version), reset(), digests(), buckets) of what this topology measures."""
        out: dict[str, tuple[Any, Any, Any, int]] = {}
        out["object_store"] = (self.sync_object_store, self.reset_replicas, self.replica_digests, 0)
        manifests = {self.args.bucket_mb: self.manifest}
        if topology == "one_node" and self.label == self.args.sweep_size:
            for mb in [int(x) for x in self.args.sweep_mb.split(",") if x]:
                manifests.setdefault(mb, ray.get(self.trainer.plan.remote(self.args.dtype, mb * 2**20)))
        for mb, manifest in manifests.items():
            name = "collective" if mb == self.args.bucket_mb else f"collective_bucket_{mb}mb"
            ref = ray.put(manifest)
            out[name] = (lambda v, ref=ref: self.sync_collective(ref, v), self.reset_replicas,
                         self.replica_digests, len(manifest.buckets))
        return out

    def in_rank_contender(self) -> dict[str, tuple[Any, Any, Any, int]]:
        return {"in_rank": (self.sync_in_rank, lambda: ray.get(self.trainer.reset_hybrid.remote()),
                            lambda: [ray.get(self.trainer.hybrid_digest.remote())], 0)}

    def measure(self, topology: str, contenders: dict[str, tuple[Any, Any, Any, int]], log) -> dict[str, Any]:
        """``--warmup`` + ``--repeats`` rounds, each one sync of every contender, the order turned
        round by round (so that the other jobs' load hits them alike); every sync into zeroed
        targets; the last round's syncs checked against the trainer's weights."""
        names = list(contenders)
        times: dict[str, list[float]] = {name: [] for name in names}
        rounds = self.args.warmup + self.args.repeats
        for i in range(rounds):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                sync, reset, digests, _ = contenders[name]
                reset()
                self.version += 1
                t0 = time.perf_counter()
                sync(self.version)
                dt = time.perf_counter() - t0
                if i >= self.args.warmup:
                    times[name].append(dt)
                if i == rounds - 1:
                    self.check(name, topology, digests())
        out = {}
        gb = self.wire_bytes / 1e9
        for name in names:
            out[name] = {**median_stats(times[name]), "buckets": contenders[name][3]}
            log(f"[{self.label}] {topology} {name}: {out[name]['median_s']:.3f} s "
                f"({gb / out[name]['median_s']:.2f} GB/s; each: "
                + ", ".join(f"{x:.3f}" for x in times[name]) + ")")
        return out

    def check(self, transport: str, topology: str, got: list[str]) -> None:
        want = ray.get(self.trainer.expected.remote(self.args.dtype, self.version))
        bad = [i for i, g in enumerate(got) if g != want]
        if bad:
            raise Mismatch(f"{self.label} {topology} {transport}: receiver(s) {bad} hold other weights than the "
                           f"trainer sent (version {self.version}: {got} vs {want})")


def bench_size(args: argparse.Namespace, label: str, nodes: dict[str, str], log) -> dict[str, Any]:
    run = Run(args, label, nodes)
    out: dict[str, Any] = {"params": run.n, "tensors": len(run.shapes), "wire_bytes": run.wire_bytes,
                           "buckets": len(run.manifest.buckets), "one_node": {}, "two_nodes": {}}
    try:
        # the hybrid first, on its own: its bf16 copy is dropped before the replicas take memory
        out["one_node"].update(run.measure("one_node", run.in_rank_contender(), log))
        ray.get(run.trainer.drop_hybrid.remote())
        for topology in TOPOLOGIES:
            run.place(topology)
            formation = run.form()
            log(f"[{label}] {topology}: collective group formed in {formation:.3f} s")
            res = out[topology]
            res.update(run.measure(topology, run.contenders(topology), log))
            res["collective_formation_s"] = formation
            sweep = {int(name.split("_")[2][:-2]): res.pop(name) for name in list(res)
                     if name.startswith("collective_bucket_")}
            if sweep:
                res["bucket_sweep"] = sweep
    finally:
        run.close()
    return out


# ------------------------------------------------------------------------------------------------
# figures and the table


def figures(res: dict[str, Any]) -> dict[str, Any]:
    """The flat figures of results.json's ``weight_sync``: per topology, per transport and size,
    seconds (median) and GB/s (wire bytes of one copy of the model / s), the collective's group
    formation, and the collective's speed-up over the object store (> 1: the collective is faster)."""
    out: dict[str, Any] = {t: {} for t in TOPOLOGIES}
    for label, r in res["sizes"].items():
        gb = r["wire_bytes"] / 1e9
        for topology in TOPOLOGIES:
            f, per = out[topology], r[topology]
            for transport in TRANSPORTS:
                if transport in per:
                    s = per[transport]["median_s"]
                    f[f"{transport}_s_{label}"] = round(s, 4)
                    f[f"{transport}_gb_per_s_{label}"] = round(gb / s, 3)
            if "collective_formation_s" in per:
                f[f"collective_formation_s_{label}"] = round(per["collective_formation_s"], 4)
            if "collective" in per and "object_store" in per:
                f[f"speedup_collective_vs_object_store_{label}"] = round(
                    per["object_store"]["median_s"] / per["collective"]["median_s"], 3)
            for mb, sweep in per.get("bucket_sweep", {}).items():
                f[f"collective_s_{label}_bucket_{mb}mb"] = round(sweep["median_s"], 4)
                f[f"collective_gb_per_s_{label}_bucket_{mb}mb"] = round(gb / sweep["median_s"], 3)
    return out


def cell(per: dict[str, Any], transport: str, gb: float) -> str:
    if transport not in per:
        return "n/a"
    r = per[transport]
    s = r["median_s"]
    return f"{s:.3f} s ({r['min_s']:.3f}–{r['max_s']:.3f}) · {gb / s:.2f} GB/s"


def table(res: dict[str, Any]) -> list[str]:
    lines = ["| params | wire MB | topology | object store | collective | in-rank (hybrid) | "
             "collective ÷ object store (speed-up) | group formation |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for label, r in res["sizes"].items():
        gb = r["wire_bytes"] / 1e9
        for topology in TOPOLOGIES:
            per = r[topology]
            speedup = per["object_store"]["median_s"] / per["collective"]["median_s"]
            in_rank = cell(per, "in_rank", gb) if topology == "one_node" else "n/a (a hybrid is in its rank)"
            lines.append(f"| {label.upper()} ({r['params']:,}) | {r['wire_bytes'] / 1e6:,.0f} | "
                         f"{topology.replace('_', ' ')} | {cell(per, 'object_store', gb)} | "
                         f"{cell(per, 'collective', gb)} | {in_rank} | {speedup:.2f}× | "
                         f"{per['collective_formation_s']:.3f} s |")
    return lines


def sweep_lines(res: dict[str, Any], bucket_mb: int) -> list[str]:
    lines = []
    for label, r in res["sizes"].items():
        sweep = r["one_node"].get("bucket_sweep")
        if not sweep:
            continue
        gb = r["wire_bytes"] / 1e9
        rows = {**{int(mb): s for mb, s in sweep.items()}, bucket_mb: r["one_node"]["collective"]}
        lines += [f"Bucket size, collective, one node, {label.upper()} ({r['wire_bytes'] / 1e6:,.0f} MB on the wire):",
                  "", "| bucket MB | buckets | seconds (min–max) | GB/s |", "|---:|---:|---:|---:|"]
        for mb in sorted(rows):
            s = rows[mb]
            lines.append(f"| {mb} | {s['buckets']} | {s['median_s']:.3f} ({s['min_s']:.3f}–{s['max_s']:.3f}) | "
                         f"{gb / s['median_s']:.2f} |")
        lines.append("")
    return lines


def in_rank_sentence(res: dict[str, Any]) -> str:
    ratios = [r["one_node"]["object_store"]["median_s"] / r["one_node"]["in_rank"]["median_s"]
              for r in res["sizes"].values() if "in_rank" in r["one_node"]]
    if not ratios:
        return ""
    return (f"The in-rank path (a cast-and-copy in the trainer's process: no second process, no serialisation, "
            f"no socket) was {min(ratios):.0f}–{max(ratios):.0f}× faster than the object store within one node. ")


def sweep_sentence(res: dict[str, Any]) -> str:
    for label, r in res["sizes"].items():
        sweep = r["one_node"].get("bucket_sweep")
        if sweep:
            rows = {int(mb): s for mb, s in sweep.items()}
            rows[res["settings"]["bucket_mb"]] = r["one_node"]["collective"]
            best = min(rows, key=lambda mb: rows[mb]["median_s"])
            worst = max(rows, key=lambda mb: rows[mb]["median_s"])
            return (f"At {label.upper()}, {best} MB buckets were the fastest ({rows[best]['median_s']:.3f} s) "
                    f"and {worst} MB the slowest ({rows[worst]['median_s']:.3f} s), consistent with a pipeline: "
                    "with several buckets the receivers copy one bucket out while the sender packs the next, "
                    "with one they all wait for the whole (not measured apart; a difference smaller than the min–max "
                    "spread is this machine's noise). ")
    return ""


def markdown(res: dict[str, Any], command: str) -> str:
    a = res["settings"]
    speedups = [r[t]["object_store"]["median_s"] / r[t]["collective"]["median_s"]
                for r in res["sizes"].values() for t in TOPOLOGIES]
    lines = [
        "## Weight sync: the object store, the collective and the in-rank path (`bench_weight_sync.py`)", "",
        f"Command: `.venv/bin/{command}` ({res['date']}; {res['machine']}; load average "
        f"{res['load_average'][0]:.1f} before, {res['load_average'][1]:.1f} after; peak memory of the run's "
        f"processes {res['peak_own_gb']:.1f} GB, of the machine, other jobs' included, {res['peak_used_gb']:.1f} GB "
        f"of {res['total_gb']:.0f}).", "",
        f"A trainer actor with N fp32 parameters (transformer-like matrices, the embedding first) sends them, in "
        f"{a['dtype']}, to {a['replicas']} replica actors that copy them into their own {a['dtype']} tensors; the "
        f"hybrid path copies them inside the trainer's process. Two nodes of a `LocalMultiNodeCluster` (raylets "
        f"with their own object stores, on this machine): *one node* puts the trainer and the replicas on node A, "
        f"*two nodes* the replicas on node B. Each figure is the median of {a['repeats']} syncs after "
        f"{a['warmup']} warm-up one(s) (min–max in brackets), timed end to end from the driver, the object "
        f"store and the collective interleaved round by round (the order turned each round), the in-rank path "
        f"before them, every sync into zeroed targets; "
        f"GB/s = bytes of one copy of the model in {a['dtype']} ÷ seconds (each replica gets its own copy). "
        f"Collective: gloo, buckets of ≤ {a['bucket_mb']} MB; group formation (the first sync of a generation "
        f"joins) timed apart. After each transport's last sync every receiver's weights are hashed against "
        f"the trainer's (they matched). One torch thread per actor.", "",
        *table(res), "",
        *sweep_lines(res, a["bucket_mb"]),
        f"Reading. On this CPU machine the collective's speed-up over the object store ranged "
        f"{min(speedups):.2f}–{max(speedups):.2f}× (medians; see the min–max: on a 2-core machine shared with "
        "other jobs a ratio near 1 can flip from run to run). Both move bytes through host memory on the same "
        "two cores. The object store path pickles the state dict in band (a copy; Ray's zero-copy tensor "
        "serialisation, `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`, is off, as in Tidal) into the trainer node's "
        "plasma store (across nodes node B's object manager copies it over), then each replica unpickles a "
        "copy of its own and loads it; the collective packs buckets (casting while it packs) and broadcasts "
        "them over gloo's TCP loopback into each receiver's bucket buffer. Two \"nodes\" here are two raylets "
        "on one host: across nodes adds the object-store transfer, never a network. "
        f"{in_rank_sentence(res)}{sweep_sentence(res)}"
        "These CPU ratios say little about a GPU cluster, where the figure depends on:", "",
        "- **Bus bandwidth.** On GPU the collective is NCCL: NVLink within a node (hundreds of GB/s of bus "
        "bandwidth), InfiniBand / RoCE across nodes (25–50 GB/s per NIC), device memory to device memory. The "
        "object store path adds a device → host copy, serialisation, the object-store transfer over the hosts' "
        "network, deserialisation and a host → device copy, and holds a full host-RAM copy of the weights per "
        "node; so on GPUs the collective is expected to win by a wide margin, which this CPU run cannot show.",
        "- **Bucket size.** Each bucket is one broadcast: too small and the sync is bound by launch and "
        "round-trip latency; too big and the sender's and each receiver's memory peak grows by a bucket and "
        "packing, sending and loading no longer overlap. verl's default `update_weights_bucket_megabytes` is 512.",
        f"- **dtype.** The wire carries the engine's dtype: bf16 moves half the bytes of fp32 (the trainer casts "
        f"while packing); here {a['dtype']}.", "",
        "Figures: `benchmarks/results/weight_sync.json` (`results.json` `weight_sync.*`: "
        "`<topology>.<transport>_s_<size>`, `…_gb_per_s_<size>`, `collective_formation_s_<size>`, "
        "`speedup_collective_vs_object_store_<size>` = object-store seconds ÷ collective seconds).", "",
    ]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------
# main


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, without the defaults (and with the output options)."""
    parts = ["python benchmarks/bench_weight_sync.py"]
    if args.quick:
        parts.append("--quick")
    for key, default in DEFAULTS.items():
        value = getattr(args, key)
        if key != "quick" and value != default and not (args.quick and QUICK.get(key) == value):
            parts.append(f"--{key.replace('_', '-')} {shlex.quote(str(value))}")
    if args.write:
        parts.append(f"--write {args.write}")
    return " ".join(parts)


def memory_gb() -> tuple[float, float]:
    """(used, total) GB of this machine, as `free` counts used (total − available): other jobs too."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return (info["MemTotal"] - info["MemAvailable"]) / 1e9, info["MemTotal"] / 1e9


def own_pss_gb() -> float:
    """GB this process and its descendants (the cluster's nodes, their workers and object stores)
    hold: the sum of their proportional set sizes, so shared pages (plasma) count once."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, total = [os.getpid()], 0
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except OSError:
            continue
    return total / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=DEFAULTS["sizes"], help="parameter counts, comma-separated (10m, 500m, 2k, …)")
    ap.add_argument("--replicas", type=int, default=DEFAULTS["replicas"])
    ap.add_argument("--dtype", default=DEFAULTS["dtype"], choices=["bfloat16", "float16", "float32"],
                    help="the wire's and the replicas' dtype (the trainer holds fp32)")
    ap.add_argument("--bucket-mb", type=int, default=DEFAULTS["bucket_mb"])
    ap.add_argument("--sweep-mb", default=DEFAULTS["sweep_mb"], help="other bucket sizes ('' = none), one node")
    ap.add_argument("--sweep-size", default=DEFAULTS["sweep_size"], help="the size the bucket sweep runs at")
    ap.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    ap.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    ap.add_argument("--threads", type=int, default=DEFAULTS["threads"], help="torch threads per actor")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="the collective's timeout")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: " + ", ".join(f"{k} {v!r}" for k, v in QUICK.items()))
    ap.add_argument("--json", type=Path, help="also write every figure (each sync's seconds included) here")
    ap.add_argument("--write", type=Path, help="replace this script's section of this RESULTS.md and write "
                    "benchmarks/results/weight_sync.json")
    ap.add_argument("--json-out", type=Path, help="with --write: the weight_sync JSON here instead")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == DEFAULTS[key]:
                setattr(args, key, value)
    sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    if not sizes or args.replicas < 1 or args.repeats < 1 or args.warmup < 0 or args.bucket_mb < 1:
        ap.error("need --sizes, --replicas >= 1, --repeats >= 1, --warmup >= 0, --bucket-mb >= 1")
    args.sizes = ",".join(sizes)
    args.sweep_size = args.sweep_size.strip().lower()

    def log(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    largest = max(parse_size(s) for s in sizes) * ws.torch_dtype(args.dtype).itemsize
    store_mb = max(256, math.ceil(1.25 * largest / 2**20) + 256)  # one wire copy per node, and room
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cluster = LocalMultiNodeCluster(NodeSpec(gpus=0, num_cpus=1, labels={"tidal.io/node": "A"}),
                                    [NodeSpec(gpus=0, num_cpus=1, labels={"tidal.io/node": "B"})],
                                    object_store_mb=store_mb)
    load_before = os.getloadavg()[0]
    used0, total = memory_gb()
    res: dict[str, Any] = {"sizes": {}, "settings": {k: getattr(args, k) for k in DEFAULTS},
                           "object_store_mb_per_node": store_mb}
    peak = [used0, own_pss_gb()]
    done = threading.Event()

    def sample() -> None:  # every 0.25 s: the machine's memory in use (other jobs too) and this run's own
        while not done.wait(0.25):
            peak[0], peak[1] = max(peak[0], memory_gb()[0]), max(peak[1], own_pss_gb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log(f"object store {store_mb} MB per node; memory in use {used0:.1f} of {total:.1f} GB")
    with cluster:
        ray.init(address=cluster.address, namespace=f"bench-weight-sync-{os.getpid()}", log_to_driver=False,
                 configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
                                           "GLOO_SOCKET_IFNAME": "lo"}})
        try:
            nodes = {"A": cluster.cluster.head_node.node_id, "B": cluster.workers[0].node_id}
            for label in sizes:
                t0 = time.perf_counter()
                res["sizes"][label] = bench_size(args, label, nodes, log)
                log(f"[{label}] done in {time.perf_counter() - t0:.0f} s; peak so far: this run's processes "
                    f"{peak[1]:.1f} GB, the machine {peak[0]:.1f} GB in use")
        finally:
            ray.shutdown()
            done.set()
    res.update(date=time.strftime("%Y-%m-%d"), load_average=[load_before, os.getloadavg()[0]],
               peak_used_gb=peak[0], peak_own_gb=peak[1], total_gb=total, command=command_line(args),
               machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {total:.0f} GB, torch {torch.__version__}, "
                       f"Ray {ray.__version__}")
    res["figures"] = figures(res)
    print("\n".join(table(res)))
    print(json.dumps(res["figures"], indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
    if args.write:
        from results_io import write_json, write_section

        write_section(MARK, markdown(res, res["command"]), args.write, after="multinode")
        data = {**res["figures"], "command": res["command"], "date": res["date"], "machine": res["machine"],
                "dtype": args.dtype, "replicas": args.replicas, "bucket_mb": args.bucket_mb,
                "repeats": args.repeats, "warmup": args.warmup,
                "params": {k: r["params"] for k, r in res["sizes"].items()},
                "wire_bytes": {k: r["wire_bytes"] for k, r in res["sizes"].items()},
                "load_average": res["load_average"], "peak_memory_gb_own": round(res["peak_own_gb"], 2),
                "peak_memory_gb_machine": round(res["peak_used_gb"], 2)}
        print(f"wrote {write_json(MARK, data, args.json_out)}")
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
