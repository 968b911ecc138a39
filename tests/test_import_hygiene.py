"""What importing the package costs: no host, no torch for config-only use, and numerics
without omegaconf/yaml (a GPU box may have only torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch_free

HOSTS = (
    "megatron",
    "nemo",
    "nemo_run",
    "vllm",
    "transformer_engine",
    "lightning",
    "pytorch_lightning",
    "transformers",
)


def modules_after(code: str, blocked: tuple[str, ...] = ()) -> set[str]:
    prelude = ""
    if blocked:
        # Make the blocked packages unimportable, as on a machine that lacks them.
        prelude = f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
    probe = prelude + code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def roots(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def test_import_package_imports_no_host_and_no_torch():
    mods = roots(
        modules_after("import nemo_fp8_plugin; nemo_fp8_plugin.get_recipe('fp8_blockwise')")
    )
    assert not mods & set(HOSTS), mods & set(HOSTS)
    assert "torch" not in mods


def test_config_commands_do_not_import_torch():
    code = (
        "from nemo_fp8_plugin.cli import main\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['recipes', '--json'])\n"
    )
    mods = roots(modules_after(code))
    assert "torch" not in mods and not mods & set(HOSTS)


def test_package_imports_without_yaml_and_omegaconf():
    mods = modules_after("import nemo_fp8_plugin", blocked=("yaml", "omegaconf"))
    assert "nemo_fp8_plugin" in mods
