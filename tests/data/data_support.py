"""Shared by the data tests: a byte-level BPE tokenizer trained in code with a chat template,
the real GSM8K file (when present), and verl-schema rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GSM8K_DIR = Path(os.environ.get("TIDAL_GSM8K_DIR", ROOT.parent / "shared" / "data" / "gsm8k"))
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_tokenizer():
    """A real HF fast tokenizer (byte-level BPE, trained here on a few lines) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant 12+7= 19 copy:abc= abc", "Janet's ducks lay 16 eggs #### 18"] * 20,
                            trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def gsm8k_test_rows(count: int = 3) -> list[dict]:
    path = GSM8K_DIR / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K is not at {path} (set TIDAL_GSM8K_DIR)")
    with path.open(encoding="utf-8") as fh:
        return [json.loads(next(fh)) for _ in range(count)]


def row(content="12+7=", truth="19", source="tidal/arith", **extra) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": content}], "ability": "tidal",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}, **extra}
