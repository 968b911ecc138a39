"""Trainer-side refit quantizer: vLLM block-FP8 layout, bit-exactness against the numpy
reference, the BF16 rules, MoE stacks, tensor-parallel shards, streaming, and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_numerics_reference import ref_block_quantize, ref_mx_quantize

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import quantize_blockwise
from nemo_fp8_plugin.rl import RefitLayoutError, quantize_for_refit
from nemo_fp8_plugin.rl.refit import default_is_linear_weight, row_parallel_shard_dim
from presets import preset_names

H, F, V = 256, 384, 300


def llama_state(layers=2, dtype=torch.bfloat16, seed=0):
    """A small Llama-shaped HF state dict (names as vLLM loads them)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    sd = {"model.embed_tokens.weight": r(V, H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": r(H),
                p + "self_attn.q_proj.weight": r(H, H),
                p + "self_attn.k_proj.weight": r(128, H),
                p + "self_attn.v_proj.weight": r(128, H),
                p + "self_attn.o_proj.weight": r(H, H),
                p + "post_attention_layernorm.weight": r(H),
                p + "mlp.gate_proj.weight": r(F, H),
                p + "mlp.up_proj.weight": r(F, H),
                p + "mlp.down_proj.weight": r(H, F),
            }
        )
    sd["model.norm.weight"] = r(H)
    sd["lm_head.weight"] = r(V, H)
    return sd


def is_fp8_weight(name):
    return name.endswith("_proj.weight")


@pytest.mark.parametrize(
    "recipe,pow2", [("fp8_blockwise", False), ("fp8_blockwise", True), ("fp8_subchannel", True)]
)
def test_block_layout_and_exactness(recipe, pow2):
    spec = get_recipe(recipe).replace(pow2_scales=pow2)
    sd = llama_state()
    out = list(quantize_for_refit(sd, spec, num_layers=2, fused=False))
    names = [n for n, _ in out]
    expected = []
    for n in sd:
        expected.append(n)
        if is_fp8_weight(n):
            expected.append(n + "_scale_inv")
    assert names == expected  # input order, scale right after
    got = dict(out)
    for n, t in sd.items():
        if not is_fp8_weight(n):
            assert got[n] is t  # passed through untouched
            continue
        data, sinv = got[n], got[n + "_scale_inv"]
        assert data.dtype == torch.float8_e4m3fn and data.shape == t.shape
        assert sinv.dtype == torch.float32
        assert sinv.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        want_d, want_s = ref_block_quantize(
            t.float().numpy(), (128, 128), "e4m3", pow2, 0.0, float(torch.finfo(t.dtype).max)
        )
        np.testing.assert_array_equal(data.view(torch.uint8).numpy(), want_d)
        np.testing.assert_array_equal(sinv.numpy().view(np.uint32), want_s.view(np.uint32))


def test_bf16_rules_decide_by_default():
    spec = get_recipe("fp8_blockwise").replace(bf16_layers={"first": 1, "modules": ["*.o_proj"]})
    got = dict(quantize_for_refit(llama_state(), spec, num_layers=2, fused=False))
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16  # first layer
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" not in got
    assert got["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16  # glob
    assert got["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert got["lm_head.weight"].dtype == torch.bfloat16


def test_explicit_keep_bf16_and_linear_filter():
    spec = get_recipe("fp8_blockwise")
    got = dict(
        quantize_for_refit(
            llama_state(1),
            spec,
            keep_bf16=lambda n: "k_proj" in n,
            is_linear_weight=lambda n, t: "proj" in n and t.dim() == 2,
            fused=False,
        )
    )
    assert got["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_generation_bf16_passes_everything_through():
    spec = get_recipe("fp8_blockwise").replace(generation="bf16")
    sd = llama_state(1)
    assert all(t is sd[n] for n, t in quantize_for_refit(sd, spec))


def test_default_linear_weight_heuristic():
    w = torch.zeros(4, 4)
    assert default_is_linear_weight("model.layers.3.mlp.down_proj.weight", w)
    assert default_is_linear_weight("model.layers.0.mlp.experts.w13_weight", torch.zeros(2, 4, 4))
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "output_layer.weight",
        "transformer.wte.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.down_proj.bias",
    ):
        assert not default_is_linear_weight(name, w), name
    assert not default_is_linear_weight("x.weight", torch.zeros(4, 4, dtype=torch.int8))
    assert not default_is_linear_weight("conv.weight", torch.zeros(2, 2, 3, 3))


def test_moe_expert_stack_per_expert():
    spec = get_recipe("fp8_blockwise")
    w13 = torch.randn(4, 256, 384).to(torch.bfloat16)
    w13[2] *= 100
    got = dict(
        quantize_for_refit(
            {"model.layers.0.mlp.experts.w13_weight": w13},
            spec,
            keep_bf16=lambda n: False,
            fused=False,
        )
    )
    data = got["model.layers.0.mlp.experts.w13_weight"]
    sinv = got["model.layers.0.mlp.experts.w13_weight_scale_inv"]
    assert data.shape == (4, 256, 384) and sinv.shape == (4, 2, 3)
    for e in range(4):
        q = quantize_blockwise(w13[e], (128, 128))
        assert torch.equal(data[e].view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(sinv[e], q.scale_inv)


@pytest.mark.parametrize("layout", ["nemo_fp8", "compressed_tensors"])
@pytest.mark.parametrize("block", [(1, 32), (32, 32)])
def test_mxfp8_refit(layout, block):
    spec = get_recipe("mxfp8").replace(weight_block=list(block))
    w = (torch.randn(96, 256) * 3).to(torch.bfloat16)
    name = "model.layers.0.mlp.up_proj.weight"
    got = dict(
        quantize_for_refit(
            {name: w}, spec, keep_bf16=lambda n: False, mx_scale_layout=layout, fused=False
        )
    )
    want_d, want_e = ref_mx_quantize(w.float().numpy(), block, "e4m3")
    np.testing.assert_array_equal(got[name].view(torch.uint8).numpy(), want_d)
    if layout == "nemo_fp8":
        s = got[name + "_scale_inv"]
        assert s.dtype == torch.float8_e8m0fnu
        np.testing.assert_array_equal(s.view(torch.uint8).numpy(), want_e)
    else:
        s = got[name + "_scale"]  # vLLM's MXFP8 checkpoint layout: uint8 [N, K/32]
        assert s.dtype == torch.uint8 and s.shape == (96, 8)
        np.testing.assert_array_equal(s.numpy(), np.repeat(want_e, block[0], 0)[:96])


# --------------------------------------------------------------------------- tensor parallel


def _quantize_one(name, t, spec, **kw):
    got = dict(quantize_for_refit({name: t}, spec, keep_bf16=lambda n: False, fused=False, **kw))
    return got[name], got[name + "_scale_inv"]


@pytest.mark.parametrize(
    "name,dim",
    [("model.layers.0.mlp.gate_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1)],
)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_shards_on_block_boundaries_equal_the_gathered_tensor(name, dim, tp, block):
    spec = get_recipe("fp8_blockwise").replace(weight_block=list(block))
    full = (torch.randn(1024, 512 * tp // 2) * torch.rand(1024, 1) * 10).to(torch.bfloat16)
    assert row_parallel_shard_dim(name, full) == dim
    gathered_d, gathered_s = _quantize_one(name, full, spec)
    shards = full.chunk(tp, dim=dim)
    outs = [
        _quantize_one(name, s.contiguous(), spec, tp_rank=r, tp_size=tp)
        for r, s in enumerate(shards)
    ]
    data = torch.cat([d.view(torch.uint8) for d, _ in outs], dim=dim)
    scales = torch.cat([s for _, s in outs], dim=dim)
    assert torch.equal(data, gathered_d.view(torch.uint8))
    assert torch.equal(scales, gathered_s)


def test_misaligned_shard_is_reported_with_the_tensor_name():
    spec = get_recipe("fp8_blockwise")
    shard = torch.randn(96, 256)  # 384 output rows split 4 ways: 96 is not a multiple of 128
    name = "model.layers.7.self_attn.q_proj.weight"
    with pytest.raises(RefitLayoutError, match=r"q_proj.*shard 1 of 4.*96") as err:
        list(
            quantize_for_refit({name: shard}, spec, keep_bf16=lambda n: False, tp_rank=1, tp_size=4)
        )
    assert err.value.key == name and isinstance(err.value, FP8ConfigError)
    # the input dim of a row-parallel layer, chosen by an explicit shard_dim
    with pytest.raises(RefitLayoutError, match="input dim"):
        list(
            quantize_for_refit(
                {"w.weight": torch.randn(128, 200)},
                spec,
                keep_bf16=lambda n: False,
                tp_rank=0,
                tp_size=2,
                shard_dim=1,
            )
        )
    # 1x128 weight tiles split along the output dim anywhere
    ok = get_recipe("fp8_blockwise").replace(weight_block=[1, 128])
    assert (
        len(
            list(
                quantize_for_refit(
                    {name: shard}, ok, keep_bf16=lambda n: False, tp_rank=1, tp_size=4
                )
            )
        )
        == 2
    )


# --------------------------------------------------------------------------- streaming, errors


def test_streams_one_tensor_at_a_time():
    consumed = []

    def source():
        for n, t in llama_state(2).items():
            consumed.append(n)
            yield n, t

    gen = quantize_for_refit(source(), get_recipe("fp8_blockwise"), num_layers=2, fused=False)
    assert consumed == []  # lazy
    first = [next(gen) for _ in range(3)]  # embed, norm, q_proj data
    assert [n for n, _ in first][-1] == "model.layers.0.self_attn.q_proj.weight"
    assert len(consumed) == 3
    next(gen)  # its scale: nothing new read
    assert len(consumed) == 3


def test_fused_path_is_bit_identical():
    spec = get_recipe("fp8_blockwise")
    w = (torch.randn(1024, 1280) * 0.02).to(torch.bfloat16)
    w[5, 7] = 300.0
    name = "model.layers.0.mlp.down_proj.weight"
    fast = dict(quantize_for_refit({name: w}, spec, keep_bf16=lambda n: False, fused=True))
    ref = dict(quantize_for_refit({name: w}, spec, keep_bf16=lambda n: False, fused=False))
    assert torch.equal(fast[name].view(torch.uint8), ref[name].view(torch.uint8))
    assert torch.equal(fast[name + "_scale_inv"], ref[name + "_scale_inv"])


def test_bad_requests():
    sd = {"a.weight": torch.randn(128, 128)}
    with pytest.raises(FP8ConfigError, match="block or mx"):
        list(quantize_for_refit(sd, get_recipe("fp8_current")))
    with pytest.raises(FP8ConfigError, match="together"):
        list(quantize_for_refit(sd, get_recipe("fp8_blockwise"), tp_size=2))
    with pytest.raises(FP8ConfigError, match="tp_rank"):
        list(quantize_for_refit(sd, get_recipe("fp8_blockwise"), tp_rank=2, tp_size=2))
    with pytest.raises(FP8ConfigError, match="mx_scale_layout"):
        list(quantize_for_refit(sd, get_recipe("mxfp8"), mx_scale_layout="swizzled"))
    with pytest.raises(FP8ConfigError, match="last"):  # last-N rules need the layer count
        spec = get_recipe("fp8_blockwise").replace(bf16_layers={"last": 1})
        list(quantize_for_refit({"model.layers.0.mlp.up_proj.weight": torch.randn(128, 128)}, spec))


@pytest.mark.parametrize("recipe", preset_names(lambda row: row.tiled and not row.is_nvfp4))
def test_default_kernel_is_bit_identical_to_the_reference(recipe):
    """fused=None takes the public quantizers' own choice (the CPU kernels here)."""
    from nemo_fp8_plugin.numerics import kernel_for

    spec = get_recipe(recipe)
    w = (torch.randn(384, 1280) * 0.02).to(torch.bfloat16)
    w[5, 7], w[200, 1000], w[300, 3] = 300.0, float("nan"), float("-inf")
    stack = (torch.randn(3, 256, 512) * 0.02).to(torch.float16)
    weights = {
        "model.layers.0.mlp.down_proj.weight": w,
        "model.layers.0.mlp.experts.w13_weight": stack,
    }
    fast = dict(quantize_for_refit(weights, spec, keep_bf16=lambda n: False))
    ref = dict(quantize_for_refit(weights, spec, keep_bf16=lambda n: False, fused=False))
    assert fast.keys() == ref.keys() and len(fast) == 4
    for name, want in ref.items():
        got = fast[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        if got.element_size() == 1:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want), name
    assert kernel_for(w, 128) in ("cpu", "reference")
