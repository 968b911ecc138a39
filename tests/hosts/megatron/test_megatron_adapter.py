"""megatron-core adapter against the installed megatron-core 0.16.1 ``TransformerConfig``."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from pathlib import Path

import pytest
import yaml
from megatron.core.quantization.quant_config import MatchContext, RecipeConfig
from megatron.core.transformer import TransformerConfig

from conftest import REPO, load_te_recipe_module
from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts import megatron as mg

pytestmark = pytest.mark.host

RECIPES = ["fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"]
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, bf16=True)

EXPECTED = {  # what megatron-core must end up with, written out independently of the adapter
    "fp8_delayed": dict(
        fp8="hybrid",
        fp8_recipe="delayed",
        fp8_amax_history_len=1024,
        fp8_amax_compute_algo="max",
        fp8_param=True,
        first_last_layers_bf16=False,
    ),
    "fp8_current": dict(
        fp8="hybrid",
        fp8_recipe="tensorwise",
        fp8_param=True,
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=1,
        num_layers_at_end_in_bf16=1,
    ),
    "fp8_subchannel": dict(
        fp8="hybrid", fp8_recipe="blockwise", fp8_param=False, first_last_layers_bf16=False
    ),
    "fp8_blockwise": dict(
        fp8="e4m3", fp8_recipe="blockwise", fp8_param=False, first_last_layers_bf16=False
    ),
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
        TransformerConfig(
            **MODEL,
            fp8="hybrid",
            fp8_recipe="delayed",
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=1,
            num_layers_at_end_in_bf16=0,
        )
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "fp8_delayed", "bf16_layers": {"first": 1}})
    assert err.value.key == "bf16_layers.first"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("fp8: {recipe: fp8_delayed, bf16_layers: {first: 1}}\nmodel: {num_layers: 4}\n")
    assert main(["apply", str(cfg), "--host", "megatron"]) == 2
    err_text = capsys.readouterr().err
    assert "fp8.bf16_layers.first" in err_text and "Traceback" not in err_text


def test_per_module_rules_become_a_real_recipe_config():
    spec = get_recipe(
        {"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*.linear_qkv", "output_layer"]}}
    )
    cfg = mg.build_transformer_config(spec, **MODEL)
    assert isinstance(cfg.quant_recipe, RecipeConfig)
    match = cfg.quant_recipe.match_to_config_key
    assert match(MatchContext("decoder.layers.2.self_attention.linear_qkv", 2)) == "bf16"
    assert match(MatchContext("decoder.layers.2.mlp.linear_fc1", 2)) is None


@pytest.mark.parametrize(
    "override,key",
    [
        ({"recipe": "fp8_blockwise", "amax_epsilon": 1e-6}, "amax_epsilon"),
        ({"recipe": "fp8_blockwise", "margin": 2}, "margin"),
        ({"recipe": "fp8_delayed", "reduce_amax": False}, "reduce_amax"),
        ({"recipe": "mxfp8", "weight_block": [32, 32]}, "weight_block"),
        ({"recipe": "fp8_current", "amax_history_len": 16}, "amax_history_len"),
        ({"recipe": "fp8_delayed", "fp8_wgrad": False}, "fp8_wgrad"),
        ({"recipe": "fp8_blockwise", "fp8_wgrad": False}, "fp8_wgrad"),
    ],
)
def test_settings_megatron_would_drop_are_refused(override, key, tmp_path):
    spec = get_recipe(override)
    assert any(f"{key}:" in w for w in mg.native_keys(spec).warnings)
    with pytest.raises(FP8ConfigError) as err:
        mg.build_transformer_config(spec, **MODEL)
    assert err.value.key.endswith(key)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"fp8": override, "model": {"num_layers": 4}}))
    with pytest.raises(FP8ConfigError) as err:
        apply_path(mg.ADAPTER, cfg)
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
    return apply_path(mg.ADAPTER, path)


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
    assert any("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=0" in w for w in result.notes)
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


@pytest.mark.parametrize(
    "native,key",
    [
        ("fp8_recipe: delayed", "model.fp8_recipe"),
        ("fp8: hybrid", "model.fp8"),
        ("first_last_layers_bf16: true", "model.first_last_layers_bf16"),
        ("fp4: e2m1", "model.fp4"),
        ("fp8_quantizer_factory: pkg.mod.fn", "model.fp8_quantizer_factory"),
    ],
)
def test_apply_refuses_conflicting_native_keys(tmp_path, native, key):
    text = f"precision: fp8_blockwise\nmodel:\n  num_layers: 4\n  {native}\n"
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, text)
    assert err.value.key == key


def test_apply_accepts_matching_native_keys(tmp_path):
    out = _apply(
        tmp_path, "precision: fp8_blockwise\nmodel:\n  fp8: e4m3\n  fp8_recipe: blockwise\n"
    ).data
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
    out = apply_path(mg.ADAPTER, REPO / "conf" / "examples" / "megatron_gpt_fp8_current.yaml").data
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model = {k: v for k, v in out["model"].items() if k in fields}
    assert model["fp8_recipe"] == "tensorwise"
    TransformerConfig(**model)


def test_megatron_core_reads_fp8_wgrad_only_for_delayed_scaling():
    """Why fp8_wgrad: false is refused: megatron-core 0.16's get_fp8_recipe hands it to TE only
    as DelayedScaling's override_linear_precision (which TE 2.x ignores, see test_host_te)."""
    from megatron.core import fp8_utils

    lines = [ln.strip() for ln in inspect.getsource(fp8_utils).splitlines() if "fp8_wgrad" in ln]
    assert lines and all(ln.startswith("override_linear_precision=") for ln in lines), lines


# --------------------------------------------------------------------------- TE in this process


@pytest.fixture
def te_unset(tmp_path, monkeypatch):
    """``transformer_engine.common.recipe`` importable as TE 2.20.2's real recipe module,
    imported with NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset (as a training process that forgot it)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    recipe = load_te_recipe_module(tmp_path, name="te_recipe_megatron_unset")
    monkeypatch.delitem(sys.modules, "te_recipe_megatron_unset")
    pkg, common = (
        types.ModuleType("transformer_engine"),
        types.ModuleType("transformer_engine.common"),
    )
    common.recipe, pkg.common = recipe, common
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)
    return recipe


def test_building_the_config_catches_the_fp32_scale_trap(te_unset):
    """megatron-core builds Float8BlockScaling with TE's import-time (power-of-2) defaults; the
    build functions run in the training process, so they refuse it there, naming the fix."""
    spec = get_recipe("fp8_blockwise")
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1") as err:
        mg.build_transformer_config(spec, **MODEL)
    assert err.value.key == "pow2_scales"
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"):
        mg.apply_to_transformer_config(TransformerConfig(**MODEL), spec)
    # What this TE's defaults give is exactly what fp8_subchannel asks for.
    cfg = mg.build_transformer_config(get_recipe("fp8_subchannel"), **MODEL)
    assert cfg.fp8_recipe == "blockwise"


def test_apply_warning_says_who_checks_the_variable(tmp_path):
    result = _apply(tmp_path, "precision: fp8_blockwise\nmodel: {num_layers: 4}\n")
    (warning,) = [w for w in result.notes if "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in w]
    assert "callback" not in warning  # plain megatron-core has none
    assert "verify_installed_te('fp8_blockwise')" in warning
    over = _apply(
        tmp_path, "fp8: {recipe: fp8_blockwise, pow2_scales: true}\nmodel: {num_layers: 4}\n"
    )
    assert any(
        "verify_installed_te({'recipe': 'fp8_blockwise', 'pow2_scales': True})" in w
        for w in over.notes
    )


# --------------------------------------------------------------------------- BF16 layers vs num_layers


@pytest.mark.parametrize("section", ["model", "language_model"])
def test_apply_refuses_more_bf16_layers_than_the_model_has(tmp_path, capsys, section):
    text = f"fp8: {{recipe: fp8_blockwise, bf16_layers: {{first: 40}}}}\n{section}: {{num_layers: 4}}\n"
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, text)
    assert err.value.key == "fp8.bf16_layers.first" and err.value.value == 40
    assert f"{section}.num_layers) has 4" in str(err.value)
    src, dst = tmp_path / "cli.yaml", tmp_path / "never.yaml"
    src.write_text(text)
    assert main(["apply", str(src), "--host", "megatron", "-o", str(dst)]) == 2
    line = capsys.readouterr().err
    assert "fp8.bf16_layers.first" in line and "has 4" in line and not dst.exists()


def test_apply_refuses_first_plus_last_covering_every_layer(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        _apply(
            tmp_path,
            "fp8: {recipe: fp8_blockwise, bf16_layers: {first: 2, last: 2}}\n"
            "model: {num_layers: 4}\n",
        )
    assert err.value.key == "fp8.bf16_layers.last"


def test_apply_layer_check_uses_the_named_model_and_stays_quiet_without_a_count(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        _apply(
            tmp_path, "fp8: {recipe: fp8_blockwise, model: llama3-8b, bf16_layers: {first: 40}}\n"
        )
    assert err.value.key == "fp8.bf16_layers.first" and "has 32" in str(err.value)
    out = _apply(tmp_path, "fp8: {recipe: fp8_blockwise, bf16_layers: {first: 40}}\n").data
    assert out["model"]["num_layers_at_start_in_bf16"] == 40  # nothing states a layer count
    ok = _apply(
        tmp_path, "fp8: {recipe: fp8_blockwise, bf16_layers: {first: 1}}\nmodel: {num_layers: 4}\n"
    ).data
    assert ok["model"]["num_layers_at_start_in_bf16"] == 1


# --------------------------------------------------------------------------- what get_fp8_recipe honours


def test_honoured_fields_are_the_installed_get_fp8_recipe_s():
    """megatron-core 0.16.1's get_fp8_recipe hands fp8_dot_product_attention to TE only for
    delayed and tensorwise, fp8_multi_head_attention only for delayed (the delayed branch reads
    them inside TEDelayedScaling.__init__, in another file the reader follows): the stacks rows
    for the installed version are what its source says."""
    import importlib.metadata as md

    from megatron_source import read_honoured_fields

    from nemo_fp8_plugin.hosts.megatron.honoured import honoured_fp8_fields

    got = honoured_fp8_fields()
    assert (got.version, got.source) == ("0.16.1", "installed")
    assert got.recipes_reading("fp8_dot_product_attention") == ["delayed", "tensorwise"]
    assert got.recipes_reading("fp8_multi_head_attention") == ["delayed"]
    assert got.recipes_reading("fp8_margin") == ["delayed"]
    assert got.fields["blockwise"] == got.fields["mxfp8"] == frozenset()
    root = Path(str(md.distribution("megatron-core").locate_file("megatron")))
    assert read_honoured_fields(root) == got.fields


def test_the_reader_follows_the_source_not_a_list(tmp_path):
    """A megatron-core whose MXFP8 branch passes fp8_dpa (as 0.18 does) is read as honouring it."""
    import importlib.metadata as md

    from megatron_source import read_honoured_fields

    core = tmp_path / "megatron" / "core"
    (core / "extensions").mkdir(parents=True)
    src = md.distribution("megatron-core").locate_file("megatron/core/fp8_utils.py").read_text()
    patched = src.replace(
        "transformer_engine.common.recipe.MXFP8BlockScaling(\n"
        "                    fp8_format=fp8_format\n",
        "transformer_engine.common.recipe.MXFP8BlockScaling(\n"
        "                    fp8_format=fp8_format, "
        "fp8_dpa=config.fp8_dot_product_attention\n",
    )
    assert patched != src
    (core / "fp8_utils.py").write_text(patched)
    te_ext = (
        md.distribution("megatron-core")
        .locate_file("megatron/core/extensions/transformer_engine.py")
        .read_text()
    )
    (core / "extensions" / "transformer_engine.py").write_text(te_ext)
    fields = read_honoured_fields(tmp_path / "megatron")
    assert "fp8_dot_product_attention" in fields["mxfp8"]
    assert "fp8_multi_head_attention" not in fields["mxfp8"]


@pytest.mark.parametrize(
    "override,key,instead",
    [
        (
            {"recipe": "mxfp8", "fp8_dot_product_attention": True},
            "fp8_dot_product_attention",
            "fp8_current",
        ),
        (
            {
                "recipe": "mxfp8",
                "fp8_dot_product_attention": True,
                "fp8_multi_head_attention": True,
            },
            "fp8_dot_product_attention",
            "fp8_delayed",
        ),
        (
            {
                "recipe": "fp8_current",
                "fp8_dot_product_attention": True,
                "fp8_multi_head_attention": True,
            },
            "fp8_multi_head_attention",
            "fp8_delayed",
        ),
    ],
)
def test_fp8_attention_get_fp8_recipe_drops_is_refused(override, key, instead, tmp_path, capsys):
    spec = get_recipe(override)
    (warning,) = [w for w in mg.native_keys(spec).warnings if f"{key}:" in w]
    assert "megatron-core 0.16.1" in warning
    with pytest.raises(FP8ConfigError) as err:
        mg.build_transformer_config(spec, **MODEL)
    assert err.value.key == key  # a recipe, not a config: the spec field (hosts.recipe_keys)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"fp8": override, "model": {"num_layers": 4}}))
    with pytest.raises(FP8ConfigError) as err:
        apply_path(mg.ADAPTER, cfg)
    assert err.value.key == f"fp8.{key}"
    assert main(["apply", str(cfg), "--host", "megatron"]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1
    assert f"fp8.{key}" in line and "megatron-core 0.16.1" in line and instead in line


def test_fp8_attention_where_get_fp8_recipe_honours_it_is_written():
    spec = get_recipe(
        {
            "recipe": "fp8_delayed",
            "fp8_dot_product_attention": True,
            "fp8_multi_head_attention": True,
        }
    )
    cfg = mg.build_transformer_config(spec, **MODEL)
    assert cfg.fp8_dot_product_attention and cfg.fp8_multi_head_attention
    cur = mg.build_transformer_config(
        get_recipe({"recipe": "fp8_current", "fp8_dot_product_attention": True}), **MODEL
    )
    assert cur.fp8_dot_product_attention is True


def test_fp8_wgrad_refusal_names_the_nearest_te_setting(tmp_path):
    spec = get_recipe({"recipe": "fp8_blockwise", "fp8_wgrad": False})
    with pytest.raises(FP8ConfigError) as err:
        mg.build_transformer_config(spec, **MODEL)
    assert "NVTE_BACKWARD_OVERRIDE=high_precision" in str(err.value)
    assert "whole backward" in str(err.value)


# --------------------------------------------------------------------------- DDP / optimizer side


@pytest.mark.parametrize("name", RECIPES)
def test_ddp_and_optimizer_fields_build_megatron_cores_own_configs(name):
    """fp8_param_gather and reuse_grad_buf_for_mxfp8_param_ag are DistributedDataParallelConfig
    fields (its __post_init__ asserts the first when the second is set); OptimizerConfig also
    takes fp8_recipe and the reuse flag, and warns for MXFP8 without them."""
    import warnings

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    spec = get_recipe(name)
    ddp_fields = mg.ddp_config_fields(spec)
    assert set(ddp_fields) <= {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    ddp = DistributedDataParallelConfig(**ddp_fields)
    assert ddp.fp8_param_gather is spec.fp8_param
    assert ddp.reuse_grad_buf_for_mxfp8_param_ag is (name == "mxfp8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = OptimizerConfig(**mg.optimizer_config_fields(spec))
    assert opt.fp8_recipe == mg.FP8_RECIPE[spec.scaling]
    assert not [w for w in caught if "reuse_grad_buf_for_mxfp8_param_ag" in str(w.message)]
    built = mg.build_ddp_config(spec, overlap_grad_reduce=True)
    assert isinstance(built, DistributedDataParallelConfig) and built.overlap_grad_reduce
    with pytest.raises(FP8ConfigError) as err:
        mg.build_ddp_config(spec, fp8_param_gather=not spec.fp8_param)
    assert err.value.key == "fp8_param_gather"


def _ddp_from_megatron_lm_args(out):
    """What Megatron-LM's training.get_model does with a --yaml-cfg file: every
    DistributedDataParallelConfig field found among the flattened args (root, model_parallel,
    language_model) becomes a DDP kwarg."""
    from megatron.core.distributed import DistributedDataParallelConfig

    flat = {
        **out.get("model_parallel", {}),
        **out.get("language_model", {}),
        **{k: v for k, v in out.items() if not isinstance(v, dict)},
    }
    names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    return DistributedDataParallelConfig(**{k: v for k, v in flat.items() if k in names})


def test_write_distributed_fields_places_them_per_layout():
    spec = get_recipe("mxfp8")
    lm = {"language_model": {"num_layers": 2}, "model_parallel": {"tensor_model_parallel_size": 1}}
    assert mg.write_distributed_fields(lm, spec) == [
        "fp8_param_gather",
        "reuse_grad_buf_for_mxfp8_param_ag",
    ]
    ddp = _ddp_from_megatron_lm_args(lm)
    assert ddp.fp8_param_gather and ddp.reuse_grad_buf_for_mxfp8_param_ag
    plain = {"model": {"num_layers": 2}}
    mg.write_distributed_fields(plain, spec)
    from megatron.core.distributed import DistributedDataParallelConfig

    assert DistributedDataParallelConfig(**plain["ddp"]).reuse_grad_buf_for_mxfp8_param_ag
    with pytest.raises(FP8ConfigError) as err:
        mg.write_distributed_fields({"model": {}, "ddp": {"fp8_param_gather": False}}, spec)
    assert err.value.key == "ddp.fp8_param_gather"
    with pytest.raises(FP8ConfigError) as err:
        mg.write_distributed_fields({"language_model": {}, "fp8_param_gather": False}, spec)
    assert err.value.key == "fp8_param_gather"
    with pytest.raises(FP8ConfigError) as err:
        mg.write_distributed_fields({"model": {}, "ddp": 3}, spec)
    assert err.value.key == "ddp"
    assert (
        mg.write_distributed_fields(
            {"model": {}}, get_recipe({"recipe": "fp8_blockwise", "training": "bf16"})
        )
        == []
    )


def test_apply_writes_the_ddp_side(tmp_path):
    lm = _apply(tmp_path, "precision: mxfp8\nlanguage_model: {num_layers: 2}\n").data
    assert lm["fp8_param_gather"] is True and lm["reuse_grad_buf_for_mxfp8_param_ag"] is True
    assert _ddp_from_megatron_lm_args(lm).reuse_grad_buf_for_mxfp8_param_ag
    plain = _apply(tmp_path, "precision: fp8_current\nmodel: {num_layers: 4}\n", "p.yaml").data
    # reuse_grad_buf_for_mxfp8_param_ag: false is the DDP config's default: not written
    assert plain["ddp"] == {"fp8_param_gather": True}
    assert _apply(tmp_path, yaml.safe_dump(plain), "again.yaml").data == plain
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, "precision: mxfp8\nmodel: {}\nddp: {fp8_param_gather: false}\n", "c.yaml")
    assert err.value.key == "ddp.fp8_param_gather"
