"""Test-side reader of megatron-core's ``get_fp8_recipe``: which ``fp8*`` ``TransformerConfig``
fields each ``fp8_recipe`` branch reads, parsed with :mod:`ast` from a megatron-core source tree
(the installed 0.16.1, or the excerpts of later releases in ``tests/fixtures/megatron_core/``).

For every ``if config.fp8_recipe == Fp8Recipe.<name>:`` branch the ``config.<field>`` reads are
collected, following calls that receive ``config`` into functions and classes of megatron-core
itself (``TEDelayedScaling.__init__`` in ``megatron/core/extensions/transformer_engine.py``
reads the delayed-scaling fields). What it reads checks the ``get_fp8_recipe.*`` rows of
``nemo_fp8_plugin.stacks.FACTS`` (``tests/test_stacks_megatron_source.py``); the package only
reads the rows (``nemo_fp8_plugin.hosts.megatron.honoured``).
"""

from __future__ import annotations

import ast
from pathlib import Path


def read_honoured_fields(megatron_root: Path) -> dict[str, frozenset[str]]:
    """``fp8_recipe`` -> ``fp8*`` fields read by its branch of ``get_fp8_recipe`` in the
    megatron-core source tree whose ``megatron/`` package directory is ``megatron_root``.

    Raises ``LookupError`` when the source has no ``get_fp8_recipe`` with recipe branches (a
    megatron-core this reader does not understand: better to fail than to guess)."""
    reader = _Reader(Path(megatron_root))
    return reader.recipe_branches()


class _Reader:
    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[Path, ast.Module] = {}

    def _tree(self, path: Path) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._trees[path]

    def _module_path(self, dotted: str) -> Path | None:
        parts = dotted.split(".")
        if parts[0] != "megatron":
            return None  # only megatron-core's own code decides which fields it passes on
        base = self.root.joinpath(*parts[1:])
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand
        return None

    def recipe_branches(self) -> dict[str, frozenset[str]]:
        path = self.root / "core" / "fp8_utils.py"
        tree = self._tree(path)
        fns = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.name == "get_fp8_recipe" and n.args.args
        ]
        out: dict[str, set[str]] = {}
        for fn in fns:
            param = fn.args.args[0].arg
            for node in ast.walk(fn):
                if not isinstance(node, ast.If):
                    continue
                recipe = _recipe_tested(node.test, param)
                if recipe is None:
                    continue
                reads = out.setdefault(recipe, set())
                for stmt in node.body:
                    reads |= self._reads(stmt, param, path, depth=0)
        if not out:
            raise LookupError(
                f"{path}: no get_fp8_recipe with `config.fp8_recipe == Fp8Recipe.<name>` branches"
            )
        return {r: frozenset(f for f in fs if f.startswith("fp8")) for r, fs in out.items()}

    def _reads(self, node: ast.AST, param: str, path: Path, depth: int) -> set[str]:
        """``param.<attr>`` reads in ``node``, following calls that pass ``param`` on."""
        found: set[str] = set()
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == param
            ):
                found.add(sub.attr)
            elif isinstance(sub, ast.Call) and depth < 4:
                for callee_param, target in self._passes(sub, param, path):
                    found |= self._callee_reads(target, callee_param, depth + 1)
        return found

    def _passes(self, call: ast.Call, param: str, path: Path):
        """``(callee parameter name, (file, function node))`` for each place ``call`` hands
        ``param`` to a megatron-core function or class constructor."""
        if not isinstance(call.func, ast.Name):
            return []
        target = self._resolve(call.func.id, path)
        if target is None:
            return []
        file, fn, skip_self = target
        names = [a.arg for a in fn.args.args][1 if skip_self else 0 :]
        out = []
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Name) and arg.id == param and i < len(names):
                out.append((names[i], (file, fn)))
        for kw in call.keywords:
            if kw.arg and isinstance(kw.value, ast.Name) and kw.value.id == param:
                out.append((kw.arg, (file, fn)))
        return out

    def _resolve(self, name: str, path: Path):
        tree = self._tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return path, node, False
            if isinstance(node, ast.ClassDef) and node.name == name:
                init = next(
                    (
                        n
                        for n in node.body
                        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
                    ),
                    None,
                )
                return (path, init, True) if init is not None else None
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        other = self._module_path(node.module)
                        if other is not None and other != path:
                            return self._resolve(alias.name, other)
        return None

    def _callee_reads(self, target, param: str, depth: int) -> set[str]:
        file, fn = target
        found: set[str] = set()
        for stmt in fn.body:
            found |= self._reads(stmt, param, file, depth)
        return found


def _recipe_tested(test: ast.AST, param: str) -> str | None:
    """``name`` when ``test`` contains ``param.fp8_recipe == Fp8Recipe.name`` (or ``== "name"``)."""
    for node in ast.walk(test):
        if not (
            isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
        ):
            continue
        left, right = node.left, node.comparators[0]
        for a, b in ((left, right), (right, left)):
            if (
                isinstance(a, ast.Attribute)
                and a.attr == "fp8_recipe"
                and isinstance(a.value, ast.Name)
                and a.value.id == param
            ):
                if (
                    isinstance(b, ast.Attribute)
                    and isinstance(b.value, ast.Name)
                    and b.value.id == "Fp8Recipe"
                ):
                    return b.attr
                if isinstance(b, ast.Constant) and isinstance(b.value, str):
                    return b.value
    return None
