"""Processes that stand in for trainer ranks: each joins a gloo group with the others (its default
process group, as a trainer rank's) and hosts one ``vllm_ranks.RankWorker``. A vLLM engine built
with their addresses (``VLLMHost(rank_workers=...)``) drives them as its TP workers.

``RankProcs(world)`` starts them and reads their addresses; ``ask(rank, command)`` sends one JSON
command to a process (``where``: the worker's pid, device and TP rank; ``quit``); ``close()``
ends them. Used by the engine tests and ``benchmarks/bench_vllm_tp.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, os, sys, datetime
import torch.distributed as dist
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
from cluster.engines.vllm_engine import vllm_unavailable_reason
vllm_unavailable_reason()  # vLLM's environment defaults, before vLLM is imported
from cluster.engines.vllm_ranks import RankWorker
worker = RankWorker()
print(json.dumps({"address": worker.address, "pid": os.getpid()}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "quit":
        break
    if command["op"] == "where":
        reply = {**worker.where().__dict__, "process_pid": os.getpid()}
    else:
        reply = {"error": f"unknown op {command['op']!r}"}
    print(json.dumps(reply), flush=True)
worker.close()
dist.destroy_process_group()
"""


class RankProcs:
    """``world`` processes in one gloo group, each hosting a vLLM rank worker."""

    def __init__(self, world: int):
        from cluster.ports import free_port

        port = free_port("127.0.0.1")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(rank), str(world), str(port)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
                      for rank in range(world)]
        hello = [self._read(rank) for rank in range(world)]
        self.addresses = [h["address"] for h in hello]
        self.pids = [h["pid"] for h in hello]

    def _read(self, rank: int) -> dict[str, Any]:
        proc = self.procs[rank]
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"rank process {rank} exited with {proc.wait()}")
            if line.startswith("{"):  # vLLM may print its own lines
                return json.loads(line)

    def ask(self, rank: int, op: str) -> dict[str, Any]:
        self.procs[rank].stdin.write(json.dumps({"op": op}) + "\n")
        self.procs[rank].stdin.flush()
        return self._read(rank)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
