"""Bit-exactness of the quantizers against NUMERICS.md (atol = rtol = 0).

Every test runs twice (the autouse ``impl`` fixture): through the CPU kernels the public
functions dispatch to (``numerics/_cpu.py``, from the first element) and through the eager
reference (kernels switched off), so both are held to the same independent oracle.

The expected values come from ``test_numerics_reference.py`` (numpy, tile-by-tile loops,
FP8 decoded from its bit layout), never from the code under test. Every case mixes random
tiles with edge tiles: all zeros, one huge value, subnormal inputs, +-inf, NaN, NaN only,
an amax of exactly fp8_max, values on rounding ties and binade boundaries, an amax so small
that ``fp8_max / amax`` overflows, and partial tiles.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_numerics_reference import (
    FMT_MAX,
    fp8_table,
    ref_block_quantize,
    ref_mx_quantize,
    ref_tensor_quantize,
)

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import (
    QTensor,
    fp8_dtype,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_per_tensor,
    quantize_with_scale,
)
from presets import FP8_PRESETS

DTYPES = [torch.float32, torch.bfloat16]
FMTS = ["e4m3", "e5m2"]
RECIPES = FP8_PRESETS
PATTERNS = [
    "zeros",
    "huge",
    "subnormal",
    "inf",
    "nan",
    "nan_only",
    "fp8_max",
    "ties",
    "tiny_amax",
    "negative",
]


@pytest.fixture(autouse=True)
def seeded():
    """The few tensors drawn without an explicit generator are reproducible too."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True, params=["kernel", "reference"])
def impl(request, monkeypatch):
    """Which implementation the public quantizers run: the CPU kernels (from one element on)
    or the eager reference."""
    from nemo_fp8_plugin.numerics import kernel_for
    from nemo_fp8_plugin.numerics import quantize as quantize_module

    if request.param == "kernel":
        monkeypatch.setitem(quantize_module._MIN_NUMEL, "value", 1)
        assert kernel_for(torch.ones(8)) == "cpu", "the CPU kernels did not build"
    else:
        monkeypatch.setenv("NEMO_FP8_CPU_KERNEL", "0")
        assert kernel_for(torch.ones(1 << 20)) == "reference"
    return request.param


def pattern(name: str, shape, dtype: torch.dtype, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """One edge tile (built in fp32, then rounded to ``dtype``)."""
    n = int(np.prod(shape))
    base = torch.randn(n, generator=gen)
    fmax = FMT_MAX[fmt]
    tiny = torch.finfo(dtype).tiny
    if name == "zeros":
        t = torch.zeros(n)
        t[::2] = -0.0
    elif name == "huge":
        t = base.clone()
        t[n // 2] = torch.finfo(dtype).max / 2
    elif name == "subnormal":
        t = base * tiny / 8
    elif name == "inf":
        t = base.clone()
        t[0], t[-1] = math.inf, -math.inf
    elif name == "nan":
        t = base.clone()
        t[1::5] = math.nan
    elif name == "nan_only":
        t = torch.full((n,), math.nan)
    elif name == "fp8_max":
        t = base / base.abs().max() * (fmax / 2)
        t[n // 3] = -fmax
    elif name == "ties":
        # scale is 1 (amax == fp8_max): midpoints between neighbouring FP8 values, values
        # just above/below them, and the subnormal/normal boundary
        vals = torch.tensor(fp8_table(fmt)[0], dtype=torch.float32)
        mids = (vals[1:] + vals[:-1]) / 2
        pool = torch.cat(
            [
                mids,
                torch.nextafter(mids, torch.tensor(math.inf)),
                torch.nextafter(mids, torch.tensor(-math.inf)),
                -mids,
            ]
        )
        t = pool[torch.randint(len(pool), (n,), generator=gen)]
        t[0] = fmax
    elif name == "tiny_amax":
        t = base * 1e-37
    elif name == "negative":
        t = -base.abs() - 0.5
    else:
        raise AssertionError(name)
    return t.reshape(shape).to(dtype)


def edge_tensor(shape, block, dtype, fmt, seed=0) -> torch.Tensor:
    """Random tiles of varied magnitude, with PATTERNS in the first tiles (row-major)."""
    gen = torch.Generator().manual_seed(seed)
    m, k = shape
    bm, bn = block
    x = torch.randn(m, k, generator=gen)
    kt = -(-k // bn)
    mt = -(-m // bm)
    mags = 10.0 ** (torch.rand(mt, kt, generator=gen) * 6 - 3)
    x = x * mags.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :k]
    x = x.to(dtype)
    for t, name in enumerate(PATTERNS):
        i, j = divmod(t, kt)
        if i >= mt:
            break
        rows = slice(i * bm, min((i + 1) * bm, m))
        cols = slice(j * bn, min((j + 1) * bn, k))
        tile_shape = (rows.stop - rows.start, cols.stop - cols.start)
        x[rows, cols] = pattern(name, tile_shape, dtype, fmt, gen)
    return x


def as_bytes(data: torch.Tensor) -> np.ndarray:
    return data.view(torch.uint8).numpy()


def f32_bits(t) -> np.ndarray:
    return np.asarray(t, dtype=np.float32).view(np.uint32)


def vinf(dtype):
    return float(torch.finfo(dtype).max)


# --------------------------------------------------------------------------- block scaling


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "block,shape", [((1, 128), (11, 1300)), ((128, 128), (300, 1300))], ids=["1x128", "128x128"]
)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32scales", "pow2scales"])
def test_blockwise_exact(dtype, fmt, block, shape, pow2):
    x = edge_tensor(shape, block, dtype, fmt)
    q = quantize_blockwise(x, block, fmt, pow2_scales=pow2)
    want_data, want_sinv = ref_block_quantize(x.float().numpy(), block, fmt, pow2, 0.0, vinf(dtype))
    assert q.data.dtype == fp8_dtype(fmt) and q.data.shape == x.shape
    assert q.scale_inv.dtype == torch.float32
    assert q.scale_inv.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    np.testing.assert_array_equal(as_bytes(q.data), want_data)
    np.testing.assert_array_equal(f32_bits(q.scale_inv.numpy()), f32_bits(want_sinv))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-4, 1.0])
def test_blockwise_epsilon(dtype, eps):
    x = edge_tensor((4, 640), (1, 128), dtype, "e4m3", seed=3)
    q = quantize_blockwise(x, (1, 128), "e4m3", eps=eps)
    want_data, want_sinv = ref_block_quantize(
        x.float().numpy(), (1, 128), "e4m3", False, eps, vinf(dtype)
    )
    np.testing.assert_array_equal(as_bytes(q.data), want_data)
    np.testing.assert_array_equal(f32_bits(q.scale_inv.numpy()), f32_bits(want_sinv))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_recipe_role_is_exact(recipe, dtype):
    """Each preset's tile, format and scale option per GEMM operand role."""
    spec = get_recipe(recipe)
    for role in ("input", "weight", "grad_output"):
        fmt, block = spec.format_for(role), spec.block_for(role)
        shape = (70, 300) if block is None or block[0] == 1 else (150, 300)
        x = edge_tensor(shape, block or (1, 128), dtype, fmt, seed=hash(role) % 1000)
        xn = x.float().numpy()
        if spec.scaling == "mx":
            q = quantize_mxfp8(x, block, fmt)
            want_data, want_e = ref_mx_quantize(xn, block, fmt)
            np.testing.assert_array_equal(q.scale_inv.view(torch.uint8).numpy(), want_e)
        elif spec.scaling == "block":
            q = quantize_blockwise(x, block, fmt, pow2_scales=spec.pow2_scales)
            want_data, want_sinv = ref_block_quantize(
                xn, block, fmt, spec.pow2_scales, 0.0, vinf(dtype)
            )
            np.testing.assert_array_equal(f32_bits(q.scale_inv.numpy()), f32_bits(want_sinv))
        else:  # delayed and current scaling both cast per tensor; delayed with its state's scale
            q = quantize_per_tensor(x, fmt, pow2_scales=spec.pow2_scales)
            want_data, want_sinv = ref_tensor_quantize(xn, fmt, spec.pow2_scales, 0.0)
            assert f32_bits(q.scale_inv.numpy()) == f32_bits(want_sinv)
        np.testing.assert_array_equal(as_bytes(q.data), want_data, err_msg=f"{recipe} {role}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_column_tiles_equal_row_tiles_of_the_transpose(dtype):
    """TE's column-wise copy: 1x128 tiles of x.T are 128x1 tiles of x, bit for bit."""
    x = edge_tensor((300, 260), (128, 1), dtype, "e4m3", seed=11)
    col = quantize_blockwise(x, (128, 1), "e4m3")
    row_t = quantize_blockwise(x.t().contiguous(), (1, 128), "e4m3")
    assert torch.equal(col.data.view(torch.uint8), row_t.data.view(torch.uint8).t())
    assert torch.equal(col.scale_inv, row_t.scale_inv.t())
    mx_col = quantize_mxfp8(x[:, :256], (32, 1))
    mx_row_t = quantize_mxfp8(x[:, :256].t().contiguous(), (1, 32))
    assert torch.equal(mx_col.data.view(torch.uint8), mx_row_t.data.view(torch.uint8).t())
    assert torch.equal(mx_col.scale_inv.view(torch.uint8), mx_row_t.scale_inv.view(torch.uint8).t())


def test_moe_expert_stack_is_per_expert():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 200, 300, generator=gen).to(torch.bfloat16)
    w[1] *= 1000
    q = quantize_blockwise(w, (128, 128), "e4m3")
    assert q.scale_inv.shape == (3, 2, 3)
    for e in range(3):
        qe = quantize_blockwise(w[e], (128, 128), "e4m3")
        assert torch.equal(q.data[e].view(torch.uint8), qe.data.view(torch.uint8))
        assert torch.equal(q.scale_inv[e], qe.scale_inv)
    assert torch.equal(q.dequantize()[2], quantize_blockwise(w[2], (128, 128)).dequantize())


# --------------------------------------------------------------------------- per tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32scales", "pow2scales"])
@pytest.mark.parametrize("name", PATTERNS + ["random"])
def test_per_tensor_exact(dtype, fmt, pow2, name):
    gen = torch.Generator().manual_seed(1)
    if name == "random":
        x = (torch.randn(33, 65, generator=gen) * 7).to(dtype)
    else:
        x = pattern(name, (33, 65), dtype, fmt, gen)
    q = quantize_per_tensor(x, fmt, pow2_scales=pow2)
    want_data, want_sinv = ref_tensor_quantize(x.float().numpy(), fmt, pow2, 0.0)
    assert q.scale_inv.shape == () and q.block is None
    np.testing.assert_array_equal(as_bytes(q.data), want_data)
    assert f32_bits(q.scale_inv.numpy()) == f32_bits(want_sinv)


@pytest.mark.parametrize("fmt", FMTS)
def test_cast_with_given_scale_saturates(fmt):
    """Delayed scaling casts with a stale scale: values far beyond fp8_max saturate."""
    x = torch.tensor([1e30, -1e30, 3.0, math.inf, -math.inf, math.nan, 1e-30])
    q = quantize_with_scale(x, torch.tensor(1000.0), fmt)
    want_data, want_sinv = ref_tensor_quantize(x.numpy(), fmt, False, 0.0, scale=np.float32(1000.0))
    np.testing.assert_array_equal(as_bytes(q.data), want_data)
    assert f32_bits(q.scale_inv.numpy()) == f32_bits(want_sinv)


# --------------------------------------------------------------------------- MXFP8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "block,shape",
    [((1, 32), (13, 352)), ((32, 32), (70, 352)), ((32, 1), (70, 40)), ((1, 32), (5, 70))],
    ids=["1x32", "32x32", "32x1", "1x32-partial"],
)
def test_mxfp8_exact(dtype, fmt, block, shape):
    x = edge_tensor(shape, block, dtype, fmt, seed=7)
    q = quantize_mxfp8(x, block, fmt)
    want_data, want_e = ref_mx_quantize(x.float().numpy(), block, fmt)
    assert q.scale_inv.dtype == torch.float8_e8m0fnu
    assert q.scale_inv.shape == want_e.shape
    np.testing.assert_array_equal(as_bytes(q.data), want_data)
    np.testing.assert_array_equal(q.scale_inv.view(torch.uint8).numpy(), want_e)


# Blocks decided by TE's exp2f_rcp (TE PR 2647, pinned TE 2.20.2; NUMERICS.md): an inf in
# the block gives scale byte 0xFE and multiplier 2^-127 (not 0: the inf saturates, finite
# values keep their 2^-127-scaled code); a block whose amax is at most 448 * 2^-127 gives byte
# 0x00 and multiplier 2^127 (not 1: its values are cast at full precision, not flushed).
# (value, E4M3 byte, E5M2 byte), worked out by hand from the FP8 bit layouts.
MX_INF_BLOCK = [
    (math.inf, 0x7E, 0x7B),  # saturates to +448 / +57344
    (-math.inf, 0xFE, 0xFB),
    (1.0, 0x00, 0x00),  # 2^-127
    (2.0**120, 0x04, 0x20),  # 2^-7: E4M3 subnormal 4 * 2^-9, E5M2 normal
    (-3 * 2.0**125, 0xB4, 0xBA),  # -0.75
    ((2 - 2.0**-7) * 2.0**127, 0x40, 0x40),  # 1.9921875 rounds to 2.0
    (2.0**110, 0x00, 0x00),  # 2^-17: E5M2's half step, ties to even (0)
    (3 * 2.0**110, 0x00, 0x02),  # 1.5 * 2^-16: tie, to even code 2
    (-0.0, 0x80, 0x80),
    (math.nan, 0x7F, 0x7F),  # ignored by the amax, stays NaN (sign kept)
]
MX_TINY_BLOCK = [
    (2.0**-119, 0x78, 0x5C),  # 2^-119 * 2^127 = 256
    (-3 * 2.0**-122, 0xEC, 0xD6),  # -96
    (2.0**-130, 0x20, 0x30),  # fp32/bf16 subnormal -> 0.125
    (-5 * 2.0**-133, 0x9A, 0xAD),  # -0.078125
    (2.0**-133, 0x08, 0x24),  # bf16's smallest subnormal -> 2^-6
    (-0.0, 0x80, 0x80),
]
MX_LAYOUTS = {"1x32": (1, 32), "32x1": (32, 1), "32x32": (32, 32)}


def mx_pinned(layout: str, dtype: torch.dtype, fmt: str):
    """``(x, expected data bytes, expected scale bytes)`` holding an inf block (scale byte
    0xFE, filled with 1.0) and a tiny block (byte 0x00, filled with 0.0) for ``layout``."""
    col = 1 if fmt == "e4m3" else 2
    rows = []
    for pinned, fill in ((MX_INF_BLOCK, 1.0), (MX_TINY_BLOCK, 0.0)):
        vals = [v for v, *_ in pinned] + [fill] * (32 - len(pinned))
        codes = [c[col] for c in pinned] + [0] * (32 - len(pinned))
        rows.append((vals, codes, fill))
    if layout == "32x32":  # each block's values in its first row, the filler elsewhere
        x = torch.cat([torch.full((32, 32), fill) for _, _, fill in rows], dim=1)
        want = np.zeros((32, 64), dtype=np.uint8)
        for b, (vals, codes, _) in enumerate(rows):
            x[0, 32 * b : 32 * (b + 1)] = torch.tensor(vals)
            want[0, 32 * b : 32 * (b + 1)] = codes
        scales = np.array([[0xFE, 0x00]], dtype=np.uint8)
    else:
        x = torch.tensor([vals for vals, _, _ in rows])
        want = np.array([codes for _, codes, _ in rows], dtype=np.uint8)
        scales = np.array([[0xFE], [0x00]], dtype=np.uint8)
        if layout == "32x1":
            x, want, scales = x.t().contiguous(), want.T.copy(), scales.T.copy()
    assert torch.equal(x.to(dtype).float().nan_to_num(), x.nan_to_num())  # exact in dtype
    x = x.to(dtype)
    # a NaN keeps its sign bit (the bf16 conversion of torch's NaN may set it)
    nan = torch.isnan(x).numpy()
    want[nan] = 0x7F | (torch.signbit(x).numpy()[nan].astype(np.uint8) << 7)
    return x, want, scales


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("layout", list(MX_LAYOUTS))
def test_mxfp8_inf_and_tiny_blocks_follow_exp2f_rcp(dtype, fmt, layout):
    x, want_data, want_e = mx_pinned(layout, dtype, fmt)
    q = quantize_mxfp8(x, MX_LAYOUTS[layout], fmt)
    np.testing.assert_array_equal(q.scale_inv.view(torch.uint8).numpy(), want_e)
    np.testing.assert_array_equal(as_bytes(q.data), want_data)
    # the independent numpy reference agrees
    ref_data, ref_e = ref_mx_quantize(x.float().numpy(), MX_LAYOUTS[layout], fmt)
    np.testing.assert_array_equal(ref_data, want_data)
    np.testing.assert_array_equal(ref_e, want_e)


@pytest.mark.parametrize("fmt", FMTS)
def test_mxfp8_tiny_block_round_trips_and_inf_block_dequantizes(fmt):
    x, _, _ = mx_pinned("1x32", torch.float32, fmt)
    deq = quantize_mxfp8(x, 32, fmt).dequantize()
    # every tiny value is q * 2^-127 exactly (an old kernel's multiplier 1 gave zeros)
    np.testing.assert_array_equal(f32_bits(deq[1].numpy()), f32_bits(x[1].numpy()))
    inf_row = deq[0].tolist()
    assert inf_row[0] == math.inf and inf_row[1] == -math.inf  # +-fp8_max * 2^127 overflows
    assert inf_row[2] == 0.0 and inf_row[3] == 2.0**120 and inf_row[4] == -3 * 2.0**125
    assert inf_row[5] == math.inf  # 2.0 * 2^127 = 2^128 overflows fp32
    assert math.isnan(inf_row[9])


def test_exp2f_rcp_multiplier_bits():
    from nemo_fp8_plugin.numerics.scaling import e8m0_quant_multiplier

    e = torch.arange(256, dtype=torch.int32)
    bits = e8m0_quant_multiplier(e).view(torch.int32).tolist()
    assert bits[0] == 0x7F000000 and bits[1] == 0x7E800000 and bits[127] == 0x3F800000
    assert bits[253] == 0x00800000 and bits[254] == 0x00400000 and bits[255] == 0x7FFFFFFF
    assert bits[:254] == [(254 - i) << 23 for i in range(254)]


@pytest.mark.parametrize("fmt", FMTS)
def test_split_data_multiply_casts_like_one_multiply(fmt):
    """The quantizers multiply by ``e8m0_data_factors`` (no subnormal operand); the cast
    must give the bits of ``x * exp2f_rcp(e)`` for every exponent byte."""
    from nemo_fp8_plugin.numerics.scaling import (
        e8m0_data_factors,
        e8m0_quant_multiplier,
        saturating_cast,
    )

    gen = torch.Generator().manual_seed(11)
    e = torch.arange(255, dtype=torch.int32)[:, None]
    # per exponent: values around the block's own range and far below it, plus edges
    top = ((e - 127).double() + math.log2(FMT_MAX[fmt])).clamp(max=127.99)  # log2 of the amax
    x = torch.exp2(top - torch.rand(255, 256, generator=gen, dtype=torch.float64) * 40).float()
    x = x * torch.randn(255, 256, generator=gen).sign()
    assert torch.isfinite(x).all() and (x[254].abs() > 2.0**110).sum() > 100
    x[:, :4] = torch.tensor([math.inf, -math.inf, 0.0, float(torch.finfo(torch.float32).max)])
    x[:, 4] = torch.finfo(torch.float32).tiny / 4  # a subnormal
    m1, m2 = e8m0_data_factors(e)
    fmax, dt = FMT_MAX[fmt], fp8_dtype(fmt)
    split = saturating_cast(x * m1 * m2, fmax, dt).view(torch.uint8)
    one = saturating_cast(x * e8m0_quant_multiplier(e), fmax, dt).view(torch.uint8)
    assert torch.equal(split, one)


def test_mxfp8_layout_and_leading_dims():
    x = torch.randn(2, 3, 64)
    q = quantize_mxfp8(x)
    assert q.data.shape == (2, 3, 64) and q.scale_inv.shape == (2, 3, 2)
    flat = quantize_mxfp8(x.reshape(6, 64))
    assert torch.equal(
        q.scale_inv.view(torch.uint8).reshape(6, 2), flat.scale_inv.view(torch.uint8)
    )


# --------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("kind", ["tensor", "1x128", "128x128", "mx1x32", "mx32x32"])
def test_dequantize_is_data_times_scale_inv_per_tile(kind):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(130, 300, generator=gen) * 5
    if kind == "tensor":
        q = quantize_per_tensor(x)
    elif kind.startswith("mx"):
        q = quantize_mxfp8(x[:, :288], (1, 32) if kind == "mx1x32" else (32, 32))
    else:
        q = quantize_blockwise(x, (1, 128) if kind == "1x128" else (128, 128))
    data = q.data.float().numpy().astype(np.float32)
    s = q.scale_inv.float().numpy().astype(np.float32)
    bm, bn = q.block or (data.shape[0], data.shape[1])
    want = np.empty_like(data)
    for i in range(data.shape[0]):
        for j in range(0, data.shape[1], bn):
            sv = s if q.block is None else s[i // bm, j // bn]
            want[i, j : j + bn] = data[i, j : j + bn] * sv
    got = q.dequantize()
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_qtensor_fields():
    q = quantize_blockwise(torch.randn(4, 256), (1, 128), "e5m2")
    assert isinstance(q, QTensor) and q.fmt == "e5m2" and q.block == (1, 128) and not q.is_mx
    assert "e5m2" in repr(q)
    assert quantize_mxfp8(torch.randn(4, 64)).is_mx


# --------------------------------------------------------------------------- bad input


def test_bad_arguments_raise_config_errors():
    x = torch.randn(4, 128)
    with pytest.raises(FP8ConfigError, match="fmt"):
        quantize_blockwise(x, fmt="e3m4")
    with pytest.raises(FP8ConfigError, match="block"):
        quantize_blockwise(x, block=(0, 128))
    with pytest.raises(FP8ConfigError, match="rank"):
        quantize_blockwise(torch.randn(128))
    with pytest.raises(FP8ConfigError, match="int64"):
        quantize_per_tensor(torch.ones(3, dtype=torch.int64))
    with pytest.raises(FP8ConfigError, match="1x32, 32x1 or 32x32"):
        quantize_mxfp8(x, block=64)
