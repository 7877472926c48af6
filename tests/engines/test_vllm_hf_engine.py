"""The vLLM engine serves a Hugging Face folder as the torch engine does: on the trainer's state
dict (HF names, the LM head tied to the embedding) both give the same greedy tokens, log-probs
and finish reasons, and a stop string ends a response at the same token.

Runs where ``vllm`` imports (its own venv: docs/engines.md); skips with the reason elsewhere. The
tests share one vLLM host serving ``vllm_shared``'s tiny Qwen2 folder.
"""

from __future__ import annotations

import asyncio

import pytest
import vllm_shared

from data.types import GenerationRequest, SamplingSpec

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(vllm_shared.skip_reason() is not None, reason=str(vllm_shared.skip_reason())),
]

TEXTS = ("12 + 7 =", "what is 3 * 4", "the answer is", "count 0123", "copy abc", "#### 42")


@pytest.fixture(scope="module")
def tok():
    from models.hf import load_tokenizer

    return load_tokenizer(vllm_shared.hf_folder())


def request(rid: str, prompt: list[int], budget: int = 24, **sampling) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(rid, prompt, SamplingSpec(max_new_tokens=budget, **sampling))


def on_vllm(scenario, weights):
    """A fresh engine on the shared host, ``weights`` as version 1, then ``scenario``'s result."""

    async def main():
        engine = vllm_shared.hf_engine()
        try:
            await engine.load_weights(weights, 1)
            return await scenario(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def on_torch(model, tok, requests: list[GenerationRequest]):
    """The same requests on the torch engine (``HFRunner``) serving ``model``."""
    from cluster.engines.hf_runner import HFRunner
    from cluster.engines.torch_engine import TorchEngine

    engine = TorchEngine(HFRunner(model), max_batch=len(requests), eos_id=tok.eos_token_id, seed=0,
                         detokenize=tok.decode)

    async def main():
        try:
            await engine.load_weights(model.state_dict(), 1)
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_tokens_and_logprobs_on_the_trainers_weights_match_the_hf_torch_engine(tok, seed, ignore_eos):
    model = vllm_shared.hf_model_of(seed)
    reqs = [request(f"r{i}", tok.encode(t), ignore_eos=ignore_eos) for i, t in enumerate(TEXTS)]

    async def scenario(engine):
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    got = on_vllm(scenario, model.state_dict())
    want = on_torch(model, tok, reqs)
    assert [(g.request_id, g.tokens, g.finish_reason, g.param_version) for g in got] == [
        (w.request_id, w.tokens, w.finish_reason, 1) for w in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_weights_of_a_second_model_replace_the_first_and_the_tied_head_follows_the_embedding(tok):
    first, second = vllm_shared.hf_model_of(0), vllm_shared.hf_model_of(1)
    reqs = [request(f"r{i}", tok.encode(t), ignore_eos=True) for i, t in enumerate(TEXTS[:3])]

    async def scenario(engine):
        before = await asyncio.gather(*(engine.generate(r) for r in reqs))
        await engine.load_weights(second.state_dict(), 2)
        return before, await asyncio.gather(*(engine.generate(r) for r in reqs))

    before, after = on_vllm(scenario, first.state_dict())
    assert [r.tokens for r in before] == [r.tokens for r in on_torch(first, tok, reqs)]
    assert [(r.tokens, r.param_version) for r in after] == [(r.tokens, 2) for r in on_torch(second, tok, reqs)]
    assert [r.tokens for r in before] != [r.tokens for r in after]


def test_a_stop_string_ends_the_response_at_the_token_that_completes_it_as_on_the_torch_engine(tok):
    model = vllm_shared.hf_model_of(0)
    prompt = tok.encode(TEXTS[0])

    async def whole(engine):
        return await engine.generate(request("w", prompt, budget=16, ignore_eos=True))

    tokens = on_vllm(whole, model.state_dict()).tokens
    stop = next(text for text in (tok.decode([t]) for t in tokens[4:]) if text.strip())
    stopping = request("s", prompt, budget=16, stop=(stop,))

    async def stopped(engine):
        return await engine.generate(stopping)

    got = on_vllm(stopped, model.state_dict())
    (want,) = on_torch(model, tok, [stopping])
    assert (got.tokens, got.finish_reason) == (want.tokens, "stop")
    assert len(got.tokens) < 16 and stop in tok.decode(got.tokens)


def test_a_state_dict_with_a_wrong_shape_or_a_missing_name_is_refused_and_leaves_the_weights_alone(tok):
    state = vllm_shared.hf_weights(0)
    prompt = tok.encode(TEXTS[1])

    async def scenario(engine):
        before = await engine.generate(request("r", prompt))
        wrong = dict(vllm_shared.hf_weights(1))
        wrong["model.norm.weight"] = wrong["model.norm.weight"][:8]
        with pytest.raises(ValueError, match="model.norm.weight"):
            await engine.load_weights(wrong, 2)
        missing = dict(vllm_shared.hf_weights(1))
        del missing["lm_head.weight"]
        with pytest.raises(ValueError, match="lm_head.weight"):
            await engine.load_weights(missing, 2)
        after = await engine.generate(request("r", prompt))
        return before, after, engine.param_version

    before, after, version = on_vllm(scenario, state)
    assert (after.tokens, after.param_version, version) == (before.tokens, 1, 1)
