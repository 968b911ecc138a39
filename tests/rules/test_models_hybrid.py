"""Hybrid models NeMo RL's examples train: Qwen3.5 (Gated DeltaNet linear attention + full
attention, dense and MoE) and Nemotron-3 Nano (Nemotron-H: Mamba-2, attention and MoE layers).

Each layer's linear modules follow its kind (``ModelDescription.layer_kinds``), on the
megatron-core side (names checked against the installed megatron-core 0.16.1 source), the
Hugging Face side and vLLM's; per-layer rules and the explain table resolve against them.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.registry import get_recipe
from nemo_fp8_plugin.rules import describe_model, resolve
from nemo_fp8_plugin.rules.models import from_hf_config

pytestmark = pytest.mark.torch_free

NANO3 = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def _layer(names, i, root="decoder.layers"):
    prefix = f"{root}.{i}."
    return sorted(n[len(prefix) :] for n in names if n.startswith(prefix))


def test_qwen35_dense_has_three_linear_attention_layers_per_full_attention_layer():
    d = describe_model("Qwen/Qwen3.5-9B-Base")
    assert (d.family, d.num_layers, d.hidden_size, d.ffn_hidden_size) == (
        "qwen3_5",
        32,
        4096,
        12288,
    )
    assert d.layer_kinds.count("linear_attention+mlp") == 24
    assert [i for i, k in enumerate(d.layer_kinds) if k == "attention+mlp"] == list(range(3, 32, 4))
    mg = d.megatron_linear_modules
    assert _layer(mg, 0) == [
        "mlp.linear_fc1",
        "mlp.linear_fc2",
        "self_attention.in_proj",
        "self_attention.out_proj",
    ]
    assert "self_attention.linear_qkv" in _layer(mg, 3)
    assert d.hf_names("decoder.layers.0.self_attention.in_proj") == tuple(
        f"model.layers.0.linear_attn.in_proj_{p}" for p in ("qkv", "z", "b", "a")
    )
    assert d.vllm_members("model.layers.0.linear_attn.in_proj_ba") == (
        "model.layers.0.linear_attn.in_proj_b",
        "model.layers.0.linear_attn.in_proj_a",
    )
    assert d.summary()["layer_kinds"] == {"linear_attention+mlp": 24, "attention+mlp": 8}


def test_qwen35_megatron_names_are_megatron_cores_gated_delta_net():
    # the installed megatron-core 0.16.1's source, located without importing it (torch-free)
    dist = metadata.distribution("megatron-core")
    assert dist.version == "0.16.1"
    root = Path(str(dist.locate_file("megatron")))
    src = (root / "core/ssm/gated_delta_net.py").read_text()
    assert "self.in_proj = build_module(" in src and "self.out_proj = build_module(" in src
    mamba = (root / "core/ssm/mamba_mixer.py").read_text()  # Nemotron-H's mixer.in/out_proj
    assert "self.in_proj = build_module(" in mamba and "self.out_proj = build_module(" in mamba


def test_the_vl_config_json_parser_agrees_with_the_qwen35_moe_table_entry():
    # The shape of Qwen/Qwen3.5-35B-A3B's config.json (a VL wrapper with the text model's
    # fields under text_config, model_type qwen3_5_moe_text, no dense intermediate_size),
    # typed from the same second-hand sizes as the table: this checks the parser's reading
    # of that shape against the table's builder, not the sizes themselves.
    cfg = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "num_hidden_layers": 40,
            "hidden_size": 2048,
            "num_experts": 256,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "layer_types": ["linear_attention"] * 3
            + ["full_attention"]
            + (["linear_attention"] * 3 + ["full_attention"]) * 9,
        },
    }
    from_file = from_hf_config(cfg, name="Qwen/Qwen3.5-35B-A3B")
    table = describe_model("Qwen/Qwen3.5-35B-A3B-Base")
    assert from_file.layer_kinds == table.layer_kinds
    assert from_file.megatron_linear_modules == table.megatron_linear_modules
    assert (table.num_experts, table.moe_ffn_hidden_size, table.num_shared_experts) == (256, 512, 1)
    assert set(table.layer_kinds) == {"linear_attention+moe", "attention+moe"}
    assert "mlp.shared_experts.linear_fc1" in _layer(table.megatron_linear_modules, 0)


def test_qwen35_bad_layer_types_name_the_key():
    with pytest.raises(FP8ConfigError) as err:
        from_hf_config(
            {
                "model_type": "qwen3_5_text",
                "num_hidden_layers": 4,
                "hidden_size": 64,
                "intermediate_size": 128,
                "layer_types": ["linear_attention", "sliding_attention", "x", "y"],
            }
        )
    assert err.value.key == "layer_types"


def test_nemotron_3_nano_layers_follow_its_hybrid_pattern():
    d = describe_model(NANO3)
    assert describe_model("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16").layer_kinds == (
        d.layer_kinds
    )
    assert (d.family, d.num_layers, d.hidden_size, d.num_experts) == ("nemotron_h", 52, 2688, 128)
    kinds = d.layer_kinds
    assert (kinds.count("mamba"), kinds.count("moe"), kinds.count("attention")) == (23, 23, 6)
    assert [i for i, k in enumerate(kinds) if k == "attention"] == [5, 12, 19, 26, 33, 42]
    mg = d.megatron_linear_modules
    assert _layer(mg, 0) == ["mixer.in_proj", "mixer.out_proj"]
    assert _layer(mg, 5) == ["self_attention.linear_proj", "self_attention.linear_qkv"]
    assert "mlp.experts.linear_fc1" in _layer(mg, 1)
    # squared-ReLU experts: no gate_proj on the HF side; vLLM names the stack model.layers
    assert d.hf_names("decoder.layers.1.mlp.experts.linear_fc1")[:2] == (
        "backbone.layers.1.mixer.experts.0.up_proj",
        "backbone.layers.1.mixer.experts.1.up_proj",
    )
    assert d.vllm_module("backbone.layers.5.mixer.k_proj") == "model.layers.5.mixer.qkv_proj"


def test_nvidias_six_sensitive_nano3_layers_are_the_mamba_layers_before_attention():
    from nemo_fp8_plugin.hosts.nemo_rl.modelopt import NANO3_REAL_QUANT_IGNORE

    kinds = describe_model(NANO3).layer_kinds
    listed = sorted(
        int(p.split(".")[2]) for p in NANO3_REAL_QUANT_IGNORE if p.startswith("*.layers.")
    )
    assert listed == [i - 1 for i, k in enumerate(kinds) if k == "attention"]
    assert all(kinds[i] == "mamba" for i in listed)


def test_hybrid_routers_stay_bf16_on_both_sides():
    spec = get_recipe("fp8_blockwise")
    for model, router in (
        (NANO3, "model.layers.1.mixer.gate"),
        ("qwen3.5-35b-a3b", "model.layers.0.mlp.gate"),
    ):
        d = describe_model(model)
        gen = {x.module: x for x in resolve(spec, d, "generation").decisions}
        train = {x.module: x for x in resolve(spec, d, "training").decisions}
        assert gen[router].precision == "bf16" and gen[router].rule == "builtin:router"
        assert train["decoder.layers.1.mlp.router"].precision == "bf16"


def test_rules_resolve_per_layer_kind():
    spec = get_recipe("fp8_blockwise").replace(bf16_layers={"modules": ["*mixer.in_proj*"]})
    d = describe_model(NANO3)
    train = resolve(spec, d, "training")
    bf16 = {x.module for x in train.decisions if x.rule and x.rule.startswith("bf16_layers")}
    assert bf16 == {
        f"decoder.layers.{i}.mixer.in_proj" for i, k in enumerate(d.layer_kinds) if k == "mamba"
    }


def test_nemotron_pattern_and_layer_count_must_agree():
    cfg = {
        "model_type": "nemotron_h",
        "num_hidden_layers": 5,
        "hybrid_override_pattern": "M*E",
        "hidden_size": 64,
        "intermediate_size": 128,
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
    }
    with pytest.raises(FP8ConfigError) as err:
        from_hf_config(cfg)
    assert err.value.key == "hybrid_override_pattern"
    with pytest.raises(FP8ConfigError) as err:
        from_hf_config({**cfg, "num_hidden_layers": 3, "hybrid_override_pattern": "M*X"})
    assert err.value.key == "hybrid_override_pattern"
    assert from_hf_config({**cfg, "num_hidden_layers": 3}).layer_kinds == (
        "mamba",
        "attention",
        "moe",
    )
