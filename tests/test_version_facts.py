"""Version knowledge lives in ``nemo_fp8_plugin.stacks`` only: one parser, the tested versions
and the hosts' per-release facts as rows; no command parses a host's source while it runs (the
readers are the tests', ``tests/hosts/vllm_source.py`` and ``tests/megatron_source.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.cli import main

pytestmark = pytest.mark.torch_free

PACKAGE = Path(stacks.__file__).parent
EXAMPLES = PACKAGE.parent / "conf" / "examples"
FIXTURE = PACKAGE.parent / "tests" / "fixtures" / "nemo_rl_grpo_trimmed.yaml"


def _configs(tmp_path: Path) -> list[tuple[Path, str, str | None]]:
    """(config, host, refusal) per host, each asking for what reads version facts:
    megatron-core's dropped fields (the honoured-fields rows: none dropped for plain block
    scaling, ``fp8_wgrad: false`` refused by that very check, whose message ``refusal``
    names), NeMo RL's and vLLM's rollout keys. ``refusal`` None: the command succeeds."""
    out = []
    for name, host, block, refusal in (
        ("megatron_gpt_fp8_current.yaml", "megatron", {"recipe": "fp8_blockwise"}, None),
        (
            "megatron_gpt_fp8_current.yaml",
            "megatron",
            {"recipe": "fp8_blockwise", "fp8_wgrad": False},
            "passes fp8_wgrad to Transformer Engine only as DelayedScaling's",
        ),
        ("nemo_rl_grpo_trimmed.yaml", "nemo-rl", {"recipe": "fp8_blockwise"}, None),
        ("vllm_llama8b_fp8_blockwise.yaml", "vllm", {"recipe": "fp8_subchannel"}, None),
    ):
        data = yaml.safe_load((EXAMPLES / name if host != "nemo-rl" else FIXTURE).read_text())
        data.pop("precision", None)
        data["fp8"] = block
        path = tmp_path / f"{len(out)}-{name}"
        path.write_text(yaml.safe_dump(data))
        out.append((path, host, refusal))
    return out


def test_apply_and_explain_parse_no_source(tmp_path, monkeypatch, capsys):
    """``ast.parse`` is never called while apply and explain run (before, megatron-core's
    ``fp8_utils.py`` was parsed on every dropped-field check). Each run must get through the
    checks that read version facts: it succeeds, or is refused by that check, never earlier."""
    calls: list[str] = []
    real = ast.parse

    def recording(source, filename="<unknown>", *args, **kwargs):
        calls.append(str(filename))
        return real(source, filename, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", recording)
    for path, host, refusal in _configs(tmp_path):
        for hardware in ([], ["--hardware", "h100"]):
            out = str(tmp_path / "o.yaml")
            for argv in (
                ["apply", str(path), "--host", host, "-o", out, *hardware],
                ["explain", str(path), "--host", host, *hardware],
            ):
                rc = main(argv)
                err = capsys.readouterr().err
                if refusal is None:
                    assert rc == 0, (argv, err)
                else:
                    assert rc == 2 and refusal in err, (argv, err)
    assert calls == []


def test_one_version_parser():
    """No module but stacks.py defines a version parser."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "stacks.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and re.search(
                r"version_tuple|parse_version|^_key$|version_key", node.name
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not found, found


def _string_constants(tree: ast.Module):
    docstrings = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node


@pytest.mark.parametrize(
    "where",
    ["hosts/vllm", "hosts/megatron", "numerics/vllm_numerics.py", "explain.py", "cli/doctor.py"],
)
def test_tested_versions_are_referred_to_by_name(where):
    """The vLLM and megatron-core modules name no tested version in their code (messages and
    values): they ask stacks.TESTED, a stack or a row."""
    versions = [*stacks.TESTED["vllm"], *stacks.TESTED["megatron-core"]]
    pattern = re.compile(r"(?<![\d.])(" + "|".join(map(re.escape, versions)) + r")(?!\d)")
    root = PACKAGE / where
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value[:60]!r}"
        for path in files
        for node in _string_constants(ast.parse(path.read_text(encoding="utf-8")))
        if pattern.search(node.value)
    ]
    assert not found, found
