"""The rollout-engine interface every engine implements (torch, vLLM, simulated).

An engine serves one replica. All methods are coroutines so a Ray async actor can host it and a
vLLM ``AsyncLLM`` can sit behind it; CPU-heavy engines run their compute off the event loop.

Contract (tested by ``tests/engines/test_engine_contract.py``):

- ``generate`` returns when the request finishes (``stop``/``length``) or is aborted
  (``abort``, carrying the tokens and log-probs produced so far). A re-submitted request with
  prompt = original prompt + partial tokens and the remaining budget continues the response.
- ``abort(ids)`` / ``abort_all()`` make the matching ``generate`` calls return promptly.
- ``pause()`` rejects new work: ``generate`` on a paused engine returns at once with
  ``finish_reason="abort"`` and no tokens. ``resume()`` accepts work again.
- ``sleep()`` frees the KV cache and the weights; ``wake_up()`` restores memory (weights must then
  be loaded again unless ``keep_weights`` was kept). Generating while asleep is an error.
- ``load_weights(state, version)`` replaces the weights; later tokens carry ``version``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from cluster.types import GenerationRequest, GenerationResult


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


class EngineState:
    """The state flags every engine keeps, and the contract verbs that only touch them.

    An engine sets ``_version``, ``_sleeping``, ``_paused`` and ``_weights_loaded`` and provides
    ``_abort_where(match)`` (sync or async: it finishes the matching requests with ``abort`` and
    returns how many); this mixin does the rest once for every engine.
    """

    _version: int
    _sleeping: bool
    _paused: bool
    _weights_loaded: bool

    @property
    def param_version(self) -> int:
        return self._version

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def weights_loaded(self) -> bool:
        return self._weights_loaded

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

    async def _aborted(self, match: Any) -> int:
        count = self._abort_where(match)  # type: ignore[attr-defined]
        return await count if inspect.isawaitable(count) else count
