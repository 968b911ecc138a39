"""megatron-core adapter against the installed megatron-core 0.16.1 ``TransformerConfig``."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from conftest import REPO
from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.hosts import megatron as mg

from megatron.core.quantization.quant_config import MatchContext, RecipeConfig
from megatron.core.transformer import TransformerConfig

RECIPES = ["fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"]
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, bf16=True)

EXPECTED = {  # what megatron-core must end up with, written out independently of the adapter
    "fp8_delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024,
                        fp8_amax_compute_algo="max", fp8_param=True, first_last_layers_bf16=False),
    "fp8_current": dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True,
                        first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                        num_layers_at_end_in_bf16=1),
    "fp8_subchannel": dict(fp8="hybrid", fp8_recipe="blockwise", fp8_param=False,
                           first_last_layers_bf16=False),
    "fp8_blockwise": dict(fp8="e4m3", fp8_recipe="blockwise", fp8_param=False,
                          first_last_layers_bf16=False),
    "mxfp8": dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param=True, first_last_layers_bf16=False),
}


@pytest.mark.parametrize("name", RECIPES)
def test_transformer_config_passes_megatron_validation(name):
    cfg = mg.build_transformer_config(get_recipe(name), **MODEL)
    assert isinstance(cfg, TransformerConfig)
    for key, want in EXPECTED[name].items():
        assert getattr(cfg, key) == want, key
    assert cfg.quant_recipe is None


@pytest.mark.parametrize("name", RECIPES)
def test_apply_to_existing_config(name):
    base = TransformerConfig(**MODEL)
    cfg = mg.apply_to_transformer_config(base, get_recipe(name))
    assert cfg is not base and base.fp8 is None
    assert (cfg.fp8, cfg.fp8_recipe) == (EXPECTED[name]["fp8"], EXPECTED[name]["fp8_recipe"])
    assert cfg.num_layers == 4 and cfg.hidden_size == 256


def test_delayed_with_bf16_layers_refused_by_us_first(tmp_path, capsys):
    """megatron-core refuses delayed scaling + first/last BF16 layers at __post_init__; we refuse
    the same request earlier, from the config, naming the key."""
    with pytest.raises(ValueError, match="Delayed scaling does not support first / last layer"):
        TransformerConfig(**MODEL, fp8="hybrid", fp8_recipe="delayed", first_last_layers_bf16=True,
                          num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=0)
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "fp8_delayed", "bf16_layers": {"first": 1}})
    assert err.value.key == "bf16_layers.first"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("fp8: {recipe: fp8_delayed, bf16_layers: {first: 1}}\nmodel: {num_layers: 4}\n")
    assert main(["apply", str(cfg), "--host", "megatron"]) == 2
    err_text = capsys.readouterr().err
    assert "fp8.bf16_layers.first" in err_text and "Traceback" not in err_text


def test_per_module_rules_become_a_real_recipe_config():
    spec = get_recipe({"recipe": "fp8_blockwise",
                       "bf16_layers": {"modules": ["*.linear_qkv", "output_layer"]}})
    cfg = mg.build_transformer_config(spec, **MODEL)
    assert isinstance(cfg.quant_recipe, RecipeConfig)
    match = cfg.quant_recipe.match_to_config_key
    assert match(MatchContext("decoder.layers.2.self_attention.linear_qkv", 2)) == "bf16"
    assert match(MatchContext("decoder.layers.2.mlp.linear_fc1", 2)) is None


@pytest.mark.parametrize("override,key", [
    ({"recipe": "fp8_blockwise", "amax_epsilon": 1e-6}, "amax_epsilon"),
    ({"recipe": "fp8_blockwise", "margin": 2}, "margin"),
    ({"recipe": "fp8_delayed", "reduce_amax": False}, "reduce_amax"),
    ({"recipe": "mxfp8", "weight_block": [32, 32]}, "weight_block"),
    ({"recipe": "fp8_current", "amax_history_len": 16}, "amax_history_len"),
])
def test_settings_megatron_would_drop_are_refused(override, key, tmp_path):
    spec = get_recipe(override)
    assert any(f"{key}:" in w for w in mg.native_keys(spec).warnings)
    with pytest.raises(FP8ConfigError) as err:
        mg.build_transformer_config(spec, **MODEL)
    assert err.value.key.endswith(key)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"fp8": override, "model": {"num_layers": 4}}))
    with pytest.raises(FP8ConfigError) as err:
        mg.apply_file(cfg)
    assert err.value.key == f"fp8.{key}"


def test_megatron_own_validation_surfaces_as_our_error():
    """More BF16 layers than the model has: megatron-core's own check, reported as ours."""
    spec = get_recipe({"recipe": "fp8_current", "bf16_layers": {"first": 5, "last": 1}})
    with pytest.raises(FP8ConfigError) as err:
        mg.build_transformer_config(spec, **MODEL)
    assert err.value.key == "num_layers_at_start_in_bf16"
    assert "megatron-core refuses" in str(err.value)


def _apply(tmp_path, text: str, name: str = "in.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return mg.apply_file(path)


BASE_YAML = """\
precision: fp8_current
model:
  num_layers: 4
  hidden_size: 256
  num_attention_heads: 4
  bf16: true
train:
  micro_batch_size: 1
"""


def test_apply_writes_under_model_keeps_the_rest_and_is_idempotent(tmp_path):
    result = _apply(tmp_path, BASE_YAML)
    out = result.data
    assert "precision" not in out
    assert out["train"] == {"micro_batch_size": 1}
    model = out["model"]
    assert model["num_layers"] == 4 and model["fp8_recipe"] == "tensorwise"
    assert model["num_layers_at_start_in_bf16"] == 1
    assert any("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=0" in w for w in result.warnings)
    again = _apply(tmp_path, yaml.safe_dump(out, sort_keys=False), "out.yaml").data
    assert again == out
    # The written section is a valid TransformerConfig as megatron-core sees it.
    TransformerConfig(**model)


def test_apply_places_keys_under_model_or_language_model(tmp_path):
    flat = _apply(tmp_path, "precision: mxfp8\nnum_layers: 2\n").data
    assert flat["model"]["fp8_recipe"] == "mxfp8" and flat["num_layers"] == 2
    assert "fp8" not in flat  # a root-level fp8 would read as the plugin's own request key
    assert _apply(tmp_path, yaml.safe_dump(flat), "again.yaml").data == flat
    lm = _apply(tmp_path, "fp8: fp8_subchannel\nlanguage_model: {num_layers: 2}\n").data
    assert lm["language_model"]["fp8_recipe"] == "blockwise" and "fp8" not in lm


@pytest.mark.parametrize("native,key", [
    ("fp8_recipe: delayed", "model.fp8_recipe"),
    ("fp8: hybrid", "model.fp8"),
    ("first_last_layers_bf16: true", "model.first_last_layers_bf16"),
    ("fp4: e2m1", "model.fp4"),
    ("fp8_quantizer_factory: pkg.mod.fn", "model.fp8_quantizer_factory"),
])
def test_apply_refuses_conflicting_native_keys(tmp_path, native, key):
    text = f"precision: fp8_blockwise\nmodel:\n  num_layers: 4\n  {native}\n"
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, text)
    assert err.value.key == key


def test_apply_accepts_matching_native_keys(tmp_path):
    out = _apply(tmp_path, "precision: fp8_blockwise\nmodel:\n  fp8: e4m3\n  fp8_recipe: blockwise\n").data
    assert out["model"]["fp8_recipe"] == "blockwise"


def test_apply_cli_writes_the_file(tmp_path, capsys):
    src = tmp_path / "in.yaml"
    src.write_text(BASE_YAML)
    dst = tmp_path / "out.yaml"
    assert main(["apply", str(src), "--host", "megatron", "-o", str(dst)]) == 0
    assert yaml.safe_load(dst.read_text())["model"]["fp8"] == "hybrid"
    assert "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES" in capsys.readouterr().err


def test_no_request_leaves_config_unchanged(tmp_path):
    out = _apply(tmp_path, "precision: bf16\nmodel: {num_layers: 2}\n")
    assert out.data == {"precision": "bf16", "model": {"num_layers": 2}}


def test_example_config_applies_and_validates():
    out = mg.apply_file(REPO / "conf" / "examples" / "megatron_gpt_fp8_current.yaml").data
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model = {k: v for k, v in out["model"].items() if k in fields}
    assert model["fp8_recipe"] == "tensorwise"
    TransformerConfig(**model)
