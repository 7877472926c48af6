"""One vLLM host shared by the engine tests of this folder (starting one takes 20-60 s on CPU).

``tests/engines/conftest.py`` starts it right after collection when a selected test needs it (so
start-up is outside every test's timeout) and closes it at the end of the session. Each test
builds its own ``VLLMEngine`` on it: own requests, version, pause/sleep state and counters.
"""

from __future__ import annotations

import time
from typing import Any

from cluster.model import TinyLMConfig
from cluster.problems import CharTokenizer

TOK = CharTokenizer()
# vLLM's CPU attention needs head_dim >= 32 (TinyLM's test shape, n_embd 32 / 4 heads, has 8).
CFG = TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_embd=64, max_seq_len=64)
MAX_BATCH = 8

_host: Any = None
_error: BaseException | None = None
start_s: float | None = None


def skip_reason() -> str | None:
    from cluster.engines.vllm_engine import vllm_unavailable_reason

    return vllm_unavailable_reason()


def wants_vllm(nodeid: str) -> bool:
    return "[vllm" in nodeid or "test_vllm_engine.py" in nodeid


def host() -> Any:
    """The shared ``VLLMHost`` (started on first call); a failed start fails every caller."""
    global _host, _error, start_s
    if _error is not None:
        raise RuntimeError("the shared vLLM host failed to start") from _error
    if _host is None:
        from cluster.engines.vllm_engine import VLLMHost

        t0 = time.perf_counter()
        try:
            _host = VLLMHost(CFG, max_batch=MAX_BATCH, eos_id=TOK.eos_id, seed=0, threads=1)
        except BaseException as exc:
            _error = exc
            raise
        start_s = time.perf_counter() - t0
    return _host


def engine() -> Any:
    from cluster.engines.vllm_engine import VLLMEngine

    return VLLMEngine(CFG, max_batch=MAX_BATCH, eos_id=TOK.eos_id, host=host())


def close() -> None:
    global _host
    if _host is not None:
        _host.close()
        _host = None


def weights(seed: int) -> dict[str, Any]:
    """TinyLM weights with a wide head, so greedy choices are never near-ties."""
    import torch

    from cluster.model import TinyLM

    torch.manual_seed(seed)
    model = TinyLM(CFG)
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model.state_dict()
