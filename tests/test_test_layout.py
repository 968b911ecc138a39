"""The test suite's own rules: recipe lists come from the registry (``tests/presets.py``), so a
new preset is tested everywhere or fails loudly; no test file is named after a tracker entry."""

from __future__ import annotations

import ast
import re

from conftest import REPO
from presets import preset_names

TESTS = REPO / "tests"


def _literal_strings(node: ast.AST) -> list[str] | None:
    """The elements of a list/tuple literal of string constants, else None."""
    if isinstance(node, (ast.List, ast.Tuple)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


def _hand_written_recipe_lists(tree: ast.Module, presets: set[str]) -> list[int]:
    """Lines of recipe lists typed out: a parametrize's values or a module-level constant that
    is a literal of two or more preset names."""
    found = []
    candidates: list[ast.AST] = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id.startswith("BUILT_IN_") for t in targets):
                continue  # the one statement of what ships (tests/test_spec.py)
            candidates.append(node.value)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("parametrize", "sampled_from")
        ):
            candidates.extend(node.args[1:2] if node.func.attr == "parametrize" else node.args)
    for value in candidates:
        names = _literal_strings(value)
        if names and len([n for n in names if n in presets]) >= 2:
            found.append(value.lineno)  # type: ignore[attr-defined]
    return found


def test_no_hand_written_recipe_list():
    presets = set(preset_names())
    offenders = {
        str(path.relative_to(REPO)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if (lines := _hand_written_recipe_lists(ast.parse(path.read_text()), presets))
    }
    assert offenders == {}, "take the list from tests/presets.py (preset_names / FP8_PRESETS)"


def test_the_check_sees_a_typed_out_list():
    presets = set(preset_names())
    typed = ast.parse(
        'RECIPES = ["fp8_blockwise", "mxfp8"]\n'
        '@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])\n'
        "def test_x(recipe): ...\n"
        'SOME = ["fp8_blockwise"]\n'  # one name is a case, not a list
        'BUILT_IN_FP8_PRESETS = ("fp8_current", "mxfp8")\n'  # what ships, stated once
    )
    assert _hand_written_recipe_lists(typed, presets) == [1, 2]


def test_no_test_file_is_named_after_a_tracker_entry():
    named = [
        str(p.relative_to(REPO))
        for p in TESTS.rglob("*.py")
        if re.search(r"(issue|ticket|bug|gh)[_-]?\d+", p.name, re.IGNORECASE)
    ]
    assert named == []
