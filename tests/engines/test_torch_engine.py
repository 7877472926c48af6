"""The torch engine decodes exactly like the model, samples reproducibly and frees its memory.

References are computed with ``TinyLM.forward`` on the whole sequence (no cache), one token at a
time. Weights get a wide output head so greedy choices are never near-ties.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from cluster.engines.torch_engine import TorchEngine, sample_tokens
from data.types import GenerationRequest, SamplingSpec
from models.model import TinyLM, TinyLMConfig

pytestmark = pytest.mark.timeout(20)  # a scheduler bug hangs rather than fails

EOS = 2
CFG = TinyLMConfig(vocab_size=47, n_layer=2, n_head=4, n_embd=32, max_seq_len=64)


def make_model(seed: int = 0, cfg: TinyLMConfig = CFG) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(cfg).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, CFG.vocab_size) for _ in range(length - 1)]


def request(rid: str, prompt: list[int], budget: int, **sampling) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(rid, prompt, SamplingSpec(max_new_tokens=budget, **sampling))


def run(model: TinyLM | None, scenario, *, max_batch: int = 4) -> None:
    """Build an engine (with ``model``'s weights as version 1 unless None), run, shut down."""

    async def main() -> None:
        engine = TorchEngine(CFG, max_batch=max_batch, eos_id=EOS, seed=0)
        try:
            if model is not None:
                await engine.load_weights(model.state_dict(), 1)
            await scenario(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


@torch.no_grad()
def uncached_greedy(model: TinyLM, prompt: list[int], budget: int) -> list[int]:
    ids, out = list(prompt), []
    while len(out) < budget:
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(token)
        out.append(token)
    return out


def test_batched_cached_decode_matches_an_uncached_greedy_loop_for_prompts_of_different_lengths():
    model = make_model()
    prompts = [make_prompt(n, seed=n) for n in (3, 8, 13, 21)]

    async def scenario(engine):
        reqs = [request(f"r{i}", p, 30, ignore_eos=True) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert [r.tokens for r in results] == [uncached_greedy(model, p, 30) for p in prompts]
        # All four shared each decode step: 29 batched steps, not 4 × 29.
        assert engine.stats()["decode_steps"] == 29

    run(model, scenario)


def test_requests_joining_a_running_batch_in_freed_slots_decode_like_the_model():
    model = make_model(seed=1)
    budgets = [5, 25, 10, 15, 20]
    prompts = [make_prompt(4 + 3 * i, seed=10 + i) for i in range(len(budgets))]

    async def scenario(engine):
        reqs = [request(f"r{i}", p, b, ignore_eos=True) for i, (p, b) in enumerate(zip(prompts, budgets))]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert [r.tokens for r in results] == [uncached_greedy(model, p, b) for p, b in zip(prompts, budgets)]

    run(model, scenario, max_batch=2)


def test_a_seeded_request_samples_the_same_tokens_in_any_batch_and_another_seed_differs():
    prompt = make_prompt(6, seed=0)

    async def scenario(engine):
        spec = dict(temperature=1.5, top_p=0.95, ignore_eos=True)
        alone = await engine.generate(request("a", prompt, 30, seed=7, **spec))
        crowd = [engine.generate(request(f"x{i}", make_prompt(5 + i, i), 30, **spec)) for i in range(3)]
        together, *_ = await asyncio.gather(engine.generate(request("b", prompt, 30, seed=7, **spec)), *crowd)
        other = await engine.generate(request("c", prompt, 30, seed=8, **spec))
        assert together.tokens == alone.tokens
        assert other.tokens != alone.tokens

    run(make_model(), scenario)


def test_logprobs_equal_the_untempered_log_softmax_of_a_full_forward_pass():
    model = make_model(seed=2)
    prompts = [make_prompt(n, seed=n) for n in (4, 9)]

    async def scenario(engine):
        reqs = [request(f"r{i}", p, 30, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True) for i, p in enumerate(prompts)]
        for prompt, result in zip(prompts, await asyncio.gather(*(engine.generate(r) for r in reqs))):
            with torch.no_grad():
                logp = model(torch.tensor([prompt + result.tokens]))[0].log_softmax(dim=-1)  # (T, V)
            positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(result.tokens))
            expected = logp[positions, torch.tensor(result.tokens)]
            assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0)

    run(model, scenario)


def test_sleep_frees_the_kv_cache_and_the_weights_and_wake_up_reallocates_them():
    cache_bytes = 2 * 4 * CFG.n_layer * 4 * CFG.n_head * CFG.max_seq_len * CFG.head_dim  # k+v, fp32, 4 slots

    async def scenario(engine):
        assert (engine.kv_cache_bytes, engine.stats()["kv_cache_bytes"]) == (cache_bytes, cache_bytes)
        assert engine.weight_bytes > 0
        await engine.sleep()
        assert (engine.kv_cache_bytes, engine.weight_bytes) == (0, 0)
        assert (engine.stats()["kv_cache_bytes"], engine.stats()["weight_bytes"]) == (0, 0)
        await engine.wake_up()
        assert engine.kv_cache_bytes == cache_bytes and engine.weight_bytes > 0

    run(make_model(), scenario)


def test_sleep_aborts_requests_in_flight_and_returns_their_partial_tokens():
    async def scenario(engine):
        task = asyncio.create_task(engine.generate(request("r", make_prompt(5, 0), 50, ignore_eos=True)))
        while engine.stats()["generated_tokens"] < 2:
            await asyncio.sleep(0)
        await engine.sleep()
        result = await task
        assert result.finish_reason == "abort" and 2 <= len(result.tokens) < 50

    run(make_model(), scenario)


def test_a_request_waiting_for_a_slot_aborts_without_being_prefilled():
    async def scenario(engine):
        running = asyncio.create_task(engine.generate(request("run", make_prompt(5, 0), 50, ignore_eos=True)))
        waiting = asyncio.create_task(engine.generate(request("wait", make_prompt(7, 1), 50)))
        while engine.stats()["generated_tokens"] < 2:
            await asyncio.sleep(0)
        assert engine.stats()["waiting_requests"] == 1
        assert await engine.abort(["wait"]) == 1
        aborted = await waiting
        assert (aborted.finish_reason, aborted.tokens, aborted.prefill_tokens) == ("abort", [], 0)
        assert (await running).finish_reason == "length"

    run(make_model(), scenario, max_batch=1)


def test_a_budget_beyond_max_seq_len_is_clamped_to_the_free_positions():
    async def scenario(engine):
        clamped = await engine.generate(request("r", make_prompt(60, 0), 20, ignore_eos=True))
        assert (clamped.finish_reason, len(clamped.tokens)) == ("length", 4)
        full = await engine.generate(request("full", make_prompt(64, 0), 20))
        assert (full.finish_reason, full.tokens) == ("length", [])
        with pytest.raises(ValueError, match="max_seq_len"):
            await engine.generate(request("long", make_prompt(65, 0), 20))

    run(make_model(), scenario)


def test_generating_before_weights_are_loaded_raises():
    async def scenario(engine):
        assert not engine.weights_loaded
        with pytest.raises(RuntimeError, match="load_weights"):
            await engine.generate(request("r", make_prompt(5, 0), 5))

    run(None, scenario)


def test_a_state_dict_of_another_shape_is_refused_and_the_old_weights_stay():
    wider = make_model(cfg=TinyLMConfig(vocab_size=47, n_embd=64, max_seq_len=64))
    prompt = make_prompt(6, 0)

    async def scenario(engine):
        before = await engine.generate(request("r", prompt, 20))
        with pytest.raises(ValueError, match="shape"):
            await engine.load_weights(wider.state_dict(), 2)
        with pytest.raises(ValueError, match="missing"):
            await engine.load_weights({}, 2)
        after = await engine.generate(request("r", prompt, 20))
        assert (after.tokens, after.param_version, engine.param_version) == (before.tokens, 1, 1)

    run(make_model(), scenario)


def test_torch_threads_follow_the_threads_argument():
    TorchEngine(CFG, max_batch=1, eos_id=EOS, threads=2)
    assert torch.get_num_threads() == 2
    TorchEngine(CFG, max_batch=1, eos_id=EOS, threads=1)
    assert torch.get_num_threads() == 1


def test_sampling_draws_only_from_the_top_p_nucleus_and_reports_untempered_logprobs():
    probs = torch.tensor([0.1, 0.6, 0.3])
    n = 200
    logits = probs.log().expand(n, 3)
    uniforms = torch.linspace(0, 0.9999, n)

    def draw(temperature: float, top_p: float) -> tuple[set[int], torch.Tensor]:
        tokens, logprobs = sample_tokens(logits, torch.full((n,), temperature), torch.full((n,), top_p), uniforms)
        return set(tokens.tolist()), logprobs

    assert draw(1.0, 0.5)[0] == {1}
    assert draw(1.0, 0.8)[0] == {1, 2}
    assert draw(1.0, 1.0)[0] == {0, 1, 2}
    assert draw(0.0, 1.0)[0] == {1}
    tokens, logprobs = sample_tokens(logits, torch.full((n,), 0.5), torch.ones(n), uniforms)
    assert torch.allclose(logprobs, probs.log()[tokens])
    # Temperature 0.5 sharpens the draw: token 1 gets 0.36 / (0.01 + 0.36 + 0.09) ≈ 78 % of it.
    assert 0.7 < (tokens == 1).float().mean() < 0.85


def test_a_request_running_across_a_weight_load_reports_the_version_of_its_first_token():
    async def scenario(engine):
        task = asyncio.create_task(engine.generate(request("r", make_prompt(5, 0), 50, ignore_eos=True)))
        while engine.stats()["generated_tokens"] < 2:
            await asyncio.sleep(0)
        await engine.load_weights(make_model(seed=3).state_dict(), 2)
        spanning = await task
        assert (spanning.finish_reason, spanning.param_version) == ("length", 1)
        assert (await engine.generate(request("next", make_prompt(5, 0), 5))).param_version == 2

    run(make_model(), scenario)
