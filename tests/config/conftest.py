"""The preset tests load every shipped preset: ``tiny-hf`` and ``tiny-hf-vllm`` name files that
``tidal run`` builds on first use, so their tests run where they were built (``tiny_hf_support``);
``gpu-hf`` names the user's own model folder, which the tiny Qwen2 stands in for there;
``smollm2-gsm8k`` runs beside a stand-in model folder (``smollm2_support``)."""

from __future__ import annotations

import pytest
from smollm2_support import smollm2_stub_cwd
from tiny_hf_support import tiny_hf_cwd

GPU_HF_MODEL = "models/Qwen2.5-0.5B-Instruct"
"""The folder `gpu-hf.yaml` names (a user sets their own)."""


@pytest.fixture(autouse=True)
def _tiny_hf_files_for_its_preset(request, tmp_path_factory, monkeypatch):
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    name = getattr(params.get("path"), "name", "")
    if name in ("tiny-hf.yaml", "tiny-hf-vllm.yaml"):
        monkeypatch.chdir(tiny_hf_cwd(tmp_path_factory, name.removesuffix(".yaml")))
    elif name == "gpu-hf.yaml":
        cwd = tiny_hf_cwd(tmp_path_factory)
        stand_in = cwd / GPU_HF_MODEL
        if not stand_in.exists():
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            stand_in.symlink_to((cwd / "runs" / "tiny-hf" / "model").resolve(), target_is_directory=True)
        monkeypatch.chdir(cwd)
    elif name == "smollm2-gsm8k.yaml":
        monkeypatch.chdir(smollm2_stub_cwd(tmp_path_factory))
