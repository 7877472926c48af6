"""What a vLLM host is told about a Hugging Face folder (``vllm_engine.hf_model``) and the weight
file its worker reloads (``hf_export.save_state_file``): no vLLM needed, so these run everywhere."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cluster.engines.hf_export import save_state_file  # noqa: E402
from cluster.engines.vllm_engine import hf_model  # noqa: E402
from models.hf import load_model, load_tokenizer, make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("served") / "qwen2", "qwen2", n_head=2)


def test_a_qwen2_folder_is_served_with_its_trainers_names_and_shapes_and_without_its_tied_head(qwen2):
    served = hf_model(str(qwen2), max_model_len=100)
    state = load_model(qwen2).state_dict()
    eos = load_tokenizer(qwen2).eos_token_id
    assert (served.name, served.model_dir, served.tokenizer, served.vocab_size, served.max_seq_len) == (
        "Qwen2ForCausalLM", str(qwen2), str(qwen2), 384, 100)
    assert (served.n_layer, served.kv_heads, served.head_dim, served.eos_ids, served.drop) == (
        2, 1, 32, (eos,), frozenset({"lm_head.weight"}))
    assert served.shapes == {name: tuple(t.shape) for name, t in state.items()}
    assert served.weight_bytes(state) == sum(p.numel() * p.element_size() for p in load_model(qwen2).parameters())


def test_a_llama_folder_keeps_its_untied_head_and_its_generation_configs_extra_eos_ids(tmp_path):
    folder = make_tiny_model(tmp_path / "llama", "llama", n_head=2)
    path = folder / "generation_config.json"
    eos = load_tokenizer(folder).eos_token_id
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": [eos, 5, 7]}))
    served = hf_model(str(folder))
    assert (served.name, served.max_seq_len, served.drop, served.eos_ids) == (
        "LlamaForCausalLM", 512, frozenset(), (eos, 5, 7))


def test_the_worker_file_holds_every_name_but_the_dropped_ones_in_the_hosts_dtype(qwen2, tmp_path):
    from safetensors.torch import load_file

    state = load_model(qwen2).state_dict()  # the live, tied tensors: safetensors refuses shared memory
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    save_state_file(state, tmp_path / "all.safetensors")
    save_state_file(state, tmp_path / "half.safetensors", dtype=torch.bfloat16, drop=frozenset({"lm_head.weight"}))
    everything, half = load_file(tmp_path / "all.safetensors"), load_file(tmp_path / "half.safetensors")
    assert sorted(everything) == sorted(state)
    assert all(torch.equal(everything[name], t) for name, t in state.items())
    assert sorted(half) == sorted(set(state) - {"lm_head.weight"})
    assert {t.dtype for t in half.values()} == {torch.bfloat16}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.safetensors", "half.safetensors"]
