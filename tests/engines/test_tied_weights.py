"""A tied embedding (shared with the LM head) is one tensor: counted and copied once."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from cluster.engines.torch_engine import copy_state, state_bytes


def tied_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def test_state_bytes_counts_a_tied_embedding_once():
    model = tied_model(0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert state_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_copy_state_loads_a_tied_model_and_keeps_the_tie():
    source, target = tied_model(1), tied_model(2)
    copy_state(target, source.state_dict())
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
