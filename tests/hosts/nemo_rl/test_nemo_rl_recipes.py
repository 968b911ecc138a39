"""What each recipe and mode spells for NeMo RL (``hosts/nemo_rl/spelling.py``): the other
recipes, generation-only and training-only, KV cache, importance sampling, output forms, the
adapter contract, first/last BF16 layers through ``model_overrides``, MXFP8 rollouts, per-module
rules. Shared helpers: ``nemo_rl_cases.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from nemo_rl_cases import (
    CONFIGS,
    IS_ON,
    MAIN_STACK,
    MEG,
    MISSING,
    VLLM,
    _with_native,
    apply_8b,
    changed,
    eight_b,
    nemo_rl_model_override_functions,
    resolved,
    run_cli,
    write_input,
)

from conftest import shared_nemo_rl
from nemo_fp8_plugin._io import dump_yaml
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import HostAdapter, apply_path, get_adapter
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.nemo_rl import NeMoRLAdapter, native_keys
from nemo_fp8_plugin.registry import get_recipe

pytestmark = pytest.mark.torch_free


def test_fp8_subchannel_is_block_fp8_on_both_sides_with_pow2_scales(tmp_path):
    ours, warnings = apply_8b(tmp_path, recipe="fp8_subchannel")
    assert changed(ours) == {
        f"{MEG}.fp8_cfg.enabled": True,
        f"{MEG}.fp8_cfg.fp8": "hybrid",
        f"{MEG}.env_vars": MISSING,
        f"{MEG}.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0",
        f"{MEG}.optimizer.use_precision_aware_optimizer": False,
        f"{VLLM}.precision": "fp8",
        f"{VLLM}.use_deep_gemm": True,
        f"{VLLM}.pow2_weight_scaling_factors": True,
        f"{VLLM}.pow2_activation_scaling_factors": True,
        # FlashInfer's Hopper kernel quantizes batches below 32 tokens itself, with fp32 scales
        f"{VLLM}.env_vars.VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
        **IS_ON,
    }
    assert warnings == []


def test_mxfp8_is_mxfp8_training_and_mx_generation(tmp_path):
    ours, warnings = apply_8b(tmp_path, recipe="mxfp8")
    assert changed(ours) == {
        f"{MEG}.fp8_cfg.enabled": True,
        f"{MEG}.fp8_cfg.fp8_recipe": "mxfp8",
        f"{MEG}.optimizer.use_precision_aware_optimizer": False,
        f"{VLLM}.precision": "fp8",
        f"{VLLM}.is_mx": True,
        # NVIDIA's MXFP8 rollout keys: NeMo RL refuses MXFP8 without power-of-2 scales
        f"{VLLM}.pow2_weight_scaling_factors": True,
        f"{VLLM}.pow2_activation_scaling_factors": True,
        **IS_ON,
    }
    # The preset's fp8_param: true is not carried over (NVIDIA-NeMo/RL issue 1164), and it is said.
    assert ours[f"{MEG}.fp8_cfg.fp8_param"] is False
    assert any("fp8_param" in w and "1164" in w for w in warnings)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_current"])
def test_preset_fp8_param_true_is_written_false_for_nemo_rl(tmp_path, recipe):
    assert get_recipe(recipe).fp8_param is True  # the premise: these presets gather FP8 params
    src = write_input(
        tmp_path,
        CONFIGS / "grpo_math_8B_megatron.yaml",
        lambda d: d["policy"].update(precision=recipe),
        relative_defaults=True,
    )
    result = apply_path(NEMO_RL, src, stack=MAIN_STACK)
    # false is the parent's value already, so the overlay leaves it out
    assert result.data["policy"]["megatron_cfg"]["fp8_cfg"].get("fp8_param", False) is False
    (warning,) = [w for w in result.warnings if "fp8_param" in w]
    assert "token_mult_prob_error" in warning and "fp8_param: true" in warning
    hk = native_keys(get_recipe(recipe))
    assert hk.keys["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_param"] is False
    assert any("fp8_param" in w for w in hk.warnings)


def test_fp8_param_stated_by_the_user_is_kept(tmp_path):
    for sub in ("block", "native"):
        (tmp_path / sub).mkdir()
    ours, warnings = apply_8b(tmp_path / "block", recipe="mxfp8", fp8_param=True)
    assert ours[f"{MEG}.fp8_cfg.fp8_param"] is True
    assert not any("fp8_param" in w for w in warnings)
    native = _with_native(
        tmp_path / "native",
        {
            "policy": {
                "megatron_cfg": {
                    "fp8_cfg": {"enabled": True, "fp8_recipe": "mxfp8", "fp8_param": True}
                }
            }
        },
        recipe="mxfp8",
    )
    data = apply_path(NEMO_RL, native, stack=MAIN_STACK).data
    assert data["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_param"] is True
    assert native_keys(get_recipe("mxfp8"), fp8_param_stated=True).warnings == []


def test_fp8_current_trains_tensorwise_generates_bf16_and_warns(tmp_path):
    ours, warnings = apply_8b(tmp_path, recipe="fp8_current")
    diff = changed(ours)
    assert (
        diff[f"{MEG}.fp8_cfg.fp8_recipe"] == "tensorwise" and diff[f"{MEG}.fp8_cfg.fp8"] == "hybrid"
    )
    assert (
        ours[f"{VLLM}.precision"] == "${policy.precision}"
        and ours["policy.precision"] == "bfloat16"
    )
    assert not any(k.startswith(VLLM) for k in diff)
    assert diff["loss_fn.use_importance_sampling_correction"] is True
    assert any("BF16" in w and "differ" in w for w in warnings)


def test_fp8_current_with_fp8_kv_cache_is_refused(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, eight_b(tmp_path, recipe="fp8_current", kv_cache="fp8"))
    assert err.value.key == "fp8.kv_cache"


@pytest.mark.parametrize("how", ["policy.precision", "fp8 block"])
def test_fp8_delayed_is_refused_with_a_suggestion(tmp_path, capsys, how):
    def edit(d):
        if how == "policy.precision":
            d["policy"]["precision"] = "fp8_delayed"
        else:
            d["fp8"] = {"recipe": "fp8_delayed"}

    src = write_input(
        tmp_path, CONFIGS / "grpo_math_8B_megatron.yaml", edit, relative_defaults=True
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == ("policy.precision" if how == "policy.precision" else "fp8.recipe")
    assert "fp8_blockwise" in str(err.value)
    assert run_cli("apply", str(src), "--host", "nemo-rl") == 2
    assert "fp8_blockwise" in capsys.readouterr().err


def test_generation_only_mode(tmp_path):
    ours, _ = apply_8b(tmp_path, training="bf16")
    assert changed(ours) == {f"{VLLM}.precision": "fp8", f"{VLLM}.use_deep_gemm": True, **IS_ON}


def test_generation_only_refuses_enabled_fp8_training(tmp_path):
    src = _with_native(
        tmp_path, {"policy": {"megatron_cfg": {"fp8_cfg": {"enabled": True}}}}, training="bf16"
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == f"{MEG}.fp8_cfg.enabled"


def test_training_only_mode_keeps_bf16_generation(tmp_path):
    ours, _ = apply_8b(tmp_path, generation="bf16")
    diff = changed(ours)
    assert diff[f"{MEG}.fp8_cfg.enabled"] is True
    assert not any(k.startswith(VLLM) for k in diff)


def test_fp8_kv_cache(tmp_path):
    """The 8B config has pipeline_model_parallel_size 2, which NeMo RL refuses with an FP8 KV
    cache (the release's grpo.py): refused naming the key; with 1, written."""
    with pytest.raises(FP8ConfigError) as err:
        apply_8b(tmp_path, kv_cache="fp8")
    assert err.value.key == f"{MEG}.pipeline_model_parallel_size" and "grpo.py" in str(err.value)
    src = _with_native(
        tmp_path, {"policy": {"megatron_cfg": {"pipeline_model_parallel_size": 1}}}, kv_cache="fp8"
    )
    data = apply_path(NEMO_RL, src).data
    assert data["policy"]["generation"]["vllm_cfg"]["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize(
    "is_block, expected",
    [
        ({"truncation": "tis"}, ("tis", 2.0, None, False)),
        ({"truncation": "tis", "ratio_max": 3.0, "ratio_min": 0.2}, ("tis", 3.0, 0.2, False)),
        ({"truncation": "icepop", "ratio_max": 5.0, "ratio_min": 0.5}, ("icepop", 5.0, 0.5, False)),
        # NeMo RL requires the lower bound for icepop; the spec's default is 1/ratio_max
        ({"truncation": "icepop", "ratio_max": 4.0}, ("icepop", 4.0, 0.25, False)),
        (
            {"truncation": "seq-mask-tis", "ratio_max": 1.002, "ratio_min": 0.999},
            ("seq-mask-tis", 1.002, 0.999, False),
        ),
    ],
)
def test_importance_sampling_keys(tmp_path, is_block, expected):
    ours, _ = apply_8b(tmp_path, importance_sampling=is_block)
    got = tuple(
        ours[f"loss_fn.{k}"]
        for k in (
            "truncated_importance_sampling_type",
            "truncated_importance_sampling_ratio",
            "truncated_importance_sampling_ratio_min",
            "sequence_level_importance_ratios",
        )
    )
    assert got == expected
    assert ours["loss_fn.use_importance_sampling_correction"] is True


def test_sequence_level_needs_a_sequence_level_loss(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, eight_b(tmp_path, importance_sampling={"level": "sequence"}))
    assert err.value.key == "loss_fn.token_level_loss"
    src = _with_native(
        tmp_path,
        {"loss_fn": {"token_level_loss": False}},
        importance_sampling={"level": "sequence"},
    )
    assert apply_path(NEMO_RL, src).data["loss_fn"]["sequence_level_importance_ratios"] is True


def test_importance_sampling_off_leaves_the_loss_alone(tmp_path):
    """Training-only FP8 without the correction leaves the loss as the config has it; FP8
    generation without it is what every NeMo RL release stops on at start-up (grpo.py), so it
    is refused naming the request's key."""
    ours, _ = apply_8b(tmp_path, importance_sampling=False, generation="bf16")
    assert not any(k.startswith("loss_fn") for k in changed(ours))
    with pytest.raises(FP8ConfigError) as err:
        apply_8b(tmp_path, importance_sampling=False)
    assert err.value.key == "fp8.importance_sampling" and "stops at start-up" in str(err.value)


def test_moe_router_dtype_only_for_moe_models(tmp_path):
    ours, _ = apply_8b(tmp_path)
    assert ours[f"{MEG}.moe_router_dtype"] == "fp64"  # Llama 3.1 8B is dense: inherited value
    ours, _ = apply_8b(tmp_path, training="bf16", model="moonshotai/Moonlight-16B-A3B-Instruct")
    assert ours[f"{MEG}.moe_router_dtype"] == "fp64"  # no FP8 training, no change
    ours, _ = apply_8b(tmp_path, model="moonshotai/Moonlight-16B-A3B-Instruct")
    assert ours[f"{MEG}.moe_router_dtype"] == "fp32"


def test_stdout_overlay_points_at_absolute_parents(tmp_path, capsys):
    src = eight_b(tmp_path)
    assert run_cli("apply", str(src), "--host", "nemo-rl") == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert Path(data["defaults"]).is_absolute()
    assert Path(data["defaults"]) == (CONFIGS / "grpo_math_1B_megatron.yaml").resolve()


def test_resolved_output_has_no_defaults_and_every_key(tmp_path):
    src = eight_b(tmp_path)
    overlay = apply_path(NEMO_RL, src, output=tmp_path / "a.yaml")
    full = apply_path(NeMoRLAdapter(resolve=True), src)
    assert "defaults" not in full.data
    (tmp_path / "a.yaml").write_text(dump_yaml(overlay.data))
    (tmp_path / "full.yaml").write_text(dump_yaml(full.data))
    assert resolved(tmp_path / "full.yaml") == resolved(tmp_path / "a.yaml")


def test_request_in_a_parent_root_key_falls_back_to_resolved_output(tmp_path):
    parent = write_input(
        tmp_path,
        CONFIGS / "grpo_math_8B_megatron.yaml",
        lambda d: d.update(precision="fp8_blockwise"),
        relative_defaults=True,
    )
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {parent.name}\ngrpo:\n  max_num_steps: 7\n")
    result = apply_path(NEMO_RL, child, output=tmp_path / "out.yaml")
    assert "defaults" not in result.data and "precision" not in result.data
    assert result.data["grpo"]["max_num_steps"] == 7
    assert any("fully resolved" in w for w in result.warnings)


def test_adapter_contract():
    adapter = get_adapter("nemo_rl")
    assert isinstance(adapter, HostAdapter) and adapter.name == "nemo-rl"
    hk = adapter.spell(get_recipe("fp8_blockwise"))
    assert hk.keys["policy"]["megatron_cfg"]["fp8_cfg"] == {
        "enabled": True,
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "fp8_param": False,
    }
    assert hk.env == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    delayed = native_keys(get_recipe("fp8_delayed"))
    assert delayed.keys == {} and "fp8_blockwise" in delayed.warnings[0]


@pytest.mark.host
def test_first_last_layers_reach_training_through_model_overrides(tmp_path):
    """NeMo RL merges policy.megatron_cfg.model_overrides into the Bridge model provider (a
    megatron-core TransformerConfig) before building the model, so BF16 first/last layers are
    expressible for training: written there, not warned about."""
    from megatron.core.transformer import TransformerConfig

    ours, warnings = apply_8b(tmp_path, bf16_layers={"first": 1, "last": 2})
    diff = changed(ours)
    overrides = {
        k.rsplit(".", 1)[1]: v for k, v in diff.items() if k.startswith(f"{MEG}.model_overrides.")
    }
    assert overrides == {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 2,
    }
    assert (diff[f"{VLLM}.num_first_layers_in_bf16"], diff[f"{VLLM}.num_last_layers_in_bf16"]) == (
        1,
        2,
    )
    assert not any("training runs them in FP8" in w for w in warnings)
    # NeMo RL's own merge and conflict check accept it, and megatron-core validates the result.
    fns = nemo_rl_model_override_functions()
    out = yaml.safe_load((tmp_path / "out.yaml").read_text())
    megatron_cfg = {**resolved(tmp_path / "out.yaml")["policy"]["megatron_cfg"]}
    fns["_validate_model_override_conflicts"](megatron_cfg, megatron_cfg["model_overrides"])
    provider = TransformerConfig(num_layers=8, hidden_size=256, num_attention_heads=4, bf16=True)
    merged = fns["_merge_model_overrides"](
        provider, out["policy"]["megatron_cfg"]["model_overrides"]
    )
    fp8_cfg = megatron_cfg["fp8_cfg"]  # NeMo RL then sets these three from fp8_cfg
    merged.fp8, merged.fp8_recipe, merged.fp8_param = (
        fp8_cfg["fp8"],
        fp8_cfg["fp8_recipe"],
        fp8_cfg["fp8_param"],
    )
    merged.__post_init__()
    assert (
        merged.first_last_layers_bf16,
        merged.num_layers_at_start_in_bf16,
        merged.num_layers_at_end_in_bf16,
    ) == (True, 1, 2)


def test_fp8_current_preset_first_last_layers_in_native_keys():
    hk = native_keys(get_recipe("fp8_current"))
    assert hk.keys["policy"]["megatron_cfg"]["model_overrides"] == {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 1,
    }
    assert not any("bf16_layers.first" in w or "bf16_layers.last" in w for w in hk.warnings)
    # generation-only BF16 layers leave training alone; per-module globs still cannot be said
    gen = native_keys(
        get_recipe(
            {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1, "applies_to": "generation"}}
        )
    )
    assert "model_overrides" not in gen.keys["policy"]["megatron_cfg"]
    mods = native_keys(
        get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*q_proj*"]}})
    )
    assert any("'*q_proj*'" in w and "training" in w for w in mods.warnings)


def test_mxfp8_rollouts_give_nvidias_keys(tmp_path):
    """BF16 training, MXFP8 generation: precision fp8, is_mx, power-of-2 scales (NeMo RL's
    init_fp8 refuses anything else for MXFP8), attention projections kept out by keyword."""
    ours, warnings = apply_8b(
        tmp_path,
        recipe="mxfp8",
        training="bf16",
        bf16_layers={"modules": ["*q_proj*", "*k_proj*", "*v_proj*", "*o_proj*"]},
    )
    assert changed(ours) == {
        f"{VLLM}.precision": "fp8",
        f"{VLLM}.is_mx": True,
        f"{VLLM}.pow2_weight_scaling_factors": True,
        f"{VLLM}.pow2_activation_scaling_factors": True,
        f"{VLLM}.quantization_ignored_layer_kws": ["q_proj", "k_proj", "v_proj", "o_proj"],
        **IS_ON,
    }
    # vLLM 0.25.1's ModelOpt MXFP8 method quantizes lm_head unless listed, and NeMo RL lists
    # base-model names only (test_nemo_rl_preflight.py)
    (lm_head,) = warnings
    assert ours[f"{MEG}.fp8_cfg.enabled"] is False and "quantizes 1 module(s)" in lm_head
    assert lm_head.endswith(
        "lm_head; NeMo RL builds the list from the base model's names, without the output head"
    )
    # the keys NeMo RL's own init_fp8 checks for MXFP8 (its source, read with ast)
    src = shared_nemo_rl("src/nemo_rl/models/generation/vllm/quantization/fp8.py")
    import ast

    fn = next(
        n
        for n in ast.walk(ast.parse(src.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "init_fp8"
    )
    refused_if_false = {
        c.args[0].value
        for n in ast.walk(fn)
        if isinstance(n, ast.Compare)
        and isinstance(n.ops[0], ast.Is)
        and isinstance(n.comparators[0], ast.Constant)
        and n.comparators[0].value is False
        for c in [n.left]
        if isinstance(c, ast.Call) and c.args
    }
    assert refused_if_false == {"pow2_weight_scaling_factors", "pow2_activation_scaling_factors"}
    assert all(ours[f"{VLLM}.{k}"] is True for k in refused_if_false)


@pytest.mark.host
def test_model_overrides_cannot_carry_a_per_module_quant_recipe():
    """NeMo RL's only per-module route on its Megatron side would be model_overrides.quant_recipe:
    its own merge (`_merge_model_overrides`, from its source) keeps the nested mapping as a
    plain dict on the provider, and megatron-core then calls `.match()` on it when it builds the
    model. So the plugin does not write it, and says training runs those modules in FP8."""
    import ast
    import copy as copy_module
    import dataclasses
    from collections.abc import Mapping
    from typing import Any

    from megatron.core.quantization.utils import get_quant_config_or_none
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_plugin.hosts import megatron as mg

    tree = ast.parse(shared_nemo_rl("src/nemo_rl/models/megatron/setup.py").read_text())
    defs = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and n.name in ("_merge_model_overrides", "_merge_model_override_value")
    ]
    scope = {
        "Mapping": Mapping,
        "Any": Any,
        "copy": copy_module,
        "replace": dataclasses.replace,
        "is_dataclass": dataclasses.is_dataclass,
        "fields": dataclasses.fields,
    }
    exec(compile(ast.Module(body=defs, type_ignores=[]), "setup.py", "exec"), scope)
    spec = get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*linear_proj"]}})
    mapping = mg.transformer_config_fields(spec).keys["quant_recipe"]
    merged = scope["_merge_model_overrides"](
        TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4),
        {"quant_recipe": mapping},
    )
    assert isinstance(merged.quant_recipe, dict)  # survives the merge, as a dict
    with pytest.raises(AttributeError, match="match"):
        get_quant_config_or_none("decoder.layers.0.self_attention.linear_proj", merged.quant_recipe)
    # the real RecipeConfig would have worked: the dict is the problem, not the rule
    assert (
        get_quant_config_or_none(
            "decoder.layers.0.self_attention.linear_proj", mg.quant_recipe_object(mapping)
        )
        is not None
    )
    # what the plugin writes instead: nothing per module for training, and a warning
    hk = native_keys(spec)
    assert "quant_recipe" not in json.dumps(hk.keys)
    assert any("training runs the modules it matches in FP8" in w for w in hk.warnings)


@pytest.mark.parametrize(
    ("numerics", "named", "deep_gemm"),
    [
        ("vllm", None, True),
        ("trainer", "generation_numerics=trainer", True),
        ("vllm_deepgemm_ue8m0", None, False),
    ],
)
def test_generation_numerics_nemo_rl_cannot_express_is_said(numerics, named, deep_gemm):
    """NeMo RL generates with vLLM's own kernels (vLLM's numerics): ``trainer`` is said, not
    silently dropped. It turns DeepGEMM's E8M0 mode off when use_deep_gemm is true (its
    generation/vllm/quantization/fp8.py) and sets nothing when false, where vLLM's default is
    DeepGEMM in its E8M0 mode: ``vllm_deepgemm_ue8m0`` is ``use_deep_gemm: false``. A
    BF16-generation recipe has nothing to say."""
    spec = get_recipe({"recipe": "fp8_blockwise", "generation_numerics": numerics})
    said = [w for w in native_keys(spec).warnings if "generation_numerics" in w]
    assert native_keys(spec).keys["policy"]["generation"]["vllm_cfg"]["use_deep_gemm"] is deep_gemm
    if named is None:
        assert said == []
    else:
        (warning,) = said
        assert named in warning
    bf16_gen = get_recipe({"recipe": "fp8_current", "generation_numerics": "trainer"})
    assert not [w for w in native_keys(bf16_gen).warnings if "generation_numerics" in w]
