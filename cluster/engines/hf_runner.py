"""``HFRunner``: any Hugging Face causal LM as the torch engine's model, on transformers' ``DynamicCache``.

Owns the running rows' cache: one ``DynamicCache`` whose rows are the running sequences, in the
order the batching core lists them, left-padded to a common length (a 2-D attention mask hides the
padding; position ids carry each row's true positions). The prompts admitted together are
prefilled as one left-padded batch, in a cache of their own, then merged in; finished rows are dropped and all-padding columns cut off at
the next iteration. Must not schedule, sample or load models from disk (``cluster.hf`` does);
runs only on the torch engine's worker thread.

Why not transformers' ``ContinuousBatchingManager``: it owns admission and scheduling (which the
batching core owns here), samples with one generation config for all requests (no per-request
temperature, top-p or seed) and returns no per-token log-probs of aborted requests.
"""

from __future__ import annotations

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
        self._rows: list[SequenceState] = []
        self._pads: list[int] = []  # left-padding columns of each row

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
        """One token for every running row: feed each row's last token at its true position."""
        self._keep(decoding)
        device, length = self.device, self._length()
        last = torch.tensor([[seq.tokens[-1] for seq in decoding]], device=device).T  # (B, 1)
        # The prompt fills positions 0..P-1; generated token i sits at position P + i.
        positions = [[len(seq.request.prompt_tokens) + len(seq.tokens) - 1] for seq in decoding]
        positions = torch.tensor(positions, device=device)  # (B, 1)
        pads = torch.tensor(self._pads, device=device)  # (B,)
        mask = (torch.arange(length + 1, device=device)[None] >= pads[:, None]).long()  # (B, L + 1)
        out = self.model(input_ids=last, attention_mask=mask, position_ids=positions,
                         cache=self._cache, use_cache=True)
        return out.logits[:, -1].float()  # (B, V)

    def _prefill(self, admitted: list[SequenceState]) -> torch.Tensor:
        """Prefill the admitted prompts as one left-padded batch in a cache of their own, then
        append that cache's rows to the running rows' cache."""
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
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        self._merge(cache, admitted, [width - length for length in lengths])
        return out.logits[:, -1].float()  # (A, V)

    # ---------------------------------------------------------------- the rows' cache

    def _length(self) -> int:
        return 0 if self._cache is None else self._cache.layers[0].keys.shape[-2]

    def _reset(self) -> None:
        self._cache, self._rows, self._pads = None, [], []

    def _keep(self, decoding: list[SequenceState]) -> None:
        """Make the cache's rows exactly ``decoding`` (a subsequence of them, in order), then cut
        the columns that are padding in every row."""
        if len(decoding) == len(self._rows) and all(a is b for a, b in zip(decoding, self._rows)):
            return
        where = {id(seq): i for i, seq in enumerate(self._rows)}
        if any(id(seq) not in where for seq in decoding):
            raise RuntimeError("a running sequence has no row in the KV cache")
        keep = [where[id(seq)] for seq in decoding]
        index = torch.tensor(keep, device=self.device)
        cut = min(self._pads[i] for i in keep)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, cut:]
            layer.values = layer.values.index_select(0, index)[:, :, cut:]
        self._rows = list(decoding)
        self._pads = [self._pads[i] - cut for i in keep]

    def _merge(self, cache: Any, seqs: list[SequenceState], pads: list[int]) -> None:
        """Append ``cache`` (the rows of ``seqs``, left-padded by ``pads``) to the rows' cache,
        left-padding the shorter side."""
        if self._cache is None:
            self._cache, self._rows, self._pads = cache, list(seqs), list(pads)
            return
        length, new = self._length(), cache.layers[0].keys.shape[-2]
        width = max(length, new)
        for mine, theirs in zip(self._cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self._pads = [pad + width - length for pad in self._pads] + [pad + width - new for pad in pads]
        self._rows.extend(seqs)

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
