"""Transformer Engine adapter against TE 2.20.2's real recipe module (loaded by file path).

TE's recipe module reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES and
NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES when it is imported, so each environment state is
loaded under its own module name (a fresh import) with the variables set or cleared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

from conftest import REPO, load_te_recipe_module
from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin.hosts import apply_path, te
from presets import FP8_PRESETS

pytestmark = pytest.mark.host

RECIPES = FP8_PRESETS
BACKWARD_OVERRIDE = "NVTE_BACKWARD_OVERRIDE"  # TE >= 2.15, read at import by every recipe class
ENV_VARS = (te.ENV_BLOCK_FP32_SCALES, te.ENV_CURRENT_POW2_SCALES, BACKWARD_OVERRIDE)


def _load(tmp_path_factory, monkeypatch, name: str, env: dict[str, str]):
    """TE's recipe module imported fresh with exactly ``env`` among the variables it reads."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    module = load_te_recipe_module(tmp_path_factory.mktemp("te"), name=name)
    monkeypatch.delitem(sys.modules, name)
    return module


@pytest.fixture
def te_unset(tmp_path_factory, monkeypatch):
    """TE as a training process sees it when nobody set the variables."""
    return _load(tmp_path_factory, monkeypatch, "te_recipe_env_unset", {})


@pytest.fixture
def te_fp32_env(tmp_path_factory, monkeypatch):
    """TE imported with NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 (as NeMo RL's FP8 recipe sets it)."""
    return _load(
        tmp_path_factory, monkeypatch, "te_recipe_env_fp32", {te.ENV_BLOCK_FP32_SCALES: "1"}
    )


@pytest.mark.parametrize("name", RECIPES)
def test_every_field_and_quantizer_reads_back(name, te_unset):
    spec = get_recipe(name)
    obj = te.build_te_recipe(spec, te_unset)
    desc = te.te_recipe_description(spec)
    assert type(obj).__name__ == desc["class"] == te.TE_RECIPE_CLASS[spec.scaling]
    for field, want in desc["fields"].items():
        have = getattr(obj, field)
        assert (have.name if field == "fp8_format" else have) == want, field
    for attr in desc["quantizers"]:
        qp = getattr(obj, attr)
        assert isinstance(qp, te_unset.QParams)
        assert qp.power_2_scale is spec.pow2_scales, attr
        assert qp.amax_epsilon == spec.amax_epsilon, attr
    assert te.recipe_mismatches(obj, spec) == []


def test_expected_te_objects(te_unset):
    """The values that matter, stated independently of the adapter's own description."""
    F = te_unset.Format
    d = te.build_te_recipe(get_recipe("fp8_delayed"), te_unset)
    assert (d.fp8_format, d.amax_history_len, d.amax_compute_algo, d.margin) == (
        F.HYBRID,
        1024,
        "max",
        0,
    )
    c = te.build_te_recipe(get_recipe("fp8_current"), te_unset)
    assert c.fp8_format == F.HYBRID and c.use_power_2_scales is False
    sub = te.build_te_recipe(get_recipe("fp8_subchannel"), te_unset)
    assert sub.fp8_format == F.HYBRID and sub.fp8_quant_fwd_weight.power_2_scale is True
    assert (sub.x_block_scaling_dim, sub.w_block_scaling_dim, sub.grad_block_scaling_dim) == (
        1,
        2,
        1,
    )
    blk = te.build_te_recipe(get_recipe("fp8_blockwise"), te_unset)
    assert blk.fp8_format == F.E4M3
    assert [getattr(blk, a).power_2_scale for a in te.QUANTIZER_ROLES] == [False, False, False]
    mx = te.build_te_recipe(get_recipe("mxfp8"), te_unset)
    assert mx.fp8_format == F.E4M3 and mx.enable_2d_quantization is False


def test_constructor_alone_is_the_trap(te_unset):
    """Why the adapter sets quantizer parameters itself: TE's constructor keeps the
    import-time class defaults (power-of-2) even when asked for fp32 scales."""
    obj = te_unset.Float8BlockScaling(fp8_format=te_unset.Format.E4M3, use_f32_scales=True)
    assert obj.use_f32_scales is True
    assert obj.fp8_quant_fwd_inp.power_2_scale is True
    problems = te.recipe_mismatches(obj, get_recipe("fp8_blockwise"))
    assert {p[0] for p in problems} == {f"{a}.power_2_scale" for a in te.QUANTIZER_ROLES}


def test_instance_parameters_do_not_leak_into_the_class(te_unset):
    te.build_te_recipe(get_recipe("fp8_blockwise"), te_unset)
    fresh = te_unset.Float8BlockScaling()
    assert fresh.fp8_quant_fwd_inp.power_2_scale is True  # class default untouched


def test_trap_variable_unset_never_runs_pow2(te_unset):
    """Variable unset at TE import + fp8_blockwise: the object we build has fp32 scales
    (takes effect), and the recipe megatron-core would build is refused with the fix."""
    spec = get_recipe("fp8_blockwise")
    ours = te.build_te_recipe(spec, te_unset)
    assert all(getattr(ours, a).power_2_scale is False for a in te.QUANTIZER_ROLES)
    host = te.host_built_recipe(spec, te_unset)
    assert host.fp8_quant_fwd_inp.power_2_scale is True
    with pytest.raises(FP8ConfigError) as err:
        te.verify_host_recipe(spec, te_unset)
    msg = str(err.value)
    assert err.value.key == "pow2_scales"
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in msg and "fp32" in msg


def test_trap_variable_set_passes(te_fp32_env):
    spec = get_recipe("fp8_blockwise")
    te.verify_host_recipe(spec, te_fp32_env)
    assert te.host_built_recipe(spec, te_fp32_env).fp8_quant_bwd_grad.power_2_scale is False


def test_reverse_trap_subchannel_with_fp32_env(te_fp32_env, te_unset):
    """A cluster-wide NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 would silently give fp8_subchannel
    fp32 scales; the check refuses and asks for 0."""
    spec = get_recipe("fp8_subchannel")
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0"):
        te.verify_host_recipe(spec, te_fp32_env)
    te.verify_host_recipe(spec, te_unset)


def test_current_scaling_pow2_follows_its_own_variable(tmp_path_factory, monkeypatch, te_unset):
    spec = get_recipe({"recipe": "fp8_current", "pow2_scales": True})
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1"):
        te.verify_host_recipe(spec, te_unset)
    pow2 = _load(
        tmp_path_factory, monkeypatch, "te_recipe_env_pow2", {te.ENV_CURRENT_POW2_SCALES: "1"}
    )
    te.verify_host_recipe(spec, pow2)
    assert te.build_te_recipe(spec, te_unset).use_power_2_scales is True


def test_required_env():
    assert te.required_env(get_recipe("fp8_blockwise")) == {te.ENV_BLOCK_FP32_SCALES: "1"}
    assert te.required_env(get_recipe("fp8_subchannel")) == {te.ENV_BLOCK_FP32_SCALES: "0"}
    assert te.required_env(get_recipe("fp8_current")) == {te.ENV_CURRENT_POW2_SCALES: "0"}
    assert te.required_env(get_recipe("fp8_delayed")) == {}
    assert te.required_env(get_recipe("mxfp8")) == {}
    assert te.required_env(get_recipe({"recipe": "fp8_blockwise", "training": "bf16"})) == {}


def test_trap_in_a_fresh_process_both_env_states():
    """The same check in a new interpreter per environment, as a training process sees TE."""
    script = textwrap.dedent("""
        import sys, tempfile
        from pathlib import Path
        sys.path.insert(0, sys.argv[1])
        from conftest import load_te_recipe_module
        from nemo_fp8_plugin import get_recipe, FP8ConfigError
        from nemo_fp8_plugin.hosts.te import verify_host_recipe
        m = load_te_recipe_module(Path(tempfile.mkdtemp()))
        try:
            verify_host_recipe(get_recipe("fp8_blockwise"), m)
            print("OK")
        except FP8ConfigError as e:
            print("REFUSED", e.key)
    """)
    results = {}
    for value in (None, "1"):
        env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
        if value is not None:
            env[te.ENV_BLOCK_FP32_SCALES] = value
        out = subprocess.run(
            [sys.executable, "-c", script, str(REPO / "tests")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert out.returncode == 0, out.stderr
        results[value] = out.stdout.strip().splitlines()[-1]
    assert results == {None: "REFUSED pow2_scales", "1": "OK"}


@pytest.mark.parametrize(
    "override,key",
    [
        ({"recipe": "fp8_delayed", "pow2_scales": True}, "pow2_scales"),
        ({"recipe": "fp8_delayed", "amax_epsilon": 1e-6}, "amax_epsilon"),
    ],
)
def test_unexpressible_settings_refused(override, key, te_unset):
    with pytest.raises(FP8ConfigError) as err:
        te.build_te_recipe(get_recipe(override), te_unset)
    assert err.value.key == key
    assert any(key in w for w in map(str, te.ADAPTER.spell(get_recipe(override)).warnings))


def test_non_default_tiles_and_epsilon_read_back(te_unset):
    spec = get_recipe(
        {
            "recipe": "fp8_blockwise",
            "activation_block": [128, 128],
            "weight_block": [1, 128],
            "amax_epsilon": 1e-12,
        }
    )
    obj = te.build_te_recipe(spec, te_unset)
    assert (obj.x_block_scaling_dim, obj.w_block_scaling_dim) == (2, 1)
    assert obj.fp8_quant_fwd_weight.amax_epsilon == 1e-12
    mx = te.build_te_recipe(get_recipe({"recipe": "mxfp8", "weight_block": [32, 32]}), te_unset)
    assert mx.enable_2d_quantization is True


def test_ignored_constructor_argument_is_caught(te_unset):
    """A TE that silently ignores a field (here: one we pretend it lacks) is refused."""
    spec = get_recipe("fp8_delayed")
    obj = te.build_te_recipe(spec, te_unset)
    obj.amax_history_len = 16  # as if the constructor had dropped the value
    assert te.recipe_mismatches(obj, spec) == [("amax_history_len", 16, 1024)]


def test_te_adapter_imports_no_host():
    code = (
        "import sys; import nemo_fp8_plugin.hosts.te as t; "
        "t.ADAPTER.spell(__import__('nemo_fp8_plugin').get_recipe('fp8_blockwise')); "
        "print(any(m.startswith(('torch', 'transformer_engine')) for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr


def test_apply_file_describes_the_object(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_blockwise\n")
    out = apply_path(te.ADAPTER, cfg).data["transformer_engine"]
    assert out["class"] == "Float8BlockScaling"
    assert out["env"] == {te.ENV_BLOCK_FP32_SCALES: "1"}
    assert out["quantizers"]["fp8_quant_fwd_inp"] == {"power_2_scale": False, "amax_epsilon": 0.0}


# --------------------------------------------------------------------------- TE of this process


def install_te(monkeypatch, recipe_module):
    """Make ``from transformer_engine.common import recipe`` return ``recipe_module`` (TE's real
    recipe file, loaded by path), as it would in a training process with TE installed; the
    package shells above it are empty modules."""
    pkg, common = (
        types.ModuleType("transformer_engine"),
        types.ModuleType("transformer_engine.common"),
    )
    common.recipe, pkg.common = recipe_module, common
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe_module)


def test_verify_installed_te_checks_this_process(monkeypatch, te_unset, te_fp32_env):
    """The in-process check the host paths call: refuses the trap, passes with the variable."""
    install_te(monkeypatch, te_unset)
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1") as err:
        te.verify_installed_te("fp8_blockwise", where="the test")
    assert err.value.key == "pow2_scales" and "the test" in str(err.value)
    assert te.verify_installed_te({"recipe": "fp8_blockwise", "pow2_scales": True}) is True
    assert te.verify_installed_te("mxfp8") is True  # NVTE_BACKWARD_OVERRIDE checked (unset here)
    install_te(monkeypatch, te_fp32_env)
    assert te.verify_installed_te(get_recipe("fp8_blockwise")) is True


def test_verify_installed_te_without_te_checks_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    assert te.verify_installed_te("fp8_blockwise") is False


def test_fp8_wgrad_false_is_refused_because_te_ignores_it(te_unset):
    """TE 2.20's DelayedScaling takes megatron-core's override_linear_precision argument and
    drops it (no such field), and no TE 2.x recipe has another wgrad switch."""
    obj = te_unset.DelayedScaling(override_linear_precision=(False, False, True))
    assert not hasattr(obj, "override_linear_precision")
    for name in RECIPES:
        spec = get_recipe(name).replace(fp8_wgrad=False)
        with pytest.raises(FP8ConfigError) as err:
            te.build_te_recipe(spec, te_unset)
        assert err.value.key == "fp8_wgrad"
        assert any("fp8_wgrad" in w for w in map(str, te.ADAPTER.spell(spec).warnings))


# --------------------------------------------------------------------------- NVTE_BACKWARD_OVERRIDE


def _load_with_override(tmp_path_factory, monkeypatch, spec, value, name):
    """TE imported with NVTE_BACKWARD_OVERRIDE=value and the recipe's own variable pinned as
    the plugin asks (so the override is the only thing wrong)."""
    env = dict(te.required_env(spec))
    env[BACKWARD_OVERRIDE] = value
    return _load(tmp_path_factory, monkeypatch, name, env)


@pytest.mark.parametrize("value", ["high_precision", "dequantized"])
@pytest.mark.parametrize("name", RECIPES)
def test_backward_override_at_import_is_refused_for_every_recipe(
    name, value, tmp_path_factory, monkeypatch
):
    """TE >= 2.15 reads NVTE_BACKWARD_OVERRIDE at import into every recipe class: block,
    current and MXFP8 silently run their backward in high precision (or dequantized), and
    DelayedScaling raises. The check must refuse all five, naming the variable."""
    spec = get_recipe(name)
    mod = _load_with_override(tmp_path_factory, monkeypatch, spec, value, f"te_bo_{name}_{value}")
    cls = getattr(mod, te.TE_RECIPE_CLASS[spec.scaling])
    if spec.scaling == "delayed":
        with pytest.raises((AssertionError, ValueError), match="backward_override"):
            te.host_built_recipe(spec, mod)  # TE's own refusal, as megatron-core would hit it
    else:
        assert te.host_built_recipe(spec, mod).backward_override == value  # TE silently switches
    with pytest.raises(FP8ConfigError) as err:
        te.verify_host_recipe(spec, mod, where="the test")
    assert err.value.key == BACKWARD_OVERRIDE
    text = str(err.value)
    assert f"{BACKWARD_OVERRIDE}={value}" in text and cls.__name__ in text
    assert "unset" in text and "\n" not in text.strip()
    # The object the plugin builds itself pins the override off, whatever the environment.
    assert te.build_te_recipe(spec, mod).backward_override is None


def test_verify_installed_te_checks_the_override_for_every_recipe(tmp_path_factory, monkeypatch):
    """Before TE 2.15 only block and current scaling had import-time state; now every recipe
    has, so the in-process check must run for MXFP8 and delayed scaling too."""
    spec = get_recipe("mxfp8")
    install_te(
        monkeypatch,
        _load_with_override(
            tmp_path_factory, monkeypatch, spec, "high_precision", "te_bo_installed"
        ),
    )
    for name in RECIPES:
        with pytest.raises(FP8ConfigError) as err:
            te.verify_installed_te(name, where="the test")
        assert err.value.key == BACKWARD_OVERRIDE, name


def test_verify_installed_te_runs_for_mxfp8_and_delayed(monkeypatch, te_unset):
    install_te(monkeypatch, te_unset)
    assert te.verify_installed_te("mxfp8") is True
    assert te.verify_installed_te("fp8_delayed") is True


def test_recipe_mismatches_reports_a_backward_override(te_unset):
    obj = te_unset.Float8CurrentScaling(
        fp8_format=te_unset.Format.HYBRID, backward_override="dequantized"
    )
    assert ("backward_override", "dequantized", None) in te.recipe_mismatches(
        obj, get_recipe("fp8_current"), check_fields=False
    )
    clean = te.build_te_recipe(get_recipe("fp8_current"), te_unset)
    assert te.recipe_mismatches(clean, get_recipe("fp8_current")) == []


def test_an_older_te_without_backward_override_is_not_a_mismatch(te_unset):
    """TE < 2.15 has no backward_override attribute: its backward is the recipe's own."""
    obj = te.build_te_recipe(get_recipe("mxfp8"), te_unset)
    fields = ("fp8_format", "margin", "enable_2d_quantization", "fp8_dpa", "fp8_mha")
    legacy = type("MXFP8BlockScaling", (), {k: getattr(obj, k) for k in fields})()
    assert not hasattr(legacy, "backward_override")
    assert te.recipe_mismatches(legacy, get_recipe("mxfp8")) == []


def test_fp8_wgrad_message_names_the_nearest_te_setting():
    """TE has backward_override now, but for the whole backward, so fp8_wgrad: false stays
    refused and the message points at the nearest TE setting."""
    assert "NVTE_BACKWARD_OVERRIDE=high_precision" in te.FP8_WGRAD_IGNORED
    assert "whole backward" in te.FP8_WGRAD_IGNORED
    spec = get_recipe("fp8_blockwise").replace(fp8_wgrad=False)
    warning = next(w for w in map(str, te.ADAPTER.spell(spec).warnings) if "fp8_wgrad" in w)
    assert "NVTE_BACKWARD_OVERRIDE=high_precision" in warning
