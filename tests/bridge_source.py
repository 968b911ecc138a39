"""Megatron-Bridge's recipe registry read from a release's ``mixed_precision.py`` (the wheel in
the download cache): what ``nemo_fp8_plugin.hosts.bridge.recipes.RECORDED_RECIPES`` is checked
against. Parsed with :mod:`ast`, never imported (Bridge does not install here). Each function
decorated with ``@register`` either returns ``MixedPrecisionConfig(<field>=<literal>, ...)`` or
starts from another recipe (``cfg = bf16_mixed()``) and sets fields on it; a recipe written any
other way is reported as unreadable, never guessed."""

from __future__ import annotations

import ast
import functools
from typing import Any

_MIRRORED = ("fp8_param", "fp4_param")
"""Fields Bridge keeps equal to ``fp8_param_gather`` / ``fp4_param_gather``: left out, as in the
recorded table."""


class _Unreadable(Exception):
    """A recipe body this reader does not follow (it is left out)."""


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "torch":  # a dtype, by import path (torch.half is torch.float16)
            return "torch.float16" if node.attr == "half" else f"torch.{node.attr}"
    raise _Unreadable(ast.unparse(node))


def _class_defaults(tree: ast.Module) -> dict[str, Any]:
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MixedPrecisionConfig"
    )
    out: dict[str, Any] = {}
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out[item.target.id] = _literal(item.value) if item.value is not None else None
    return out


def parse_recipes(source: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``(recipes, unreadable)`` of Bridge's ``mixed_precision.py`` text: each
    ``@register``-ed recipe -> the fields it sets to other than ``MixedPrecisionConfig``'s
    defaults (as ``RECORDED_RECIPES``), and the names of recipes written in a form this
    reader does not follow."""
    tree = ast.parse(source)
    defaults = _class_defaults(tree)
    functions = {
        n.name: n
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "register" for d in n.decorator_list)
    }

    @functools.cache
    def build(name: str) -> tuple[tuple[str, Any], ...]:
        fields: dict[str, Any] | None = None
        for stmt in functions[name].body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # the docstring
            call = getattr(stmt, "value", None)
            if isinstance(stmt, ast.Return) and isinstance(call, ast.Call):
                if getattr(call.func, "id", None) != "MixedPrecisionConfig" or call.args:
                    raise _Unreadable(ast.unparse(stmt))
                fields = {**defaults, **{str(k.arg): _literal(k.value) for k in call.keywords}}
                break
            if isinstance(stmt, ast.Return) and isinstance(call, ast.Name) and fields is not None:
                break
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target = stmt.targets[0]
                if isinstance(target, ast.Name) and isinstance(call, ast.Call) and not call.args:
                    base = getattr(call.func, "id", None)
                    if base in functions and fields is None:
                        fields = dict(build(base))
                        continue
                if isinstance(target, ast.Attribute) and fields is not None:
                    fields[target.attr] = _literal(stmt.value)
                    continue
            raise _Unreadable(ast.unparse(stmt))
        if fields is None:
            raise _Unreadable(name)
        return tuple(fields.items())

    recipes: dict[str, dict[str, Any]] = {}
    unreadable: list[str] = []
    for name in functions:
        try:
            fields = dict(build(name))
        except _Unreadable:
            unreadable.append(name)
            continue
        recipes[name] = {
            k: v for k, v in fields.items() if k not in _MIRRORED and defaults.get(k) != v
        }
    return recipes, unreadable
