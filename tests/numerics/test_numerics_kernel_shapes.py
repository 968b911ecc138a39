"""Every C++ kernel (numerics/_cpu_kernels.cpp) against the eager reference over shapes:
partial tiles at every residue and tile counts per row at every residue mod 8 (the AVX2
code handles 8 blocks or 8 columns at a time, so a tail of each length is its own path).

Two kinds of test: deterministic sweeps that visit every residue (the MXFP8 1x32 vector
path, whose partial last block must be left to the scalar path: K=249 and K=1017 have
8 and 32 blocks per row, a multiple of 8, with a partial last one), and hypothesis
property tests over random shapes for every kernel (1x128, 128x128, MXFP8 1x32 rows and
32x1 columns, per tensor, NVFP4, the fake quantizers). Comparisons are on raw bytes
(``torch.equal``), and each test counts the library's calls so that it cannot be the
eager path compared with itself. scripts/sanitize_kernels.sh runs this file against the
AddressSanitizer + UBSan build, where a read or write past a row aborts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_numerics_kernels import edge_values

from nemo_fp8_plugin.numerics import _cpu
from nemo_fp8_plugin.numerics import fused as F
from nemo_fp8_plugin.numerics import nvfp4 as N
from nemo_fp8_plugin.numerics import quantize as Q
from nemo_fp8_plugin.numerics.reference import (
    quantize_blockwise_reference,
    quantize_mxfp8_reference,
    quantize_per_tensor_reference,
    quantize_with_scale_reference,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PROPERTY = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,  # the same shapes on every run: a CI failure reproduces locally
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module", params=["simd", "portable"])
def lib(request, tmp_path_factory):
    """Each build of the library (the sanitized one under scripts/sanitize_kernels.sh)."""
    simd = request.param == "simd"
    if simd and not {"avx2", "f16c"} <= _cpu._cpu_flags():
        pytest.skip("this CPU has no AVX2/F16C; the portable build is checked")
    return _cpu.load(simd=simd, directory=tmp_path_factory.mktemp(request.param))


@pytest.fixture
def use(lib, monkeypatch):
    """Route the public quantizers and fake quantizers through ``lib`` from the first
    element; yields the list of the library calls made."""
    monkeypatch.setitem(_cpu._state, "lib", lib)
    monkeypatch.setitem(_cpu._state, "tried", True)
    monkeypatch.setitem(Q._MIN_NUMEL, "value", 1)
    monkeypatch.delenv("NEMO_FP8_CPU_KERNEL", raising=False)
    calls: list[str] = []
    names = ("tiles", "amax", "scaled_cast", "fake_quant_tiles", "fake_quant_scaled", "nvfp4")
    for name in names:
        real = getattr(lib, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(lib, name, spy)
    with F.fused_mode(True):
        yield calls


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:
        return t.contiguous().view(torch.uint8)
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bytes, except that a NaN's sign bit is not compared: the eager reference's
    own NaN sign depends on where torch's loops put the element (vector body or scalar
    tail: the same -NaN input gives 0x7F in one row of a 3x25 tensor and 0xFF alone)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype in (torch.float32, torch.float16, torch.bfloat16) or got.element_size() == 1:
        nan = torch.isnan(want.float()) if got.dtype != torch.uint8 else None
        if nan is not None and bool(nan.any()):
            assert torch.equal(torch.isnan(got.float()), nan)
            got, want = got[~nan], want[~nan]
    assert torch.equal(_bytes(got), _bytes(want))


def same_q(got, want) -> None:
    same(got.data, want.data)
    same(got.scale_inv, want.scale_inv)


def extent(tiles: int, residue: int, tile: int) -> int:
    """A length of ``tiles`` tiles of ``tile`` whose last tile holds ``residue`` elements
    (0: a full last tile)."""
    return (tiles - 1) * tile + (residue or tile)


def values(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return edge_values(m * k, dtype, seed).reshape(m, k)


# ---------------------------------------------------------------- deterministic sweeps


@pytest.mark.parametrize("k", [249, 1017, 25, 257, 255])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_rows_partial_last_block_after_groups_of_eight(use, k, dtype):
    """K=249 (8 blocks) and K=1017 (32 blocks): a partial last block where the number of
    blocks per row is a multiple of 8. Several rows, so a vector path that ran past a row
    would overwrite the next row's first codes; one row, so it would leave the tensor."""
    for fmt in ("e4m3", "e5m2"):
        for m in (1, 3, 7):
            x = values(m, k, dtype, k + m)
            same_q(Q.quantize_mxfp8(x, 32, fmt), quantize_mxfp8_reference(x, 32, fmt))
            got = F.fake_quant_mxfp8(x, (1, 32), fmt)
            same(got, quantize_mxfp8_reference(x, (1, 32), fmt).dequantize())
    assert use.count("tiles") == use.count("fake_quant_tiles") == 6


def test_mxfp8_rows_every_residue_and_block_count_mod_8(use):
    n = 0
    for blocks in range(1, 17):  # 1..16: every residue mod 8, twice
        for residue in range(32):
            k = extent(blocks, residue, 32)
            x = values(2, k, torch.bfloat16, 100 * blocks + residue)
            same_q(Q.quantize_mxfp8(x), quantize_mxfp8_reference(x))
            n += 1
    assert use.count("tiles") == n


def test_nvfp4_every_block_count_mod_8(use):
    for blocks in range(1, 17):
        for m in (1, 5, 16, 17):
            x = values(m, 16 * blocks, torch.float32, blocks * 31 + m).clamp(-3e4, 3e4)
            x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
            for block in N.NVFP4_BLOCKS:
                got = N.quantize_nvfp4(x, block)
                want = N.quantize_nvfp4_reference(x, block)
                same(got.data, want.data)
                same(got.scale_inv, want.scale_inv)
    assert use.count("nvfp4") == 16 * 4 * len(N.NVFP4_BLOCKS)


# ---------------------------------------------------------------- property tests

dtypes = st.sampled_from(DTYPES)
fmts = st.sampled_from(("e4m3", "e5m2"))


@PROPERTY
@given(
    rows=st.integers(1, 3),
    blocks=st.integers(1, 17),
    residue=st.integers(0, 127),
    dtype=dtypes,
    fmt=fmts,
    pow2=st.booleans(),
)
def test_block_1x128_property(use, rows, blocks, residue, dtype, fmt, pow2):
    use.clear()  # one fixture for all of hypothesis's examples: count this one's calls
    x = values(rows, extent(blocks, residue, 128), dtype, blocks * 128 + residue)
    want = quantize_blockwise_reference(x, (1, 128), fmt, pow2)
    same_q(Q.quantize_blockwise(x, (1, 128), fmt, pow2), want)
    same(F.fake_quant_blockwise(x, (1, 128), fmt, pow2), want.dequantize())
    got = F.fake_quant_blockwise(x, (128, 1), fmt, pow2)  # the column-wise copy
    same(got, quantize_blockwise_reference(x, (128, 1), fmt, pow2).dequantize())
    assert use.count("tiles") == 1 and use.count("fake_quant_tiles") == 2


@PROPERTY
@given(
    row_tiles=st.integers(1, 3),
    row_residue=st.integers(0, 127),
    blocks=st.integers(1, 9),
    residue=st.integers(0, 127),
    dtype=dtypes,
)
def test_block_128x128_property(use, row_tiles, row_residue, blocks, residue, dtype):
    use.clear()
    m, k = extent(row_tiles, row_residue, 128), extent(blocks, residue, 128)
    x = values(m, k, dtype, m * 7 + k)
    want = quantize_blockwise_reference(x, (128, 128), "e4m3", False, 1e-3)
    same_q(Q.quantize_blockwise(x, (128, 128), "e4m3", False, 1e-3), want)
    same(F.fake_quant_blockwise(x, (128, 128), "e4m3", False, 1e-3), want.dequantize())
    assert use.count("tiles") == 1 and use.count("fake_quant_tiles") == 1


@PROPERTY
@given(
    rows=st.integers(1, 40),
    blocks=st.integers(1, 33),
    residue=st.integers(0, 31),
    dtype=dtypes,
    fmt=fmts,
)
@example(rows=1, blocks=8, residue=25, dtype=torch.bfloat16, fmt="e4m3")  # K=249
@example(rows=2, blocks=32, residue=25, dtype=torch.float32, fmt="e4m3")  # K=1017
def test_mxfp8_rows_and_columns_property(use, rows, blocks, residue, dtype, fmt):
    use.clear()
    x = values(rows, extent(blocks, residue, 32), dtype, rows * 40 + blocks + residue)
    want = quantize_mxfp8_reference(x, (1, 32), fmt)
    same_q(Q.quantize_mxfp8(x, (1, 32), fmt), want)
    same(F.fake_quant_mxfp8(x, (1, 32), fmt), want.dequantize())
    # columns: 32x1 blocks down the rows; the row count's residue is the partial block,
    # the column count's residue mod 8 the vector tail
    xt = x.t().contiguous()
    got = F.fake_quant_mxfp8(xt, (32, 1), fmt)
    same(got, quantize_mxfp8_reference(xt, (32, 1), fmt).dequantize())
    same_q(Q.quantize_mxfp8(x, (32, 32), fmt), quantize_mxfp8_reference(x, (32, 32), fmt))
    assert use.count("tiles") == 2 and use.count("fake_quant_tiles") == 2


@PROPERTY
@given(numel=st.integers(1, 5000), dtype=dtypes, fmt=fmts, pow2=st.booleans())
def test_per_tensor_and_given_scale_property(use, numel, dtype, fmt, pow2):
    use.clear()
    x = edge_values(numel, dtype, numel)
    want = quantize_per_tensor_reference(x, fmt, pow2)
    same_q(Q.quantize_per_tensor(x, fmt, pow2), want)
    same(F.fake_quant_per_tensor(x, fmt, pow2), want.dequantize())
    scale = torch.tensor(3.5)
    same_q(Q.quantize_with_scale(x, scale, fmt), quantize_with_scale_reference(x, scale, fmt))
    deq, _ = F.fake_quant_with_scale(x, scale, torch.ones(()) / scale, fmt)
    ref = quantize_with_scale_reference(x, scale, fmt, scale_inv=torch.ones(()) / scale)
    same(deq, ref.dequantize())
    assert use.count("scaled_cast") == 2 and use.count("fake_quant_scaled") == 2


@PROPERTY
@given(
    rows=st.integers(1, 40),
    blocks=st.integers(1, 17),
    dtype=dtypes,
    block=st.sampled_from(N.NVFP4_BLOCKS),
    stochastic=st.booleans(),
)
def test_nvfp4_property(use, rows, blocks, dtype, block, stochastic):
    use.clear()
    x = values(rows, 16 * blocks, dtype, rows * 17 + blocks).float().clamp(-3e4, 3e4)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x)).to(dtype)
    kw = dict(stochastic=stochastic)
    got = N.quantize_nvfp4(x, block, generator=torch.Generator().manual_seed(1), **kw)
    want = N.quantize_nvfp4_reference(x, block, generator=torch.Generator().manual_seed(1), **kw)
    same(got.data, want.data)
    same(got.scale_inv, want.scale_inv)
    fq = N.fake_quant_nvfp4(x, block, generator=torch.Generator().manual_seed(2), **kw)
    ref = N.quantize_nvfp4_reference(x, block, generator=torch.Generator().manual_seed(2), **kw)
    same(fq, N.dequantize_nvfp4(ref, torch.float32))
    assert use.count("nvfp4") == 2
