"""The fused (torch.compile) quantizers are bit-identical to the eager reference.

Compiling costs seconds per kernel variant on a small CPU, so this file compiles a bounded
set: the refit quantizer's main variant (128x128, bf16), a 1x128 gradient variant (E5M2,
fp32), MXFP8 1x32, and the per-tensor and delayed casts used by the emulation. The Inductor
cache makes reruns cheap.

The C++ CPU kernels, which the fake quantizers take on a CPU, are switched off here
(``NEMO_FP8_CPU_KERNEL=0``). Every test runs with the fused path forced on (``fused_mode(True)``), whatever
``NEMO_FP8_FUSED`` says, and checks that the compiled kernels really ran (``compiled``
records each compiled call that returned): a compile failure fails the test instead of
quietly comparing the eager path with itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_numerics_quantize import MX_LAYOUTS, edge_tensor, mx_pinned

from nemo_fp8_plugin.numerics import (
    fake_quant_blockwise,
    fake_quant_per_tensor,
    fp8_dtype,
    fp8_max,
    fused_mode,
    quantize_blockwise_fused,
    quantize_mxfp8_fused,
)
from nemo_fp8_plugin.numerics import fused as fused_mod

# the eager reference, under the names the comparisons below read naturally with
from nemo_fp8_plugin.numerics import quantize_blockwise_reference as quantize_blockwise
from nemo_fp8_plugin.numerics import quantize_mxfp8_reference as quantize_mxfp8
from nemo_fp8_plugin.numerics import quantize_per_tensor_reference as quantize_per_tensor
from nemo_fp8_plugin.numerics import quantize_with_scale_reference as quantize_with_scale


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    """Force the fused path on (the env var may say NEMO_FP8_FUSED=0), clear an earlier
    compile failure, and record the kind of every compiled kernel call that completed."""
    ran: list[str] = []
    real = fused_mod._compiled

    def spy(key, impl, static):
        fn = real(key, impl, static)

        def call(*args):
            out = fn(*args)
            ran.append(key[0])
            return out

        return call

    monkeypatch.setattr(fused_mod, "_compiled", spy)
    monkeypatch.setitem(fused_mod._state, "failed", None)
    # the fake quantizers take the C++ kernels on a CPU (test_numerics_fakequant_cpu.py);
    # off here, so that these tests hold the compiled kernels (the CUDA path) to the bits
    monkeypatch.setenv("NEMO_FP8_CPU_KERNEL", "0")
    torch.manual_seed(0)
    with fused_mode(True):
        yield ran


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def same_q(a, b):
    assert a.fmt == b.fmt and a.block == b.block
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert a.scale_inv.dtype == b.scale_inv.dtype
    assert torch.equal(a.scale_inv.view(torch.uint8), b.scale_inv.view(torch.uint8))


def same_bits(a, b):
    """Bitwise equal fp32, except that NaN payloads and signs may differ (a dequantized NaN
    is NaN whichever bits the multiply produced)."""
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    ok = ~torch.isnan(a)
    assert torch.equal(a[ok].view(torch.int32), b[ok].view(torch.int32))


def test_block_128x128_bf16_matches_eager(compiled):
    x = edge_tensor((256, 1280), (128, 128), torch.bfloat16, "e4m3")
    same_q(quantize_blockwise_fused(x, (128, 128)), quantize_blockwise(x, (128, 128)))
    # a 3-D MoE stack and a second shape go through the same compiled variant
    w = torch.randn(2, 128, 384, generator=gen(1)).to(torch.bfloat16) * 3
    same_q(quantize_blockwise_fused(w, (128, 128)), quantize_blockwise(w, (128, 128)))
    assert compiled == ["block_cast", "block_cast"] and fused_mod.compile_failed() is None


def test_fake_quant_1x128_e5m2_fp32_matches_eager(compiled):
    x = edge_tensor((64, 1280), (1, 128), torch.float32, "e5m2", seed=4)
    same_bits(
        fake_quant_blockwise(x, (1, 128), "e5m2", force=True),
        quantize_blockwise(x, (1, 128), "e5m2").dequantize(),
    )
    # column-wise use: 128x1 tiles (TE's column-wise copy) on the untransposed tensor
    xc = edge_tensor((256, 640), (128, 1), torch.float32, "e5m2", seed=5)
    same_bits(
        fake_quant_blockwise(xc, (128, 1), "e5m2", force=True),
        quantize_blockwise(xc, (128, 1), "e5m2").dequantize(),
    )
    assert compiled == ["block_fq", "block_fq"]


def test_mxfp8_matches_eager(compiled):
    x = edge_tensor((64, 1024), (1, 32), torch.bfloat16, "e4m3", seed=6)
    same_q(quantize_mxfp8_fused(x, 32), quantize_mxfp8(x, 32))
    same_bits(
        fused_mod.fake_quant_mxfp8(x, (1, 32), "e4m3", force=True),
        quantize_mxfp8(x, 32).dequantize(),
    )
    assert compiled == ["mx_cast", "mx_fq"]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", list(MX_LAYOUTS))
def test_mxfp8_inf_and_tiny_blocks_in_the_compiled_kernels(compiled, layout, fmt):
    """The blocks TE's exp2f_rcp decides (0xFE: multiplier 2^-127; 0x00: 2^127), pinned by
    hand in test_numerics_quantize, through the compiled cast and fake-quantization."""
    x, want_data, want_e = mx_pinned(layout, torch.float32, fmt)
    block = MX_LAYOUTS[layout]
    q = quantize_mxfp8_fused(x, block, fmt)
    assert torch.equal(q.scale_inv.view(torch.uint8), torch.from_numpy(want_e))
    assert torch.equal(q.data.view(torch.uint8), torch.from_numpy(want_data))
    deq = fused_mod.fake_quant_mxfp8(x, block, fmt, force=True)
    same_bits(deq, quantize_mxfp8(x, block, fmt).dequantize())
    finite = torch.isfinite(x) & (x.abs() < 2.0**-100)
    assert torch.equal(deq[finite], x[finite])  # the tiny block round-trips exactly
    assert (deq[torch.isinf(x)] == x[torch.isinf(x)]).all()  # an inf stays an inf, not NaN
    assert compiled == ["mx_cast", "mx_fq"]


def test_fp32_nan_keeps_its_sign_bit_in_the_fused_casts(compiled):
    # Inductor's CPU clamp used to turn +NaN into the x86 default NaN (0xFF after the cast)
    x = torch.randn(128, 256, generator=gen(2))
    x[0, 3], x[5, 7], x[9, 1], x[64, 200] = float("nan"), -float("nan"), float("inf"), -float("inf")
    same_q(quantize_blockwise_fused(x, (1, 128)), quantize_blockwise(x, (1, 128)))
    same_q(quantize_mxfp8_fused(x, (1, 32)), quantize_mxfp8(x, (1, 32)))
    assert quantize_blockwise_fused(x, (1, 128)).data.view(torch.uint8)[0, 3].item() == 0x7F
    assert compiled == ["block_cast", "mx_cast", "block_cast"]


def test_per_tensor_and_delayed_casts_match_eager(compiled):
    x = (torch.randn(64, 512, generator=gen(3)) * 30).to(torch.bfloat16)
    x[3, 7] = float("nan")
    same_bits(fake_quant_per_tensor(x, "e4m3", force=True), quantize_per_tensor(x).dequantize())
    scale, scale_inv = torch.tensor(3.5), torch.tensor(1 / 3.5)
    deq, amax = fused_mod.fake_quant_with_scale(x, scale, scale_inv, "e4m3", force=True)
    same_bits(deq, quantize_with_scale(x, scale, scale_inv=scale_inv).dequantize())
    assert float(amax) == float(x.float().nan_to_num(0).abs().max())
    assert compiled == ["tensor_fq", "scaled_fq"]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_grid_rounding_without_a_float8_cast(fmt):
    """The fake-quant kernels round to the FP8 grid with float arithmetic; it must equal
    torch's cast. Every rounding boundary (each grid value and midpoint, +-64 fp32 ulps),
    a stride through all fp32 values in range, and the top of each binade (where a naive
    magic-number rounding carries into the next exponent) are checked; the full range was
    checked exhaustively once (docs/numerics.md)."""
    dt, fmax = fp8_dtype(fmt), fp8_max(fmt)
    grid = torch.arange(256, dtype=torch.uint8).view(dt).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    bits = points.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)
    near = bits.reshape(-1).view(torch.float32)
    stride = torch.arange(
        0, torch.tensor(fmax).view(torch.int32).item(), 9973, dtype=torch.int32
    ).view(torch.float32)
    tops = torch.nextafter(torch.exp2(torch.arange(-20.0, 17.0)), torch.tensor(0.0))
    v = torch.cat([near, stride, tops]).clamp(-fmax, fmax)
    v = torch.cat([v, -v, torch.tensor([float("nan"), 255.9998016357422])])
    got = fused_mod._round_to_grid(v.clamp(-fmax, fmax), fmt)
    want = v.clamp(-fmax, fmax).to(dt).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])


def test_small_tensors_stay_eager_and_disabled_mode_is_eager(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_mod, "_cache", {})
    real_compile = torch.compile

    def spy(fn, **kw):
        calls.append(fn.__name__)
        return real_compile(fn, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    x = torch.randn(8, 128, generator=gen(4))
    fake_quant_blockwise(x, (1, 128), "e4m3")  # below the size threshold
    with fused_mode(False):
        quantize_blockwise_fused(x, (1, 128))  # fused path off
    assert calls == []


def test_compile_failure_falls_back_once_with_a_warning(monkeypatch):
    def broken(*args):
        raise RuntimeError("no compiler here")

    x = torch.randn(128, 256, generator=gen(5))
    monkeypatch.setattr(fused_mod, "_compiled", lambda key, impl, static: broken)
    monkeypatch.setitem(fused_mod._state, "failed", None)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        q = quantize_blockwise_fused(x, (128, 128))
    same_q(q, quantize_blockwise(x, (128, 128)))
    assert "no compiler here" in fused_mod.compile_failed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the path is off now
        same_bits(
            fake_quant_blockwise(x, (1, 128), "e4m3", force=True),
            quantize_blockwise(x, (1, 128)).dequantize(),
        )


def test_emulated_linear_fused_equals_eager(compiled):
    """fp8_blockwise's fake-quantized operands (1x128 rows, 128x1 columns, 128x128
    weights) through the compiled kernels: outputs and gradients bit-identical to eager."""
    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.numerics import FP8EmulatedLinear

    g = gen(9)
    x = torch.randn(128, 256, generator=g)
    dy = torch.randn(128, 384, generator=g)
    results, kernels = [], []
    for fused in (False, True):
        layer = FP8EmulatedLinear(256, 384, bias=False, recipe=get_recipe("fp8_blockwise"))
        with torch.no_grad():
            layer.weight.copy_(torch.randn(384, 256, generator=torch.Generator().manual_seed(1)))
        xx = x.clone().requires_grad_()
        with fused_mode(fused, min_numel=0):
            y = layer(xx)
            y.backward(dy)
        results.append((y.detach(), xx.grad, layer.weight.grad))
        kernels.append(len(compiled))
    # eager really was eager, and the fused pass compiled all five casts (the column-wise
    # weight of dgrad reuses the 128x128 row-wise result transposed)
    assert kernels[0] == 0 and compiled == ["block_fq"] * 5
    for eager_t, fused_t in zip(*results):
        assert torch.equal(eager_t, fused_t)
