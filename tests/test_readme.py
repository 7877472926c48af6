"""The README keeps its promises: two set-up commands first, and a config reference in step."""

from __future__ import annotations

import re
from pathlib import Path

from config.reference import END_MARK, START_MARK, iter_fields, splice_into

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_config_reference_in_the_readme_matches_the_schema():
    # Regenerate with: python -m config.reference README.md
    assert splice_into(README) == README


def test_the_config_reference_lists_every_key():
    table = README.split(START_MARK)[1].split(END_MARK)[0]
    keys = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    assert keys == {key for key, _ in iter_fields()}


def test_the_first_code_block_holds_exactly_the_two_make_commands():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make run", "make test"]


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
