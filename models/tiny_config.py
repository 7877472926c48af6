"""The tiny LM's shape: a plain dataclass, importable without torch (the driver sizes the model
from it; ``models.model`` builds the torch module)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    max_seq_len: int = 128

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head
