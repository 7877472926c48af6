"""``TinyLM`` as a Hugging Face GPT-2 checkpoint, so vLLM (or ``transformers``) serves the same weights.

Owns the exact TinyLM ↔ GPT-2 mapping (config, weight names, Conv1D transposes), the
char-level tokenizer export and the safetensors file a vLLM worker reloads weights from. Heavy optional packages (``safetensors``, ``tokenizers``,
``transformers``) are imported inside the functions that need them; the mapping only needs torch.
The mapping table and its reasons are in ``docs/engines.md``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from data.problems import CharTokenizer
from models.model import TinyLMConfig

ARCHITECTURE = "GPT2LMHeadModel"
WEIGHTS_FILE = "model.safetensors"
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_config(cfg: TinyLMConfig, *, bos_id: int, eos_id: int, pad_id: int | None = None,
                dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of a GPT-2 that computes exactly what ``TinyLM(cfg)`` computes."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": 4 * cfg.n_embd,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


def to_gpt2_state(state: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A ``TinyLM`` state dict under GPT-2 names and layouts: CPU, contiguous, never shared.

    Raises ``ValueError`` on a name it does not know (a changed ``TinyLM`` must change this map).
    """
    return {name: t.to("cpu", dtype=dtype or t.dtype).contiguous().clone()
            for name, t in to_gpt2_named(state.items())}


def to_gpt2_named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``TinyLM`` (name, tensor) pairs as GPT-2's, lazily: the renamed tensor is a view (Conv1D
    weights transposed), on its own device and dtype, never copied. The one TinyLM → GPT-2 map:
    ``to_gpt2_state`` (the safetensors file a vLLM worker reloads) and a vLLM worker receiving a
    collective weight sync bucket by bucket both go through it.
    """
    for name, tensor in named:
        new = _gpt2_name(name)
        t = tensor.detach()
        yield new, (t.t() if new.endswith(_CONV1D) else t)  # Linear (out, in) → Conv1D (in, out)


def from_gpt2_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``to_gpt2_state`` (GPT-2 names → ``TinyLM`` names); ignores GPT-2 mask buffers."""
    inverse: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        t = tensor.t() if name.endswith(_CONV1D) else tensor
        inverse[_tiny_name(name)] = t.contiguous()
    return inverse


def save_weights(state: Mapping[str, torch.Tensor], path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> int:
    """Write a ``TinyLM`` state dict as a GPT-2 safetensors file; returns its size in bytes."""
    return save_state_file(to_gpt2_state(state, dtype=dtype), path)


def save_state_file(state: Mapping[str, torch.Tensor], path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    drop: frozenset[str] = frozenset()) -> int:
    """Write ``state`` under its own names (a Hugging Face state dict, say) as a safetensors file,
    without the names in ``drop`` (a tied LM head, which the reader takes from the embedding);
    returns its size in bytes. Tensors go to CPU in ``dtype`` (default: their own); two names
    sharing memory are written as two copies (safetensors refuses shared tensors).

    Written to ``path + ".tmp"`` then renamed, so a reader never sees half a file.
    """
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if name in drop:
            continue
        t = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in seen else t
        seen.add(storage)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path.stat().st_size


def export_checkpoint(out_dir: str | os.PathLike, cfg: TinyLMConfig, state: Mapping[str, torch.Tensor] | None = None,
                      *, tokenizer: CharTokenizer | None = None, dtype: str = "float32",
                      with_tokenizer: bool = True) -> Path:
    """Write a Hugging Face model directory for ``TinyLM(cfg)``; returns its path.

    ``config.json`` + ``generation_config.json`` always; ``model.safetensors`` when ``state`` is
    given (vLLM can start from the config alone with ``load_format="dummy"`` and get its weights
    later); the tokenizer files when ``with_tokenizer`` (needs the ``tokenizers`` package).
    """
    tokenizer = tokenizer or CharTokenizer()
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, model vocab_size={cfg.vocab_size}")
    out = write_config(out_dir, cfg, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                       dtype=dtype)
    if state is not None:
        save_weights(state, out / WEIGHTS_FILE, dtype=getattr(torch, dtype))
    if with_tokenizer:
        save_tokenizer(out, tokenizer, model_max_length=cfg.max_seq_len)
    return out


def write_config(out_dir: str | os.PathLike, cfg: TinyLMConfig, *, bos_id: int, eos_id: int,
                 pad_id: int | None = None, dtype: str = "float32") -> Path:
    """``config.json`` + ``generation_config.json`` only: all vLLM needs to start with dummy weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = gpt2_config(cfg, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def save_tokenizer(out_dir: str | os.PathLike, tokenizer: CharTokenizer | None = None, *,
                   model_max_length: int | None = None) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` for ``AutoTokenizer``.

    A WordLevel model over the character vocabulary, a pre-tokenizer that isolates every
    character, ``<bos>`` prepended by the post-processor, and a decoder that concatenates.
    Written with ``tokenizers`` alone (no ``transformers`` needed).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = tokenizer or CharTokenizer()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(tokenizer.itos)}
    pad, bos, eos = (tokenizer.itos[i] for i in (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_id)])
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([pad, bos, eos])
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length or 1_000_000,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------
# names


def _gpt2_name(name: str) -> str:
    parts = name.split(".")
    if name == "tok_emb.weight":
        return "transformer.wte.weight"
    if name == "pos_emb.weight":
        return "transformer.wpe.weight"
    if name == "head.weight":
        return "lm_head.weight"
    if parts[0] == "ln_f":
        return "transformer." + name
    if parts[0] == "blocks" and len(parts) >= 4:
        i, rest = parts[1], ".".join(parts[2:])
        mapped = {
            "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
            "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
            "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
            "attn.proj.weight": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
            "mlp.0.weight": "mlp.c_fc.weight", "mlp.0.bias": "mlp.c_fc.bias",
            "mlp.2.weight": "mlp.c_proj.weight", "mlp.2.bias": "mlp.c_proj.bias",
        }.get(rest)
        if mapped is not None:
            return f"transformer.h.{i}.{mapped}"
    raise ValueError(f"no GPT-2 name for TinyLM parameter {name!r}")


def _tiny_name(name: str) -> str:
    fixed = {"transformer.wte.weight": "tok_emb.weight", "transformer.wpe.weight": "pos_emb.weight",
             "lm_head.weight": "head.weight"}
    if name in fixed:
        return fixed[name]
    if name.startswith("transformer.ln_f."):
        return name.removeprefix("transformer.")
    if name.startswith("transformer.h."):
        i, rest = name.removeprefix("transformer.h.").split(".", 1)
        back = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.0",
                "mlp.c_proj": "mlp.2", "ln_1": "ln_1", "ln_2": "ln_2"}
        module, leaf = rest.rsplit(".", 1)
        if module in back:
            return f"blocks.{i}.{back[module]}.{leaf}"
    raise ValueError(f"no TinyLM name for GPT-2 parameter {name!r}")
