"""The layers of DESIGN.md hold: import-linter's contracts pass, no import cycle at any level, every
module is under a contract, and no contract makes an exception; the packages with layers of their own
have exhaustive contracts. And the code's size stays reviewable: no module over 600 lines, no function
over 80, no two functions with the same body."""

from __future__ import annotations

import ast
import os
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp
import pytest
from support import processes  # tests/support

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("hypertron", cache_dir=None)


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    r = processes.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"{len(CONTRACTS)} kept, 0 broken" in r.stdout


def test_no_import_cycle_between_any_modules(graph):
    """Strongly connected components of the whole module graph (a package's ``__init__`` included,
    so a child importing its parent that imports it counts) are single modules."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(module: str) -> None:  # Tarjan, iteratively deep enough for this package
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if not imported.startswith("hypertron"):
                continue
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                m = stack.pop()
                on_stack.discard(m)
                component.append(m)
                if m == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_every_module_is_under_a_contract_and_no_contract_makes_exceptions(graph):
    assert not [c["id"] for c in CONTRACTS if "ignore_imports" in c]
    (layers,) = [c for c in CONTRACTS if c["type"] == "layers" and c["containers"] == ["hypertron"]]
    assert layers.get("exhaustive") is True
    assert all(c.get("exhaustive") is True for c in CONTRACTS if c["type"] == "layers")  # serve-layers too
    named = {part.strip().strip("()") for layer in layers["layers"] for part in layer.replace(":", "|").split("|")}
    uncovered = sorted(m for m in graph.modules if m != "hypertron" and m.split(".")[1] not in named)
    assert not uncovered, f"modules under no layer: {uncovered}"
    (acyclic,) = [c for c in CONTRACTS if c["type"] == "acyclic_siblings"]
    assert acyclic["ancestors"] == ["hypertron"] and "depth" not in acyclic  # every depth (up to 10)
    assert max(m.count(".") for m in graph.modules) < 10


def test_the_ground_floor_imports_no_jax():
    """The CLI builds its parser from the config; the tokenizer serves a server without a model
    library: neither may pull in JAX."""
    code = ("import sys, hypertron.config, hypertron.tokenizer, hypertron.errors, hypertron.cli; "
            "print(sorted(m for m in ('jax', 'grain', 'orbax') if m in sys.modules))")
    r = processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[]"


def test_the_packages_with_layers_of_their_own_have_exhaustive_contracts():
    layered = {c["containers"][0] for c in CONTRACTS if c["type"] == "layers" and c.get("exhaustive")}
    want = {"hypertron", "hypertron.serve", "hypertron.models", "hypertron.monitor", "hypertron.cli",
            "hypertron.train", "hypertron.kernels"}
    assert want <= layered, sorted(want - layered)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def _sources(*folders: str) -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))}


@pytest.fixture(scope="module")
def sources() -> dict[str, ast.Module]:
    return _sources("hypertron", "bench", "tests")


def _functions(tree: ast.Module):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_module_over_600_lines(sources):
    long = {path: tree.body[-1].end_lineno for path, tree in sources.items()
            if not path.startswith("tests/") and tree.body and tree.body[-1].end_lineno > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_over_80_lines(sources):
    long = [f"{path}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for path, tree in sources.items() for f in _functions(tree)
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_two_functions_have_the_same_body(sources):
    """Bodies of two lines or more, compared as syntax trees (docstrings aside): a copy belongs in
    one place that both call."""
    bodies = defaultdict(list)
    for path, tree in sources.items():
        for f in _functions(tree):
            body = f.body[1:] if ast.get_docstring(f) is not None else f.body
            if body and body[-1].end_lineno - body[0].lineno >= 1:
                bodies[ast.dump(ast.Module(body=body, type_ignores=[]))].append(f"{path}:{f.lineno} {f.name}")
    assert not [places for places in bodies.values() if len(places) > 1]
