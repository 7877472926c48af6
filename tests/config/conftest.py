"""The preset tests load every shipped preset: ``tiny-hf`` and ``tiny-hf-vllm`` name files that
``tidal run`` builds on first use, so their tests run where they were built (``tiny_hf_support``)."""

from __future__ import annotations

import pytest
from tiny_hf_support import tiny_hf_cwd


@pytest.fixture(autouse=True)
def _tiny_hf_files_for_its_preset(request, tmp_path_factory, monkeypatch):
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    name = getattr(params.get("path"), "name", "")
    if name in ("tiny-hf.yaml", "tiny-hf-vllm.yaml"):
        monkeypatch.chdir(tiny_hf_cwd(tmp_path_factory, name.removesuffix(".yaml")))
