"""The `nemo-fp8` CLI as users run it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from nemo_fp8_plugin.cli import COMMANDS, build_parser

FIVE = ("fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8")


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "nemo_fp8_plugin", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_recipes_json_lists_the_five_with_their_fields():
    out = cli("recipes", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(FIVE) <= set(rows)
    for name in FIVE:
        for key in ("description", "scaling", "fp8_format", "activation_block", "weight_block",
                    "pow2_scales", "amax_history_len", "bf16_layers", "kv_cache"):
            assert key in rows[name], (name, key)
    assert rows["fp8_blockwise"]["weight_block"] == [128, 128]
    assert rows["fp8_blockwise"]["activation_block"] == [1, 128]
    assert rows["fp8_delayed"]["amax_history_len"] == 1024


def test_recipes_text_one_line_each():
    out = cli("recipes")
    lines = out.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines[:5]] == list(FIVE)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_explain_precision_name(tmp_path):
    out = cli("explain", write(tmp_path, "precision: fp8_blockwise\n"), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["recipe"]["name"] == "fp8_blockwise"
    assert report["recipe"]["pow2_scales"] is False
    assert report["keys"] == ["precision"]
    text = cli("explain", write(tmp_path, "precision: fp8_blockwise\n"))
    assert "recipe: fp8_blockwise" in text.stdout


def test_explain_mapping_override(tmp_path):
    out = cli("explain", write(tmp_path, "fp8:\n  recipe: fp8_blockwise\n  pow2_scales: true\n"),
              "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["recipe"]["pow2_scales"] is True


def test_explain_bogus_recipe_exits_2_with_one_line(tmp_path):
    out = cli("explain", write(tmp_path, "precision: fp8_bogus\n"))
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    for name in FIVE:
        assert name in lines[0]
    assert "did you mean 'fp8_blockwise'" in lines[0]
    assert "precision" in lines[0]


@pytest.mark.parametrize("args", [
    ("explain", "/nonexistent/c.yaml"),
    ("explain",),
    ("apply", "x.yaml"),
    ("frobnicate",),
])
def test_usage_errors_exit_2_without_traceback(args):
    out = cli(*args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_not_a_mapping(tmp_path):
    out = cli("explain", write(tmp_path, "- 1\n- 2\n"))
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_no_request_is_reported_not_refused(tmp_path):
    out = cli("explain", write(tmp_path, "precision: bf16-mixed\n"), "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout)["recipe"] is None


def test_help_on_every_command():
    assert cli("--help").returncode == 0
    names = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert len(names) == len(COMMANDS)
    for name in names:
        out = cli(name, "--help")
        assert out.returncode == 0, name
        assert "usage: nemo-fp8" in out.stdout


def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("nemo-fp8")
    out = subprocess.run([str(exe), "recipes"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "fp8_blockwise" in out.stdout


def test_example_configs_explain():
    for path in sorted((REPO / "conf" / "examples").glob("*.yaml")):
        out = cli("explain", path, "--json")
        assert out.returncode == 0, (path, out.stderr)
