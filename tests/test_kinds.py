"""Scaling kinds as objects: a new kind is its class (with its capability row), its numerics
and its preset YAML, and nothing else (docs/architecture.md, "How to add a scaling kind").

The kind below exists only in this file: per-tensor current scaling whose scales are powers
of two by construction (E8M0 scales). Its class, numerics and preset (written to a temporary
directory) are registered, and ``explain`` and ``apply`` run on it for every host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nemo_fp8_plugin import registry
from nemo_fp8_plugin.capabilities import CAPABILITIES, RecipeCapability
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.dotted import flatten
from nemo_fp8_plugin.hosts import ADAPTERS
from nemo_fp8_plugin.kinds import KINDS, Kind, kind, register_kind

pytestmark = pytest.mark.torch_free

NAME = "current_pow2"
RECIPE = "fp8_current_pow2"


class CurrentPow2(Kind):
    """Per-tensor current scaling with power-of-2 (E8M0) scales: TE's Float8CurrentScaling
    with ``use_power_2_scales`` pinned on."""

    name = NAME

    def te_fields(self, spec):
        return {**super().te_fields(spec), "use_power_2_scales": True}

    def te_quantizers(self, spec):
        return self._qparams(spec)


ROW = RecipeCapability(
    scaling=NAME,
    te_class="Float8CurrentScaling",
    megatron_recipe="tensorwise",
    scale_format="e8m0",
    te_amax_epsilon=True,
    training_archs=frozenset({"hopper", "blackwell"}),
    nearest={("ada", "train"): "fp8_current", ("ada", "rl"): "fp8_current"},
)


def fake_quant(t, tile, fmt, pow2, eps):
    """Its numerics: the per-tensor quantizer with power-of-2 scales."""
    from nemo_fp8_plugin.numerics import fake_quant_per_tensor

    return fake_quant_per_tensor(t, fmt, True, eps)


PRESET = {
    "name": RECIPE,
    "description": "Per-tensor current scaling, power-of-2 scales (a test kind).",
    "scaling": NAME,
    "fp8_format": "hybrid",
    "activation_block": None,
    "weight_block": None,
    "gradient_block": None,
    "pow2_scales": True,
    "amax_epsilon": 0.0,
    "amax_history_len": 1,
    "amax_compute_algo": "most_recent",
    "margin": 0,
    "reduce_amax": True,
    "fp8_wgrad": True,
    "fp8_dot_product_attention": False,
    "fp8_multi_head_attention": False,
    "fp8_param": False,
    "training": "fp8",
    "generation": "fp8",
    "kv_cache": "auto",
    "generation_numerics": "vllm",
    "bf16_layers": {"first": 0, "last": 0, "modules": [], "applies_to": "both"},
    "importance_sampling": {
        "enabled": True,
        "level": "token",
        "truncation": None,
        "ratio_max": 2.0,
        "ratio_min": None,
    },
    "qat": None,
    "hardware": None,
}


@pytest.fixture(scope="module")
def new_kind(tmp_path_factory):
    """The kind, its numerics and its preset (a YAML file in a temporary directory),
    registered for this module and removed after."""
    from nemo_fp8_plugin.numerics.recipe import KIND_NUMERICS, register_numerics
    from nemo_fp8_plugin.registry import load_yaml_file, register_recipe

    preset = tmp_path_factory.mktemp("recipes") / f"{RECIPE}.yaml"
    preset.write_text(yaml.safe_dump(PRESET, sort_keys=False))
    programmatic = list(registry._programmatic)
    register_kind(CurrentPow2(), ROW)
    register_numerics(NAME, fake_quant)
    try:
        register_recipe(load_yaml_file(preset), source=str(preset))
        yield RECIPE
    finally:
        for table in (KINDS, CAPABILITIES, KIND_NUMERICS):
            table.pop(NAME, None)
        registry._programmatic[:] = programmatic
        registry.default_registry(reload=True)


def _config(host: str, tmp_path: Path) -> Path:
    """A config of ``host`` asking for the recipe."""
    config = {
        "nemo2": {"trainer": {"max_steps": 1}, "precision": RECIPE},
        "bridge": {"mixed_precision": RECIPE},
        "megatron": {"model": {"num_layers": 8}, "precision": RECIPE},
        "nemo-rl": {
            "policy": {
                "precision": RECIPE,
                "model_name": "meta-llama/Llama-3.1-8B-Instruct",
                "megatron_cfg": {"enabled": True},
                "generation": {"backend": "vllm", "vllm_cfg": {}},
            }
        },
        "vllm": {"model": "m", "max_model_len": 4096, "precision": RECIPE},
        "te": {"precision": RECIPE},
    }[host]
    path = tmp_path / f"{host}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("host", list(ADAPTERS))
def test_a_new_kind_is_explained_and_applied_for_every_host(new_kind, host, tmp_path, capsys):
    config = _config(host, tmp_path)
    assert main(["explain", str(config), "--host", host, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recipe"]["scaling"] == NAME
    assert "refused" not in report["hosts"][host], report["hosts"][host]
    out = tmp_path / f"{host}.out.yaml"
    assert main(["apply", str(config), "--host", host, "-o", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    explained = dict(flatten(report["hosts"][host]["keys"]))
    assert explained.items() <= dict(flatten(written)).items()
    if host == "vllm":  # the row has no vLLM FP8 path: vLLM generates in BF16 and says so
        assert not explained and "no FP8 vLLM generation path" in str(report["hosts"]["vllm"])
    else:
        assert explained
    flat = json.dumps(written)
    if host in ("megatron", "nemo2", "bridge"):
        assert '"fp8_recipe": "tensorwise"' in flat  # the row's megatron-core recipe
    if host == "nemo-rl":
        assert written["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_recipe"] == "tensorwise"
    if host == "te":
        te = written["transformer_engine"]
        assert te["class"] == "Float8CurrentScaling"
        assert te["fields"]["use_power_2_scales"] is True  # the class's answer
        assert te["quantizers"]["fp8_quant_fwd_inp"]["power_2_scale"] is True


def test_the_new_kind_answers_from_its_row_and_its_class(new_kind):
    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.kinds import hardware_problems, side_summary

    spec = get_recipe(RECIPE)
    assert kind(NAME).row is ROW
    ada = hardware_problems(spec.replace(generation="bf16"), "ada")
    assert ada and ada[0].recipe == "fp8_current"  # the row's nearest recipe
    assert side_summary(spec, "hopper")["training"] == "Float8CurrentScaling on Hopper (SM90)"
    with pytest.raises(Exception, match="pow2_scales"):
        get_recipe({"recipe": RECIPE, "pow2_scales": False})  # E8M0 scales: the row says so


@pytest.mark.host  # torch: the emulated linear
def test_the_new_kind_runs_its_own_numerics(new_kind):
    import torch

    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.numerics import RoleQuantizer

    x = torch.randn(8, 64) * 3
    ours = RoleQuantizer(get_recipe(RECIPE), "input").rowwise(x)
    pow2 = get_recipe({"recipe": "fp8_current", "pow2_scales": True})
    assert torch.equal(ours, RoleQuantizer(pow2, "input").rowwise(x))
    assert not torch.equal(ours, RoleQuantizer(get_recipe("fp8_current"), "input").rowwise(x))
