"""Imports flow one way (DESIGN §3): each package imports only the packages below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"config", "policies", "metrics", "loop", "cluster", "sim", "tasks", "flows", "storage", "deployments"}
ALLOWED = {
    "config": set(),
    "policies": {"config"},
    "metrics": set(),
    "loop": {"config", "policies", "metrics"},
    "cluster": {"config", "policies", "metrics", "loop"},
    "sim": {"config", "policies", "metrics", "loop"},
    "storage": {"config"},
    "tasks": {"cluster", "policies", "metrics", "storage", "config", "loop"},
    "flows": {"tasks", "cluster", "config", "storage", "sim", "policies", "metrics", "loop"},
    "deployments": {"flows", "config"},
}
# Pure packages must not pull heavy runtimes in either.
FORBIDDEN_THIRD_PARTY = {"config": {"ray", "torch"}, "policies": {"ray", "torch"}, "metrics": {"ray", "torch"},
                         "loop": {"ray", "torch", "prefect", "time"}, "sim": {"ray", "torch", "prefect"}}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        used = imported_top_levels(path)
        wrong = ((used & OURS) - ALLOWED[package] - {package}) | (used & FORBIDDEN_THIRD_PARTY.get(package, set()))
        if wrong:
            bad[str(path.relative_to(ROOT))] = sorted(wrong)
    assert bad == {}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_every_package_says_what_it_owns_in_a_docstring(package):
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text(encoding="utf-8")))
    assert doc and len(doc) > 40
