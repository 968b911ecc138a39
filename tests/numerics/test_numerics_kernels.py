"""The single-pass CPU kernels (numerics/_cpu.py, _cpu_kernels.cpp) against the eager
reference, bit for bit, and the public quantizers' dispatch and fallback.

Every comparison is on the raw bytes (``torch.equal`` of uint8 / int32 views): data, scales,
dtypes and shapes. The AVX2 build and the portable build (``-DNEMO_FP8_NO_SIMD``) are both
checked where the CPU has AVX2 (the portable one is what a CPU without it runs).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import _cpu
from nemo_fp8_plugin.numerics import quantize as Q
from nemo_fp8_plugin.numerics.reference import (
    quantize_blockwise_reference,
    quantize_mxfp8_reference,
    quantize_per_tensor_reference,
    quantize_with_scale_reference,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same(got, want) -> None:
    assert got.fmt == want.fmt and got.block == want.block
    for a, b in ((got.data, want.data), (got.scale_inv, want.scale_inv)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(_bytes(a.contiguous()), _bytes(b.contiguous()))


@pytest.fixture(scope="module", params=["simd", "portable"])
def lib(request, tmp_path_factory):
    """Each build of the library, from a fresh cache directory."""
    simd = request.param == "simd"
    if simd and not {"avx2", "f16c"} <= _cpu._cpu_flags():
        pytest.skip("this CPU has no AVX2/F16C; the portable build is checked")
    return _cpu.load(simd=simd, directory=tmp_path_factory.mktemp(request.param))


@pytest.fixture
def use(lib, monkeypatch):
    """Route the public quantizers through ``lib`` from the first element."""
    monkeypatch.setitem(_cpu._state, "lib", lib)
    monkeypatch.setitem(_cpu._state, "tried", True)
    monkeypatch.setitem(Q._MIN_NUMEL, "value", 1)
    return lib


def edge_values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random data over many magnitudes with the edge cases sprinkled in: zeros of both
    signs, NaN of both signs, +-inf, the format maxima and just above, values that round
    to the E4M3/E5M2 subnormals, ties, the input dtype's max and tiniest values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen))
    fi = torch.finfo(dtype)
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            math.nan,
            -math.nan,
            math.inf,
            -math.inf,
            448.0,
            -448.0,
            449.0,
            464.0,
            57344.0,
            61440.0,
            2.0**-6,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-10,
            2.0**-16,
            2.0**-17,
            1.0625,
            1.1875,
            fi.max,
            -fi.max,
            fi.tiny,
            fi.smallest_normal * 0.5,
            1e-30,
        ]
    )
    idx = torch.randint(0, n, (specials.numel() * 4,), generator=gen)
    x[idx] = specials.repeat(4)
    return x.to(dtype)


def tile_cases():
    """(shape, block): divisible, partial tiles in both dims, 3-D stacks, a row shorter than
    a tile, a single element."""
    return [
        ((130, 384), (1, 128)),
        ((130, 384), (128, 128)),
        ((200, 300), (1, 128)),
        ((200, 300), (128, 128)),
        ((3, 130, 260), (128, 128)),
        ((3, 130, 260), (1, 128)),
        ((5, 7), (1, 128)),
        ((1, 1), (128, 128)),
        ((64, 96), (16, 32)),
        ((70, 72), (3, 24)),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_blockwise_matches_the_reference(use, dtype, fmt):
    options = [(False, 0.0), (True, 0.0), (False, 1e-3), (True, 1e-3)]
    for i, (shape, block) in enumerate(tile_cases()):
        n = math.prod(shape)
        x = edge_values(n, dtype, i).reshape(shape)
        # every scale option on the first two shapes, one each (in turn) on the others
        for pow2, eps in options if i < 2 else [options[i % 4]]:
            got = Q.quantize_blockwise(x, block, fmt, pow2_scales=pow2, eps=eps)
            want = quantize_blockwise_reference(x, block, fmt, pow2_scales=pow2, eps=eps)
            assert_same(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blockwise_edge_tiles(use, dtype):
    """Tiles that are all zero, all NaN, hold one inf, one huge value, only tiny values
    (the scale overflows to the input dtype's max), exactly fp8_max."""
    fi = torch.finfo(dtype)
    x = torch.zeros(8, 128 * 8)
    x[1, 128:256] = math.nan
    x[2, 256] = math.inf
    x[3, 384] = -fi.max
    x[4, 512:640] = fi.tiny
    x[5, 640:768] = 448.0
    x[6, 768:896] = -1e-40 if dtype == torch.float32 else -fi.tiny
    x[7, 896] = math.nan
    x[7, 897] = 3.0
    x = x.to(dtype)
    for block in ((1, 128), (128, 128), (2, 128)):
        for pow2 in (False, True):
            assert_same(
                Q.quantize_blockwise(x, block, pow2_scales=pow2),
                quantize_blockwise_reference(x, block, pow2_scales=pow2),
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_matches_the_reference(use, dtype, fmt):
    cases = [
        ((64, 256), 32),
        ((64, 256), (32, 32)),
        ((2, 3, 96), 32),
        ((2, 64, 96), (32, 32)),
        ((70, 100), 32),
        ((70, 100), (32, 32)),
        ((7,), 32),
        ((4, 5, 6, 64), (1, 32)),
        ((33, 613), 32),  # 19 whole blocks (two groups of eight in vector lanes) + a partial
        ((3, 1024), 32),
    ]
    for i, (shape, block) in enumerate(cases):
        x = edge_values(math.prod(shape), dtype, 100 + i).reshape(shape)
        assert_same(Q.quantize_mxfp8(x, block, fmt), quantize_mxfp8_reference(x, block, fmt))


def test_mxfp8_huge_and_tiny_blocks(use):
    """Blocks whose exponent is 0xFE (inf amax), 0 (amax 0), near 2^127, subnormal, or whose
    amax rounds the exponent up or not, at every position of a group of eight blocks (the
    vector-lane path) and in a partial last block."""
    specials = [math.inf, 3e38, 1e-39, -math.nan, 448.0, 449.0, 2.0**-127, 0.0, -5.5e-41]
    x = torch.randn(len(specials), 32 * 16 + 7) * 0.01
    for r, v in enumerate(specials):
        for blk in range(17):
            x[r, (blk * 32 + r * 3) % x.shape[1]] = v if (blk + r) % 3 else -v
    x[0, 32:64] = 0.0  # an all-zero block
    x[0, 64], x[0, 65] = math.inf, -3e38  # exponent 0xFE: 3e38 * 2^-127 is a normal FP8 value
    x[1, -7:] = math.inf  # a partial block holding inf
    # amaxes whose amax * fp32(1/448) is the subnormal 0x3FFFFF, 0x400000 (2^-127: no round
    # up) and 0x400001 (rounds up), in blocks 9-11 of the second group of eight
    x[2, 288:384] = 0.0
    edge = torch.tensor([0x045FFFFB, 0x04600000, 0x04600002], dtype=torch.int32)
    x[2, 288:384:32] = edge.view(torch.float32)
    for fmt in ("e4m3", "e5m2"):
        assert_same(Q.quantize_mxfp8(x, 32, fmt), quantize_mxfp8_reference(x, 32, fmt))
        xb = x.bfloat16()
        assert_same(Q.quantize_mxfp8(xb, 32, fmt), quantize_mxfp8_reference(xb, 32, fmt))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_and_given_scale_match_the_reference(use, dtype, fmt):
    for i, shape in enumerate([(300, 257), (5,), (2, 3, 4, 70001 // 24 + 1)]):
        x = edge_values(math.prod(shape), dtype, 200 + i).reshape(shape)
        for pow2 in (False, True):
            for eps in (0.0, 0.5):
                assert_same(
                    Q.quantize_per_tensor(x, fmt, pow2_scales=pow2, eps=eps),
                    quantize_per_tensor_reference(x, fmt, pow2_scales=pow2, eps=eps),
                )
        finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).to(dtype)
        for scale in (torch.tensor(0.37), torch.tensor(3.0e-7, dtype=torch.float64)):
            assert_same(
                Q.quantize_with_scale(finite, scale, fmt),
                quantize_with_scale_reference(finite, scale, fmt),
            )
    tiny = torch.full((64,), 1e-40)  # amax so small that 448 / amax overflows to FLT_MAX
    assert_same(Q.quantize_per_tensor(tiny, fmt), quantize_per_tensor_reference(tiny, fmt))


def test_every_fp32_encoding_sample(use):
    """The encoder against torch's cast on a dense sweep of fp32 bit patterns: every 2^23
    patterns' neighbourhood (both signs) and every pattern between 2^-12 and 2^9 in steps
    of 37 ulps (the full 2^32 sweep was run once by hand: identical)."""
    hi = torch.arange(0, 1 << 9, dtype=torch.int64) << 23
    near = (hi[:, None] + torch.arange(-64, 64)[None, :]).flatten()
    dense = torch.arange(0x39800000, 0x44000000, 37, dtype=torch.int64)
    bits = torch.cat([near, dense]).clamp(0, (1 << 32) - 1)
    bits = torch.cat([bits, bits | (1 << 31)]).to(torch.int64)
    x = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
    one = torch.tensor(1.0)
    for fmt in ("e4m3", "e5m2"):
        assert_same(Q.quantize_with_scale(x, one, fmt), quantize_with_scale_reference(x, one, fmt))


def test_large_tensor_threads(use):
    """Enough tile rows that every thread gets several, on a non-contiguous view."""
    x = edge_values(1024 * 640, torch.bfloat16, 7).reshape(640, 1024).t()
    for block in ((1, 128), (128, 128)):
        assert_same(Q.quantize_blockwise(x, block), quantize_blockwise_reference(x, block))
    assert_same(Q.quantize_mxfp8(x, 32), quantize_mxfp8_reference(x, 32))


def test_dispatch_by_size_and_block(use, monkeypatch):
    x = torch.randn(64, 128)
    assert Q.kernel_for(x, 128) == "cpu"
    assert Q.kernel_for(x, 1) == "reference"  # MXFP8 32x1: no eight-wide rows
    monkeypatch.setitem(Q._MIN_NUMEL, "value", x.numel() + 1)
    assert Q.kernel_for(x, 128) == "reference"
    monkeypatch.setitem(Q._MIN_NUMEL, "value", 1)
    monkeypatch.setenv("NEMO_FP8_CPU_KERNEL", "0")
    assert Q.kernel_for(x, 128) == "reference"


def test_no_compiler_falls_back_to_identical_bits(monkeypatch, tmp_path):
    """Without a compiler: one RuntimeWarning naming the reason, then the reference."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("NEMO_FP8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(Q._MIN_NUMEL, "value", 1)
    saved = dict(_cpu._state)
    _cpu.reset()
    try:
        x = edge_values(4096, torch.bfloat16, 3).reshape(32, 128)
        with pytest.warns(RuntimeWarning, match="no C.. compiler"):
            got = Q.quantize_blockwise(x, (128, 128))
        assert _cpu.status()["loaded"] is False and "compiler" in _cpu.status()["error"]
        assert Q.kernel_for(x, 128) == "reference"
        assert_same(got, quantize_blockwise_reference(x, (128, 128)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once only
            Q.quantize_mxfp8(x, 32)
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))
    finally:
        _cpu._state.clear()
        _cpu._state.update(saved)


def test_a_failing_compile_falls_back(monkeypatch, tmp_path):
    script = tmp_path / "cxx"
    script.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="broken compiler"):
        _cpu.build(cxx=str(script), directory=tmp_path / "c")
    assert not any((tmp_path / "c").glob("*"))  # no half-written library left behind


def test_build_is_cached_outside_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("NEMO_FP8_CACHE_DIR", str(tmp_path))
    assert _cpu.cache_dir() == tmp_path / "cpu_kernels"
    monkeypatch.delenv("NEMO_FP8_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cpu.cache_dir() == tmp_path / "xdg" / "nemo_fp8_plugin" / "cpu_kernels"
    path, seconds = _cpu.build(simd=False, directory=tmp_path / "k")
    again, seconds2 = _cpu.build(simd=False, directory=tmp_path / "k")
    assert again == path and seconds2 == 0.0 and seconds > 0
    assert [p.name for p in (tmp_path / "k").iterdir()] == [path.name]


def test_tile_rows_cut_into_panels(use):
    """Panels holding one or two tiles (the default keeps whole tile rows of real weights in
    one panel): many panels per tile row, partial last panels, every input dtype."""
    from nemo_fp8_plugin.numerics.reference import QTensor

    cases = [
        (torch.float32, (130, 600)),
        (torch.bfloat16, (2, 130, 520)),
        (torch.float16, (40, 1100)),
    ]
    for i, (dtype, shape) in enumerate(cases):
        x = edge_values(math.prod(shape), dtype, 300 + i).reshape(shape)
        x3 = x if x.dim() == 3 else x.unsqueeze(0)
        for block in ((128, 128), (1, 128), (16, 32)):
            want = quantize_blockwise_reference(x, block)
            data, sinv = use.tiles(
                x3, *block, "e4m3", mx=False, vinf=torch.finfo(dtype).max, panel_bytes=65536
            )
            got = QTensor(data.reshape(x.shape), sinv.reshape(want.scale_inv.shape), "e4m3", block)
            assert_same(got, want)
        for block, panel in (((32, 32), 4096), ((1, 32), 12 * 32 * x.element_size())):
            want = quantize_mxfp8_reference(x, block)
            data, e = use.tiles(x3, *block, "e4m3", mx=True, panel_bytes=panel)
            e = e.reshape(want.scale_inv.shape).view(torch.float8_e8m0fnu)
            assert_same(QTensor(data.reshape(x.shape), e, "e4m3", block), want)


def test_simd_build_is_eight_wide(lib):
    assert lib.simd_width in (1, 8)
    if "portable" in str(lib.path.parent.name):
        assert lib.simd_width == 1
    else:
        assert lib.simd_width == 8


# --------------------------------------------------------------------------- argument checks


BAD = [
    ("pow2_scales", "false"),
    ("pow2_scales", 1),
    ("pow2_scales", None),
    ("eps", "0"),
    ("eps", -1.0),
    ("eps", math.nan),
    ("eps", math.inf),
    ("eps", True),
    ("eps", [0.0]),
    ("fmt", "e3m4"),
    ("fmt", 3),
    ("fmt", torch.float16),
    ("block", (0, 128)),
    ("block", "128"),
    ("block", (1.0, 128)),
    ("block", (True, 128)),
    ("block", (1, 2, 3)),
]


def _quantizers():
    from nemo_fp8_plugin.numerics import fused

    return {
        "quantize_blockwise": (Q.quantize_blockwise, True),
        "quantize_blockwise_reference": (quantize_blockwise_reference, True),
        "quantize_blockwise_fused": (fused.quantize_blockwise_fused, True),
        "quantize_per_tensor": (Q.quantize_per_tensor, False),
        "quantize_per_tensor_reference": (quantize_per_tensor_reference, False),
        "quantize_mxfp8": (Q.quantize_mxfp8, None),
        "quantize_mxfp8_reference": (quantize_mxfp8_reference, None),
        "quantize_mxfp8_fused": (fused.quantize_mxfp8_fused, None),
    }


@pytest.mark.parametrize("name", list(_quantizers()))
def test_bad_arguments_name_the_argument(name):
    fn, blockwise = _quantizers()[name]
    takes = {"fmt"} | ({"block"} if blockwise is not False else set())
    takes |= {"pow2_scales", "eps"} if blockwise is not None else set()
    x = torch.randn(4, 64)
    checked = 0
    for key, value in BAD:
        if key not in takes:
            continue
        with pytest.raises(FP8ConfigError) as err:
            fn(x, **{key: value})
        assert err.value.key == key, (name, key, value)
        checked += 1
    assert checked >= 7
    for bad_x, why in (
        ([1.0, 2.0], "list"),
        (torch.ones(4, 64, dtype=torch.int32), "int32"),
        (torch.ones(4, 64, dtype=torch.float64), "float64"),
        (torch.ones(4, 64).to_sparse(), "sparse"),
    ):
        with pytest.raises(FP8ConfigError, match=why) as err:
            fn(bad_x)
        assert err.value.key == "x"
    if blockwise:
        with pytest.raises(FP8ConfigError) as err:
            fn(torch.randn(64))
        assert err.value.key == "x"
    if blockwise is None:
        with pytest.raises(FP8ConfigError) as err:
            fn(x, block=(1, 64))
        assert err.value.key == "block"


def test_fake_quantization_flags_are_checked():
    """The emulation's fake-quantizers take the same flags: a string is never a bool, on the
    eager path (small tensors) as on the compiled one."""
    from nemo_fp8_plugin.numerics import fake_quant_blockwise, fake_quant_per_tensor

    x = torch.randn(4, 128)
    for fn, args in (
        (fake_quant_blockwise, (x, (1, 128), "e4m3")),
        (fake_quant_per_tensor, (x, "e4m3")),
    ):
        with pytest.raises(FP8ConfigError) as err:
            fn(*args, pow2_scales="false")
        assert err.value.key == "pow2_scales"
        with pytest.raises(FP8ConfigError) as err:
            fn(*args, eps="0.1")
        assert err.value.key == "eps"


def test_given_scale_is_checked():
    from nemo_fp8_plugin.numerics.reference import quantize_with_scale_reference as ref

    x = torch.randn(8)
    for fn in (Q.quantize_with_scale, ref):
        for bad, key in (
            (2.0, "scale"),
            (torch.ones(2), "scale"),
            (torch.ones((), dtype=torch.int32), "scale"),
        ):
            with pytest.raises(FP8ConfigError) as err:
                fn(x, bad)
            assert err.value.key == key
        with pytest.raises(FP8ConfigError) as err:
            fn(x, torch.tensor(1.0), scale_inv="1")
        assert err.value.key == "scale_inv"


def test_kernel_min_numel_is_checked():
    before = Q.kernel_min_numel()
    for bad in (-1, "10", 1.5, True):
        with pytest.raises(FP8ConfigError):
            Q.kernel_min_numel(bad)
    assert Q.kernel_min_numel() == before
