"""The adapter contract's records: code decides on a warning's or note's fields, never on its
wording, and the shared layer of ``hosts`` names no host (read statically, from the source)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nemo_fp8_plugin.hosts import ADAPTERS, Message, RuleIssueKind

pytestmark = pytest.mark.torch_free

PACKAGE = Path(__file__).resolve().parents[2] / "nemo_fp8_plugin"

_MESSAGE = re.compile(r"warn|note", re.IGNORECASE)
_TEXT_METHODS = ("replace", "startswith", "endswith")


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        first = node.args[0]  # section.get("warnings", [])
        if node.func.attr == "get" and isinstance(first, ast.Constant):
            return str(first.value)
    return None


def _text_decisions(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` of each decision on a warning's or note's text: ``.replace(`` /
    ``.startswith(`` / ``.endswith(`` called on one, ``in`` / ``not in`` over one (a substring
    test), and ``x in warnings`` / ``x in notes``. A name counts as a message when it says so
    (``warning``, ``notes``, ``result.warnings``) or when a loop or comprehension binds it
    from one."""
    bound: set[str] = set()

    def message(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and _name(node) in ("list", "sorted", "reversed"):
            return bool(node.args) and message(node.args[0])
        name = _name(node)
        return name is not None and (bool(_MESSAGE.search(name)) or name in bound)

    for _ in range(2):  # loop variables of loop variables
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, (ast.For, ast.comprehension)):
                pairs.append((node.target, node.iter))
            for target, source in pairs:
                if message(source) and isinstance(target, ast.Name):
                    bound.add(target.id)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _TEXT_METHODS and message(node.func.value):
                found.append((node.lineno, f".{node.func.attr}( on {ast.unparse(node.func.value)}"))
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and (message(left) or message(right)):
                    found.append((node.lineno, ast.unparse(node)))
                left = right
    return found


def _package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_no_package_code_decides_on_a_messages_wording():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path, tree in _package_sources()
        for line, what in _text_decisions(tree)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "code",
    [
        "moved = [w for w in result.warnings if w in unexpressible]",
        'out = [w.replace("(host megatron)", "(host nemo-rl)") for w in warnings]',
        'keep = [n for n in r["notes"] if not n.startswith("judged for")]',
        'labelled = [w if f"host {host}" in w else w for w in section.get("warnings", [])]',
        "seen = text in result.notes",
    ],
)
def test_the_scan_finds_each_kind_of_text_decision(code):
    assert _text_decisions(ast.parse(code))


def test_a_message_is_its_fields_rendered():
    rule = Message(
        "no megatron-core name",
        "megatron",
        "bf16_layers.modules[1]='*x*'",
        RuleIssueKind.UNTRANSLATABLE,
        (1,),
        ("*x*",),
    )
    assert str(rule) == "bf16_layers.modules[1]='*x*' (host megatron): no megatron-core name"
    assert str(rule.about("nemo-rl")).startswith("bf16_layers.modules[1]='*x*' (host nemo-rl)")
    assert rule.key == "bf16_layers.modules[1]" and rule.patterns == ("*x*",)
    assert str(Message("fp8_wgrad: dropped", "nemo2")) == "nemo2: fp8_wgrad: dropped"
    assert str(Message("as is")) == "as is"


# The contract, the context and the pipeline are the same for every host: a host-specific step
# is a method or hook of that host's adapter. The table of hosts (hosts/table.py) is the one
# place that lists them.
SHARED = ("__init__.py", "contract.py", "context.py", "pipeline.py")


def _host_names() -> set[str]:
    return {n for host in ADAPTERS for n in (host, host.replace("-", "_"))}


@pytest.mark.parametrize("module", SHARED)
def test_the_shared_layer_names_no_host(module):
    tree = ast.parse((PACKAGE / "hosts" / module).read_text())
    docstrings = {  # every bare string statement: a docstring, or an attribute's
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    names = _host_names()
    words = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names - {"te"}))) + r")\b")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings:
                continue  # prose may name a library (megatron-core); code may not name a host
            if node.value in names or words.search(node.value):
                found.append(f"{node.lineno}: {node.value[:60]!r}")
        elif isinstance(node, (ast.Name, ast.Attribute, ast.alias, ast.FunctionDef, ast.arg)):
            ident = getattr(node, "id", None) or getattr(node, "attr", None)
            ident = ident or getattr(node, "name", None) or getattr(node, "arg", None)
            if ident and any(part in names - {"te"} for part in ident.lower().split("_")):
                found.append(f"{node.lineno}: {ident}")
    assert not found, found
