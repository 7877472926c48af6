"""The ``tiny-hf`` preset's folder for the tests that load the preset: built once per test session
(``models.hf.ensure_tiny``) under pytest's base temp folder, as ``<cwd>/runs/tiny-hf``; a test
``chdir``s into ``<cwd>`` so that the preset's relative paths resolve there.

Importable from every test folder: pytest puts ``tests/`` on ``sys.path`` (``tests/conftest.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest


def tiny_hf_cwd(tmp_path_factory: pytest.TempPathFactory, preset: str = "tiny-hf") -> Path:
    """A working directory whose ``runs/tiny-hf`` (or the folder of ``preset``, one of
    ``models.hf.TINY_PRESETS``) holds the preset's model and data."""
    from models.hf import TINY_PRESETS, ensure_tiny

    root, heads = TINY_PRESETS[preset]
    cwd = tmp_path_factory.getbasetemp() / "tiny-hf-cwd"
    ensure_tiny(cwd / root, n_head=heads)
    return cwd
