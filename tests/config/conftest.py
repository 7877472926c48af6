"""The preset tests load every shipped preset: ``tiny-hf`` names files that ``tidal run`` builds on
first use, so its test runs where they were built (``tiny_hf_support``); ``smollm2-gsm8k`` runs
beside a stand-in model folder (``smollm2_support``)."""

from __future__ import annotations

import pytest
from smollm2_support import smollm2_stub_cwd
from tiny_hf_support import tiny_hf_cwd


@pytest.fixture(autouse=True)
def _tiny_hf_files_for_its_preset(request, tmp_path_factory, monkeypatch):
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if getattr(params.get("path"), "name", None) == "tiny-hf.yaml":
        monkeypatch.chdir(tiny_hf_cwd(tmp_path_factory))
    if getattr(params.get("path"), "name", None) == "smollm2-gsm8k.yaml":
        monkeypatch.chdir(smollm2_stub_cwd(tmp_path_factory))
