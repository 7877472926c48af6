"""TinyLM exported as a Hugging Face GPT-2 computes the same logits; the tokenizer matches CharTokenizer.

The name/layout mapping needs only torch; the checks through ``transformers``/``tokenizers``/
``safetensors`` run where those are installed (the vLLM venv) and skip elsewhere.
"""

from __future__ import annotations

import json

import pytest
import torch

from cluster.engines import hf_export
from data.problems import CharTokenizer
from models.model import TinyLM, TinyLMConfig

TOK = CharTokenizer()
CFG = TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=4, n_embd=32, max_seq_len=64)


def model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    m = TinyLM(CFG).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    return m


def test_the_gpt2_names_and_conv1d_layouts_round_trip_exactly():
    state = model().state_dict()
    gpt2 = hf_export.to_gpt2_state(state)
    assert "transformer.h.1.attn.c_attn.weight" in gpt2 and "lm_head.weight" in gpt2
    # Conv1D stores (in, out): the transpose of nn.Linear's (out, in).
    assert gpt2["transformer.h.0.attn.c_attn.weight"].shape == (CFG.n_embd, 3 * CFG.n_embd)
    assert gpt2["transformer.h.0.mlp.c_fc.weight"].shape == (CFG.n_embd, 4 * CFG.n_embd)
    back = hf_export.from_gpt2_state(gpt2)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="no GPT-2 name"):
        hf_export.to_gpt2_state({"blocks.0.mystery.weight": torch.zeros(1)})


def test_the_config_describes_tinylm_exactly():
    config = hf_export.gpt2_config(CFG, bos_id=TOK.bos_id, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert config["activation_function"] == "gelu"  # exact erf GELU, as nn.GELU(); GPT-2's default is tanh
    assert (config["n_positions"], config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"]) == (
        CFG.max_seq_len, CFG.n_embd, CFG.n_layer, CFG.n_head, 4 * CFG.n_embd)
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == TOK.eos_id
    json.dumps(config)


def test_transformers_loads_the_export_and_computes_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    m = model(3)
    hf_export.export_checkpoint(tmp_path, CFG, m.state_dict(), tokenizer=TOK)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([TOK.encode("copy:abc=12+7=ccc"), TOK.encode("e6=eeeeee???  ...")])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, m(ids), atol=1e-5, rtol=0)


def test_the_exported_tokenizer_encodes_and_decodes_like_chartokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    hf_export.save_tokenizer(tmp_path, TOK, model_max_length=CFG.max_seq_len)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("copy:abc=", "12+7=19", "a b, c. d?", "c4=cccc"):
        assert tok(text)["input_ids"] == TOK.encode(text)
        assert tok.decode(TOK.encode(text), skip_special_tokens=True) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (TOK.bos_id, TOK.eos_id, TOK.pad_id)


def test_save_weights_writes_one_safetensors_file_under_gpt2_names(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    state = model().state_dict()
    path = tmp_path / "w.safetensors"
    size = hf_export.save_weights(state, path)
    loaded = safetensors.load_file(str(path))
    assert size == path.stat().st_size and not (tmp_path / "w.safetensors.tmp").exists()
    assert loaded.keys() == hf_export.to_gpt2_state(state).keys()
    back = hf_export.from_gpt2_state(loaded)
    assert all(torch.equal(back[k], v) for k, v in state.items())
