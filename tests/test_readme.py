"""The README keeps its promises: two set-up commands first, a short page whose links resolve, and a
config reference (docs/config.md) in step with the schema."""

from __future__ import annotations

import re
from pathlib import Path

from config.reference import END_MARK, START_MARK, iter_fields, splice_into

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIG_DOC = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")


def test_the_config_reference_in_docs_matches_the_schema():
    # Regenerate with: python -m config.reference docs/config.md
    assert splice_into(CONFIG_DOC) == CONFIG_DOC


def test_the_config_reference_lists_every_key():
    table = CONFIG_DOC.split(START_MARK)[1].split(END_MARK)[0]
    keys = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    assert keys == {key for key, _ in iter_fields()}


def test_the_first_code_block_holds_exactly_the_two_make_commands():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make run", "make test"]


def test_the_readme_is_at_most_260_lines():
    assert len(README.splitlines()) <= 260


def test_every_relative_link_and_image_in_the_readme_exists():
    targets = {t.split("#")[0] for t in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", README)}
    relative = {t for t in targets if t and not re.match(r"^[a-z]+:", t)}
    assert relative, "the README links to nothing"
    missing = sorted(t for t in relative if not (ROOT / t).exists())  # compare.png too: `make compare` writes it
    assert missing == []


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
