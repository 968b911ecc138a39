"""An independent reference of shared/NUMERICS.md, written with numpy and Python loops.

Nothing here calls the plugin or torch's float8 casts: FP8 values are decoded from their bit
layout by hand, rounding to FP8 is a nearest-neighbour search over that table with ties to
the even code, scales are computed with numpy float32 arithmetic (IEEE, correctly rounded),
and quantization loops over tiles one by one. The exactness tests in
``test_numerics_quantize.py`` compare the plugin against these functions with no tolerance.
This file also tests the reference itself against facts stated in NUMERICS.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.torch_free

FMT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_table(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Sorted non-negative finite values of a format and their byte codes (from the bits)."""
    vals, codes = [], []
    for code in range(128):
        if fmt == "e4m3":
            e, m = code >> 3, code & 7
            if e == 15 and m == 7:
                continue  # NaN; E4M3FN has no inf
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        else:
            e, m = code >> 2, code & 3
            if e == 31:
                continue  # inf / NaN
            v = (m / 4) * 2.0**-14 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15)
        vals.append(v)
        codes.append(code)
    order = np.argsort(vals)
    return np.asarray(vals, dtype=np.float64)[order], np.asarray(codes, dtype=np.int64)[order]


_TABLES = {f: fp8_table(f) for f in FMT_MAX}


def ref_cast(v: np.ndarray, fmt: str) -> np.ndarray:
    """Round float32 values (already within +-max) to FP8 bytes: nearest, ties to even code;
    NaN -> 0x7F with the sign bit. Vectorised nearest-neighbour search over the table."""
    vals, codes = _TABLES[fmt]
    v = np.asarray(v, dtype=np.float32).ravel()
    neg = np.signbit(v)
    nan = np.isnan(v)
    a = np.where(nan, 0.0, np.abs(v.astype(np.float64)))
    assert (a <= FMT_MAX[fmt]).all(), fmt
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, len(vals) - 1)
    lo = np.clip(hi - 1, 0, len(vals) - 1)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (codes[lo] % 2 == 0))
    code = np.where(vals[hi] == a, codes[hi], np.where(pick_lo, codes[lo], codes[hi]))
    code = np.where(nan, 0x7F, code) | np.where(neg, 0x80, 0)
    return code.astype(np.uint8)


def decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    """FP8 bytes -> float64 values (NaN for NaN codes)."""
    vals, tcodes = _TABLES[fmt]
    lookup = {int(c): float(v) for c, v in zip(tcodes, vals)}
    out = []
    for c in np.asarray(codes).ravel().tolist():
        mag = lookup.get(c & 0x7F, math.nan)
        out.append(-mag if c & 0x80 else mag)
    return np.asarray(out)


def f32(x) -> np.float32:
    return np.float32(x)


def ref_amax(block: np.ndarray) -> np.float32:
    """max |x| ignoring NaN (CUDA fmaxf), 0 for an all-NaN or empty block."""
    a = np.abs(np.asarray(block, dtype=np.float32)).ravel()
    a = a[~np.isnan(a)]
    return f32(a.max()) if a.size else f32(0.0)


def ref_scale(amax, fmt: str, pow2: bool, eps: float, value_for_inf: float) -> np.float32:
    """TE compute_scale_from_amax, in numpy float32."""
    amax = f32(amax)
    if amax < f32(eps):
        amax = f32(eps)
    if math.isinf(amax) or amax == 0 or math.isnan(amax):
        return f32(1.0)
    with np.errstate(over="ignore"):
        scale = f32(FMT_MAX[fmt]) / amax
    if math.isinf(scale):
        scale = f32(value_for_inf)
    if pow2:
        mant, exp = math.frexp(float(scale))  # scale = mant * 2^exp, mant in [0.5, 1)
        scale = f32(math.ldexp(0.5, exp))
    return scale


def ref_scale_inv(scale) -> np.float32:
    return f32(1.0) / f32(scale)


def ref_block_quantize(
    x: np.ndarray, block, fmt: str, pow2: bool, eps: float, value_for_inf: float
):
    """Tile by tile. ``x`` is ``[M, K]`` float32 (exact upcast of the input). Returns
    (bytes [M, K], scale_inv [ceil(M/bm), ceil(K/bn)])."""
    bm, bn = block
    m, k = x.shape
    mt, kt = -(-m // bm), -(-k // bn)
    data = np.zeros((m, k), dtype=np.uint8)
    sinv = np.zeros((mt, kt), dtype=np.float32)
    for i in range(mt):
        for j in range(kt):
            tile = x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            scale = ref_scale(ref_amax(tile), fmt, pow2, eps, value_for_inf)
            with np.errstate(over="ignore", invalid="ignore"):
                scaled = (tile.astype(np.float32) * scale).astype(np.float32)
            mx = FMT_MAX[fmt]
            scaled = np.where(np.isnan(scaled), scaled, np.clip(scaled, -mx, mx))
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            data[rows, cols] = ref_cast(scaled, fmt).reshape(tile.shape)
            sinv[i, j] = ref_scale_inv(scale)
    return data, sinv


def ref_tensor_quantize(x: np.ndarray, fmt: str, pow2: bool, eps: float, scale=None):
    """Per-tensor current scaling (FLT_MAX for an overflowing scale), or a given scale."""
    if scale is None:
        scale = ref_scale(ref_amax(x), fmt, pow2, eps, float(np.finfo(np.float32).max))
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (np.asarray(x, dtype=np.float32) * f32(scale)).astype(np.float32)
    mx = FMT_MAX[fmt]
    scaled = np.where(np.isnan(scaled), scaled, np.clip(scaled, -mx, mx))
    return ref_cast(scaled, fmt).reshape(np.shape(x)), ref_scale_inv(scale)


def ref_e8m0(amax, fmt: str) -> int:
    """Biased E8M0 exponent: the smallest e with 2^(e-127) >= amax * fp32(1/fp8_max),
    clamped to [0, 254]; NaN -> 255."""
    val = f32(amax) * f32(1.0 / FMT_MAX[fmt])
    if math.isnan(val):
        return 255
    if math.isinf(val):
        return 254
    if val == 0:
        return 0
    mant, exp = math.frexp(float(val))
    unbiased = exp - 1 if mant == 0.5 else exp
    return int(min(max(unbiased + 127, 0), 254))


def ref_mx_multiplier(e: int) -> float:
    """TE's ``ptx::exp2f_rcp`` since TE PR 2647 (NUMERICS.md; TE 2.20.2): 2^(127 - e) for
    every byte 0..254 (byte 0 -> 2^127, byte 254 -> 2^-127), NaN for 255."""
    if e == 255:
        return math.nan
    return 2.0 ** (127 - e)


def ref_mx_quantize(x: np.ndarray, block, fmt: str):
    """MXFP8, tile by tile on ``[M, K]`` float32. Returns (bytes, e8m0 bytes)."""
    bm, bn = block
    m, k = x.shape
    mt, kt = -(-m // bm), -(-k // bn)
    data = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((mt, kt), dtype=np.uint8)
    for i in range(mt):
        for j in range(kt):
            tile = x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            e = ref_e8m0(ref_amax(tile), fmt)
            with np.errstate(over="ignore", invalid="ignore"):
                scaled = (tile.astype(np.float32) * f32(ref_mx_multiplier(e))).astype(np.float32)
            mx = FMT_MAX[fmt]
            scaled = np.where(np.isnan(scaled), scaled, np.clip(scaled, -mx, mx))
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            data[rows, cols] = ref_cast(scaled, fmt).reshape(tile.shape)
            scales[i, j] = e
    return data, scales


class RefDelayedState:
    """TE kernel_bulk, written as the loop it is in CUDA (one thread per history slot)."""

    def __init__(self, length: int, algo: str, margin: int, fmt: str):
        self.hist = [f32(0.0)] * length
        self.scale = f32(1.0)
        self.algo = algo
        self.scaled_max = f32(FMT_MAX[fmt]) * f32(2.0**-margin)

    def record(self, amax) -> None:
        a = f32(amax)
        if not math.isnan(a) and (a > self.hist[0] or math.isnan(self.hist[0])):
            self.hist[0] = a

    def update(self) -> None:
        length = len(self.hist)
        last = self.hist[0]
        amax = f32(0.0)
        if last != 0:
            new = []
            for i in range(length):
                a = self.hist[i + 1] if i < length - 1 else last
                amax = a if math.isnan(amax) or (not math.isnan(a) and a > amax) else amax
                new.append(a if i > 0 else f32(0.0))
            self.hist = new
        if self.algo == "most_recent":
            amax = last
        if math.isfinite(amax) and amax > 0:
            with np.errstate(over="ignore"):
                scale = self.scaled_max / f32(amax)
        else:
            scale = self.scale
        if math.isinf(scale):
            scale = f32(np.finfo(np.float32).max)
        self.scale = f32(scale)

    @property
    def scale_inv(self) -> np.float32:
        return f32(1.0) / self.scale


# --------------------------------------------------------------------------- tests of the reference


@pytest.mark.parametrize(
    "fmt,count,maximum,min_sub", [("e4m3", 127, 448.0, 2.0**-9), ("e5m2", 124, 57344.0, 2.0**-16)]
)
def test_table_matches_format_facts(fmt, count, maximum, min_sub):
    vals, codes = fp8_table(fmt)
    assert len(vals) == count
    assert vals[-1] == maximum and vals[0] == 0.0 and vals[1] == min_sub


def test_cast_rounds_to_nearest_even():
    # E4M3 between 8 and 16 the spacing is 1: 8.5 ties to 8 (even code), 9.5 to 10
    assert decode(ref_cast(np.float32([8.5, 9.5, 15.5, -0.0]), "e4m3"), "e4m3").tolist() == [
        8.0,
        10.0,
        16.0,
        -0.0,
    ]


def test_scale_from_amax_edge_cases():
    big = float(np.finfo(np.float32).max)
    assert ref_scale(0.0, "e4m3", False, 0.0, big) == 1.0
    assert ref_scale(math.inf, "e4m3", False, 0.0, big) == 1.0
    assert ref_scale(448.0, "e4m3", False, 0.0, big) == 1.0
    assert ref_scale(1e-38, "e4m3", False, 0.0, 123.0) == f32(123.0)
    assert ref_scale(3.0, "e4m3", True, 0.0, big) == 128.0  # 149.33 rounded down


@pytest.mark.parametrize(
    "e,want", [(0, 2.0**127), (1, 2.0**126), (127, 1.0), (253, 2.0**-126), (254, 2.0**-127)]
)
def test_mx_multiplier_is_exp2f_rcp(e, want):
    # NUMERICS.md: byte 0 gives 2^127 (no special case), 0xFE gives 2^-127 (not 0)
    assert ref_mx_multiplier(e) == want and np.float32(want) == want
    assert math.isnan(ref_mx_multiplier(255))


def test_e8m0_rounds_up():
    assert ref_e8m0(448.0, "e4m3") == 127  # exactly 2^0
    assert ref_e8m0(449.0, "e4m3") == 128  # any mantissa bit rounds up
    assert ref_e8m0(0.0, "e4m3") == 0
    assert ref_e8m0(math.inf, "e4m3") == 254
