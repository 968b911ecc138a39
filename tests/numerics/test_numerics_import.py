"""numerics runs on a machine that has only torch: no YAML, no omegaconf, no host package, and
of the plugin itself nothing but ``errors`` (the layer contract: numerics sits below the
recipe spec and registry; the caller resolves a recipe name with ``get_recipe``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import nemo_fp8_plugin

PACKAGE = Path(nemo_fp8_plugin.__file__).resolve().parent
NUMERICS = PACKAGE / "numerics"
NUMERICS_MODULES = sorted(p.stem for p in NUMERICS.glob("*.py") if p.stem != "__init__")

BLOCKED = ("yaml", "omegaconf", "megatron", "transformer_engine", "vllm", "nemo", "torchao")


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _package_modules_except(*allowed: str) -> list[str]:
    """Every module and subpackage of nemo_fp8_plugin (found on disk, nothing imported) whose
    dotted name is not under one of ``allowed``."""
    names = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if not parts:
            continue
        name = "nemo_fp8_plugin." + ".".join(parts)
        if not any(name == a or name.startswith(a + ".") for a in allowed):
            names.append(name)
    return sorted(set(names))


ISOLATED = """
import json, sys, types
# The package's __init__ imports the registry and the spec; load numerics under a bare package
# object instead, with yaml, the spec, the registry and every other plugin module made
# unimportable (None in sys.modules), as on a machine where only these files existed.
pkg = types.ModuleType("nemo_fp8_plugin")
pkg.__path__ = [{package!r}]
sys.modules["nemo_fp8_plugin"] = pkg
for name in {blocked!r}:
    sys.modules[name] = None
import importlib
import torch
for name in {modules!r}:
    importlib.import_module("nemo_fp8_plugin.numerics." + name)
import nemo_fp8_plugin.numerics as N


class Spec:  # a recipe spec without the spec module: only the fields numerics reads
    name, scaling, fp8_format = "duck_block", "block", "e4m3"
    pow2_scales, amax_epsilon, amax_history_len, amax_compute_algo = False, 0.0, 1, "max"
    margin, reduce_amax, fp8_wgrad = 0, True, True

    def format_for(self, role):
        return "e4m3"

    def block_for(self, role):
        return (128, 128) if role == "weight" else (1, 128)


gen = torch.Generator().manual_seed(0)
model = N.convert_to_fp8_emulation(torch.nn.Sequential(torch.nn.Linear(128, 128)), Spec())
model(torch.randn(4, 128, generator=gen)).sum().backward()
N.quantize_mxfp8(torch.randn(4, 64, generator=gen))
N.DelayedScalingState(4, "max", 0, "e5m2").update(torch.tensor(3.0))
try:
    N.convert_to_fp8_emulation(torch.nn.Linear(4, 4), "fp8_blockwise")
except N.RecipeTypeError as err:
    assert "get_recipe" in str(err), err
else:
    raise AssertionError("a recipe name was accepted")
print(json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)))
"""


@pytest.mark.slow
def test_numerics_loads_without_spec_registry_yaml_or_any_other_plugin_module():
    blocked = (
        "yaml",
        "omegaconf",
        "nemo_fp8_plugin.spec",
        "nemo_fp8_plugin.registry",
        *_package_modules_except("nemo_fp8_plugin.errors", "nemo_fp8_plugin.numerics"),
    )
    assert "nemo_fp8_plugin.config" in blocked and "nemo_fp8_plugin.rl.refit" in blocked
    loaded = _run(ISOLATED.format(package=str(PACKAGE), blocked=blocked, modules=NUMERICS_MODULES))
    plugin = {m for m in loaded if m.split(".")[0] == "nemo_fp8_plugin"}
    want = {
        "nemo_fp8_plugin",
        "nemo_fp8_plugin.errors",
        "nemo_fp8_plugin.numerics",
        *(f"nemo_fp8_plugin.numerics.{m}" for m in NUMERICS_MODULES),
    }
    assert plugin == want
    assert "yaml" not in {m.split(".")[0] for m in loaded}


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(level, module)`` of every import in a file, those under ``if TYPE_CHECKING:`` aside
    (annotations only, never executed)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


@pytest.mark.parametrize("module", ["__init__", *NUMERICS_MODULES])
def test_numerics_imports_only_torch_stdlib_and_errors(module):
    """Imports inside functions count too (the subprocess test only runs some of them)."""
    bad = []
    for level, name in _imports(NUMERICS / f"{module}.py"):
        if level == 0:
            ok = (
                name.split(".")[0] in ("torch", "__future__")
                or name.split(".")[0] in sys.stdlib_module_names
            )
        elif level == 1:
            ok = name == "" or name.split(".")[0] in NUMERICS_MODULES
        else:
            ok = level == 2 and name == "errors"
        if not ok:
            bad.append("." * level + name)
    assert not bad, f"numerics/{module}.py imports {bad}"


def test_import_check_catches_a_forbidden_import(tmp_path):
    """The AST check above is not vacuous: a lazy registry import is an import it sees."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from ..registry import get_recipe\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..spec import RecipeSpec\n"
    )
    assert sorted(_imports(probe)) == [(0, "typing"), (2, "registry")]


CODE = """
import sys
for m in {blocked!r}:
    sys.modules[m] = None
import torch
import nemo_fp8_plugin.numerics as N
from nemo_fp8_plugin.spec import RecipeSpec
spec = RecipeSpec(name="custom_block", scaling="block", fp8_format="e4m3",
                  activation_block=(1, 128), weight_block=(128, 128), gradient_block=(1, 128))
gen = torch.Generator().manual_seed(0)
q = N.quantize_blockwise(torch.randn(4, 256, generator=gen), (1, 128))
model = N.convert_to_fp8_emulation(torch.nn.Sequential(torch.nn.Linear(128, 128)), spec)
model(torch.randn(2, 128, generator=gen)).sum().backward()
from nemo_fp8_plugin.rl.refit import quantize_for_refit
out = dict(quantize_for_refit({{"l.weight": torch.randn(128, 128, generator=gen)}}, spec,
                              keep_bf16=lambda n: False, fused=False))
assert out["l.weight"].dtype == torch.float8_e4m3fn
print(json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)))
"""


@pytest.mark.slow
def test_numerics_and_refit_need_only_torch():
    loaded = _run("import json\n" + CODE.format(blocked=BLOCKED))
    roots = {m.split(".")[0] for m in loaded}
    assert not roots & {
        "yaml",
        "omegaconf",
        "megatron",
        "transformer_engine",
        "vllm",
        "nemo",
        "torchao",
    }
