"""Every recipe on the Transformer Engine versions users have: 2.11.0 (NeMo 2.7.3's range),
2.14.0 (NeMo RL v0.6.0's lock: 2.14.0+71bbefb), 2.14.1, 2.15.0 (NeMo RL v0.7.0's and main's
lock: 2.15.0+42b8400; the registry's releases stand in for those git builds) and 2.20.2
(latest), each release's own
``transformer_engine/common/recipe/__init__.py`` loaded by file path from its pure-Python wheel
in ``.cache/upstream`` (``scripts/install.sh test`` downloads them with
``pip download --no-deps transformer-engine==V``).

Each recipe is built (:func:`build_te_recipe`, every field read back) and passes the
start-of-training check (:func:`verify_host_recipe`) with the environment the recipe needs set
before the module is imported, or is refused naming the version and the first release that can
run it. The same module then stands in for ``transformer_engine.common.recipe`` under the NeMo 2
and Megatron-Bridge callbacks, Bridge's registered recipes and megatron-core's
``build_transformer_config``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

from conftest import IN_CI, UPSTREAM, upstream_file
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import te
from nemo_fp8_plugin.registry import get_recipe, list_recipes

pytestmark = pytest.mark.host

VERSIONS = stacks.TESTED["transformer-engine"]
MEMBER = "transformer_engine/common/recipe/__init__.py"
PRESETS = [s.name for s in list_recipes() if s.training == "fp8"]


def _wheel(version: str):
    wheels = sorted(UPSTREAM.glob(f"transformer_engine-{version}-*.whl"))
    if not wheels:
        reason = f"{UPSTREAM}/transformer_engine-{version}-py3-none-any.whl is absent"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return wheels[0]


def load_te(version: str, dest, monkeypatch, env: dict[str, str], name: str | None = None):
    """TE ``version``'s recipe module, imported with exactly ``env`` among the variables TE
    reads at import (the others unset)."""
    _wheel(version)
    for var in _te_variables():
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    path = upstream_file(f"transformer_engine-{version}-*.whl", MEMBER, dest / version)
    name = name or f"te_recipe_{version.replace('.', '_')}_{abs(hash(str(dest)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _te_variables() -> set[str]:
    from nemo_fp8_plugin.capabilities import (
        ENV_BACKWARD_OVERRIDE,
        ENV_BLOCK_FP32_SCALES,
        ENV_CURRENT_POW2_SCALES,
        ENV_NVFP4,
    )

    return {
        ENV_BACKWARD_OVERRIDE,
        ENV_BLOCK_FP32_SCALES,
        ENV_CURRENT_POW2_SCALES,
        *ENV_NVFP4.values(),
    }


def install_as_te(monkeypatch, module, version: str) -> None:
    """``module`` importable as ``transformer_engine.common.recipe`` (empty package shells;
    the top one says ``__version__`` as TE's does). Import megatron-core before: imported with
    TE present it asks for TE's kernels."""
    pkg, common = (
        types.ModuleType("transformer_engine"),
        types.ModuleType("transformer_engine.common"),
    )
    pkg.__version__ = version
    common.recipe, pkg.common = module, common
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", module)


# --------------------------------------------------------------------------- the table is right


@pytest.mark.parametrize("version", VERSIONS)
def test_the_field_table_agrees_with_each_release(version, tmp_path, monkeypatch):
    """Every ``Class.field`` fact of the stacks table says, for this release, what the
    release's own classes declare (and each class fact: whether the class exists)."""
    mod = load_te(version, tmp_path, monkeypatch, {})
    checked = 0
    for f in stacks.FACTS:
        if f.host != "transformer-engine":
            continue
        answer = stacks.lookup("transformer-engine", f.name, version)
        assert answer.tested, answer.note
        cls_name, _, field = f.name.partition(".")
        if not field:
            assert answer.present == hasattr(mod, cls_name), f.name
            continue
        classes = (
            [te.TE_RECIPE_CLASS[k] for k in te.TE_RECIPE_CLASS]
            if cls_name == "Recipe"
            else [cls_name]
        )
        for name in classes:
            declared = field in getattr(mod, name).__dataclass_fields__
            assert declared == answer.present, (f.name, name, version)
            checked += 1
    assert checked >= 10


def test_an_untested_version_is_said_to_be_untested():
    answer = stacks.lookup(
        "transformer-engine", "MXFP8BlockScaling.enable_2d_quantization", "2.21.0"
    )
    assert answer.present is True and answer.tested is False
    assert "untested" in answer.note and "2.20.2" in answer.note
    old = stacks.lookup("transformer-engine", "MXFP8BlockScaling.enable_2d_quantization", "2.18.0")
    assert old.present is False and "from 2.19" in old.note


# --------------------------------------------------------------------------- every recipe, every version


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("recipe", PRESETS)
def test_every_recipe_builds_and_passes_the_start_check(recipe, version, tmp_path, monkeypatch):
    spec = get_recipe(recipe)
    mod = load_te(version, tmp_path, monkeypatch, te.required_env(spec))
    obj = te.build_te_recipe(spec, mod, te_version=version)
    assert type(obj).__name__ == te.TE_RECIPE_CLASS[spec.scaling]
    assert te.recipe_mismatches(obj, spec) == []
    te.verify_host_recipe(spec, mod, te_version=version)


@pytest.mark.parametrize("version", VERSIONS)
def test_nvfp4_on_a_te_without_row_scaling_is_its_default_recipe(version, tmp_path, monkeypatch):
    """TE < 2.16 has no row_scaled_activation and TE < 2.17 no "4over6": their absence is the
    spec's "off", so nothing is refused, and no hint names a variable that TE never reads."""
    spec = get_recipe("nvfp4")
    mod = load_te(version, tmp_path, monkeypatch, te.required_env(spec))
    obj = te.build_te_recipe(spec, mod, te_version=version)
    has_row = "row_scaled_activation" in mod.NVFP4BlockScaling.__dataclass_fields__
    assert has_row == (version == "2.20.2")
    assert obj.fp4_quant_bwd_grad.stochastic_rounding is True  # TE's default recipe, read back


@pytest.mark.parametrize("version", VERSIONS)
def test_a_wrong_nvfp4_variable_is_still_caught_on_every_version(version, tmp_path, monkeypatch):
    spec = get_recipe("nvfp4")
    env = {**te.required_env(spec), "NVTE_NVFP4_DISABLE_RHT": "1"}
    mod = load_te(version, tmp_path, monkeypatch, env)
    with pytest.raises(FP8ConfigError, match="NVTE_NVFP4_DISABLE_RHT=0") as err:
        te.verify_host_recipe(spec, mod, te_version=version)
    assert err.value.key == "NVTE_NVFP4_DISABLE_RHT"


@pytest.mark.parametrize("version", VERSIONS)
def test_mxfp8_32x32_tiles_need_te_2_19(version, tmp_path, monkeypatch):
    """32x32 MXFP8 weight tiles are TE's enable_2d_quantization (from 2.19): refused naming the
    version and the minimum where it is missing, built where it exists."""
    spec = get_recipe({"recipe": "mxfp8", "weight_block": [32, 32]})
    mod = load_te(version, tmp_path, monkeypatch, {})
    if stacks.lookup(
        "transformer-engine", "MXFP8BlockScaling.enable_2d_quantization", version
    ).present:
        assert te.build_te_recipe(spec, mod, te_version=version).enable_2d_quantization is True
        return
    for check in (te.build_te_recipe, te.verify_host_recipe):
        with pytest.raises(FP8ConfigError) as err:
            check(spec, mod, te_version=version)
        assert err.value.key == "weight_block"
        assert f"Transformer Engine {version}" in str(err.value)
        assert "2.19" in str(err.value) and "NVTE_" not in str(err.value)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_fp32_scale_trap_is_caught_on_every_version(version, tmp_path, monkeypatch):
    mod = load_te(version, tmp_path, monkeypatch, {})
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"):
        te.verify_host_recipe(get_recipe("fp8_blockwise"), mod, te_version=version)


# --------------------------------------------------------------------------- hosts on the older TE


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("recipe", PRESETS)
def test_callbacks_start_on_every_version(recipe, version, tmp_path, monkeypatch):
    """The NeMo 2 Lightning callback's start-of-training check, against this TE as the
    process's ``transformer_engine.common.recipe``."""
    from nemo_fp8_plugin.hosts.nemo2.callback import FP8ScaleRefreshCallback

    spec = get_recipe(recipe)
    mod = load_te(version, tmp_path, monkeypatch, te.required_env(spec))
    install_as_te(monkeypatch, mod, version)
    assert te.verify_installed_te(recipe) is True
    FP8ScaleRefreshCallback(recipe).setup(trainer=None, pl_module=None, stage="fit")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("recipe", PRESETS)
def test_build_transformer_config_on_every_version(recipe, version, tmp_path, monkeypatch):
    """megatron-core 0.16.1's real TransformerConfig, built in a process whose TE is this one."""
    import megatron.core.transformer  # noqa: F401  (before TE appears: see install_as_te)

    from nemo_fp8_plugin.hosts import megatron as mg

    spec = get_recipe(recipe)
    mod = load_te(version, tmp_path, monkeypatch, te.required_env(spec))
    install_as_te(monkeypatch, mod, version)
    cfg = mg.build_transformer_config(
        spec, num_layers=4, hidden_size=256, num_attention_heads=4, bf16=True
    )
    if spec.scaling == "nvfp4":
        assert (cfg.fp4, cfg.fp4_recipe) == ("e2m1", "nvfp4")
    else:
        assert cfg.fp8 == spec.fp8_format


@pytest.mark.parametrize("version", VERSIONS)
def test_bridge_registered_recipes_resolve_on_every_version(version, tmp_path, monkeypatch):
    """Megatron-Bridge 0.6.2's own mixed_precision.py (from its wheel) with our recipes
    registered resolves each in a process whose TE is this one (nvfp4 is Bridge's own
    bf16_with_nvfp4_mixed, reached through mixed_precision_config, which checks TE too)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "bridge"))  # its folder
    from test_bridge_adapter import _AllowList, _load_bridge_mixed_precision

    from nemo_fp8_plugin.hosts import bridge

    mp = _load_bridge_mixed_precision(
        tmp_path, monkeypatch, f"bridge_mp_{version.replace('.', '_')}"
    )
    bridge.register(mp, instantiate_module=_AllowList())
    for recipe in PRESETS:
        spec = get_recipe(recipe)
        mod = load_te(version, tmp_path / recipe, monkeypatch, te.required_env(spec))
        install_as_te(monkeypatch, mod, version)
        if spec.scaling == "nvfp4":
            config = bridge.mixed_precision_config(recipe, mp_module=mp)
            assert config.fp4_recipe == "nvfp4"
        else:
            assert mp.get_mixed_precision_config(recipe).fp8 == spec.fp8_format


def test_skip_reason_names_the_wheel_path():
    """The skip for a missing wheel names the path the install script downloads to."""
    with pytest.raises((pytest.skip.Exception, pytest.fail.Exception)) as out:
        _wheel("0.0.0")
    assert re.search(r"transformer_engine-0\.0\.0-py3-none-any\.whl is absent", str(out.value))


@pytest.mark.parametrize("version", VERSIONS)
def test_nvfp4_fp8_attention_is_a_field_of_every_release(version, tmp_path, monkeypatch):
    """NVFP4BlockScaling(fp8_dpa=True) builds and reads back on each release (the megatron
    adapter decides whether the host passes it)."""
    spec = get_recipe({"recipe": "nvfp4", "fp8_dot_product_attention": True})
    mod = load_te(version, tmp_path, monkeypatch, te.required_env(spec))
    assert te.build_te_recipe(spec, mod, te_version=version).fp8_dpa is True
