"""Hugging Face model folders: load one (model + tokenizer) and build a tiny one offline.

Owns ``load_model`` / ``load_tokenizer`` (``from_pretrained`` with ``local_files_only=True``, the
``custom_chat_template`` applied), ``make_tiny_model`` (a tiny Qwen2 or Llama with random
weights and a byte-level BPE tokenizer trained in code, saved with ``save_pretrained``) and
``make_tiny`` / ``ensure_tiny``: the ``tiny-hf`` preset's folder (that model plus the arithmetic
task as verl-schema parquet), written whole or not at all. Must not download anything, schedule
requests or train; ``transformers`` and ``tokenizers`` are imported inside the functions, so
importing this module costs nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" on every save is noise here
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


TINY_HF_PRESET = "tiny-hf"
TINY_HF_ROOT = "runs/tiny-hf"
"""Where the ``tiny-hf`` preset's paths point (relative to the working directory, beside the
default ``trainer.default_local_dir``); ``tidal run tiny-hf`` builds it there once when missing."""
TINY_HF_VLLM_ROOT = "runs/tiny-hf-vllm"
TINY_PRESETS = {TINY_HF_PRESET: (TINY_HF_ROOT, 4), "tiny-hf-vllm": (TINY_HF_VLLM_ROOT, 2)}
"""Preset → (its folder, the model's attention heads): ``tidal run`` builds the folder once when
missing. ``tiny-hf-vllm``'s model has 2 heads of 32 (vLLM's CPU attention needs a head size of at
least 32; ``tiny-hf``'s 4 heads of 16 have the same weight shapes)."""
TINY_FILES = ("model/config.json", "model/model.safetensors", "model/tokenizer.json", "data/train.parquet",
              "data/test.parquet")
"""What a complete ``make_tiny`` folder holds (relative paths)."""


class TinyFolderError(ValueError):
    """``make_tiny`` cannot write its folder; ``str()`` is one line."""


def make_tiny(directory: str | os.PathLike[str], *, train: int = 512, val: int = 64, seed: int = 0,
              arch: str = "qwen2", n_head: int = 4) -> Path:
    """Write the ``tiny-hf`` files into ``directory`` (which must not exist, or be an empty folder):
    ``model/`` (``make_tiny_model`` with ``n_head`` heads: weights, config and tokenizer with its chat template) and
    ``data/train.parquet`` / ``data/test.parquet`` (the built-in ``arith`` task in verl's row
    schema, ``data_source: tidal/arith``; seeds ``seed`` and ``seed + 1``). The same arguments
    write the same bytes. Everything is built in a temporary folder beside ``directory`` and
    renamed into place: a failure leaves nothing behind. Raises ``TinyFolderError`` (one line)."""
    from data.datasets import task_rows, write_rows

    if n_head < 1 or 64 % n_head:
        raise TinyFolderError(f"{n_head} heads do not divide the tiny model's width 64")
    root = Path(directory).expanduser()
    if root.exists() and not root.is_dir():
        raise TinyFolderError(f"{directory}: exists and is not a folder")
    if root.is_dir() and any(root.iterdir()):
        raise TinyFolderError(f"{directory}: the folder is not empty (make-tiny writes a new or empty folder)")
    above = next(p for p in root.parents if p.exists())
    if not above.is_dir():
        raise TinyFolderError(f"{directory}: {above} is not a folder")
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.", suffix=".tmp"))
    except OSError as exc:
        raise TinyFolderError(f"{directory}: cannot create the folder ({exc.strerror or exc})") from None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
        make_tiny_model(tmp / "model", arch, seed=seed, n_head=n_head)
        write_rows(task_rows("arith", train, seed), tmp / "data" / "train.parquet")
        write_rows(task_rows("arith", val, seed + 1), tmp / "data" / "test.parquet")
        if root.is_dir():
            root.rmdir()
        os.replace(tmp, root)
    except OSError as exc:
        raise TinyFolderError(f"{directory}: cannot write the folder ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def tiny_complete(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds every file ``make_tiny`` writes."""
    return all((Path(directory) / name).is_file() for name in TINY_FILES)


def ensure_tiny(directory: str | os.PathLike[str] = TINY_HF_ROOT, *, n_head: int = 4) -> bool:
    """Build the ``tiny-hf`` folder with ``make_tiny``'s defaults (and ``n_head``) unless it is complete already;
    returns whether it built it. Another process building it at the same time is fine (the first
    rename wins); a folder with only some of the files is a ``TinyFolderError``."""
    if tiny_complete(directory):
        return False
    try:
        make_tiny(directory, n_head=n_head)
    except TinyFolderError:
        if tiny_complete(directory):  # built by someone else meanwhile
            return False
        if not Path(directory).is_dir():  # not creatable: make_tiny's own line says why
            raise
        missing = [name for name in TINY_FILES if not (Path(directory) / name).is_file()]
        raise TinyFolderError(f"{directory}: an incomplete tiny-hf folder (missing {', '.join(missing)}): "
                              "remove it and run again") from None
    return True
