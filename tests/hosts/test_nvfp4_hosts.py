"""`nvfp4`, the sixth recipe, in every host, each output judged by the host's own code
: Transformer Engine 2.20.2's recipe module from its wheel, megatron-core
0.16.1's TransformerConfig, NeMo 2.7.3's MegatronMixedPrecision, Megatron-Bridge 0.6.2's
mixed_precision.py from its wheel, NeMo RL's own model_overrides merge (read from its source
with ast) and vLLM's refusal with the reason. The numerics are tests/numerics/test_numerics_nvfp4.py's.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import json
import sys
import types

import pytest
import yaml

from conftest import load_te_recipe_module, nemo_rl_configs, shared_nemo_rl, upstream_file
from nemo_fp8_plugin import FP8ConfigError, RecipeSpec, get_recipe, list_recipes
from nemo_fp8_plugin.capabilities import CAPABILITIES, ENV_NVFP4, NVFP4_GENERATION_REFUSAL
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.hosts import apply_path, bridge, mapping_context, run, te
from nemo_fp8_plugin.hosts import megatron as mg
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.registry import load_yaml_file, preset_dir

CONFIGS = nemo_rl_configs()
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4)
BRIDGE_WHEEL = "megatron_bridge-0.6.2-*.whl"


# --------------------------------------------------------------------------- the preset


def test_nvfp4_is_the_sixth_preset_and_listed(capsys):
    assert [s.name for s in list_recipes()][:6][-1] == "nvfp4"
    data = load_yaml_file(preset_dir() / "nvfp4.yaml")
    assert set(data) == set(RecipeSpec.OVERRIDABLE) | {"name"}  # every field written out
    spec = get_recipe("nvfp4")
    assert RecipeSpec.from_mapping(data) == spec
    assert (
        spec.scaling,
        spec.fp8_format,
        spec.activation_block,
        spec.weight_block,
        spec.gradient_block,
        spec.pow2_scales,
        spec.training,
        spec.generation,
    ) == ("nvfp4", "e2m1", (1, 16), (16, 16), (1, 16), False, "fp8", "bf16")
    assert spec.format_for("weight") == spec.format_for("grad_output") == "e2m1"
    assert main(["recipes"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("nvfp4"))
    assert "SM100" in line
    row = CAPABILITIES["nvfp4"]
    assert (row.te_class, row.scale_format, row.training_archs) == (
        "NVFP4BlockScaling",
        "e4m3",
        frozenset({"blackwell"}),
    )


@pytest.mark.parametrize(
    "override, key, text",
    [
        ({"fp8_format": "e4m3"}, "fp8_format", "E2M1"),
        ({"weight_block": [1, 32]}, "weight_block", "[1, 16]"),
        ({"activation_block": [16, 16]}, "activation_block", "[1, 16]"),
        ({"gradient_block": None}, "gradient_block", "missing"),
        ({"pow2_scales": True}, "pow2_scales", "E4M3"),
        ({"generation": "fp8"}, "generation", "ModelOpt"),
    ],
)
def test_nvfp4_spec_refuses_with_the_key(override, key, text):
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "nvfp4", **override})
    assert err.value.key == key and text in str(err.value)
    assert "\n" not in str(err.value)


def test_e2m1_is_nvfp4s_format_only():
    with pytest.raises(FP8ConfigError) as err:
        get_recipe({"recipe": "mxfp8", "fp8_format": "e2m1"})
    assert err.value.key == "fp8_format" and "nvfp4" in str(err.value)
    assert get_recipe({"recipe": "nvfp4", "weight_block": [1, 16]}).weight_block == (1, 16)


def test_generation_refusal_names_modelopt_and_blackwell():
    assert "ModelOpt" in NVFP4_GENERATION_REFUSAL
    assert "compressed-tensors" in NVFP4_GENERATION_REFUSAL
    assert "Blackwell" in NVFP4_GENERATION_REFUSAL


def test_nvfp4_dimensions_need_32():
    spec = get_recipe("nvfp4")
    assert spec.check_dims({"hidden_size": 4096, "ffn_hidden_size": 14336}) == []
    found = spec.check_dims({"hidden_size": 4112})  # 16-aligned, not 32 (FP4 TMA rows)
    assert [(f.level, f.key) for f in found] == [("error", "model.hidden_size")]
    found = spec.check_dims({"ffn_hidden_size": 11008}, tensor_parallel=16)  # 688 per rank
    assert [(f.level, f.key) for f in found] == [("error", "tensor_model_parallel_size")]


# --------------------------------------------------------------------------- Transformer Engine


@pytest.fixture(scope="module")
def te_recipe(tmp_path_factory):
    return load_te_recipe_module(tmp_path_factory.mktemp("te_nvfp4"), name="te_recipe_nvfp4")


@pytest.mark.parametrize("weight_block, two_d", [((16, 16), True), ((1, 16), False)])
def test_te_builds_nvfp4blockscaling_and_reads_every_field_back(te_recipe, weight_block, two_d):
    spec = get_recipe({"recipe": "nvfp4", "weight_block": list(weight_block)})
    obj = te.build_te_recipe(spec, te_recipe)
    assert type(obj).__name__ == "NVFP4BlockScaling"
    assert obj.fp4_format is te_recipe.Format.E2M1 and obj.fp8_format is te_recipe.Format.E4M3
    assert (obj.disable_rht, obj.disable_stochastic_rounding, obj.disable_2d_quantization) == (
        False,
        False,
        not two_d,
    )
    # what TE's own __post_init__ derives: RHT on the wgrad operands, SR on gradients only
    assert obj.fp4_quant_fwd_inp.random_hadamard_transform is True
    assert obj.fp4_quant_fwd_weight.fp4_2d_quantization is two_d
    assert obj.fp4_quant_bwd_grad.stochastic_rounding is True
    assert obj.fp4_quant_fwd_inp.stochastic_rounding is False
    assert te.recipe_mismatches(obj, spec) == []
    assert (
        te.recipe_mismatches(te_recipe.NVFP4BlockScaling(disable_rht=True), spec)[0][0]
        == "disable_rht"
    )
    desc = te.te_recipe_description(spec)
    assert desc["class"] == "NVFP4BlockScaling" and desc["fields"]["fp4_format"] == "E2M1"


def test_te_env_pins_every_nvfp4_variable_of_tes_source(tmp_path):
    """Every NVTE_NVFP4_* variable TE's recipe module reads is pinned, with the value that
    gives the spec's recipe."""
    src = upstream_file(
        "transformer_engine-2.20.2-*.whl", "transformer_engine/common/recipe/__init__.py", tmp_path
    ).read_text()
    read = {
        n.args[0].value
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "getenv"
        and n.args
        and isinstance(n.args[0], ast.Constant)
        and str(n.args[0].value).startswith("NVTE_NVFP4")
    }
    env = te.required_env(get_recipe("nvfp4"))
    assert set(env) == read == set(ENV_NVFP4.values())
    assert (
        te.required_env(get_recipe({"recipe": "nvfp4", "weight_block": [1, 16]}))[
            "NVTE_NVFP4_DISABLE_2D_QUANTIZATION"
        ]
        == "1"
    )


@pytest.mark.parametrize(
    "var, value",
    [
        ("NVTE_NVFP4_DISABLE_RHT", "1"),
        ("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "1"),
        ("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "1"),
        ("NVTE_NVFP4_4OVER6", "all"),
    ],
)
def test_host_built_nvfp4_with_a_stray_variable_is_refused_naming_it(
    tmp_path, monkeypatch, var, value
):
    spec = get_recipe("nvfp4")
    for name, want in te.required_env(spec).items():
        monkeypatch.setenv(name, want)
    good = load_te_recipe_module(tmp_path / "ok", name=f"te_ok_{var}")
    te.verify_host_recipe(spec, good)  # megatron-core's NVFP4BlockScaling() is the spec's
    monkeypatch.setenv(var, value)
    bad = load_te_recipe_module(tmp_path / "bad", name=f"te_bad_{var}")
    with pytest.raises(FP8ConfigError) as err:
        te.verify_host_recipe(spec, bad)
    assert err.value.key == var and f"{var}=" in str(err.value)


# --------------------------------------------------------------------------- megatron-core


def test_megatron_core_takes_the_fp4_fields():
    from megatron.core.transformer import TransformerConfig

    spec = get_recipe({"recipe": "nvfp4", "bf16_layers": {"last": 1}})
    cfg = mg.build_transformer_config(spec, **MODEL)
    assert isinstance(cfg, TransformerConfig)
    assert (cfg.fp4, cfg.fp4_recipe, cfg.fp4_param, cfg.fp8, cfg.fp8_param) == (
        "e2m1",
        "nvfp4",
        True,
        None,
        False,
    )
    assert (cfg.first_last_layers_bf16, cfg.num_layers_at_end_in_bf16) == (True, 1)
    # megatron-core itself refuses FP4 next to FP8: the plugin writes fp8: null
    with pytest.raises(ValueError, match="fp4 and fp8"):
        dataclasses.replace(cfg, fp8="hybrid")


def test_megatron_yaml_with_a_native_fp8_is_refused(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("precision: nvfp4\nmodel: {num_layers: 4, hidden_size: 256, fp8: hybrid}\n")
    with pytest.raises(FP8ConfigError) as err:
        apply_path(mg.ADAPTER, path)
    assert err.value.key == "model.fp8"
    path.write_text(
        "precision: nvfp4\nmodel: {num_layers: 4, hidden_size: 256, num_attention_heads: 4}\n"
    )
    result = apply_path(mg.ADAPTER, path)
    # fp8_param_gather: false is the DDP config's default, so not written
    ddp = result.data.get("ddp", {})
    assert result.data["model"]["fp4"] == "e2m1" and ddp.get("fp8_param_gather", False) is False
    assert mg.ADAPTER.validate(result, mapping_context(yaml.safe_load(path.read_text())))


def test_fp8_recipes_refuse_a_native_fp4(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("precision: fp8_blockwise\nmodel: {num_layers: 4, fp4: e2m1}\n")
    with pytest.raises(FP8ConfigError) as err:
        apply_path(mg.ADAPTER, path)
    assert err.value.key == "model.fp4"


# --------------------------------------------------------------------------- NeMo 2


@pytest.mark.slow
def test_nemo2_megatron_mixed_precision_takes_the_fp4_fields():
    from megatron.core.transformer import TransformerConfig
    from nemo.collections.llm.recipes.precision.mixed_precision import bf16_mixed
    from nemo.lightning.pytorch.plugins.mixed_precision import (
        MegatronMixedPrecision,
        update_config_with_dtype_overrides,
    )

    from nemo_fp8_plugin.hosts import nemo2

    result = run(nemo2.ADAPTER, mapping_context({"precision": "nvfp4", "trainer": {}}))
    block = result.data["trainer"]["plugins"]
    # no plugin in the config: the block is an overlay NeMo-Run merges into the factory's own
    # plugin (NeMo's bf16_mixed), so the plugin is built from the two, as NeMo-Run builds it
    plugin = MegatronMixedPrecision(
        **{
            **bf16_mixed().__arguments__,
            **{k: nemo2._dtype(v) for k, v in block.items() if k != "_target_"},
        }
    )
    assert (plugin.dtype_config.fp4, plugin.dtype_config.fp4_recipe, plugin.dtype_config.fp8) == (
        "e2m1",
        "nvfp4",
        None,
    )
    # NeMo 2.7.3 has no fp4_param on the plugin: it goes on model.config, which the strategy's
    # copy of the DtypeConfig leaves alone (NeMo's own update function, as connect() runs it)
    assert "fp4_param" not in block and result.data["model"]["config"]["fp4_param"] is True
    model_cfg = TransformerConfig(**MODEL, fp4_param=False)
    model_cfg.fp4_param = result.data["model"]["config"]["fp4_param"]
    update_config_with_dtype_overrides(plugin.dtype_config, model_cfg)
    assert (model_cfg.fp4, model_cfg.fp4_recipe, model_cfg.fp4_param, model_cfg.fp8) == (
        "e2m1",
        "nvfp4",
        True,
        None,
    )
    dataclasses.replace(model_cfg)  # megatron-core accepts what NeMo pushed


# --------------------------------------------------------------------------- Megatron-Bridge


@pytest.fixture
def mp(tmp_path, monkeypatch):
    from megatron.core.transformer import TransformerConfig

    path = upstream_file(BRIDGE_WHEEL, "megatron/bridge/training/mixed_precision.py", tmp_path)
    models = types.ModuleType("megatron.bridge.models")
    models.GPTModelProvider = models.T5ModelProvider = TransformerConfig
    monkeypatch.setitem(sys.modules, "megatron.bridge", types.ModuleType("megatron.bridge"))
    monkeypatch.setitem(sys.modules, "megatron.bridge.models", models)
    spec = importlib.util.spec_from_file_location("bridge_mp_nvfp4", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    # finalize() asks the installed TE for >= 2.7 under fp4; the contract's TE is 2.20.2
    monkeypatch.setattr(module, "is_te_min_version", lambda *a, **k: True)
    return module


def test_bridge_yaml_names_bridges_recipe_and_register_adds_no_duplicate(mp, tmp_path):
    class Allow:
        def register_allowed_target_prefix(self, prefix):
            pass

    added = bridge.register(mp, instantiate_module=Allow())
    assert "nvfp4" not in added and "nvfp4" not in mp.MIXED_PRECISION_RECIPES
    assert mp.MIXED_PRECISION_RECIPES["bf16_with_nvfp4_mixed"].__module__ == mp.__name__
    path = tmp_path / "b.yaml"
    path.write_text("mixed_precision: bf16_mixed\nprecision: nvfp4\nmodel: {num_layers: 4}\n")
    out = apply_path(bridge.ADAPTER, path).data
    assert out["mixed_precision"]["fp4_recipe"] == "nvfp4"  # the block, as for every recipe
    cfg = mp.get_mixed_precision_config("bf16_with_nvfp4_mixed")  # Bridge's recipe of that name
    mine = bridge.mixed_precision_config("nvfp4", mp_module=mp)
    assert dataclasses.asdict(cfg) == {**dataclasses.asdict(mine), "fp8_recipe": cfg.fp8_recipe}
    # and stops there: the output asks for nothing more
    path.write_text(yaml.safe_dump(out))
    assert apply_path(bridge.ADAPTER, path).data == out


def test_bridge_variant_gets_the_block_and_setup_pushes_fp4(mp, tmp_path):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    path = tmp_path / "b.yaml"
    path.write_text("fp8: {recipe: nvfp4, bf16_layers: {last: 2}}\nmodel: {num_layers: 4}\n")
    result = apply_path(bridge.ADAPTER, path)
    block = result.data["mixed_precision"]
    assert isinstance(block, dict)
    import torch

    fields = {
        k: (getattr(torch, v["_target_"].split(".")[1]) if isinstance(v, dict) else v)
        for k, v in block.items()
        if k != "_target_"
    }
    cfg = mp.MixedPrecisionConfig(**fields)
    cfg.finalize()
    model = TransformerConfig(**MODEL)
    cfg.setup(model, OptimizerConfig(), DistributedDataParallelConfig())
    assert (model.fp4, model.fp4_recipe, model.fp4_param, model.fp8) == (
        "e2m1",
        "nvfp4",
        True,
        None,
    )
    assert (model.first_last_layers_bf16, model.num_layers_at_end_in_bf16) == (True, 2)
    dataclasses.replace(model)


# --------------------------------------------------------------------------- NeMo RL


def _nemo_rl_function(*names: str):
    """NeMo RL's own functions from its source (it cannot be installed), exec'd with the names
    they use."""
    tree = ast.parse(shared_nemo_rl("src/nemo_rl/models/megatron/setup.py").read_text())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(d.name for d in defs) == sorted(names)
    from collections.abc import Mapping
    from typing import Any

    scope = {
        "Mapping": Mapping,
        "Any": Any,
        "copy": copy,
        "is_dataclass": dataclasses.is_dataclass,
        "fields": dataclasses.fields,
        "replace": dataclasses.replace,
    }
    exec(compile(ast.Module(body=defs, type_ignores=[]), "nemo_rl/setup.py", "exec"), scope)
    return [scope[n] for n in names]


MAIN = "nemo-rl-main-2026-08-22"  # NeMo RL with model_overrides (NVFP4 training)


def _moonlight(tmp_path, fp8, **policy):
    src = CONFIGS / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml"
    data = yaml.safe_load(src.read_text())
    data["defaults"] = str((src.parent / data["defaults"]).resolve())
    data["fp8"] = fp8
    data["policy"].update(policy)
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_nemo_rl_nvfp4_reaches_the_provider_through_model_overrides(tmp_path):
    from megatron.core.transformer import TransformerConfig

    src = _moonlight(tmp_path, {"recipe": "nvfp4", "fp8_param": True})
    result = apply_path(NEMO_RL, src, stack=MAIN)  # model_overrides: main's (not v0.7.0's)
    meg = result.data["policy"]["megatron_cfg"]
    assert meg["model_overrides"] == {"fp4": "e2m1", "fp4_recipe": "nvfp4", "fp4_param": True}
    assert "fp8_cfg" not in meg or not meg["fp8_cfg"].get("enabled")
    # the variables main's TE (2.15) reads, each at the recipe's value (the later TEs' ones are
    # left out: tests/hosts/nemo_rl/test_nemo_rl_te_facts.py)
    written = {k: v for k, v in meg["env_vars"].items() if k in ENV_NVFP4.values()}
    assert written and written.items() <= te.required_env(get_recipe("nvfp4")).items()
    assert "precision" not in result.data["policy"]["generation"].get("vllm_cfg", {})
    assert any("BF16" in n and "ModelOpt" in n for n in map(str, result.notes))
    # NeMo RL's own merge, on a megatron-core TransformerConfig (a Bridge provider subclasses it)
    (merge,) = _nemo_rl_function("_merge_model_overrides", "_merge_model_override_value")[:1]
    merged = merge(TransformerConfig(**MODEL), meg["model_overrides"])
    assert (merged.fp4, merged.fp4_recipe, merged.fp4_param, merged.fp8) == (
        "e2m1",
        "nvfp4",
        True,
        None,
    )
    merged.__post_init__()
    # fp4 is no first-class NeMo RL key, which _validate_model_override_conflicts would refuse
    policy_src = shared_nemo_rl("src/nemo_rl/models/policy/__init__.py").read_text()
    first_class = {
        n.target.id
        for c in ast.walk(ast.parse(policy_src))
        if isinstance(c, ast.ClassDef) and c.name == "MegatronConfig"
        for n in c.body
        if isinstance(n, ast.AnnAssign)
    }
    assert not set(meg["model_overrides"]) & (first_class | set(meg) - {"model_overrides"})


def test_nemo_rl_nvfp4_with_sequence_packing_is_refused(tmp_path):
    src = CONFIGS / "grpo_math_8B_megatron.yaml"  # packing on (grpo_math_1B.yaml)
    data = yaml.safe_load(src.read_text())
    data["defaults"] = str((src.parent / data["defaults"]).resolve())
    data["fp8"] = {"recipe": "nvfp4"}
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FP8ConfigError) as err:  # a release with model_overrides: it trains
        apply_path(NEMO_RL, path, stack=MAIN)
    assert err.value.key == "policy.sequence_packing.enabled" and "128" in str(err.value)


def test_nemo_rl_nvfp4_next_to_an_enabled_fp8_cfg_is_refused(tmp_path):
    path = _moonlight(
        tmp_path, {"recipe": "nvfp4"}, megatron_cfg={"enabled": True, "fp8_cfg": {"enabled": True}}
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, path, stack=MAIN)
    assert err.value.key == "policy.megatron_cfg.fp8_cfg.enabled"


# --------------------------------------------------------------------------- vLLM, analyze, doctor


def test_vllm_refuses_nvfp4_with_the_reason(tmp_path, capsys):
    path = tmp_path / "v.yaml"
    path.write_text(
        "model: meta-llama/Llama-3.1-8B-Instruct\ntensor_parallel_size: 1\nprecision: nvfp4\n"
    )
    assert main(["apply", str(path), "--host", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scaling:" in err and "ModelOpt" in err


def test_explain_shows_every_training_host_and_the_refusals(tmp_path):
    from nemo_fp8_plugin.explain import build_report

    path = tmp_path / "c.yaml"
    path.write_text("precision: nvfp4\n")
    hosts = build_report(path)["hosts"]
    assert hosts["megatron"]["keys"]["model"]["fp4_recipe"] == "nvfp4"
    assert hosts["bridge"]["keys"]["mixed_precision"]["fp4_recipe"] == "nvfp4"
    assert hosts["nemo2"]["keys"]["trainer"]["plugins"]["fp4"] == "e2m1"
    assert hosts["te"]["keys"]["transformer_engine"]["class"] == "NVFP4BlockScaling"
    assert "ModelOpt" in hosts["vllm"]["refused"]


def test_analyze_quantizes_nvfp4_with_quantize_nvfp4():
    import torch

    from nemo_fp8_plugin.analyze.metrics import quantize_dequantize
    from nemo_fp8_plugin.numerics import quantize_nvfp4

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    spec = get_recipe("nvfp4")
    assert torch.equal(
        quantize_dequantize(x, spec, "weight"), quantize_nvfp4(x, (16, 16)).dequantize()
    )
    assert torch.equal(
        quantize_dequantize(x, spec, "input"), quantize_nvfp4(x, (1, 16)).dequantize()
    )


@pytest.mark.parametrize(
    "hardware, runnable",
    [("h100", False), ("b200", None), ("gb300", None), ("rtx-pro-6000", False)],
)
def test_doctor_judges_nvfp4_per_gpu(capsys, hardware, runnable):
    assert main(["doctor", "--hardware", hardware, "--json"]) == 0
    verdict = {r["recipe"]: r for r in json.loads(capsys.readouterr().out)["recipes"]}
    assert verdict["nvfp4"]["runnable"] is runnable
    if runnable is False:
        assert any("SM100/SM103" in p for p in verdict["nvfp4"]["problems"])
