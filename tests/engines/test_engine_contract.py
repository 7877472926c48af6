"""Every rollout engine keeps the contract written in ``cluster/engines/base.py``.

Each test runs once per entry of ``ENGINES``: a name → factory that builds a fresh engine and the
inputs it needs. Adding an engine is one line there; a factory that cannot build its engine on
this machine (no GPU, package missing) calls ``pytest.skip`` with the reason.

Test-only knob: ``SamplingSpec(ignore_eos=True)`` keeps generating past EOS, so a response
always ends by ``length`` and the partial-rollout arithmetic is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from cluster.engines import RolloutEngine, SimulatedEngine
from data.problems import CharTokenizer
from data.types import GenerationRequest, GenerationResult, SamplingSpec

pytestmark = pytest.mark.timeout(20)  # a scheduler bug hangs rather than fails

try:  # imported at collection, so the first HF case does not spend its timeout importing it
    import transformers  # noqa: F401
except ImportError:
    pass

TOK = CharTokenizer()
PROMPTS = [TOK.encode(text) for text in ("a3=", "copy:abc=", "12+7=", "e6=", "copy:fdeca=")]
BUDGET = 40  # fits in every engine's context next to the longest prompt


@dataclass
class EngineCase:
    engine: RolloutEngine
    weights: Mapping[str, Any]
    """Loaded as version 1 before each test."""
    other_weights: Mapping[str, Any]
    """Different weights of the same shapes."""
    eos_id: int
    weights_change_tokens: bool = True
    """False for engines whose tokens do not depend on the weights (the simulated one)."""
    checks_names: bool = True
    """False for engines that take any names (the simulated one has no model to check against)."""


def _torch_case() -> EngineCase:
    import torch

    from cluster.engines.torch_engine import TorchEngine
    from models.model import TinyLM, TinyLMConfig

    cfg = TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=4, n_embd=32, max_seq_len=64)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        model = TinyLM(cfg)
        torch.nn.init.normal_(model.head.weight, std=0.5)  # peaked logits: greedy is unambiguous
        return model.state_dict()

    engine = TorchEngine(cfg, max_batch=4, eos_id=TOK.eos_id, seed=0)
    return EngineCase(engine, weights(0), weights(1), TOK.eos_id)


def _hf_case(arch: str) -> EngineCase:
    # A tiny random Hugging Face model built from its config (no folder, no tokenizer needed: the
    # prompts are CharTokenizer ids, all inside its vocabulary); wide init = peaked logits.
    import torch

    pytest.importorskip("transformers", reason="the HF cases need transformers (not installed here)")
    from transformers import AutoModelForCausalLM

    from cluster.engines.hf_runner import HFRunner
    from cluster.engines.torch_engine import TorchEngine
    from models.hf import tiny_config

    cfg = tiny_config(arch, 384, eos_id=TOK.eos_id, pad_id=0, n_layer=2, n_embd=32, initializer_range=0.2)

    def model(seed: int):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg)

    engine = TorchEngine(HFRunner(model(0)), max_batch=4, eos_id=TOK.eos_id, seed=0)
    return EngineCase(engine, model(0).state_dict(), model(1).state_dict(), TOK.eos_id)


def _simulated_case() -> EngineCase:
    engine = SimulatedEngine(
        decode_step_s=(0.0005, 0.0001),
        max_batch=4,
        length_sampler=lambda rng: rng.randint(4, 30),
        eos_id=TOK.eos_id,
        vocab_size=TOK.vocab_size,
    )
    return EngineCase(engine, {}, {}, TOK.eos_id, weights_change_tokens=False, checks_names=False)


def _vllm_case() -> EngineCase:
    # One vLLM host (start-up: tens of seconds) serves every test; see tests/engines/vllm_shared.py.
    import vllm_shared

    reason = vllm_shared.skip_reason()
    if reason:
        pytest.skip(reason)
    return EngineCase(vllm_shared.engine(), vllm_shared.weights(0), vllm_shared.weights(1), vllm_shared.TOK.eos_id)


def _vllm_hf_case() -> EngineCase:
    # A tiny Qwen2 folder on vLLM: the trainer's state dicts (HF names, tied LM head) as weights;
    # the prompts are CharTokenizer ids, all inside its vocabulary; EOS is its tokenizer's.
    import vllm_shared

    reason = vllm_shared.skip_reason()
    if reason:
        pytest.skip(reason)
    engine = vllm_shared.hf_engine()
    return EngineCase(engine, vllm_shared.hf_weights(0), vllm_shared.hf_weights(1), engine.eos_id)


def _vllm_tp2_case() -> EngineCase:
    # TinyLM at TP 2, its two workers in two processes we started (a hybrid's trainer ranks)
    import vllm_shared

    reason = vllm_shared.skip_reason()
    if reason:
        pytest.skip(reason)
    return EngineCase(vllm_shared.tp2_engine(), vllm_shared.weights(0), vllm_shared.weights(1), vllm_shared.TOK.eos_id)


ENGINES: dict[str, Callable[[], EngineCase]] = {
    "torch": _torch_case,
    "torch-hf-qwen2": lambda: _hf_case("qwen2"),
    "torch-hf-llama": lambda: _hf_case("llama"),
    "simulated": _simulated_case,
    "vllm": _vllm_case,
    "vllm-hf-qwen2": _vllm_hf_case,
    "vllm-tp2-ranks": _vllm_tp2_case,
}


@pytest.fixture(params=sorted(ENGINES))
def case(request) -> EngineCase:
    return ENGINES[request.param]()


def drive(case: EngineCase, scenario: Callable[[RolloutEngine], Awaitable[None]]) -> None:
    """Load ``case.weights`` as version 1, run ``scenario``, always shut the engine down."""

    async def main() -> None:
        try:
            await case.engine.load_weights(case.weights, 1)
            await scenario(case.engine)
        finally:
            await case.engine.shutdown()

    asyncio.run(main())


def request(rid: str, prompt: list[int], budget: int = BUDGET, **sampling) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(rid, prompt, SamplingSpec(max_new_tokens=budget, **sampling))


async def wait_for_tokens(engine: RolloutEngine, count: int) -> None:
    """Yield to the engine until its counter shows ``count`` generated tokens."""
    while engine.stats()["generated_tokens"] < count:
        await asyncio.sleep(0)


def check_shape(result: GenerationResult, budget: int, eos_id: int) -> None:
    assert len(result.logprobs) == len(result.tokens) <= budget
    if result.finish_reason == "stop":
        assert result.tokens[-1] == eos_id and eos_id not in result.tokens[:-1]
    else:
        assert result.finish_reason == "length" and len(result.tokens) == budget


# the first test of each engine: its first requests pay the fresh engine's warm-up (vLLM's first
# forward took > 20 s once in a CI rehearsal on a slow host, 4.6 s when rerun alone)
@pytest.mark.timeout(90)
def test_a_request_returns_within_its_budget_with_a_finish_reason(case):
    async def scenario(engine):
        results = [await engine.generate(request(f"r{i}", p, budget=12)) for i, p in enumerate(PROMPTS)]
        for i, result in enumerate(results):
            assert result.request_id == f"r{i}"
            assert result.param_version == 1
            check_shape(result, 12, case.eos_id)
        fixed = await engine.generate(request("fixed", PROMPTS[0], budget=12, ignore_eos=True))
        assert (fixed.finish_reason, len(fixed.tokens)) == ("length", 12)

    drive(case, scenario)


def test_an_aborted_request_resubmitted_with_its_partial_tokens_ends_at_the_original_budget(case):
    async def scenario(engine):
        whole = await engine.generate(request("r", PROMPTS[1], ignore_eos=True))
        before = engine.stats()["generated_tokens"]
        task = asyncio.create_task(engine.generate(request("r", PROMPTS[1], ignore_eos=True)))
        await wait_for_tokens(engine, before + 3)
        assert await engine.abort(["r"]) == 1
        first = await task
        assert first.finish_reason == "abort"
        assert 0 < len(first.tokens) < BUDGET and len(first.logprobs) == len(first.tokens)

        rest = await engine.generate(request("r", PROMPTS[1] + first.tokens, BUDGET - len(first.tokens), ignore_eos=True))
        assert rest.finish_reason == "length"
        assert len(first.tokens) + len(rest.tokens) == BUDGET
        assert rest.prefill_tokens == len(PROMPTS[1]) + len(first.tokens)
        # Greedy decoding continues exactly where the aborted call stopped.
        assert first.tokens + rest.tokens == whole.tokens

    drive(case, scenario)


def test_abort_all_returns_every_request_in_flight_and_abort_of_an_unknown_id_returns_zero(case):
    async def scenario(engine):
        before = engine.stats()
        tasks = [asyncio.create_task(engine.generate(request(f"r{i}", PROMPTS[i], ignore_eos=True))) for i in range(3)]
        await wait_for_tokens(engine, before["generated_tokens"] + 3)
        assert await engine.abort(["nobody"]) == 0
        assert await engine.abort_all() == 3
        results = await asyncio.gather(*tasks)
        assert [r.finish_reason for r in results] == ["abort"] * 3
        assert [r.request_id for r in results] == ["r0", "r1", "r2"]
        assert engine.stats()["aborted_requests"] == before["aborted_requests"] + 3

    drive(case, scenario)


def test_results_carry_the_version_of_the_weights_last_loaded(case):
    async def scenario(engine):
        assert engine.param_version == 1
        await engine.load_weights(case.other_weights, 2)
        assert engine.param_version == 2
        result = await engine.generate(request("r", PROMPTS[0]))
        assert result.param_version == 2

    drive(case, scenario)


def test_loading_other_weights_changes_the_greedy_output(case):
    if not case.weights_change_tokens:
        pytest.skip("this engine's tokens do not depend on its weights")

    async def greedy_tokens(engine) -> list[list[int]]:
        reqs = [request(f"r{i}", p, ignore_eos=True) for i, p in enumerate(PROMPTS)]
        return [r.tokens for r in await asyncio.gather(*(engine.generate(r) for r in reqs))]

    async def scenario(engine):
        before = await greedy_tokens(engine)
        await engine.load_weights(case.other_weights, 2)
        assert await greedy_tokens(engine) != before
        await engine.load_weights(case.weights, 3)
        assert await greedy_tokens(engine) == before

    drive(case, scenario)


def test_a_sleeping_engine_refuses_work_and_wake_plus_load_restores_its_greedy_output(case):
    async def scenario(engine):
        before = await engine.generate(request("r", PROMPTS[2]))
        await engine.sleep()
        assert engine.is_sleeping
        with pytest.raises(RuntimeError):
            await engine.generate(request("r", PROMPTS[2]))
        await engine.wake_up()
        assert not engine.is_sleeping
        with pytest.raises(RuntimeError):  # weights must be loaded again after a wake-up
            await engine.generate(request("r", PROMPTS[2]))
        await engine.load_weights(case.weights, 3)
        after = await engine.generate(request("r", PROMPTS[2]))
        assert (after.tokens, after.param_version) == (before.tokens, 3)

    drive(case, scenario)


def test_a_paused_engine_rejects_requests_and_a_resumed_one_accepts_them(case):
    async def scenario(engine):
        await engine.pause()
        refused = await engine.generate(request("r", PROMPTS[0]))
        assert (refused.finish_reason, refused.tokens, refused.prefill_tokens) == ("abort", [], 0)
        await engine.resume()
        accepted = await engine.generate(request("r", PROMPTS[0], ignore_eos=True))
        assert (accepted.finish_reason, len(accepted.tokens)) == ("length", BUDGET)

    drive(case, scenario)


def test_eight_concurrent_requests_all_complete_with_their_own_ids(case):
    async def scenario(engine):
        ids = [f"req-{i}" for i in range(8)]
        reqs = [request(rid, PROMPTS[i % len(PROMPTS)], temperature=1.0, seed=i) for i, rid in enumerate(ids)]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert [r.request_id for r in results] == ids
        for result in results:
            check_shape(result, BUDGET, case.eos_id)
        stats = engine.stats()
        assert stats["finished_requests"] == 8
        assert stats["generated_tokens"] == sum(len(r.tokens) for r in results)

    drive(case, scenario)


# ------------------------------------------------------------------------------------------------
# the collective transport (cluster.weight_sync): the test process is the trainer (rank 0)


class _Trainer:
    """The sending end in a thread of the test process: hosts the store on a free port, forms
    each generation's group with the engine's workers and broadcasts a state in buckets."""

    def __init__(self, world: int, bucket_bytes: int):
        from cluster import weight_sync as ws
        from cluster.ports import free_port

        self.world, self.bucket_bytes = world, bucket_bytes
        self.sender = ws.Sender("127.0.0.1", free_port())

    def spec(self, generation: int):
        from cluster import weight_sync as ws

        return ws.GroupSpec("127.0.0.1", self.sender.port, self.world, generation, timeout_s=30)

    def manifest(self, state: Mapping[str, Any]):
        from cluster import weight_sync as ws

        return ws.plan(ws.named_shapes(state), dtype="float32", bucket_bytes=self.bucket_bytes)

    async def sync(self, engine: RolloutEngine, state: Mapping[str, Any], generation: int, version: int) -> None:
        """``engine.receive_weights`` awaited while a thread sends ``state``, as a trainer would."""
        import threading

        from cluster import weight_sync as ws

        spec, manifest, errors = self.spec(generation), self.manifest(state), []

        def send() -> None:
            try:
                ws.send(self.sender.join(spec), manifest, state.__getitem__)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the test
                errors.append(exc)

        thread = threading.Thread(target=send, name="test-weight-sender", daemon=True)
        thread.start()
        try:
            seconds = await engine.receive_weights(spec, 1, manifest, version)
        finally:
            await asyncio.to_thread(thread.join, 60)
        assert not errors, errors
        assert seconds >= 0

    def close(self) -> None:
        self.sender.leave()


def _sync_state(case: EngineCase, which: str) -> Mapping[str, Any]:
    state = getattr(case, which)
    if state:
        return state
    import torch  # the simulated engine has no model: any named tensors do

    return {"w": torch.arange(6.0).view(2, 3) + (which == "other_weights"), "b": torch.zeros(5)}


@pytest.mark.timeout(90)  # a vLLM worker's first gloo group and layerwise reload
def test_weights_received_over_a_collective_group_equal_load_weights_of_the_same_state(case):
    """Buckets small enough that a layer's weights straddle two of them; a second sync of the
    same generation keeps the group, a new generation re-forms it."""

    async def greedy_tokens(engine) -> list[list[int]]:
        reqs = [request(f"r{i}", p, ignore_eos=True) for i, p in enumerate(PROMPTS)]
        return [r.tokens for r in await asyncio.gather(*(engine.generate(r) for r in reqs))]

    async def scenario(engine):
        weights, other = _sync_state(case, "weights"), _sync_state(case, "other_weights")
        assert engine.weight_ranks >= 1
        await engine.load_weights(case.other_weights, 2)
        loaded_other = await greedy_tokens(engine)
        await engine.load_weights(case.weights, 3)
        loaded = await greedy_tokens(engine)

        trainer = _Trainer(1 + engine.weight_ranks, bucket_bytes=4096)
        try:
            assert len(trainer.manifest(other).buckets) > 1 or not case.weights_change_tokens
            await trainer.sync(engine, other, generation=0, version=4)
            assert engine.param_version == 4
            assert await greedy_tokens(engine) == loaded_other
            await trainer.sync(engine, weights, generation=0, version=5)  # the same group
            assert await greedy_tokens(engine) == loaded
            await trainer.sync(engine, other, generation=1, version=6)  # re-formed
            result = await engine.generate(request("r0", PROMPTS[0], ignore_eos=True))
            assert (result.tokens, result.param_version) == (loaded_other[0], 6)
            if case.weights_change_tokens:
                assert loaded != loaded_other
        finally:
            trainer.close()

    drive(case, scenario)


def test_a_manifest_with_a_wrong_name_is_refused_before_joining_and_leaves_the_weights_alone(case):
    if not case.checks_names:
        pytest.skip("this engine takes any names (no model to check them against)")
    from cluster import weight_sync as ws
    from cluster.ports import free_port

    async def scenario(engine):
        before = await engine.generate(request("r", PROMPTS[2]))
        (first, *rest) = ws.named_shapes(case.weights)
        bad = ws.plan([("not.a.weight", first[1]), *rest], dtype="float32", bucket_bytes=1 << 20)
        # nothing listens on the port: joining would fail with a connection error, not ValueError
        spec = ws.GroupSpec("127.0.0.1", free_port(), 1 + engine.weight_ranks, 0, timeout_s=5)
        with pytest.raises(ValueError, match="not.a.weight"):
            await engine.receive_weights(spec, 1, bad, 2)
        after = await engine.generate(request("r", PROMPTS[2]))
        assert (after.tokens, after.param_version) == (before.tokens, 1)

    drive(case, scenario)
