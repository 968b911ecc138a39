"""Contract tests, emulation numerics: on this machine (the real CPU platform) the
``nemo_fp8`` method runs every GEMM through the numerics emulation; these tests use vLLM's
real layers and loaders with it and compare against the trainer's numerics."""

from __future__ import annotations

import pytest
import torch
from fake_gpu import building, moe, qcfg

from nemo_fp8_plugin.hosts.vllm import quantization_config
from nemo_fp8_plugin.registry import get_recipe

pytestmark = pytest.mark.vllm

NAMES = iter(range(10**6))


def loaded_linear(vcfg, recipe, gate, up, *, bias=None, **overrides):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with building(vcfg):
        layer = MergedColumnParallelLinear(
            256,
            [256, 256],
            bias=bias is not None,
            quant_config=NemoFp8Config.from_config({**qcfg(recipe), **overrides}),
            prefix=f"model.layers.{next(NAMES)}.mlp.gate_up_proj",
        )
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias[:256], 0)
        layer.bias.weight_loader(layer.bias, bias[256:], 1)
    layer.quant_method.process_weights_after_loading(layer)
    assert not layer.quant_method.use_vllm  # the emulation backend
    return layer


def test_emulated_bias_is_added_in_fp32_before_the_cast(vllm_env):
    """The trainer's emulated GEMM adds the bias in fp32, then casts (a GEMM
    epilogue); the engine's emulation does the same, not a bf16 add after the cast.
    Activations are quantized as vLLM does (``generation_numerics: vllm``, the default)."""
    from nemo_fp8_plugin.numerics import QTensor, fp8_gemm
    from nemo_fp8_plugin.numerics.vllm_numerics import quantize_activation_vllm

    gen = torch.Generator().manual_seed(11)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    bias = torch.randn(512, generator=gen).bfloat16()
    layer = loaded_linear(vllm_env, "fp8_blockwise", gate, up, bias=bias)
    x = torch.randn(7, 256, generator=gen).bfloat16()
    got = layer(x)[0]
    a = quantize_activation_vllm(x)
    w = QTensor(layer.weight.data, layer.weight_scale_inv.data, "e4m3", (128, 128))
    want = fp8_gemm(a, w, out_dtype=torch.bfloat16, bias=bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    after_cast = fp8_gemm(a, w, out_dtype=torch.bfloat16) + bias  # the old engine-side order
    assert not torch.equal(after_cast, want)


def test_emulated_moe_bias_is_added_in_fp32_before_the_cast(vllm_env):
    """The same for experts with biases (GPT-OSS style): the same order in each expert GEMM
    (activations quantized as vLLM's fused-MoE kernel does, the default numerics)."""
    from nemo_fp8_plugin.numerics import QTensor, fp8_gemm, quantize_blockwise
    from nemo_fp8_plugin.numerics.vllm_numerics import quantize_activation_vllm

    layer = moe(vllm_env, "fp8_blockwise")
    method = layer.quant_method
    assert not method.use_vllm
    gen = torch.Generator().manual_seed(12)
    w13 = (0.05 * torch.randn(4, 512, 256, generator=gen)).bfloat16()
    w2 = (0.05 * torch.randn(4, 256, 256, generator=gen)).bfloat16()
    q13, q2 = (quantize_blockwise(w, block=(128, 128)) for w in (w13, w2))
    layer.w13_weight.data.copy_(q13.data)
    layer.w13_weight_scale_inv.data.copy_(q13.scale_inv)
    layer.w2_weight.data.copy_(q2.data)
    layer.w2_weight_scale_inv.data.copy_(q2.scale_inv)
    layer.w13_bias = torch.randn(4, 512, generator=gen).bfloat16()
    layer.w2_bias = torch.randn(4, 256, generator=gen).bfloat16()
    x = torch.randn(3, 256, generator=gen).bfloat16()
    topk_ids = torch.tensor([[0, 2], [1, 2], [3, 0]])
    topk_weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]])
    got = method._emulated_experts(layer, x, topk_weights, topk_ids)

    def gemm(inp, q, e, b):
        return fp8_gemm(
            quantize_activation_vllm(inp),
            QTensor(q.data[e], q.scale_inv[e], "e4m3", (128, 128)),
            out_dtype=torch.bfloat16,
            bias=b,
        )

    want = torch.zeros(3, 256)
    for t in range(3):
        for slot in range(2):
            e = int(topk_ids[t, slot])
            h = gemm(x[t : t + 1], q13, e, layer.w13_bias[e])
            h = torch.nn.functional.silu(h[:, :256]) * h[:, 256:]
            want[t] += topk_weights[t, slot] * gemm(h, q2, e, layer.w2_bias[e])[0].float()
    assert torch.equal(got, want.bfloat16())


def test_amax_epsilon_reaches_the_engine(vllm_env):
    """``amax_epsilon`` travels in the ``nemo_fp8`` config; weights quantized on
    arrival match the trainer's refit quantizer with it; emulated activations use it under
    ``generation_numerics: trainer`` (TE's numerics), and vLLM's fixed floor under the
    default ``vllm`` (vLLM's quantizer has no amax floor to set)."""
    from nemo_fp8_plugin.numerics import QTensor, fp8_gemm, quantize_blockwise
    from nemo_fp8_plugin.numerics.vllm_numerics import quantize_activation_vllm
    from nemo_fp8_plugin.rl import quantize_for_refit

    spec = get_recipe({"recipe": "fp8_blockwise", "amax_epsilon": 1e-3})
    qcfg = quantization_config(spec)
    assert qcfg["amax_epsilon"] == 1e-3
    gen = torch.Generator().manual_seed(13)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    gate[:128, :128] *= 1e-4  # one tile with amax < eps
    layer = loaded_linear(
        vllm_env, "fp8_blockwise", gate, up, amax_epsilon=1e-3, generation_numerics="trainer"
    )
    trainer = dict(
        quantize_for_refit(
            [
                ("model.layers.1.mlp.gate_proj.weight", gate),
                ("model.layers.1.mlp.up_proj.weight", up),
            ],
            spec,
            num_layers=4,
        )
    )
    want_w = torch.cat(
        [
            trainer["model.layers.1.mlp.gate_proj.weight"],
            trainer["model.layers.1.mlp.up_proj.weight"],
        ]
    )
    want_s = torch.cat(
        [
            trainer["model.layers.1.mlp.gate_proj.weight_scale_inv"],
            trainer["model.layers.1.mlp.up_proj.weight_scale_inv"],
        ]
    )
    assert torch.equal(layer.weight.data.view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.data, want_s)
    no_eps = quantize_blockwise(torch.cat([gate, up]), block=(128, 128))
    assert not torch.equal(layer.weight_scale_inv.data, no_eps.scale_inv)

    x = torch.randn(5, 256, generator=gen).bfloat16()
    x[2] *= 1e-5  # a row whose activation groups have amax < eps
    w = QTensor(layer.weight.data, layer.weight_scale_inv.data, "e4m3", (128, 128))
    want = fp8_gemm(quantize_blockwise(x, block=(1, 128), eps=1e-3), w, out_dtype=torch.bfloat16)
    assert torch.equal(layer(x)[0], want)
    assert not torch.equal(
        want, fp8_gemm(quantize_blockwise(x, block=(1, 128)), w, out_dtype=torch.bfloat16)
    )
    # The default numerics: the same weights (the trainer's bytes), vLLM's activations.
    default = loaded_linear(vllm_env, "fp8_blockwise", gate, up, amax_epsilon=1e-3)
    assert torch.equal(default.weight.data.view(torch.uint8), want_w.view(torch.uint8))
    vllm_want = fp8_gemm(quantize_activation_vllm(x), w, out_dtype=torch.bfloat16)
    assert torch.equal(default(x)[0], vllm_want)
    assert not torch.equal(vllm_want, want)
