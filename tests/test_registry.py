"""The registry: built-ins, third-party recipes through entry points, duplicates refused.

The third-party tests build real distributions in a temp dir and install them with pip
(`--target`, so the shared environment is untouched); a subprocess with that directory on
its path then runs the real `nemo-fp8` CLI, which discovers them through
importlib.metadata like any installed plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemo_fp8_plugin import FP8ConfigError, RecipeRegistryError, get_recipe, register_recipe
from nemo_fp8_plugin.registry import RecipeRegistry, _spec_from_object, default_registry

pytestmark = pytest.mark.torch_free


def make_plugin(
    root: Path, dist: str, module: str, entry_points: dict[str, str], body: str
) -> Path:
    pkg = root / dist
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(textwrap.dedent(body))
    eps = "\n".join(f'{name} = "{target}"' for name, target in entry_points.items())
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.0.1"

        [tool.setuptools]
        packages = ["{module}"]

        [project.entry-points."nemo_fp8_plugin.recipes"]
        """)
        + eps
        + "\n"
    )
    return pkg


def pip_install_target(pkg: Path, target: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(target),
            str(pkg),
        ],
        check=True,
        capture_output=True,
        text=True,
    )


def run_cli(args, target: Path):
    env = dict(os.environ, PYTHONPATH=str(target) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


PLUGIN_BODY = """
    from nemo_fp8_plugin import get_recipe

    def tiny_block():
        # A third party's variant: block scaling with 1x128 weight tiles and pow2 scales.
        return get_recipe({"recipe": "fp8_blockwise", "weight_block": [1, 128],
                           "pow2_scales": True,
                           "description": "1x128 weight tiles (third-party)"})

    AS_MAPPING = {"scaling": "tensorwise", "fp8_format": "e4m3",
                  "description": "E4M3 tensorwise (third-party mapping)"}
"""


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    target = root / "site"
    pkg = make_plugin(
        root,
        "acme-fp8-recipes",
        "acme_fp8",
        {"acme_block": "acme_fp8:tiny_block", "acme_e4m3": "acme_fp8:AS_MAPPING"},
        PLUGIN_BODY,
    )
    pip_install_target(pkg, target)
    return target


@pytest.mark.slow
def test_third_party_recipe_is_listed(installed_plugin):
    out = run_cli(["recipes", "--json"], installed_plugin)
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert {"fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"} <= set(rows)
    acme = rows["acme_block"]
    assert acme["weight_block"] == [1, 128] and acme["pow2_scales"] is True
    assert "acme-fp8-recipes" in acme["source"]
    assert rows["acme_e4m3"]["scaling"] == "tensorwise"
    text = run_cli(["recipes"], installed_plugin)
    assert "acme_block" in text.stdout and "1x128 weight tiles (third-party)" in text.stdout


@pytest.mark.slow
def test_third_party_recipe_usable_in_a_config(installed_plugin, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: acme_block\n")
    out = run_cli(["explain", str(cfg), "--json"], installed_plugin)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["recipe"]["name"] == "acme_block"


@pytest.mark.slow
def test_duplicate_of_a_builtin_is_refused(tmp_path):
    target = tmp_path / "site"
    pkg = make_plugin(
        tmp_path,
        "evil-fp8",
        "evil_fp8",
        {"fp8_blockwise": "evil_fp8:R"},
        'R = {"scaling": "tensorwise"}\n',
    )
    pip_install_target(pkg, target)
    out = run_cli(["recipes"], target)
    assert out.returncode == 2
    assert "fp8_blockwise" in out.stderr and "defined twice" in out.stderr
    assert "built-in preset fp8_blockwise.yaml" in out.stderr and "evil-fp8" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_duplicate_between_two_plugins_names_both(tmp_path):
    target = tmp_path / "site"
    for dist, mod in (("one-fp8", "one_fp8"), ("two-fp8", "two_fp8")):
        pip_install_target(
            make_plugin(
                tmp_path, dist, mod, {"shared_name": f"{mod}:R"}, 'R = {"scaling": "tensorwise"}\n'
            ),
            target,
        )
    out = run_cli(["recipes", "--json"], target)
    assert out.returncode == 2
    assert "one-fp8" in out.stderr and "two-fp8" in out.stderr and "shared_name" in out.stderr


@pytest.mark.slow
def test_broken_plugin_is_named(tmp_path):
    target = tmp_path / "site"
    pip_install_target(
        make_plugin(
            tmp_path,
            "broken-fp8",
            "broken_fp8",
            {"b": "broken_fp8:make"},
            "def make():\n    raise RuntimeError('boom')\n",
        ),
        target,
    )
    out = run_cli(["recipes"], target)
    assert out.returncode == 2
    assert "broken-fp8" in out.stderr and "boom" in out.stderr


def test_registry_refuses_duplicates_directly():
    reg = RecipeRegistry()
    spec = get_recipe("fp8_current")
    reg.register(spec, "first source")
    with pytest.raises(RecipeRegistryError, match="first source and by second source"):
        reg.register(spec, "second source")


def test_entry_point_objects():
    spec = _spec_from_object(lambda: get_recipe("fp8_current"), "renamed", "test")
    assert spec.name == "renamed" and spec.scaling == "tensorwise"
    with pytest.raises(RecipeRegistryError, match="expected a RecipeSpec"):
        _spec_from_object(42, "x", "test")
    with pytest.raises(RecipeRegistryError, match="invalid recipe"):
        _spec_from_object({"scaling": "block"}, "x", "test")


def test_register_recipe_programmatically():
    spec = get_recipe("fp8_blockwise").replace(name="test_programmatic_block", pow2_scales=True)
    register_recipe(spec, source="test")
    assert get_recipe("test_programmatic_block") == spec
    with pytest.raises(RecipeRegistryError):
        register_recipe(spec, source="test again")
    # survives a reload of the registry
    assert "test_programmatic_block" in default_registry(reload=True)


def test_get_recipe_inputs():
    assert get_recipe(get_recipe("mxfp8")) is get_recipe("mxfp8")
    with pytest.raises(FP8ConfigError, match="did you mean 'mxfp8'"):
        get_recipe("mxfp")
    with pytest.raises(FP8ConfigError) as info:
        get_recipe({"pow2_scales": True})
    assert info.value.key == "recipe"
    with pytest.raises(FP8ConfigError):
        get_recipe(3.5)  # type: ignore[arg-type]
