"""Where every benchmark leaves its numbers: a marked section of RESULTS.md and a JSON file.

Each benchmark owns one section of ``benchmarks/RESULTS.md``, between ``<!-- NAME -->`` and
``<!-- /NAME -->``; :func:`write_section` replaces just that block (reading the file fresh, since
other benchmarks write there too) or adds it, before the file's ``# History`` (figures of code
since replaced, kept without markers so that no run writes there) when it has one. Its machine-readable figures go to
``benchmarks/results/NAME.json`` (:func:`write_json`); ``benchmarks/run_all.py`` (``make bench``)
merges those files into ``benchmarks/results.json``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS_MD = BENCH / "RESULTS.md"
RESULTS_DIR = BENCH / "results"
HEADER = "# Benchmark results\n\nEach section says the command that produced it; rerun it to refresh that section.\n"
HISTORY = "# History"
"""The heading above which a new section goes (everything under it is superseded)."""


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)


def write_section(name: str, body: str, path: Path = RESULTS_MD, after: str | None = None) -> None:
    """Replace the ``name`` block of ``path``; ``body`` is the markdown inside it.

    A new block goes right after the ``after`` block when there is one (related sections stay
    together), else at the end of the current results: before the ``# History`` heading, or at the
    end of a file without one.
    """
    block = f"<!-- {name} -->\n{body.rstrip()}\n<!-- /{name} -->"
    text = path.read_text(encoding="utf-8") if path.exists() else HEADER
    history = re.search(rf"^{re.escape(HISTORY)}$", text, re.M)
    if (found := _block(name).search(text)) is not None:
        text = text[:found.start()] + block + text[found.end():]
    elif after and (anchor := _block(after).search(text)) is not None:
        text = text[:anchor.end()] + "\n\n" + block + text[anchor.end():]
    elif history is not None:
        text = text[:history.start()].rstrip("\n") + "\n\n" + block + "\n\n" + text[history.start():]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    _atomic_write(path, text)


def write_json(name: str, data: dict[str, Any], path: Path | None = None) -> Path:
    """Write ``benchmarks/results/NAME.json`` (or ``path``) atomically and return its path."""
    path = path or RESULTS_DIR / f"{name}.json"
    _atomic_write(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path


def read_json(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
