"""The package's import structure: the layer contract and the absence of import cycles.

The contracts themselves live in pyproject.toml (``[tool.importlinter]``):
core (spec, registry, config, errors, _io, _resources, capabilities) <- rules <- numerics <-
hosts, rl, analyze <- cli, tools, explain; numerics imports nothing of the package except
``errors``; the core and rules import neither torch nor a host. ``scripts/test.sh`` also runs
``lint-imports`` on its own; this test keeps the contract in the suite, so that ``pytest``
alone catches a broken layer.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import IN_CI, REPO

if not IN_CI:  # CI installs the `test` extra; a missing linter there is a failure, not a skip
    pytest.importorskip("importlinter")

import grimp  # an import-linter dependency, checked just above

PACKAGE = "nemo_fp8_plugin"

pytestmark = pytest.mark.torch_free


def test_import_layer_contract_holds():
    """`lint-imports` with the contracts in pyproject.toml (run in a child process: the
    linter puts the working directory on sys.path)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(no_cache=True, no_logo=True))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _function_level_lines(path: Path) -> set[int]:
    """Line numbers of the import statements inside a function (or lambda) body of one file."""
    lines: set[int] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                lines.add(child.lineno)
            visit(child, nested)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return lines


def _module_file(module: str) -> Path:
    base = REPO.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def import_graphs() -> tuple[set[str], dict[str, set[str]], dict[str, set[str]]]:
    """(modules, module-level edges, all edges) of the package, TYPE_CHECKING imports left out.

    grimp (import-linter's graph builder) resolves every ``import``/``from ... import`` of the
    package to the module it names; ``ast`` tells which of them sit inside a function body.
    An edge is module-level when at least one of its import statements is not in a function.
    """
    graph = grimp.build_graph(PACKAGE, exclude_type_checking_imports=True, cache_dir=None)
    lazy_lines = {m: _function_level_lines(_module_file(m)) for m in graph.modules}
    module_level: dict[str, set[str]] = {}
    every: dict[str, set[str]] = {}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            every.setdefault(importer, set()).add(imported)
            details = graph.get_import_details(importer=importer, imported=imported)
            if any(d["line_number"] not in lazy_lines[importer] for d in details):
                module_level.setdefault(importer, set()).add(imported)
    return set(graph.modules), module_level, every


def cycles(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a", "b", "c"}, {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a", "b"}, {"a": {"b"}}) == []


def test_no_import_cycle_in_the_package():
    """No import cycle, counted two ways.

    * Module-level imports (those that run when a module is imported: top level, ``try``,
      ``if`` and class bodies) must form no cycle at all, child-to-parent-package imports
      included: such a cycle is the classic half-initialized-module failure, whose outcome
      depends on which module a user happens to import first.
    * Adding function-level (lazy) imports, there must still be no cycle, except through an
      import of a module's own parent package (``from . import NAME`` in ``pkg/sub.py``). Those
      are left out of this second graph because Python has always imported the parent before
      its child runs, so they add no dependency the package layout does not already imply; a
      lazy import is how a package's ``__init__`` loads a heavy submodule on first use (the vLLM
      plugin loads ``hosts.vllm.config`` only inside ``register()``). A lazy import that closes
      a loop between two modules that are not parent and child is a design cycle (as
      ``callbacks.py`` <-> ``hosts/te.py`` were) and fails here, even though it cannot fail at
      run time.

    Both graphs are module by module. A cycle between sibling packages taken whole (a module
    of ``hosts.nemo_rl`` used by ``hosts.alignment``, which ``hosts/nemo_rl/__init__.py``
    imports) is the ``acyclic_siblings`` contract's to find, in the test above.
    """
    nodes, module_level, every = import_graphs()
    assert "nemo_fp8_plugin.registry" in module_level["nemo_fp8_plugin.config"]  # not vacuous

    assert cycles(nodes, module_level) == [], "module-level import cycle"

    def is_parent(importer: str, imported: str) -> bool:
        return importer.startswith(imported + ".")

    no_parent = {a: {b for b in bs if not is_parent(a, b)} for a, bs in every.items()}
    assert cycles(nodes, no_parent) == [], "import cycle through function-level imports"


# Top-level names that a test module marked torch_free must not import (outside its tests
# marked host): torch, and the hosts, which all import torch.
TORCH_OR_HOST = frozenset(
    {
        "torch",
        "torchao",
        "transformers",
        "megatron",
        "nemo",
        "nemo_run",
        "nemo_rl",
        "transformer_engine",
        "lightning",
        "pytorch_lightning",
        "vllm",
    }
)


def _mark_names(node: ast.expr) -> set[str]:
    """``{"slow", "host"}`` for ``pytest.mark.slow``, ``[pytest.mark.host, ...]``, and
    ``pytest.mark.x(...)``."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return set().union(*(_mark_names(e) for e in node.elts))
    if isinstance(node, ast.Call):
        node = node.func
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
    ):
        return {node.attr}
    return set()


def _imported_roots(node: ast.AST) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import under ``node``, TYPE_CHECKING
    blocks left out."""
    found: set[tuple[str, int]] = set()
    for child in ast.walk(node):
        if (
            isinstance(child, ast.If)
            and isinstance(child.test, ast.Name)
            and child.test.id == "TYPE_CHECKING"
        ):
            child.body = []
        if isinstance(child, ast.Import):
            found |= {(a.name.split(".")[0], child.lineno) for a in child.names}
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
            found.add((child.module.split(".")[0], child.lineno))
    return found


def test_torch_free_test_modules_import_no_torch_or_host():
    """A static check of the `torch_free` marker (docs/architecture.md, "Test subsets"): the
    module's own imports, and those of each of its tests not marked `host`, name neither torch
    nor a host. What the plugin's modules import is the import contracts' business; running
    the subset where torch is blocked (the fourth command there) checks the rest."""
    offenders = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        module_marks: set[str] = set()
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
            ):
                module_marks |= _mark_names(stmt.value)
        if "torch_free" not in module_marks:
            continue
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                marks = set().union(*(_mark_names(d) for d in stmt.decorator_list))
                if not stmt.name.startswith("test_") or "host" in marks:
                    continue  # helpers are judged by the tests that call them
            elif isinstance(stmt, ast.ClassDef):
                continue
            for root, line in _imported_roots(stmt):
                if root in TORCH_OR_HOST:
                    offenders.append(f"{path.relative_to(REPO)}:{line}: {root}")
    assert not offenders, "torch_free modules import torch or a host:\n" + "\n".join(offenders)


def test_the_tools_face_contract_lists_every_tools_module():
    """The tools -> package face contract names modules, not packages (``as_packages =
    false``: the face is forbidden, the package's own modules are not), so a new tools module
    must be listed to be covered."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: import-linter's own TOML reader
        import tomli as tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    (face,) = [c for c in contracts if "package face" in c["name"]]
    assert face["forbidden_modules"] == ["nemo_fp8_plugin"] and face["as_packages"] is False
    tools = REPO / "nemo_fp8_plugin" / "tools"
    modules = {
        ".".join(
            ("nemo_fp8_plugin", "tools", *p.relative_to(tools).with_suffix("").parts)
        ).removesuffix(".__init__")
        for p in tools.rglob("*.py")
    }
    assert set(face["source_modules"]) == modules


def test_a_tools_module_importing_the_face_breaks_the_contract():
    """The contract can fail: grimp sees ``from .. import __version__`` in a tools module as
    an import of the face, which the contract forbids."""
    graph = grimp.build_graph("nemo_fp8_plugin")
    importers = graph.find_modules_that_directly_import("nemo_fp8_plugin")
    assert not {m for m in importers if m.startswith("nemo_fp8_plugin.tools")}
    harness = (REPO / "nemo_fp8_plugin" / "tools" / "harness.py").read_text()
    assert "from .._version import __version__" in harness
