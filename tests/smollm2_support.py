"""Stand-ins for the ``smollm2-gsm8k`` preset's files, for tests that only parse the preset: a
working directory whose ``runs/smollm2/model`` is a tiny Llama (SmolLM2's architecture) built in
code, so nothing is converted or downloaded. Tests of the real conversion live in
``tests/data/test_smollm2.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def smollm2_stub_cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory whose ``runs/smollm2/model`` is a tiny Llama folder (built once)."""
    from models.hf import make_tiny_model
    from models.smollm2 import SMOLLM2_ROOT

    cwd = tmp_path_factory.getbasetemp() / "smollm2-stub-cwd"
    model = cwd / SMOLLM2_ROOT / "model"
    if not (model / "config.json").is_file():
        make_tiny_model(model, "llama")
    return cwd
