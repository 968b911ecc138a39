"""The rules against a real megatron-core: module names of GPT models built on CPU, the
``quant_recipe`` spelling loaded by megatron-core's own ``RecipeConfig`` and matched by its
``get_quant_config_or_none``, and first/last layers through ``is_first_last_bf16_layer``.

CPU recipe (HOSTS.md): local (non-TE) layer specs, gloo, ``use_cpu_initialization``, the
inference RNG tracker. Local specs build MoE experts as ``SequentialMLP``
(``experts.local_experts.<e>.linear_fc1``) where TE builds one grouped GEMM
(``experts.linear_fc1``); the descriptions use the grouped names and the spellings cover both.
"""

from __future__ import annotations

import fnmatch
import re

import pytest
import torch

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.hosts.megatron.rules import to_megatron
from nemo_fp8_plugin.rules import builtin_high_precision, from_transformer_config, resolve

pytestmark = pytest.mark.host


@pytest.fixture(scope="module")
def megatron_env(megatron_cpu):
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=4,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        add_bias_linear=False,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _gpt(cfg):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=64)


def _linear_names(model) -> list[str]:
    out = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and not name.startswith("embedding"):
            out.append(name)
    return out


def _grouped(name: str) -> str:
    return re.sub(r"\.experts\.local_experts\.\d+\.", ".experts.", name)


MOE = dict(
    num_moe_experts=4,
    moe_ffn_hidden_size=64,
    moe_shared_expert_intermediate_size=64,
    moe_layer_freq=[0, 1, 1, 1],
    moe_router_topk=2,
)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_description_names_are_the_real_module_names(megatron_env, kind):
    cfg = _config(**(MOE if kind == "moe" else {}))
    model = _gpt(cfg)
    real = list(dict.fromkeys(_grouped(n) for n in _linear_names(model)))
    desc = from_transformer_config(cfg)
    assert sorted(real) == sorted(desc.megatron_linear_modules)
    if kind == "moe":
        assert desc.num_experts == 4 and desc.num_shared_experts == 1
        assert "decoder.layers.0.mlp.linear_fc1" in real
        assert "decoder.layers.1.mlp.router" in real


RULES = [
    {"modules": ["*down_proj*", "*.router"]},
    {"first": 1, "modules": ["*experts*"]},
    {"modules": ["model.layers.2.*"]},
    {"modules": ["*q_proj*"]},
]


@pytest.mark.parametrize("rules", RULES)
def test_quant_recipe_loads_and_matches_real_modules(megatron_env, rules):
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.quant_config import RecipeConfig
    from megatron.core.quantization.utils import get_quant_config_or_none

    cfg = _config(**MOE)
    model = _gpt(cfg)
    desc = from_transformer_config(cfg)
    spec = get_recipe("fp8_blockwise").replace(bf16_layers=rules)
    keys = to_megatron(spec, desc).keys
    recipe = RecipeConfig.from_config_dict(keys["quant_recipe"])
    decisions = resolve(spec, desc, "training").by_module()
    for name in _linear_names(model):
        d = decisions[_grouped(name)]
        qc = get_quant_config_or_none(name, recipe)
        by_pattern = qc is not None
        if builtin_high_precision(name):
            continue  # routers and the output layer are not TE modules: no quant config applies
        in_first_last = d.rule in ("bf16_layers.first", "bf16_layers.last")
        if not in_first_last:
            assert by_pattern == (d.precision == "bf16"), (name, d)
        if by_pattern:
            params = TEQuantizationParams.parse_from_config(qc)
            # No FP8 and no FP4 recipe: megatron-core disables the autocast for the module.
            assert params.training_recipe.fp8_quantization_recipe is None
            assert params.training_recipe.fp4_quantization_recipe is None
            assert params.training_recipe.override_quantized_autocast


@pytest.mark.parametrize("first, last", [(1, 1), (2, 0), (0, 1)])
def test_first_last_keys_through_megatron(megatron_env, first, last):
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    spec = get_recipe("fp8_blockwise").replace(bf16_layers={"first": first, "last": last})
    keys = to_megatron(spec).keys
    cfg = _config(num_layers=6, fp8="e4m3", fp8_recipe="blockwise", **keys)
    desc = from_transformer_config(cfg)
    per_layer = {}
    for d in resolve(spec, desc, "training").decisions:
        if d.layer is not None:
            per_layer.setdefault(d.layer, set()).add(d.precision == "bf16")
    for layer in range(6):
        assert per_layer[layer] == {is_first_last_bf16_layer(cfg, layer)}


def test_quant_recipe_globs_are_fnmatch_globs():
    """The spelling's patterns are plain fnmatch globs, as megatron-core's GlobMatcher uses."""
    from megatron.core.quantization.quant_config import GlobMatcher, MatchContext

    m = GlobMatcher("decoder.layers.*.mlp.experts.*linear_fc1", "bf16")
    for name in (
        "decoder.layers.3.mlp.experts.linear_fc1",
        "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1",
    ):
        assert m.match(MatchContext(name, 3)) == "bf16"
        assert fnmatch.fnmatch(name, m.pattern)
    assert m.match(MatchContext("decoder.layers.3.mlp.shared_experts.linear_fc1", 3)) is None
