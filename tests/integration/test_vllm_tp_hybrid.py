"""A TP-2 vLLM hybrid over 2 trainer rank actors (FSDP2 over gloo, a real local Ray cluster): TP
worker r runs inside rank r's own process on the rank's device, vLLM starts no worker process of
its own, and the hybrid generates, token for token, what a TP-1 engine with the same weights
generates (greedy), before and after a training step and an in-rank hybrid sync, each rank
loading its worker from its own shard.

Runs where ``vllm`` imports (the vLLM venv, ``.ci/vllm.sh``); skips with the reason elsewhere.
"""

from __future__ import annotations

import asyncio
import uuid

import psutil
import pytest
import ray

from cluster.engines.vllm_engine import vllm_unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(vllm_unavailable_reason() is not None, reason=str(vllm_unavailable_reason())),
]

HYBRID = "hybrid-0"


def _config(tmp_path, tp: int):
    from config import load_config

    return load_config("tiny-cpu-vllm", [
        f"storage.url=sqlite:///{tmp_path}/tidal.db", f"trainer.default_local_dir={tmp_path}/runs",
        "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}", "actor_rollout_ref.rollout.response_length=8",
    ])


def _requests(tokenizer, n: int = 6):
    from data.problems import make_problems
    from data.types import GenerationRequest, SamplingSpec

    prompts = [tokenizer.encode(p.prompt) for p in make_problems("arith", n, seed=3)]
    return [GenerationRequest(f"g{i}", p, SamplingSpec(max_new_tokens=8, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]


def _samples(requests, results) -> list:
    """Training samples from the hybrid's own responses, scored by hand (a spread of rewards)."""
    from data.types import Response, Sample

    samples = []
    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        responses = [Response(tokens=list(result.tokens[:k]), logprobs=list(result.logprobs[:k]), finish_reason="length",
                              min_version=1, max_version=1) for k in (2, 4, 6, 8)]
        samples.append(Sample(f"e0-p{i}", 0, i, list(request.prompt_tokens), responses, started_version=1,
                              scores=[0.0, 1.0, 0.0, 1.0]))
    return samples


def _tp1_tokens(engine, state, version, requests) -> list[list[int]]:
    """What a TP-1 engine (vLLM's own executor, in this process) generates from ``state``."""

    async def run() -> list[list[int]]:
        await engine.load_weights(state, version)
        return [r.tokens for r in await asyncio.gather(*(engine.generate(q) for q in requests))]

    return asyncio.run(run())


def _vllm_workers_under(pid: int) -> list[str]:
    """Processes named like vLLM's own workers (``VLLM::Worker…``, ``VllmWorker``) below ``pid``."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "Worker" in title and ("VLLM" in title or "Vllm" in title):
            found.append(f"{child.pid}: {title}")
    return found


def test_a_tp2_hybrid_lives_in_its_two_ranks_and_generates_what_tp1_does_before_and_after_a_step(
        tmp_path, ray_address):
    from cluster.actors.trainer_rank import RankGroup
    from cluster.builders import engine_factory, start_ranks, tokenizer_and_problems

    cfg = _config(tmp_path, tp=2)
    tokenizer, _ = tokenizer_and_problems(cfg)
    assert cfg.hybrid_replicas == 1
    ranks = start_ranks(cfg, f"tp-{uuid.uuid4().hex[:8]}", [{}, {}],
                        {HYBRID: engine_factory(cfg, tokenizer, hybrid=True, seed=500)})
    group = RankGroup(ranks, setup_timeout_s=300)
    from cluster.builders import model_config
    from cluster.engines.vllm_engine import VLLMEngine

    tp1 = VLLMEngine(model_config(cfg, tokenizer), max_batch=8, eos_id=tokenizer.eos_id, seed=0, threads=1)
    try:
        # worker r in rank r's own process, on its device, TP rank r of 2; the engine on rank 0
        where = [ray.get(rank.worker_where.remote()) for rank in ranks]
        for r, w in enumerate(where):
            assert (w["pid"], w["device"], w["tp_rank"], w["tp_size"]) == (w["rank_pid"], w["rank_device"], r, 2)
        assert [list(info.hybrids) for info in group.info] == [[HYBRID], []]
        # vLLM spawned no worker of its own under any rank (its engine core, the scheduler, is not a worker)
        assert [_vllm_workers_under(info.pid) for info in group.info] == [[], []]

        requests = _requests(tokenizer)
        results = []
        for version in (1, 2):
            if version == 2:  # a training step moves the weights; the hybrid sleeps through it
                ray.get(ranks[0].hybrid_sleep.remote([HYBRID]))
                before = group.state_dict_for_rollout()
                group.train_step(_samples(requests, results))
                after = group.state_dict_for_rollout()
                assert any(not (before[k] == after[k]).all() for k in before)
            ray.get(ranks[0].hybrid_wake_up.remote([HYBRID]))
            assert group.hybrid_load([HYBRID], version) > 0  # each rank loads its own worker from its shard
            results = ray.get(ranks[0].hybrid_generate_batch.remote(HYBRID, requests))
            assert all(r.param_version == version for r in results)
            got = [r.tokens for r in results]
            want = _tp1_tokens(tp1, group.state_dict_for_rollout(), version, requests)
            assert got == want, f"version {version}: TP 2 {got} != TP 1 {want}"
            assert all(len(tokens) == 8 for tokens in got)
        stats = ray.get(ranks[0].hybrid_stats.remote())[HYBRID]
        assert stats["weight_syncs"] == 2 and stats["weight_bytes"] > 0
    finally:
        asyncio.run(tp1.shutdown())
        group.close()
        for rank in ranks:
            ray.kill(rank, no_restart=True)
