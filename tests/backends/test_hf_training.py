"""The torch backend training a Hugging Face causal LM (a tiny Qwen2 built from its config, a
byte-level BPE tokenizer trained in code): learning on a fixed batch, gradient checkpointing,
the HF export beside each checkpoint, and resuming from it. Nothing is downloaded."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")

from cluster.backends import TorchBackend  # noqa: E402
from cluster.backends.grpo import logprobs_from_logits  # noqa: E402
from data.types import Response, Sample  # noqa: E402

VOCAB = 96
GOOD = 7
"""The rewarded first response token."""


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_qwen2(seed: int = 0):
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def tiny_tokenizer():
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["1 + 2 = 3", "4 + 4 = 8", "count to five"], trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


@torch.no_grad()
def token_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    x = torch.tensor([prompt + response])
    logp = logprobs_from_logits(model(input_ids=x[:, :-1]).logits, x[:, 1:])[0]
    return logp[len(prompt) - 1 :].tolist()


def make_samples(model, groups: int = 3, n: int = 6, seed: int = 0) -> list[Sample]:
    """Responses start with GOOD (score 1) or with some other token (score 0); log-probs are the
    given model's, as an engine would report them."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(2, VOCAB) for _ in range(4)]
        responses, scores = [], []
        for j in range(n):
            first = GOOD if j % 2 == 0 else rng.choice([t for t in range(2, VOCAB) if t != GOOD])
            tokens = [first] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 3))]
            responses.append(Response(tokens=tokens, logprobs=token_logprobs(model, prompt, tokens),
                                      finish_reason="stop", min_version=0, max_version=0))
            scores.append(1.0 if first == GOOD else 0.0)
        sample = Sample(f"e0-p{g}", 0, g, prompt, responses, started_version=0)
        sample.scores = scores
        samples.append(sample)
    return samples


def make_backend(model=None, **kwargs) -> TorchBackend:
    return TorchBackend(None, tiny_tokenizer(), [], model=model or tiny_qwen2(), **{"lr": 5e-3, **kwargs})


@torch.no_grad()
def good_first_token_prob(model, samples) -> float:
    probs = [torch.softmax(model(input_ids=torch.tensor([s.prompt_tokens])).logits[0, -1], -1)[GOOD] for s in samples]
    return float(torch.stack(probs).mean())


def test_a_tiny_qwen2_trains_on_a_fixed_batch_its_loss_falls_and_the_rewarded_token_gains():
    backend = make_backend(ppo_micro_batch_size_per_gpu=4)
    samples = make_samples(backend.model)
    before = good_first_token_prob(backend.model, samples)
    losses = [backend.train_step(samples).metrics["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.05
    assert good_first_token_prob(backend.model, samples) > 1.2 * before


def test_gradient_checkpointing_is_enabled_on_request_and_gives_the_same_step():
    plain, ckpt = make_backend(), make_backend(gradient_checkpointing=True)
    flag = "is_activation_checkpointing" if hasattr(plain.model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    assert (getattr(ckpt.model, flag), getattr(plain.model, flag)) == (True, False)
    samples = make_samples(plain.model)
    a, b = plain.train_step(samples).metrics, ckpt.train_step(samples).metrics
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)


def test_each_checkpoint_writes_a_hugging_face_folder_that_transformers_loads_to_the_same_logits(tmp_path):
    backend = make_backend()
    samples = make_samples(backend.model)
    backend.train_step(samples)
    step_dir = tmp_path / "checkpoints" / "global_step_1"
    backend.save_checkpoint(step_dir / "actor.pt")
    hf_dir = step_dir / "huggingface"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf_dir.iterdir()}
    assert sorted(p.name for p in step_dir.iterdir()) == ["actor.pt", "huggingface"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.tensor([samples[0].prompt_tokens])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, backend.model.eval()(input_ids=x).logits, atol=1e-6)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tok.encode("1 + 2 = 3") == backend.tokenizer.encode("1 + 2 = 3")

    backend.save_checkpoint(tmp_path / "checkpoints" / "global_step_2" / "actor.pt", export_hf=False)  # save_freq skips it
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "global_step_2").iterdir()) == ["actor.pt"]


def test_a_second_save_replaces_the_export_whole(tmp_path):
    backend = make_backend()
    samples = make_samples(backend.model)
    path = tmp_path / "global_step_1" / "actor.pt"
    backend.save_checkpoint(path)
    backend.train_step(samples)
    backend.save_checkpoint(path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent / "huggingface")
    for name, value in backend.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert sorted(p.name for p in path.parent.iterdir()) == ["actor.pt", "huggingface"]


def test_resuming_an_hf_model_from_its_checkpoint_gives_the_exact_next_step(tmp_path):
    a = make_backend(use_kl_loss=True)
    samples = make_samples(a.model)
    a.train_step(samples)
    info = a.save_checkpoint(tmp_path / "global_step_1" / "actor.pt")
    b = make_backend(model=tiny_qwen2(seed=1), use_kl_loss=True)
    b.load_checkpoint(info.path, expected_sha256=info.sha256)
    ra, rb = a.train_step(samples).metrics, b.train_step(samples).metrics
    assert rb["loss"] == ra["loss"] and rb["updates"] == ra["updates"] == 2
    for name, value in a.state_dict_for_rollout().items():
        assert torch.equal(b.state_dict_for_rollout()[name], value), name


def test_build_backend_trains_a_given_hf_model_with_the_configs_loss_keys():
    from cluster.backends import build_backend
    from config import load_config

    actor = "actor_rollout_ref.actor"
    cfg = load_config("tiny-cpu", [f"{actor}.clip_ratio_high=0.28", f"{actor}.ppo_micro_batch_size_per_gpu=4",
                                   f"{actor}.loss_agg_mode=seq-mean-token-sum", "engines.device=cpu"])
    backend = build_backend(cfg, tiny_tokenizer(), [], model=tiny_qwen2())
    assert (backend.is_hf, backend.model_cfg, backend.ref_model) == (True, None, None)
    assert (backend.clip_ratio_low, backend.clip_ratio_high, backend.micro_batch, backend.loss_agg_mode) == (
        0.2, 0.28, 4, "seq-mean-token-sum")
    assert backend.train_step(make_samples(backend.model)).metrics["updates"] == 1
