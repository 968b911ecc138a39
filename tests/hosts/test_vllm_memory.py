"""The colocated memory pre-flight: weights from the model's shape (checked byte for byte
against what ``export_fp8_checkpoint`` writes), the KV-cache estimate, and the hint to pin
``kv_cache_memory_bytes`` on NVIDIA's own NeMo RL recipes."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import shared_nemo_rl
from nemo_fp8_plugin import get_recipe, stacks
from nemo_fp8_plugin.config import load_config_chain
from nemo_fp8_plugin.dotted import get_path
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm.memory import (
    GIB,
    estimate_kv_cache,
    gpu_memory_bytes,
    weight_bytes,
)
from nemo_fp8_plugin.rules.models import describe_model

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 3,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 384,
    "tie_word_embeddings": False,
}
LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def _tiny_state_dict():
    g = torch.Generator().manual_seed(0)
    h, f, kv = 256, 512, 128
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (f, h),
        "mlp.up_proj": (f, h),
        "mlp.down_proj": (h, f),
    }
    sd = {"model.embed_tokens.weight": torch.randn(384, h, generator=g)}
    for i in range(3):
        for mod, shape in shapes.items():
            sd[f"model.layers.{i}.{mod}.weight"] = torch.randn(shape, generator=g)
    sd["lm_head.weight"] = torch.randn(384, h, generator=g)
    return {k: v.bfloat16() for k, v in sd.items()}


@pytest.mark.parametrize(
    "recipe",
    [
        "fp8_blockwise",
        {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1}},
        "mxfp8",
        {"recipe": "fp8_blockwise", "generation": "bf16"},
    ],
)
def test_weights_are_the_bytes_the_export_writes(tmp_path, recipe):
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    spec = get_recipe(recipe)
    model = describe_model(TINY)
    out = tmp_path / "fp8"
    if spec.generation == "fp8":
        export_fp8_checkpoint(_tiny_state_dict(), out, spec, config=TINY)
        from safetensors.torch import load_file

        tensors = load_file(str(out / "model.safetensors"))
    else:
        tensors = _tiny_state_dict()  # a BF16 engine holds the trainer's tensors
    written = sum(t.numel() * t.element_size() for t in tensors.values())
    counted, assumptions = weight_bytes(spec, model, config=TINY)
    assert counted == written and assumptions == ()


def test_without_a_config_the_count_says_what_it_assumed():
    counted, assumptions = weight_bytes(get_recipe("fp8_blockwise"), describe_model("llama3.1-8b"))
    exact, none = weight_bytes(
        get_recipe("fp8_blockwise"), describe_model(LLAMA_8B), config=LLAMA_8B
    )
    assert none == ()
    assert any("vocab_size unknown" in a for a in assumptions)
    assert any("no grouped-query attention" in a for a in assumptions)
    # MHA attention over-counts k and v, the missing vocabulary under-counts by more
    assert counted < exact


def test_llama_8b_in_fp8_on_an_h100():
    est = estimate_kv_cache(
        get_recipe("fp8_blockwise"),
        describe_model(LLAMA_8B),
        gpu_memory_utilization=0.5,
        hardware="NVIDIA H100 80GB HBM3",
        config=LLAMA_8B,
    )
    assert 8.0 * GIB < est.weight_bytes < 9.0 * GIB  # 6.98 B FP8 linear + 1.05 B BF16 embeddings
    assert est.kv_cache_bytes == int(0.5 * 80 * GIB) - est.weight_bytes
    assert est.estimated and est.gpu == "NVIDIA H100 80GB HBM3" and est.hints == ()
    bf16 = estimate_kv_cache(
        get_recipe({"recipe": "fp8_blockwise", "generation": "bf16"}),
        describe_model(LLAMA_8B),
        gpu_memory_utilization=0.5,
        hardware="h100",
        tensor_parallel_size=2,
        config=LLAMA_8B,
    )
    assert bf16.weight_bytes > est.weight_bytes / 2  # BF16 over two GPUs
    assert json.loads(json.dumps(est.to_dict()))["kv_cache_bytes"] == est.kv_cache_bytes


def _nemo_rl(recipe: str) -> dict:
    _, resolved = load_config_chain(shared_nemo_rl(f"examples/configs/recipes/llm/{recipe}"))
    return resolved


@pytest.mark.parametrize("version, hinted", [("0.20.0", False), ("0.25.1", True), ("0.32.0", True)])
def test_nvidias_unpinned_colocated_fp8_recipe_gets_the_hint_from_vllm_0_25(version, hinted):
    cfg = _nemo_rl("grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.yaml")
    gen = cfg["policy"]["generation"]
    assert get_path(cfg, "policy.generation.colocated.enabled") is True
    assert "kv_cache_memory_bytes" not in (gen.get("vllm_kwargs") or {})
    est = estimate_kv_cache(
        get_recipe("fp8_blockwise"),
        describe_model(LLAMA_8B),
        gpu_memory_utilization=gen["vllm_cfg"]["gpu_memory_utilization"],
        hardware="h100",
        vllm_version=version,
        colocated=True,
        config=LLAMA_8B,
    )
    pins = [h for h in est.hints if h.code == "pin_kv_cache"]
    assert bool(pins) is hinted
    if hinted:
        (pin,) = pins
        assert pin.key == "kv_cache_memory_bytes" and pin.source == "NVIDIA-NeMo/RL#3280"
        assert f"vLLM {version}" in pin.message and "0.4" in pin.message
    assert not estimate_kv_cache(
        get_recipe("fp8_blockwise"),
        describe_model(LLAMA_8B),
        gpu_memory_utilization=0.4,
        hardware="h100",
        vllm_version=version,
        colocated=False,
        config=LLAMA_8B,
    ).hints


MOONLIGHT = "grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml"
CONFIGS = {"0.6.0": "releases/v0.6.0/", "0.7.0": "releases/v0.7.0/", stacks.NEMO_RL_MAIN: ""}
"""NeMo RL release -> where its ``examples/configs`` are in the shared tree."""


def test_the_larger_kv_cache_row_is_where_nemo_rl_pins_the_kv_cache():
    """``gpu_memory_utilization:larger_kv_cache`` is measured (NVIDIA-NeMo/RL#3280), not read
    from vLLM's source (``tests/hosts/vllm_source.py`` ``MEASURED`` names this test): NeMo RL's
    colocated FP8 Moonlight recipe pins ``kv_cache_memory_bytes`` at exactly the releases whose
    vLLM has the row (main's 0.25.1; not v0.6.0's 0.17.1 nor v0.7.0's 0.20.0), saying why."""
    from vllm_source import MEASURED

    assert MEASURED["gpu_memory_utilization:larger_kv_cache"] == "tests/hosts/test_vllm_memory.py"
    assert set(CONFIGS) == {r.name for r in stacks.NEMO_RL_RELEASES}
    seen = set()
    for release, folder in CONFIGS.items():
        vllm = stacks.get_stack(f"nemo-rl-{release}").versions["vllm"]
        path = shared_nemo_rl(f"{folder}examples/configs/recipes/llm/{MOONLIGHT}")
        _, cfg = load_config_chain(path)
        assert get_path(cfg, "policy.generation.colocated.enabled") is True
        kwargs = cfg["policy"]["generation"].get("vllm_kwargs") or {}
        pins = "kv_cache_memory_bytes" in kwargs
        row = stacks.lookup("vllm", "gpu_memory_utilization:larger_kv_cache", vllm)
        assert row.tested and row.present is pins, (release, vllm)
        if pins:
            assert "vLLM 0.25's profiling" in path.read_text() and "0.20" in path.read_text()
        seen.add(pins)
    assert seen == {True, False}


def test_between_and_newer_releases():
    """A release before the row (0.22, untested) gets no hint; one newer than every release
    read is untested: the hint says whether it sizes the cache larger is unknown."""

    def pins(version):
        est = estimate_kv_cache(
            get_recipe("fp8_blockwise"),
            describe_model(LLAMA_8B),
            gpu_memory_utilization=0.5,
            hardware="h100",
            vllm_version=version,
            config=LLAMA_8B,
        )
        return [h for h in est.hints if h.code == "pin_kv_cache"]

    assert pins("0.22.0") == []
    (between,) = pins("0.33.0")
    assert "vLLM 0.33.0 (untested) sizes" in between.message
    (newer,) = pins("0.40.0")
    assert "vLLM 0.40.0 is untested (newer than every release read)" in newer.message
    assert "is unknown" in newer.message and newer.source == "NVIDIA-NeMo/RL#3280"


def test_the_pinned_moonlight_recipe_gets_its_pin_and_no_hint():
    cfg = _nemo_rl("grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml")
    gen = cfg["policy"]["generation"]
    pinned = gen["vllm_kwargs"]["kv_cache_memory_bytes"]
    est = estimate_kv_cache(
        get_recipe("fp8_blockwise"),
        describe_model(cfg["policy"]["model_name"]),
        gpu_memory_utilization=gen["vllm_cfg"]["gpu_memory_utilization"],
        hardware="h100",
        vllm_version="0.25.1",
        kv_cache_memory_bytes=pinned,
    )
    assert est.kv_cache_bytes == pinned == 20 * GIB and not est.estimated
    assert est.hints == ()
    assert any("unknown size" in a for a in est.assumptions)  # MLA ranks need config.json


def test_what_does_not_fit_is_said():
    model, spec = (
        describe_model(LLAMA_8B),
        get_recipe({"recipe": "fp8_blockwise", "generation": "bf16"}),
    )
    tight = estimate_kv_cache(
        spec, model, gpu_memory_utilization=0.1, hardware="l4", config=LLAMA_8B
    )
    assert tight.kv_cache_bytes < 0
    assert [h.code for h in tight.hints] == ["weights_exceed_budget"]
    over = estimate_kv_cache(
        spec,
        model,
        gpu_memory_utilization=0.9,
        hardware="l4",
        kv_cache_memory_bytes=20 * GIB,
        config=LLAMA_8B,
    )
    assert [h.code for h in over.hints] == ["pinned_exceeds_memory"]
    unknown = estimate_kv_cache(spec, model, gpu_memory_utilization=0.9, hardware="hopper")
    assert unknown.kv_cache_bytes is None and unknown.hints[0].code == "unknown_gpu_memory"


def test_gpu_memory_from_names():
    assert gpu_memory_bytes("h100") == gpu_memory_bytes("NVIDIA H100 80GB HBM3") == 80 * GIB
    assert gpu_memory_bytes("H200") == 141 * GIB and gpu_memory_bytes("h20") == 96 * GIB
    assert gpu_memory_bytes("NVIDIA A100-SXM4-40GB") == 40 * GIB
    assert gpu_memory_bytes("NVIDIA GeForce RTX 5090") == 32 * GIB
    assert gpu_memory_bytes("hopper") is None and gpu_memory_bytes("tpu-v5") is None


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0.5, "tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1.5}, "kv_cache_memory_bytes"),
        ({"gpu_memory_utilization": 0.5, "vllm_version": "latest"}, "vllm_version"),
    ],
)
def test_bad_arguments_name_the_key(kwargs, key):
    with pytest.raises(FP8ConfigError) as err:
        estimate_kv_cache(get_recipe("fp8_blockwise"), describe_model(LLAMA_8B), **kwargs)
    assert err.value.key == key
