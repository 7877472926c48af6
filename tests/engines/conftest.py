"""Start the shared vLLM host (``vllm_shared``) once, before the first test that needs it runs."""

from __future__ import annotations

import vllm_shared


def pytest_collection_finish(session) -> None:
    if not any(vllm_shared.wants_vllm(item.nodeid) for item in session.items):
        return
    if vllm_shared.skip_reason() is not None:
        return  # the tests skip with that reason
    try:
        vllm_shared.host()
    except Exception:  # noqa: BLE001 - reported by every test that asks for the host
        pass


def pytest_sessionfinish(session, exitstatus) -> None:
    vllm_shared.close()
