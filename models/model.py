"""A tiny decoder-only LM with a preallocated KV cache: the model of the torch engine and backend.

Top-down: config → model (embeddings → blocks → head) → blocks → attention → the cache.
Three entry points share the same weights:

- ``forward(idx)``: full causal pass, for training and as the no-cache reference;
- ``prefill(idx, cache, slot)``: one prompt into one cache slot;
- ``decode(tokens, cache, slots, positions)``: one new token for each of several slots at once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.tiny_config import TinyLMConfig  # here, and importable without torch from models.tiny_config


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # A near-zero head keeps the first policy close to uniform, so sampling is stochastic
        # and every GRPO group has some spread of rewards to learn from.
        nn.init.normal_(self.head.weight, std=0.002)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx: (B, T) → logits (B, T, V)
        _, t = idx.shape
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor, cache: KVCache, slot: int) -> torch.Tensor:
        # idx: (1, T) → logits of the last position (V,); writes cache[slot, :, 0:T]
        _, t = idx.shape
        if t > self.cfg.max_seq_len:
            raise ValueError(f"prompt of {t} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for layer, block in enumerate(self.blocks):
            x = block.prefill(x, cache, layer, slot)
        return self.head(self.ln_f(x[:, -1]))[0]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # tokens, slots, positions: (B,) → logits (B, V); token b sits at positions[b] of slots[b]
        if int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"decode position exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, C)
        for layer, block in enumerate(self.blocks):
            x = block.decode(x, cache, layer, slots, positions)
        return self.head(self.ln_f(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def prefill(self, x: torch.Tensor, cache: KVCache, layer: int, slot: int) -> torch.Tensor:
        x = x + self.attn.prefill(self.ln_1(x), cache, layer, slot)
        return x + self.mlp(self.ln_2(x))

    def decode(self, x: torch.Tensor, cache: KVCache, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.decode(self.ln_1(x), cache, layer, slots, positions)
        return x + self.mlp(self.ln_2(x))


class Attention(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: (B, T, C) → q, k, v each (B, H, T, D)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.n_head * self.head_dim, dim=-1)
        shape = (b, t, self.n_head, self.head_dim)
        return (z.view(shape).transpose(1, 2) for z in (q, k, v))  # type: ignore[return-value]

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        # y: (B, H, T, D) → (B, T, C)
        b, _, t, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(x)
        return self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def prefill(self, x: torch.Tensor, cache: KVCache, layer: int, slot: int) -> torch.Tensor:
        q, k, v = self._split(x)  # (1, H, T, D)
        t = x.shape[1]
        cache.k[layer, slot, :, :t] = k[0]
        cache.v[layer, slot, :, :t] = v[0]
        return self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def decode(self, x: torch.Tensor, cache: KVCache, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(x.unsqueeze(1))  # (B, H, 1, D)
        cache.k[layer, slots, :, positions] = k[:, :, 0]
        cache.v[layer, slots, :, positions] = v[:, :, 0]
        keys, values = cache.k[layer, slots], cache.v[layer, slots]  # (B, H, Tmax, D)
        visible = torch.arange(keys.shape[2], device=x.device)[None, :] <= positions[:, None]  # (B, Tmax)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, H, 1, Tmax)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        y = scores.softmax(dim=-1) @ values  # (B, H, 1, D)
        return self._merge(y)[:, 0]


class KVCache:
    """Preallocated keys and values: (layers, slots, heads, max_seq_len, head_dim) each."""

    def __init__(self, cfg: TinyLMConfig, slots: int, device: torch.device | str = "cpu", dtype=torch.float32):
        shape = (cfg.n_layer, slots, cfg.n_head, cfg.max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.slots = slots

    @property
    def nbytes(self) -> int:
        return self.k.element_size() * self.k.numel() * 2


def sequence_logprobs(model: TinyLM, tokens: torch.Tensor, prompt_lens: torch.Tensor, total_lens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each response token under ``model``, zero-padded.

    tokens: (B, T) prompt + response, right-padded; returns (B, T-1) where entry t is
    log p(tokens[:, t+1] | tokens[:, :t+1]) for response positions and 0 elsewhere.
    """
    logits = model(tokens[:, :-1])  # (B, T-1, V)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    idx = torch.arange(tokens.shape[1] - 1, device=tokens.device)[None, :]
    mask = (idx >= (prompt_lens[:, None] - 1)) & (idx < (total_lens[:, None] - 1))
    return logp * mask
