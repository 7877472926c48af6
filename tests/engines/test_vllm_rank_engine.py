"""A vLLM engine at TP 2 whose two workers are processes we started (``vllm_ranks``): each worker
is one of those processes (not one vLLM spawned), the engine core has no child, and greedy
generation equals a TP-1 engine's on the same weights, token for token, across a weight reload.
The contract suite runs against the same engine (``test_engine_contract.py``, ``vllm-tp2-ranks``).

Runs where ``vllm`` imports (its own venv); skips with the reason elsewhere.
"""

from __future__ import annotations

import asyncio

import psutil
import pytest
import vllm_shared
from vllm_shared import TOK

from data.problems import make_problems
from data.types import GenerationRequest, SamplingSpec

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(vllm_shared.skip_reason() is not None, reason=str(vllm_shared.skip_reason())),
]

PROMPTS = [TOK.encode(p.prompt) for task in ("count", "copy", "arith") for p in make_problems(task, 3, seed=2)]


def _greedy(engine, weights, version) -> list[list[int]]:
    async def run():
        try:
            await engine.load_weights(weights, version)
            requests = [GenerationRequest(f"r{i}", p, SamplingSpec(max_new_tokens=24, temperature=0.0, ignore_eos=True))
                        for i, p in enumerate(PROMPTS)]
            return [r.tokens for r in await asyncio.gather(*(engine.generate(q) for q in requests))]
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def test_each_tp_worker_is_a_process_we_started_and_vllm_started_none():
    host = vllm_shared.host("tp2")
    procs = vllm_shared.rank_procs()
    assert host.tensor_parallel_size == 2 and host.rank_workers == tuple(procs.addresses)
    workers = host.run(host.llm.collective_rpc("tidal_where"))
    assert [(w["pid"], w["tp_rank"]) for w in workers] == [(pid, r) for r, pid in enumerate(procs.pids)]
    for rank in (0, 1):
        where = procs.ask(rank, "where")
        assert (where["pid"], where["tp_rank"], where["tp_size"], where["device"]) == (procs.pids[rank], rank, 2, "cpu")
    (core,) = host.llm.engine_core.resources.engine_manager.processes
    assert psutil.Process(core.pid).children(recursive=True) == []  # the scheduler spawned no worker


@pytest.mark.timeout(240)  # the TP-2 engine's first forward compiles (tens of seconds on CPU)
def test_tp2_over_our_processes_generates_what_tp1_generates_across_a_weight_reload():
    for seed in (0, 1):
        weights = vllm_shared.weights(seed)
        tp2 = _greedy(vllm_shared.tp2_engine(), weights, seed + 1)
        tp1 = _greedy(vllm_shared.engine(), weights, seed + 1)
        assert tp2 == tp1
        assert all(len(tokens) == 24 for tokens in tp2)
