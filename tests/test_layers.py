"""Imports flow one way (DESIGN §3): each package imports only the packages below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"config", "policies", "metrics", "loop", "data", "models", "rollout", "cluster", "sim", "tasks", "flows", "storage",
        "deployments"}
ALLOWED = {
    "config": set(),
    "policies": {"config"},
    "metrics": set(),
    "loop": {"config", "policies", "metrics"},
    "data": {"config", "loop"},
    "models": {"config", "data"},
    "rollout": {"config", "metrics", "loop", "data"},
    "cluster": {"config", "policies", "metrics", "loop", "data", "models", "rollout"},
    "sim": {"config", "policies", "metrics", "loop"},
    "storage": {"config"},
    "tasks": {"cluster", "data", "models", "rollout", "policies", "metrics", "storage", "config", "loop"},
    "flows": {"tasks", "cluster", "data", "models", "rollout", "config", "storage", "sim", "policies", "metrics", "loop"},
    "deployments": {"flows", "config"},
}
# Pure packages must not pull heavy runtimes in either.
FORBIDDEN_THIRD_PARTY = {"config": {"ray", "torch"}, "policies": {"ray", "torch"}, "metrics": {"ray", "torch"},
                         "loop": {"ray", "torch", "prefect", "time"},
                         "data": {"ray", "torch", "prefect"}, "rollout": {"ray", "torch", "prefect"}, "sim": {"ray", "torch", "prefect"}}


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


# ------------------------------------------------------------------------------------------------
# no import cycles between modules (lazy imports inside functions count too)
# ------------------------------------------------------------------------------------------------

# Cycles accepted for now, each as the set of modules in one strongly connected component. Only
# cycles inside cluster/, sim/ or tasks/ may be listed (other helpers rewrite those packages while
# issue 14 is open); none was found when this test was written. The lead empties this after merging.
ALLOWED_CYCLES: list[set[str]] = []


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: set[str]) -> dict[str, set[str]]:
    """Module → the modules of ``packages`` it imports anywhere in its file (functions included).

    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``; an
    import of something that is not a module of ours points at its closest enclosing module.
    """
    files = {module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        resolved = set()
        for target in targets:
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                resolved.add(target)
        graph[name] = resolved
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, …, a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                component.add(w)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, c) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_no_two_modules_import_each_other_even_lazily():
    found = [c for c in cycles(import_graph(ROOT, OURS)) if set(c) not in ALLOWED_CYCLES]
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_reports_a_cycle_and_only_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_lazy_import_through_a_package_closes_a_cycle_in_a_real_package(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A package."""\n')
    (pkg / "one.py").write_text("from pkg.two import helper\n")
    (pkg / "two.py").write_text("def helper():\n    from pkg import one  # lazy\n    return one\n")
    (pkg / "three.py").write_text("from . import two\nimport pkg.one\n")
    assert import_graph(tmp_path, {"pkg"}) == {"pkg": set(), "pkg.one": {"pkg.two"}, "pkg.two": {"pkg.one"},
                                               "pkg.three": {"pkg.two", "pkg.one"}}
    assert cycles(import_graph(tmp_path, {"pkg"})) == [["pkg.one", "pkg.two", "pkg.one"]]


def private_imports(root: Path, packages: set[str]) -> dict[str, list[str]]:
    """Module file → the ``_private`` names it imports from another of ``packages``."""
    bad: dict[str, list[str]] = {}
    for pkg in sorted(packages):
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    source = node.module.split(".")[0]
                    names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                    if source in packages and source != pkg and names:
                        bad.setdefault(str(path.relative_to(root)), []).extend(f"{node.module}.{n}" for n in names)
    return bad


def test_no_package_imports_a_private_name_of_another():
    assert private_imports(ROOT, OURS) == {}


def test_a_private_name_imported_across_packages_is_found(tmp_path):
    for pkg in ("low", "high"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "low" / "engine.py").write_text("def _parse():\n    pass\n")
    (tmp_path / "low" / "user.py").write_text("from low.engine import _parse\n")  # inside its own package: fine
    (tmp_path / "high" / "cli.py").write_text("def f():\n    from low.engine import _parse, public\n")
    assert private_imports(tmp_path, {"low", "high"}) == {"high/cli.py": ["low.engine._parse"]}


@pytest.mark.parametrize("module", ["cluster.actors.controller_actor", "cluster.actors.rollout_service"])
def test_the_control_actors_start_without_torch(module):
    """The controller and the rollout service move no tensor: their Ray workers import their
    modules without torch (~2 s of CPU each, in every run; cluster/weight_sync.py imports it where
    a tensor is made)."""
    import subprocess
    import sys

    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_driver_builds_a_tiny_lm_run_without_torch():
    """A run's driver moves no tensor either: ``flows.training_run`` and the actor factories it
    makes for the built-in tiny LM import no torch (~2 s of CPU in every run; the backends, the
    model and the checkpoint's tensors are imported where they are used, in the actors)."""
    import subprocess
    import sys

    probe = ("import sys, flows.training_run\n"
             "from cluster.builders import backend_factory, model_config, tokenizer_and_problems\n"
             "from flows.configs import load_checked\n"
             "cfg = load_checked('tiny-cpu', [])\n"
             "backend_factory(cfg); model_config(cfg, tokenizer_and_problems(cfg)[0])\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
