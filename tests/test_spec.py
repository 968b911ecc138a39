"""The recipe spec and the five presets: fields, validation, immutability."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_fp8_plugin import BF16Rules, FP8ConfigError, RecipeSpec, get_recipe, list_recipes
from nemo_fp8_plugin.registry import load_yaml_file, preset_dir

pytestmark = pytest.mark.torch_free

BUILT_IN_FP8_PRESETS = ("fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8")
"""The FP8 presets the plugin ships, in the documented order: the one place a test states them
(tests/test_test_layout.py allows constants named BUILT_IN_*); other tests take the registry's."""
FIVE = BUILT_IN_FP8_PRESETS


def test_five_builtins_in_order():
    names = [s.name for s in list_recipes()]
    assert names[:5] == list(FIVE)


# What each preset must say, from the issue and from the host presets it mirrors
# (NeMo 2's mixed_precision.py, NeMo RL's fp8 configs, TE's recipe classes).
EXPECTED = {
    "fp8_delayed": dict(
        scaling="delayed",
        fp8_format="hybrid",
        amax_history_len=1024,
        amax_compute_algo="max",
        margin=0,
        pow2_scales=False,
        activation_block=None,
        weight_block=None,
        gradient_block=None,
        fp8_param=True,
    ),
    "fp8_current": dict(
        scaling="tensorwise",
        fp8_format="hybrid",
        pow2_scales=False,
        activation_block=None,
        weight_block=None,
        fp8_param=True,
    ),
    "fp8_subchannel": dict(
        scaling="block",
        fp8_format="hybrid",
        pow2_scales=True,
        activation_block=(1, 128),
        weight_block=(128, 128),
        gradient_block=(1, 128),
        fp8_param=False,
    ),
    "fp8_blockwise": dict(
        scaling="block",
        fp8_format="e4m3",
        pow2_scales=False,
        activation_block=(1, 128),
        weight_block=(128, 128),
        gradient_block=(1, 128),
        fp8_param=False,
        training="fp8",
        generation="fp8",
        kv_cache="auto",
    ),
    "mxfp8": dict(
        scaling="mx",
        fp8_format="e4m3",
        pow2_scales=True,
        activation_block=(1, 32),
        weight_block=(1, 32),
        gradient_block=(1, 32),
    ),
}


@pytest.mark.parametrize("name", FIVE)
def test_preset_fields(name):
    spec = get_recipe(name)
    for key, value in EXPECTED[name].items():
        assert getattr(spec, key) == value, key
    assert spec.description


def test_current_keeps_first_and_last_layer_bf16():
    rules = get_recipe("fp8_current").bf16_layers
    assert (rules.first, rules.last, rules.modules, rules.applies_to) == (1, 1, (), "both")


@pytest.mark.parametrize("name", FIVE)
def test_rl_preset_defaults(name):
    spec = get_recipe(name)
    assert spec.kv_cache == "auto"
    assert spec.importance_sampling.enabled is True
    assert spec.importance_sampling.level == "token"
    assert spec.importance_sampling.truncation is None


@pytest.mark.parametrize("name", FIVE)
def test_preset_file_lists_every_field(name):
    """Presets are documentation: every field is written out, none left to defaults."""
    data = load_yaml_file(preset_dir() / f"{name}.yaml")
    assert set(data) == set(RecipeSpec.OVERRIDABLE) | {"name"}
    assert RecipeSpec.from_mapping(data) == get_recipe(name)


@pytest.mark.parametrize("name", FIVE)
def test_to_dict_round_trips(name):
    spec = get_recipe(name)
    assert RecipeSpec.from_mapping(spec.to_dict()) == spec


def test_frozen():
    spec = get_recipe("fp8_blockwise")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.pow2_scales = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.bf16_layers.first = 3  # type: ignore[misc]


def test_roles():
    hybrid = get_recipe("fp8_subchannel")
    assert hybrid.format_for("input") == "e4m3"
    assert hybrid.format_for("weight") == "e4m3"
    assert hybrid.format_for("grad_output") == "e5m2"
    e4m3 = get_recipe("fp8_blockwise")
    assert e4m3.format_for("grad_output") == "e4m3"
    assert e4m3.block_for("weight") == (128, 128)
    assert e4m3.block_for("input") == (1, 128)
    assert get_recipe("fp8_current").block_for("input") is None


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"fp8_format": "e5m2"}, "fp8_format"),
        ({"fp8_format": "e4m4"}, "fp8_format"),
        ({"scaling": "rowwise"}, "scaling"),
        ({"pow2_scales": "yes"}, "pow2_scales"),
        ({"margin": True}, "margin"),
        ({"margin": -1}, "margin"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"activation_block": [1, 64]}, "activation_block"),
        ({"weight_block": [128]}, "weight_block"),
        ({"activation_block": [128, 128]}, "weight_block"),  # 2D x 2D GEMM does not exist
        ({"kv_cache": "fp8_e5m2"}, "kv_cache"),
        ({"generation_numerics": "te"}, "generation_numerics"),
        ({"generation_numerics": None}, "generation_numerics"),
        ({"training": "bf16", "generation": "bf16"}, "training"),
        ({"generation": "bf16", "kv_cache": "fp8"}, "kv_cache"),
        ({"fp8_dot_product_attention": True}, "fp8_dot_product_attention"),
        ({"bf16_layers": {"first": -2}}, "bf16_layers.first"),
        ({"bf16_layers": {"modules": ["*a_proj*", "*a_proj*"]}}, "bf16_layers.modules[1]"),
        ({"bf16_layers": {"modules": [3]}}, "bf16_layers.modules[0]"),
        ({"bf16_layers": {"frist": 1}}, "bf16_layers.frist"),
        ({"bf16_layers": {"applies_to": "inference"}}, "bf16_layers.applies_to"),
        ({"importance_sampling": {"truncation": "clip"}}, "importance_sampling.truncation"),
        ({"importance_sampling": {"ratio_max": float("nan")}}, "importance_sampling.ratio_max"),
        ({"importance_sampling": {"ratio_min": 3.0}}, "importance_sampling.ratio_min"),
        ({"hardware": "tpu"}, "hardware"),
        ({"pow2scales": True}, "pow2scales"),
    ],
)
def test_invalid_overrides_name_the_key(overrides, key):
    with pytest.raises(FP8ConfigError) as info:
        get_recipe("fp8_blockwise").with_overrides(overrides)
    assert info.value.key == key
    assert key in str(info.value)


def test_generation_numerics_default_values_and_refusals():
    """``generation_numerics`` defaults to vLLM's numerics in every preset, takes
    the three values from YAML ``fp8:`` blocks through ``get_recipe``, and a bad value is
    refused naming the key and listing the allowed ones."""
    from nemo_fp8_plugin.spec import GENERATION_NUMERICS

    assert GENERATION_NUMERICS == ("vllm", "vllm_deepgemm_ue8m0", "trainer")
    assert RecipeSpec(name="x", scaling="tensorwise").generation_numerics == "vllm"
    for spec in list_recipes():
        assert spec.generation_numerics == "vllm", spec.name
    for value in GENERATION_NUMERICS:
        spec = get_recipe({"recipe": "fp8_blockwise", "generation_numerics": value})
        assert spec.generation_numerics == value
        assert spec.to_dict()["generation_numerics"] == value
        assert RecipeSpec.from_mapping(spec.to_dict()) == spec
    with pytest.raises(FP8ConfigError) as info:
        get_recipe({"recipe": "fp8_blockwise", "generation_numerics": "vlm"})
    assert info.value.key == "generation_numerics"
    assert "vllm, vllm_deepgemm_ue8m0, trainer" in str(info.value)
    assert "did you mean 'vllm'" in str(info.value)
    # DeepGEMM's UE8M0 requantization is of block-FP8 weights.
    for recipe in ("mxfp8", "fp8_current"):
        with pytest.raises(FP8ConfigError, match="scaling: block") as info:
            get_recipe({"recipe": recipe, "generation_numerics": "vllm_deepgemm_ue8m0"})
        assert info.value.key == "generation_numerics"
    assert get_recipe({"recipe": "mxfp8", "generation_numerics": "trainer"})


def test_generation_numerics_reaches_the_spec_from_a_yaml_fp8_block(tmp_path):
    from nemo_fp8_plugin.config import find_fp8_request, load_config

    path = tmp_path / "run.yaml"
    path.write_text("fp8:\n  recipe: fp8_blockwise\n  generation_numerics: trainer\n")
    request = find_fp8_request(load_config(path))
    assert request.spec.generation_numerics == "trainer"


def test_unknown_key_suggests_the_closest():
    with pytest.raises(FP8ConfigError, match="did you mean 'pow2_scales'"):
        get_recipe({"recipe": "fp8_blockwise", "pow2_scale": True})


def test_delayed_with_first_last_bf16_is_refused():
    with pytest.raises(FP8ConfigError, match="megatron-core refuses") as info:
        get_recipe({"recipe": "fp8_delayed", "bf16_layers": {"first": 1}})
    assert info.value.key == "bf16_layers.first"
    # Generation-only rules do not touch Megatron, so they are fine with delayed scaling.
    spec = get_recipe(
        {"recipe": "fp8_delayed", "bf16_layers": {"first": 1, "applies_to": "generation"}}
    )
    assert spec.bf16_layers.first == 1


def test_current_scaling_to_delayed_keeps_inherited_rules_and_is_refused():
    with pytest.raises(FP8ConfigError, match="cannot be combined with delayed scaling"):
        get_recipe({"recipe": "fp8_current", "scaling": "delayed"})


def test_mx_requires_pow2():
    with pytest.raises(FP8ConfigError) as info:
        get_recipe({"recipe": "mxfp8", "pow2_scales": False})
    assert info.value.key == "pow2_scales"


def test_mapping_overrides_merge_nested_fields():
    spec = get_recipe({"recipe": "fp8_current", "bf16_layers": {"modules": ["*.router"]}})
    assert (spec.bf16_layers.first, spec.bf16_layers.last) == (1, 1)
    assert spec.bf16_layers.modules == ("*.router",)
    spec = get_recipe({"recipe": "fp8_blockwise", "importance_sampling": False})
    assert spec.importance_sampling.enabled is False


@pytest.mark.parametrize(
    "hw, name, level",
    [
        ("b200", "fp8_blockwise", "error"),  # fp32 block scales cannot run on Blackwell
        ("h100", "mxfp8", "error"),  # MXFP8 needs SM100
        ("l40s", "fp8_subchannel", "error"),  # block scaling needs Hopper+
        ("h200", "fp8_blockwise", "warning"),  # CUDA >= 12.9 reminder
        ("gb200", "mxfp8", None),
        ("b200", "fp8_subchannel", None),  # pow2 block scales are fine on Blackwell
        ("h100", "fp8_current", None),
        ("ada", "fp8_delayed", None),
    ],
)
def test_hardware_rules(hw, name, level):
    if level == "error":
        with pytest.raises(FP8ConfigError) as info:
            get_recipe(name).replace(hardware=hw)
        assert info.value.key in ("hardware", "pow2_scales")
        if name == "fp8_blockwise":
            # no host: judged for training and generation alike, as RL is, so the advice is
            # the same recipe with power-of-2 scales (training-only hosts: test_retarget.py)
            assert "pow2_scales: true" in str(info.value)
            assert "fp8_subchannel" not in str(info.value)
        return
    spec = get_recipe(name).replace(hardware=hw)
    levels = {f.level for f in spec.findings()}
    assert levels == ({level} if level else set())


def test_dimension_divisibility():
    block = get_recipe("fp8_blockwise")
    found = block.check_dims({"hidden_size": 4096, "ffn_hidden_size": 14336, "vocab": 1008})
    assert [f.key for f in found] == ["model.vocab"]
    assert found[0].level == "warning"  # a partial 128-tile runs, at a cost
    mx = get_recipe("mxfp8")
    found = mx.check_dims({"hidden_size": 4100})
    assert found[0].level == "error" and "32" in found[0].message
    # Every FP8 GEMM needs multiples of 16 (TE assert_dim_for_fp8_exec), per-tensor too.
    assert get_recipe("fp8_current").check_dims({"hidden_size": 4112}) == []
    assert [f.level for f in get_recipe("fp8_current").check_dims({"hidden_size": 7})] == ["error"]
    assert [f.level for f in block.check_dims({"vocab": 100})] == ["error"]


def test_direct_construction_validates():
    with pytest.raises(FP8ConfigError):
        RecipeSpec(name="x", scaling="block")  # tiles missing
    spec = RecipeSpec(name="x", scaling="tensorwise", bf16_layers={"first": 2})
    assert spec.bf16_layers == BF16Rules(first=2)
