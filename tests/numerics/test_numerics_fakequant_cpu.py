"""The one-pass C++ fake quantizers (numerics/_cpu_kernels.cpp: quantize, then dequantize
to fp32) and the NVFP4 kernel against the eager reference, bit for bit (``atol=rtol=0``:
fp32 compared as int32 words, NaN where the reference has NaN), on both builds of the
library (AVX2 and the portable ``-DNEMO_FP8_NO_SIMD`` one), and the thread choice.

The cases are the kernel tests' (``edge_values``: zeros of both signs, NaN, inf, the format
maxima, ties, subnormals, the input dtype's extremes) over every tile the emulation uses:
1x128, its column-wise 128x1, 128x128, MXFP8 1x32 / 32x1 / 32x32, NVFP4 1x16 / 16x16, with
partial tiles in both dims.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_numerics_kernels import DTYPES, edge_values

from nemo_fp8_plugin.numerics import _cpu
from nemo_fp8_plugin.numerics import fused as F
from nemo_fp8_plugin.numerics import nvfp4 as N
from nemo_fp8_plugin.numerics.reference import (
    quantize_blockwise_reference,
    quantize_mxfp8_reference,
    quantize_per_tensor_reference,
    quantize_with_scale_reference,
    tensor_amax,
)

SHAPES = ((256, 384), (130, 200), (300, 33), (1, 8))
BLOCK_TILES = ((1, 128), (128, 1), (128, 128), (16, 32), (3, 1))
MX_TILES = ((1, 32), (32, 1), (32, 32))


@pytest.fixture(scope="module", params=["simd", "portable"])
def lib(request, tmp_path_factory):
    simd = request.param == "simd"
    if simd and not {"avx2", "f16c"} <= _cpu._cpu_flags():
        pytest.skip("this CPU has no AVX2/F16C; the portable build is checked")
    return _cpu.load(simd=simd, directory=tmp_path_factory.mktemp(request.param))


@pytest.fixture
def use(lib, monkeypatch):
    """Route the fake quantizers through ``lib`` and count its calls (so a comparison
    cannot quietly be the eager path against itself)."""
    monkeypatch.setitem(_cpu._state, "lib", lib)
    monkeypatch.setitem(_cpu._state, "tried", True)
    monkeypatch.delenv("NEMO_FP8_CPU_KERNEL", raising=False)
    calls: list[str] = []
    for name in ("fake_quant_tiles", "fake_quant_scaled", "nvfp4"):
        real = getattr(lib, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(lib, name, spy)
    with F.fused_mode(True):
        yield calls


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype != torch.float32:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_block_and_mx_fake_quant_match_the_reference(use, dtype, fmt):
    for i, (m, k) in enumerate(SHAPES):
        x = edge_values(m * k, dtype, i).reshape(m, k)
        for block in BLOCK_TILES:
            for pow2, eps in ((False, 0.0), (True, 0.0), (False, 1e-3)):
                got = F.fake_quant_blockwise(x, block, fmt, pow2, eps)
                want = quantize_blockwise_reference(x, block, fmt, pow2, eps).dequantize()
                same_bits(got, want)
        for block in MX_TILES:
            same_bits(
                F.fake_quant_mxfp8(x, block, fmt),
                quantize_mxfp8_reference(x, block, fmt).dequantize(),
            )
    assert use.count("fake_quant_tiles") == len(SHAPES) * (3 * len(BLOCK_TILES) + len(MX_TILES))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_and_given_scale_fake_quant_match_the_reference(use, dtype, fmt):
    for i, (m, k) in enumerate(SHAPES):
        x = edge_values(m * k, dtype, 10 + i).reshape(m, k)
        for pow2, eps in ((False, 0.0), (True, 0.0), (False, 1e-3)):
            same_bits(
                F.fake_quant_per_tensor(x, fmt, pow2, eps),
                quantize_per_tensor_reference(x, fmt, pow2, eps).dequantize(),
            )
        for s in (3.5, 2.0**-20, 1e30):
            scale = torch.tensor(s)
            inv = torch.ones(()) / scale
            deq, amax = F.fake_quant_with_scale(x, scale, inv, fmt)
            ref = quantize_with_scale_reference(x, scale, fmt, scale_inv=inv)
            same_bits(deq, ref.dequantize())
            same_bits(amax, tensor_amax(x))
    assert use.count("fake_quant_scaled") == len(SHAPES) * 6


def test_fake_quant_of_a_large_tensor_on_several_threads(use, monkeypatch):
    monkeypatch.setenv("NEMO_FP8_CPU_THREADS", "3")
    x = edge_values(600 * 1024, torch.bfloat16, 7).reshape(600, 1024)
    for block in ((1, 128), (128, 1), (128, 128)):
        same_bits(
            F.fake_quant_blockwise(x, block, "e4m3"),
            quantize_blockwise_reference(x, block, "e4m3").dequantize(),
        )
    got = F.fake_quant_mxfp8(x, (32, 1), "e4m3")
    same_bits(got, quantize_mxfp8_reference(x, (32, 1)).dequantize())


def test_disabled_fused_mode_keeps_the_fake_quantizers_eager(use):
    x = torch.randn(64, 128)
    with F.fused_mode(False):
        F.fake_quant_blockwise(x, (1, 128), "e4m3")
        F.fake_quant_per_tensor(x, "e4m3")
        N.fake_quant_nvfp4(x, (1, 16))
    assert use == []


# --------------------------------------------------------------------------- NVFP4


def nvfp4_inputs(dtype):
    """Finite edge values, the same with a NaN, and one with an inf (global amax inf)."""
    for i, (m, k) in enumerate(((64, 128), (33, 48), (17, 32), (1, 16))):
        x = edge_values(m * k, dtype, 20 + i).reshape(m, k).float()
        x = torch.where(torch.isfinite(x), x, torch.ones_like(x))
        x = x.clamp(-3e4, 3e4).to(dtype)  # keep the RHT's sums finite in fp16
        yield x
        with_nan = x.clone()
        with_nan[0, 3] = math.nan
        yield with_nan
    with_inf = torch.randn(32, 64).to(dtype)
    with_inf[5, 5] = math.inf
    yield with_inf


def same_nvfp4(a: N.NVFP4Tensor, b: N.NVFP4Tensor) -> None:
    same_bits(a.data, b.data)
    same_bits(a.scale_inv, b.scale_inv)
    same_bits(a.global_amax.reshape(1), b.global_amax.reshape(1))
    assert (a.block, a.shape, a.dtype, a.rht, a.stochastic) == (
        b.block,
        b.shape,
        b.dtype,
        b.rht,
        b.stochastic,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", N.NVFP4_BLOCKS)
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_nvfp4_kernel_matches_the_reference(use, dtype, block, rht, stochastic):
    n = 0
    for x in nvfp4_inputs(dtype):
        if rht and not bool(torch.isfinite(x).all()):
            continue  # an inf through the RHT's matmul: inf - inf, NaN either way
        for amax in (None, 5.0):
            kw = dict(global_amax=amax, rht=rht, stochastic=stochastic)
            got = N.quantize_nvfp4(x, block, generator=torch.Generator().manual_seed(3), **kw)
            want = N.quantize_nvfp4_reference(
                x, block, generator=torch.Generator().manual_seed(3), **kw
            )
            same_nvfp4(got, want)
            n += 1
        fq = N.fake_quant_nvfp4(
            x, block, rht=rht, stochastic=stochastic, generator=torch.Generator().manual_seed(4)
        )
        ref = N.quantize_nvfp4_reference(
            x, block, rht=rht, stochastic=stochastic, generator=torch.Generator().manual_seed(4)
        )
        same_bits(fq, N.dequantize_nvfp4(ref, torch.float32, undo_rht=rht))
        n += 1
    assert use.count("nvfp4") == n > 0


def test_nvfp4_3d_input_and_default_generator(use):
    x = torch.randn(2, 24, 64)
    torch.manual_seed(11)
    got = N.quantize_nvfp4(x, (16, 16), stochastic=True)
    torch.manual_seed(11)
    want = N.quantize_nvfp4_reference(x, (16, 16), stochastic=True)
    same_nvfp4(got, want)
    assert use == ["nvfp4"]


# --------------------------------------------------------------------------- threads


def test_idle_threads_follow_the_load():
    assert _cpu.idle_threads(2, 0.3) == 2
    assert _cpu.idle_threads(2, 1.2) == 2
    assert _cpu.idle_threads(2, 1.6) == 1
    assert _cpu.idle_threads(2, 9.0) == 1
    assert _cpu.idle_threads(16, 4.0) == 13
    assert _cpu.idle_threads(4, 0.0) == 4


def test_threads_for_small_tensors_the_env_and_the_cores(monkeypatch):
    monkeypatch.delenv("NEMO_FP8_CPU_THREADS", raising=False)
    assert _cpu.threads_for(_cpu.SMALL_NUMEL - 1) == 1
    monkeypatch.setattr(_cpu.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(_cpu, "available_cores", lambda: 3)
    monkeypatch.setitem(_cpu._load_cache, "at", -1e9)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert _cpu.threads_for(1 << 24) == 3  # capped by the cores this process may use
    monkeypatch.setattr(_cpu.os, "getloadavg", lambda: (7.0, 0.0, 0.0))
    monkeypatch.setitem(_cpu._load_cache, "at", -1e9)
    assert _cpu.threads_for(1 << 24) == 1  # an oversubscribed machine
    monkeypatch.setenv("NEMO_FP8_CPU_THREADS", "5")
    assert _cpu.threads_for(10) == 5
    assert _cpu.available_cores() >= 1
