"""The rollout-engine contract (``RolloutEngine``) and what every engine shares around it.

Owns the request-id format, the engines' state flags and contract verbs (``EngineState``), the
request, readiness and state-dict checks, and result building. Owns no request lists or
scheduling (that is ``batching``); imports neither torch nor Ray. The contract is written out in
``docs/engines.md`` and tested by ``tests/engines/test_engine_contract.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from loop.readonly import ReadOnly
from data.types import FinishReason, GenerationRequest, GenerationResult


@runtime_checkable
class RolloutEngine(Protocol):
    """One replica's generation engine."""

    @property
    def param_version(self) -> int: ...

    @property
    def is_sleeping(self) -> bool: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def abort(self, request_ids: Sequence[str]) -> int: ...

    async def abort_all(self) -> int: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    async def load_weights(self, state: Mapping[str, Any], version: int) -> None: ...

    async def shutdown(self) -> None: ...

    def stats(self) -> dict[str, float]:
        """Counters: generated_tokens, prefill_tokens, aborted_requests, busy_s …"""
        ...


def request_sample_uid(request_id: str) -> str:
    """The sample a request belongs to. The rollouter names response ``j`` of sample ``uid``
    ``{uid}-r{j}``, so this is the part before the last ``-r<digits>``; any other id is its own
    sample."""
    head, sep, tail = request_id.rpartition("-r")
    return head if sep and tail.isdigit() else request_id


def check_request(request: GenerationRequest, *, max_seq_len: int | None = None,
                  vocab_size: int | None = None) -> int:
    """Validate ``request`` and return the tokens it may generate: ``max_new_tokens``, clamped to
    the free positions ``max_seq_len - len(prompt)`` when the engine has a context limit. Prompt
    ids are checked against ``vocab_size`` when given. A bad request raises ``ValueError``."""
    prompt, spec, rid = request.prompt_tokens, request.sampling, request.request_id
    if not prompt:
        raise ValueError(f"{rid}: empty prompt")
    if max_seq_len is not None and len(prompt) > max_seq_len:
        raise ValueError(f"{rid}: prompt of {len(prompt)} tokens exceeds max_seq_len={max_seq_len}")
    if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
        raise ValueError(f"{rid}: token id outside the vocabulary of {vocab_size}")
    if spec.max_new_tokens < 0 or spec.temperature < 0 or not 0 < spec.top_p <= 1:
        raise ValueError(f"{rid}: bad sampling {spec}")
    if max_seq_len is None:
        return spec.max_new_tokens
    return min(spec.max_new_tokens, max_seq_len - len(prompt))


def check_state_dict(state: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], *, model: str = "TinyLM") -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the names of ``shapes``, with those shapes
    (``model`` names the model in the message)."""
    missing, unexpected = shapes.keys() - state.keys(), state.keys() - shapes.keys()
    if missing or unexpected:
        raise ValueError(f"state dict does not match {model}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"state dict {name!r} has shape {tuple(state[name].shape)}, expected {tuple(shape)}")


def build_result(request: GenerationRequest, tokens: Sequence[int], logprobs: Sequence[float],
                 reason: FinishReason, version: int, prefilled: int) -> GenerationResult:
    """The result of ``request``: copies of its tokens and log-probs so far, finished by ``reason``."""
    return GenerationResult(request.request_id, list(tokens), list(logprobs), reason, version, prefilled)


class EngineState:
    """The state flags every engine keeps, and the contract verbs that only touch them.

    An engine sets ``_version``, ``_sleeping``, ``_paused``, ``_weights_loaded`` and ``_closed``
    and provides ``_budget(request)`` (``check_request`` with its limits), ``_generate(request,
    budget)`` (runs an accepted request) and ``_abort_where(match)`` (sync or async: finishes the
    matching requests with ``abort`` and returns how many); this mixin does the rest once.
    """

    _version: int
    _sleeping: bool
    _paused: bool
    _weights_loaded: bool
    _closed: bool

    param_version = ReadOnly[int]("_version")
    is_sleeping = ReadOnly[bool]("_sleeping")
    is_paused = ReadOnly[bool]("_paused")
    weights_loaded = ReadOnly[bool]("_weights_loaded")

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one response; returns when it stops, hits its budget or is aborted."""
        self._check_ready()
        if self._paused:
            return build_result(request, [], [], "abort", self._version, 0)
        budget = self._budget(request)
        if budget == 0:
            return build_result(request, [], [], "length", self._version, 0)
        return await self._generate(request, budget)

    async def abort(self, request_ids: Sequence[str]) -> int:
        """Finish the matching waiting or running requests with ``abort``; returns how many."""
        wanted = set(request_ids)
        return await self._aborted(lambda r: r.request.request_id in wanted)

    async def abort_all(self) -> int:
        return await self._aborted(lambda r: True)

    async def pause(self) -> None:
        """Refuse new requests (they return ``abort`` at once); running ones continue."""
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    def _check_ready(self) -> None:
        """Raise ``RuntimeError`` unless the engine can generate: open, awake, weights loaded."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._sleeping:
            raise RuntimeError("engine is asleep: call wake_up() and load_weights() first")
        if not self._weights_loaded:
            raise RuntimeError("no weights loaded: call load_weights() first")

    def _check_awake(self) -> None:
        """Raise ``RuntimeError`` unless weights may be loaded now (awake and open)."""
        if self._sleeping or self._closed:
            raise RuntimeError("engine is asleep: call wake_up() before load_weights()")

    def _budget(self, request: GenerationRequest) -> int:
        raise NotImplementedError

    async def _generate(self, request: GenerationRequest, budget: int) -> GenerationResult:
        raise NotImplementedError

    async def _aborted(self, match: Any) -> int:
        count = self._abort_where(match)  # type: ignore[attr-defined]
        return await count if inspect.isawaitable(count) else count
