"""Start the shared vLLM hosts (``vllm_shared``) once, before the first test that needs them runs."""

from __future__ import annotations

import vllm_shared


def pytest_collection_finish(session) -> None:
    wanted = set().union(*(vllm_shared.wanted_hosts(item.nodeid) for item in session.items))
    if not wanted or vllm_shared.skip_reason() is not None:
        return  # nothing to start, or the tests skip with that reason
    for name in sorted(wanted, reverse=True):  # tiny first: its tests run first
        try:
            vllm_shared.host(name)
        except Exception:  # noqa: BLE001 - reported by every test that asks for the host
            pass


def pytest_sessionfinish(session, exitstatus) -> None:
    vllm_shared.close()
