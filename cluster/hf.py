"""Hugging Face model folders: load one (model + tokenizer) and build a tiny one offline.

Owns ``load_model`` / ``load_tokenizer`` (``from_pretrained`` with ``local_files_only=True``, the
``custom_chat_template`` applied) and ``make_tiny_model`` (a tiny Qwen2 or Llama with random
weights and a byte-level BPE tokenizer trained in code, saved with ``save_pretrained``). Must not
download anything, schedule requests or train; ``transformers`` and ``tokenizers`` are imported
inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHITECTURES = ("qwen2", "llama")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template (Qwen's layout): each message is ``<|im_start|>role\\ncontent<|im_end|>``."""

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def tiny_corpus() -> list[str]:
    """What the tiny tokenizer is trained on: digits, arithmetic, a few words, chat markup."""
    words = ("the answer is", "what is", "plus", "minus", "times", "count", "copy", "question",
             "user", "assistant", "system", "Let's think step by step.", "####")
    lines = [f"{a} + {b} = {a + b}" for a in range(0, 40, 3) for b in range(0, 40, 7)]
    lines += [f"{a} * {b} = {a * b}" for a in range(12) for b in range(12)]
    lines += [f"{a} - {b} = {a - b}" for a in range(20, 40, 2) for b in range(0, 20, 3)]
    lines += [" ".join(words), "0123456789", "abcdefghijklmnopqrstuvwxyz", "#### 42"]
    return lines * 4


def train_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``tiny_corpus``, with a chat
    template, ``<|im_end|>`` as EOS and ``<|endoftext|>`` as padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(tiny_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(arch: str, vocab_size: int, *, eos_id: int, pad_id: int, n_layer: int = 2, n_embd: int = 64,
                n_head: int = 4, max_seq_len: int = 512, initializer_range: float = 0.02) -> Any:
    """A tiny ``Qwen2Config`` or ``LlamaConfig`` (``arch`` in ``ARCHITECTURES``)."""
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    return cls(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=2 * n_embd, num_hidden_layers=n_layer,
               num_attention_heads=n_head, num_key_value_heads=max(1, n_head // 2), max_position_embeddings=max_seq_len,
               initializer_range=initializer_range, tie_word_embeddings=arch == "qwen2", eos_token_id=eos_id,
               pad_token_id=pad_id, bos_token_id=None)


def make_tiny_model(directory: str | Path, arch: str = "qwen2", *, seed: int = 0, n_layer: int = 2, n_embd: int = 64,
                    n_head: int = 4, max_seq_len: int = 512, initializer_range: float = 0.02) -> Path:
    """Write a tiny random ``arch`` model and its trained tokenizer to ``directory`` (created);
    returns the folder, which ``AutoModelForCausalLM`` / ``AutoTokenizer`` load with no network."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(directory)
    tok = train_tokenizer()
    cfg = tiny_config(arch, len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n_layer=n_layer,
                      n_embd=n_embd, n_head=n_head, max_seq_len=max_seq_len, initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load_tokenizer(path: str | Path, *, custom_chat_template: str | None = None, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a local folder; ``custom_chat_template`` replaces its chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    if custom_chat_template is not None:
        tok.chat_template = custom_chat_template
    return tok


def load_model(path: str | Path, *, dtype: str = "float32", trust_remote_code: bool = False,
               device: str = "cpu") -> Any:
    """The causal LM of a local folder, in ``dtype`` (``float32``/``bfloat16``/``float16``), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code,
                                                 dtype=getattr(torch, DTYPES[dtype]))
    return model.to(device).eval()


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's generation EOS ids."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in extra if isinstance(extra, list) else [] if extra is None else [extra]:
        if i not in ids:
            ids.append(i)
    return ids
