"""`results_io.write_section`: one block per name, replaced where it stands, new ones placed after
a related block or at the end, and a new file started with the header."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import results_io  # noqa: E402


def _blocks(text: str) -> list[str]:
    return [line[5:-4] for line in text.splitlines() if line.startswith("<!-- ") and not line.startswith("<!-- /")]


def test_a_new_file_starts_with_the_header(tmp_path):
    path = tmp_path / "RESULTS.md"
    results_io.write_section("a", "## A\n\none", path)
    assert path.read_text().startswith(results_io.HEADER)
    assert "<!-- a -->\n## A\n\none\n<!-- /a -->\n" in path.read_text()


def test_a_block_is_replaced_where_it_stands_and_others_are_untouched(tmp_path):
    path = tmp_path / "RESULTS.md"
    for name in ("a", "b", "c"):
        results_io.write_section(name, f"{name} old", path)
    results_io.write_section("b", "b new", path)
    text = path.read_text()
    assert _blocks(text) == ["a", "b", "c"]
    assert "b new" in text and "b old" not in text and "a old" in text and "c old" in text


def test_a_new_block_goes_after_its_anchor_or_at_the_end_without_one(tmp_path):
    path = tmp_path / "RESULTS.md"
    for name in ("a", "b"):
        results_io.write_section(name, name, path)
    results_io.write_section("a2", "a2", path, after="a")
    results_io.write_section("z", "z", path, after="missing")
    assert _blocks(path.read_text()) == ["a", "a2", "b", "z"]
    results_io.write_section("a2", "a2 again", path, after="b")  # an existing block stays where it is
    assert _blocks(path.read_text()) == ["a", "a2", "b", "z"]


def test_a_new_block_goes_above_the_history_and_nothing_is_written_under_it(tmp_path):
    path = tmp_path / "RESULTS.md"
    results_io.write_section("a", "a", path)
    path.write_text(path.read_text() + "\n# History\n\n## old a (2026-11-30)\n\nold figures\n")
    results_io.write_section("b", "b", path)
    results_io.write_section("a", "a again", path)
    text = path.read_text()
    current, history = text.split("\n# History\n")
    assert _blocks(current) == ["a", "b"] and "a again" in current
    assert history == "\n## old a (2026-11-30)\n\nold figures\n"
