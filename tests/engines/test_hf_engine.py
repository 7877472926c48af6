"""The torch engine serving Hugging Face models (``HFRunner``), and the tiny model folders it is tested on.

The contract suite runs on the HF runner too (``test_engine_contract.py``); these tests add what
only a real HF model can show: greedy decoding equals transformers' own ``generate``, log-probs
equal the model's, the tokenizer's EOS and stop strings end a response, weights of a second model
load, and sleep frees the memory.
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cluster.engines.hf_runner import HFRunner  # noqa: E402
from cluster.engines.torch_engine import TorchEngine  # noqa: E402
from data.types import GenerationRequest, SamplingSpec  # noqa: E402
from models.hf import ARCHITECTURES, CHAT_TEMPLATE, EOS_TOKEN, load_model, load_tokenizer, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(60)

TEXTS = ("12 + 7 =", "what is 3 * 4", "the answer is", "count 0123")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf") / request.param, request.param, initializer_range=0.2)


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(folder)


def engine_for(folder, tok, **kwargs) -> TorchEngine:
    kwargs.setdefault("eos_id", tok.eos_token_id)
    return TorchEngine(HFRunner(load_model(folder)), max_batch=4, seed=0, detokenize=tok.decode, **kwargs)


def run(engine: TorchEngine, state, requests: list[GenerationRequest], version: int = 1):
    async def main():
        try:
            await engine.load_weights(state, version)
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def greedy(rid: str, prompt: list[int], budget: int = 16, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingSpec(max_new_tokens=budget, temperature=0.0, **sampling))


def hf_greedy(model, prompt: list[int], budget: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=budget, min_new_tokens=budget, do_sample=False)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------- the tiny folder


def test_a_tiny_model_folder_loads_back_with_transformers_and_its_tokenizer_round_trips(folder, tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    again = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.config.model_type == folder.name
    assert (again.eos_token, again.eos_token_id, len(again)) == (EOS_TOKEN, tok.eos_token_id, 384)
    text = "what is 12 + 7? #### 19"
    assert again.decode(again.encode(text)) == text


def test_the_chat_template_of_a_tiny_folder_applies_and_a_custom_one_replaces_it(folder):
    messages = [{"role": "user", "content": "what is 3 + 4?"}]
    tok = load_tokenizer(folder)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.chat_template == CHAT_TEMPLATE
    assert text == "<|im_start|>user\nwhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    custom = load_tokenizer(folder, custom_chat_template="{% for m in messages %}Q: {{ m['content'] }}\nA:{% endfor %}")
    assert custom.apply_chat_template(messages, tokenize=False) == "Q: what is 3 + 4?\nA:"


def test_an_unknown_architecture_is_refused(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path, "gpt9")


# ------------------------------------------------------------------------------- the engine


def test_greedy_decoding_equals_transformers_greedy_generate_and_log_probs_are_the_models(folder, tok):
    model = load_model(folder)
    prompts = [tok.encode(t) for t in TEXTS]
    results = run(engine_for(folder, tok), model.state_dict(),
                  [greedy(f"r{i}", p, ignore_eos=True) for i, p in enumerate(prompts)])
    assert [r.tokens for r in results] == [hf_greedy(model, p, 16) for p in prompts]
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + result.tokens])).logits[0, len(prompt) - 1:-1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(result.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


def test_the_tokenizers_eos_and_extra_eos_ids_end_a_response_with_stop(folder, tok):
    model = load_model(folder)
    prompt = tok.encode(TEXTS[0])
    whole = hf_greedy(model, prompt, 16)
    eos = whole[5]  # pretend the sixth greedy token is the tokenizer's EOS
    first = whole.index(eos)
    (as_eos,) = run(engine_for(folder, tok, eos_id=eos), model.state_dict(), [greedy("r", prompt)])
    (as_extra,) = run(engine_for(folder, tok, extra_eos_ids=[eos]), model.state_dict(), [greedy("r", prompt)])
    assert (as_eos.tokens, as_eos.finish_reason) == (whole[:first + 1], "stop")
    assert (as_extra.tokens, as_extra.finish_reason) == (whole[:first + 1], "stop")


def test_a_stop_string_ends_the_response_at_the_token_that_completes_it(folder, tok):
    model = load_model(folder)
    prompt = tok.encode(TEXTS[1])
    whole = hf_greedy(model, prompt, 16)
    stop = tok.decode(whole[6:8])[-2:]
    end = next(k for k in range(1, 17) if stop in tok.decode(whole[:k]))
    (result,) = run(engine_for(folder, tok), model.state_dict(), [greedy("r", prompt, stop=(stop, "never-there"))])
    assert (result.tokens, result.finish_reason) == (whole[:end], "stop")


def test_loading_a_second_models_state_dict_serves_that_models_greedy_output(folder, tok, tmp_path):
    arch = folder.name
    other = load_model(make_tiny_model(tmp_path / "other", arch, seed=7, initializer_range=0.2))
    prompt = tok.encode(TEXTS[2])
    (result,) = run(engine_for(folder, tok), other.state_dict(), [greedy("r", prompt, ignore_eos=True)], version=5)
    assert (result.tokens, result.param_version) == (hf_greedy(other, prompt, 16), 5)


def test_a_state_dict_of_another_shape_is_refused_and_the_weights_stay(folder, tok, tmp_path):
    arch = folder.name
    model = load_model(folder)
    wider = load_model(make_tiny_model(tmp_path / "wide", arch, n_embd=96))
    engine = engine_for(folder, tok)
    prompt = tok.encode(TEXTS[3])

    async def main():
        try:
            await engine.load_weights(model.state_dict(), 1)
            with pytest.raises(ValueError, match="has shape"):
                await engine.load_weights(wider.state_dict(), 2)
            return engine.param_version, (await engine.generate(greedy("r", prompt, ignore_eos=True))).tokens
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == (1, hf_greedy(model, prompt, 16))


def test_sleep_frees_the_kv_cache_and_the_weights_and_wake_plus_load_restores_them(folder, tok):
    model = load_model(folder)
    engine = engine_for(folder, tok)
    weight_bytes = engine.weight_bytes

    async def main():
        try:
            await engine.load_weights(model.state_dict(), 1)
            task = asyncio.create_task(engine.generate(greedy("r", tok.encode(TEXTS[0]), 200, ignore_eos=True)))
            while engine.stats()["generated_tokens"] < 3:
                await asyncio.sleep(0)
            in_use = engine.kv_cache_bytes
            await engine.sleep()
            aborted = await task
            asleep = (engine.kv_cache_bytes, engine.weight_bytes)
            await engine.wake_up()
            await engine.load_weights(model.state_dict(), 2)
            return in_use > 0, aborted.finish_reason, len(aborted.tokens) == len(aborted.logprobs) > 0, asleep, engine.weight_bytes
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == (True, "abort", True, (0, 0), weight_bytes)


def test_the_engine_factory_of_a_config_with_a_model_path_builds_the_hf_torch_engine_after_pickling(folder, tok):
    import pickle

    from cluster.builders import engine_factory
    from config import load_config
    from data.problems import CharTokenizer

    cfg = load_config("tiny-cpu", [f"actor_rollout_ref.model.path={folder}"])
    engine = pickle.loads(pickle.dumps(engine_factory(cfg, CharTokenizer(), hybrid=False, seed=0)))()
    model = load_model(folder)
    prompt = tok.encode(TEXTS[0])
    (result,) = run(engine, model.state_dict(), [greedy("r", prompt, ignore_eos=True)])
    assert (engine.eos_id, engine.max_batch, result.tokens) == (tok.eos_token_id, 8 * 16, hf_greedy(model, prompt, 16))


def test_an_in_process_load_copies_the_trainers_tensors_so_a_later_optimizer_step_does_not_leak_in(folder, tok, tmp_path):
    # A hybrid replica lives in the trainer's process and gets the live ``state_dict()``.
    trainer_model = load_model(make_tiny_model(tmp_path / "trainer", folder.name, seed=3, initializer_range=0.2))
    prompt = tok.encode(TEXTS[1])
    expected = hf_greedy(trainer_model, prompt, 16)
    engine = engine_for(folder, tok)

    async def main():
        try:
            await engine.load_weights(trainer_model.state_dict(), 4)
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.mul_(-1.0)  # the trainer moves on
            return (await engine.generate(greedy("r", prompt, ignore_eos=True))).tokens
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == expected


def test_the_sort_free_draw_keeps_the_distribution_and_top_p_still_takes_the_sorted_path():
    from cluster.engines.torch_engine import sample_tokens

    probs = torch.tensor([0.1, 0.6, 0.3])
    n = 200
    logits = probs.log().expand(n, 3)
    uniforms = torch.linspace(0, 0.9999, n)  # u < 0.1: 20 rows, 0.1 <= u < 0.7: 120 rows, the rest: 60

    def draw(top_p: float, **kw) -> torch.Tensor:
        return sample_tokens(logits, torch.ones(n), torch.full((n,), top_p), uniforms, **kw)[0]

    assert torch.bincount(draw(1.0, sort_only_for_top_p=True)).tolist() == [20, 120, 60]
    assert torch.equal(draw(0.8, sort_only_for_top_p=True), draw(0.8))


def test_rows_freed_by_finished_requests_are_reused_and_every_response_still_equals_generate(folder, tok):
    # Three slots, six requests of mixed budgets: finished rows are refilled in place, a long
    # prompt widens the running rows, and the mostly-free rows at the end are compacted.
    model = load_model(folder)
    texts = TEXTS + ("the answer is " + "12 + 7 = 19, " * 4, "1")
    prompts = [tok.encode(t) for t in texts]
    budgets = [3, 12, 5, 16, 2, 9]
    engine = TorchEngine(HFRunner(load_model(folder)), max_batch=3, seed=0, eos_id=tok.eos_token_id)
    results = run(engine, model.state_dict(),
                  [greedy(f"r{i}", p, b, ignore_eos=True) for i, (p, b) in enumerate(zip(prompts, budgets))])
    assert [r.tokens for r in results] == [hf_greedy(model, p, b) for p, b in zip(prompts, budgets)]


def test_the_eos_ids_are_the_tokenizers_then_the_generation_configs_others(folder, tok):
    from models.hf import eos_ids

    model = load_model(folder)
    assert eos_ids(model, tok) == [tok.eos_token_id]
    model.generation_config.eos_token_id = [7, tok.eos_token_id, 9]
    assert eos_ids(model, tok) == [tok.eos_token_id, 7, 9]


def test_each_iteration_is_one_forward_of_the_model_also_when_prompts_join_running_rows(folder, tok):
    # Two slots, three requests: the third prompt is prefilled in the same forward that decodes
    # the second (step 4). Steps: 1 prefill r0 r1; 2-3 decode; 4 r0 done, r2 joins; 5-7 decode.
    model = load_model(folder)
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    budgets = [3, 5, 4]
    runner = HFRunner(load_model(folder))
    forwards = []
    runner.model.register_forward_hook(lambda module, args, kwargs, out: forwards.append(kwargs["input_ids"].shape[1]),
                                       with_kwargs=True)
    engine = TorchEngine(runner, max_batch=2, seed=0, eos_id=tok.eos_token_id)
    results = run(engine, model.state_dict(), [greedy(f"r{i}", p, b, ignore_eos=True) for i, (p, b) in enumerate(zip(prompts, budgets))])
    assert [r.tokens for r in results] == [hf_greedy(model, p, b) for p, b in zip(prompts, budgets)]
    assert forwards == [len(prompts[0]) + len(prompts[1]), 2, 2, 1 + len(prompts[2]), 2, 1, 1]


def test_the_runners_model_still_generates_with_transformers_after_its_attention_is_switched(folder, tok):
    model = load_model(folder)
    runner = HFRunner(load_model(folder))
    prompt = tok.encode(TEXTS[0])
    assert runner.model.config._attn_implementation == "tidal_rows"
    assert hf_greedy(runner.model, prompt, 8) == hf_greedy(model, prompt, 8)


def test_a_sliding_window_model_decodes_as_transformers_generate_past_its_window(tok):
    import copy

    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=4,
                      max_window_layers=1, initializer_range=0.2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    prompts = [tok.encode(t) for t in ("what is 3 * 4 and then 5", "12 + 7 =")]  # one longer than the window, one not
    engine = TorchEngine(HFRunner(copy.deepcopy(model)), max_batch=2, seed=0, eos_id=tok.eos_token_id)
    results = run(engine, model.state_dict(), [greedy(f"r{i}", p, 12, ignore_eos=True) for i, p in enumerate(prompts)])
    assert [r.tokens for r in results] == [hf_greedy(model, p, 12) for p in prompts]
