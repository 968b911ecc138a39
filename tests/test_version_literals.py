"""Messages name host versions from the stacks table (``nemo_fp8_plugin.stacks``: NeMo RL
releases, their vLLM, the vLLM releases read), never as literals of their own, so a new release
changes one row; and what they say of those versions holds in the versions' own source."""

from __future__ import annotations

import re
import zipfile

import pytest
from vllm_source import WHEELS

from conftest import REPO, upstream_wheel
from nemo_fp8_plugin import stacks

PACKAGE = REPO / "nemo_fp8_plugin"

MODULES = ("capabilities.py", "kinds.py", "hosts/vllm/adapter.py")
"""Modules whose messages name host versions."""

LITERALS = [
    *(r.commit for r in stacks.NEMO_RL_RELEASES),
    *stacks.TESTED["vllm"],
    *{".".join(v.split(".")[:2]) for v in stacks.TESTED["vllm"]},
]


def _string_literals(path):
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                yield node.lineno, node.value


@pytest.mark.parametrize("module", MODULES)
def test_messages_take_versions_from_the_stacks_table(module):
    found = [
        (line, version, text)
        for line, text in _string_literals(PACKAGE / module)
        for version in LITERALS
        if re.search(rf"(?<![\d.]){re.escape(version)}(?![\d])", text)
    ]
    assert found == [], module


@pytest.mark.parametrize("version", sorted(WHEELS))
def test_no_vllm_release_read_has_a_device_engine_argument(version):
    """The vLLM adapter drops ``device:`` saying no release read has the engine argument:
    each wheel's ``EngineArgs`` (``vllm/engine/arg_utils.py``) declares no ``device`` field."""
    with zipfile.ZipFile(upstream_wheel(WHEELS[version])) as zf:
        source = zf.read("vllm/engine/arg_utils.py").decode()
    engine_args = source.split("class EngineArgs", 1)[1].split("\nclass ", 1)[0]
    assert "class EngineArgs" in source
    assert not re.search(r"^    device: ", engine_args, flags=re.MULTILINE)
