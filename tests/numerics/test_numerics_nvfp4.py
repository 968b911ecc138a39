"""NVFP4 numerics (``nemo_fp8_plugin.numerics.nvfp4``) bit-exact against Transformer Engine.

The oracle is TE 2.20.2's own pure-PyTorch NVFP4 reference,
``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``, the real file extracted from
the TE wheel that ``scripts/install.sh test`` downloads (never installed). Data bytes, E4M3
scale bytes and the global amax are compared bit for bit (``torch.equal`` on the raw bytes,
so NaN scales compare too; atol = rtol = 0) for 1x16 groups and 16x16 tiles, float32 /
bfloat16 / float16 inputs, with and without the random Hadamard transform, on seeded random
tensors and on adversarial ones: every E2M1 rounding threshold and tie and its neighbours,
E4M3 scale-rounding ties, zeros and -0.0, all-zero groups and tiles, huge values and dtype
maxima, subnormals (inputs and E4M3 scales), scales that underflow to 0, NaN, +-inf, and a
given global amax (exact, too small, too large, 0, inf).

Stochastic rounding has no reference in that file (it is a TE kernel feature): its scales
are checked bit-exact against the reference's (SR changes no scale), every code against its
two E2M1 neighbours, its mean statistically (unbiased over many draws from a seeded
generator, while round-to-nearest is measurably biased on the same data), and its
determinism given the generator.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib.util
import math
import sys
import types

import pytest
import torch

from conftest import upstream_file
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics.nvfp4 import (
    E2M1_VALUES,
    RHT_SIGNS,
    NVFP4Tensor,
    dequantize_nvfp4,
    pack_e2m1,
    quantize_nvfp4,
    rht_matrix,
    unpack_e2m1,
)

TE_WHEEL = "transformer_engine-2.20.2-*.whl"
REF_MEMBER = "transformer_engine/pytorch/custom_recipes/reference_nvfp4.py"
UTILS_MEMBER = "transformer_engine/pytorch/custom_recipes/reference_utils.py"
TENSOR_MEMBER = "transformer_engine/pytorch/tensor/nvfp4_tensor.py"

BLOCKS = [(1, 16), (16, 16)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLT_MAX = torch.finfo(torch.float32).max


# --------------------------------------------------------------------------- the oracle


@pytest.fixture(scope="module")
def te_ref(tmp_path_factory):
    """TE 2.20.2's ``reference_nvfp4.py``, the real file, loaded by path.

    Why stubs: importing it the normal way runs ``transformer_engine/__init__.py`` and
    ``transformer_engine.pytorch``, which load TE's compiled CUDA library (not installable
    here, and never pip-installed by this project). The file itself needs only torch once the
    names it imports exist: the two base classes it subclasses (``Quantizer``,
    ``QuantizedTensorStorage`` from ``transformer_engine.pytorch.quantized_tensor``; only
    ``Quantizer.__init__``'s ``rowwise_usage`` / ``columnwise_usage`` are used on the
    quantize path), and ``custom_recipes.gemm``'s ``GEMMType`` / ``MMParams`` (read by its
    ``qgemm`` signature at class creation). Those are stand-in modules placed in
    ``sys.modules`` only while the file loads, then removed again (whatever was there is
    restored). ``reference_utils.py`` is torch-only and is loaded for real from the wheel.
    """
    dest = tmp_path_factory.mktemp("te_nvfp4")
    ref_path = upstream_file(TE_WHEEL, REF_MEMBER, dest)
    utils_path = upstream_file(TE_WHEEL, UTILS_MEMBER, dest)

    def package(name):
        mod = types.ModuleType(name)
        mod.__path__ = []
        return mod

    te = package("transformer_engine")
    te_pt = package("transformer_engine.pytorch")
    recipes = package("transformer_engine.pytorch.custom_recipes")

    qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")

    class QuantizedTensorStorage:  # stand-in base class
        pass

    class Quantizer:  # stand-in base class: what TE's __init__ sets that the file reads
        def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
            self.rowwise_usage = rowwise
            self.columnwise_usage = columnwise
            self.internal = False

    qt.QuantizedTensorStorage = QuantizedTensorStorage
    qt.Quantizer = Quantizer

    gemm = types.ModuleType("transformer_engine.pytorch.custom_recipes.gemm")

    class GEMMType(enum.Enum):
        FPROP = "fprop"
        DGRAD = "dgrad"
        WGRAD = "wgrad"

    @dataclasses.dataclass(frozen=True)
    class MMParams:
        out_dtype: torch.dtype | None = None

    gemm.GEMMType, gemm.MMParams = GEMMType, MMParams

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    names = [
        "transformer_engine",
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.custom_recipes",
        "transformer_engine.pytorch.quantized_tensor",
        "transformer_engine.pytorch.custom_recipes.gemm",
        "transformer_engine.pytorch.custom_recipes.reference_utils",
        "te_reference_nvfp4_under_test",
    ]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        sys.modules.update(
            {
                "transformer_engine": te,
                "transformer_engine.pytorch": te_pt,
                "transformer_engine.pytorch.custom_recipes": recipes,
                "transformer_engine.pytorch.quantized_tensor": qt,
                "transformer_engine.pytorch.custom_recipes.gemm": gemm,
            }
        )
        te.pytorch, te_pt.custom_recipes, te_pt.quantized_tensor = te_pt, recipes, qt
        recipes.gemm = gemm
        recipes.reference_utils = load(names[5], utils_path)
        module = load(names[6], ref_path)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    assert module.NVFP4QuantizerRef.__mro__[1] is Quantizer  # the real class over the stub
    return module


def ref_quantize(te_ref, x: torch.Tensor, block, *, rht: bool = False, global_amax=None):
    """(data, scale, global_amax) of TE's reference for ``quantize_nvfp4(x, block, rht=rht)``.

    Without a given amax: the reference's public ``quantize``. Row-wise for plain
    quantization; with RHT its column-wise path (TE transforms the wgrad copy), fed ``x.t()``
    so that the tensor it transforms and quantizes is ``x``. With a given amax: its
    ``_quantize_blockwise_reference`` (where ``quantize`` would compute the amax), after its
    own padding. The 16x16 scale comes back one row per data row; it is checked to repeat
    over each tile's 16 rows and reduced to one row per tile."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if global_amax is None:
        quantizer = te_ref.NVFP4QuantizerRef(
            dtype=te_ref.reference_utils.Fp4Formats.E2M1,
            rowwise=not rht,
            columnwise=rht,
            quant_tile_shape=block,
            with_rht=rht,
        )
        if rht:
            r = quantizer.quantize(rows.t())
            data, scale, amax = r.data_t, r.scale_t, r.global_amax_col
        else:
            r = quantizer.quantize(x)
            data, scale, amax = r.data, r.scale, r.global_amax_row
    else:
        assert not rht
        amax = torch.as_tensor(global_amax, dtype=torch.float32).reshape(1)
        cls = te_ref.NVFP4QuantizerRef
        padded = cls._pad_tensor(rows, row_divisor=block[0], col_divisor=block[1])
        data, scale = cls._quantize_blockwise_reference(
            padded, amax, block[1], block[0], pow_2_scales=False, eps=0.0
        )
        data = data[:m]
    if block == (16, 16):
        tiles = scale[::16]
        assert torch.equal(
            scale.view(torch.uint8), tiles.repeat_interleave(16, dim=0).view(torch.uint8)
        )
        scale = tiles
    return data, scale, amax.reshape(())


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor (NaN-safe equality)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(q: NVFP4Tensor, ref) -> None:
    data, scale, amax = ref
    assert q.data.dtype == torch.uint8 and q.scale_inv.dtype == torch.float8_e4m3fn
    assert q.global_amax.dtype == torch.float32 and q.global_amax.shape == ()
    assert q.data.shape == data.shape and q.scale_inv.shape == scale.shape
    diff = (q.data != data).nonzero()
    assert diff.numel() == 0, f"{len(diff)} data bytes differ, first at {diff[:4].tolist()}"
    assert_same_scales(q, scale, amax)


def assert_same_scales(q: NVFP4Tensor, scale: torch.Tensor, amax: torch.Tensor) -> None:
    # A NaN's sign bit is not part of the contract: the reference's NaN scale bytes are 0xFF
    # or 0x7F depending on where the element falls in torch's CPU SIMD vectors (its
    # torch.min / clamp blend NaN lanes to all-ones bits; the scalar tail keeps 0x7FC00000),
    # and its global amax NaN is 0xFFFFFFFF from torch.max's reduction. Both are NaN; this
    # module writes the canonical positive NaN. Every other byte is compared bit for bit.
    ref_nan = torch.isnan(scale.float())
    assert torch.equal(torch.isnan(q.scale_inv.float()), ref_nan)
    assert (bits(q.scale_inv)[ref_nan.reshape(-1)] == 0x7F).all()
    sdiff = ((bits(q.scale_inv) != bits(scale)) & ~ref_nan.reshape(-1)).nonzero()
    assert sdiff.numel() == 0, f"{len(sdiff)} scales differ, first (flat) at {sdiff[:4].tolist()}"
    if torch.isnan(amax):
        assert torch.isnan(q.global_amax)
    else:
        assert torch.equal(bits(q.global_amax), bits(amax.float()))


# --------------------------------------------------------------------------- inputs


def _ulps(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` and their nearest neighbours up and down in ``dtype`` (fp32 tensor)."""
    v = values.to(dtype)
    fi = torch.finfo(dtype)
    exp = torch.floor(torch.log2(v.float().abs().clamp(min=fi.tiny)))
    ulp = torch.exp2(exp) * fi.eps
    up, down = (v.float() + ulp).to(dtype), (v.float() - ulp / 2).to(dtype)
    return torch.cat([v, up, down]).float()


def _threshold_pool(dtype) -> torch.Tensor:
    """E2M1 grid values, rounding boundaries (ties), and their neighbours in ``dtype``,
    both signs, and signed zeros: what a scale of exactly 1 puts on the E2M1 thresholds."""
    grid = torch.tensor([v for v in E2M1_VALUES if v > 0])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    pos = _ulps(torch.cat([grid, ties, torch.tensor([0.125, 5.5, 5.9375])]), dtype)
    pos = pos[(pos > 0) & (pos <= 6)]
    return torch.cat([pos, -pos, torch.tensor([0.0, -0.0])])


def make_input(case: str, dtype: torch.dtype, shape=(48, 64), seed: int = 0) -> torch.Tensor:
    """A seeded input (built in fp32, rounded to ``dtype`` once)."""
    g = torch.Generator().manual_seed(seed)
    m, k = math.prod(shape[:-1]), shape[-1]
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    x = torch.randn(m, k, generator=g) * 3
    if case == "randn":
        pass
    elif case == "heavy_tail":  # wide dynamic range inside groups and across them
        x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 3)
    elif case in ("thresholds", "thresholds_pow2"):
        # Global amax exactly 448 * 6 -> global scales exactly 1; a group / tile whose amax is
        # 6 * 2^j gets the decode scale 2^j exactly, so its elements are scaled exactly onto
        # the pool: E2M1 values, ties and their neighbours. pow2 varies j over the E4M3
        # normal and subnormal range (j = -9 is E4M3's smallest subnormal).
        pool = _threshold_pool(dtype)
        idx = torch.randint(0, len(pool), (m, k), generator=g)
        x = pool[idx].clone()
        x[:, ::16] = 6.0
        x[0, 0] = 2688.0
        if case == "thresholds_pow2":
            js = torch.arange(-9, 7)
            tile_j = js[torch.randint(0, len(js), (-(-m // 16), k // 16), generator=g)]
            factor = torch.exp2(tile_j.float()).repeat_interleave(16, 0)[:m]
            x = x * factor.repeat_interleave(16, 1)
            x[0, :16] = 0.0
            x[0, 0] = 2688.0
    elif case == "scale_ties":
        # Group amaxes at 6 * (E4M3 midpoints) and their neighbours, global scale 1: the E4M3
        # rounding of the decode scale lands on (or next to) a tie; also 448+ clamping.
        e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (e4m3[1:] + e4m3[:-1]) / 2
        amaxes = _ulps(torch.cat([mids, e4m3[1:]]) * 6, torch.float32)
        amaxes = amaxes[amaxes <= 2688.0].to(dtype).float()
        groups = amaxes[torch.randint(0, len(amaxes), (m, k // 16), generator=g)]
        x = (torch.rand(m, k, generator=g) * 2 - 1) * groups.repeat_interleave(16, 1)
        x[:, ::16] = groups
        x[0, 0] = 2688.0
    elif case == "thresholds_global":
        # Inexact global scale: each group / tile gets a chosen E4M3 decode scale s (its max
        # is s / multiplier), and the other elements sit within an ulp of tie / multiplier,
        # where multiplier = 1 / (s * global_decode): the order of TE's roundings of the
        # element multiplier decides the E2M1 code.
        gamax = torch.tensor(1392.0)
        enc = torch.tensor(2688.0) / gamax
        mult = enc * (torch.tensor(1.0) / torch.tensor(6.0))
        codes = torch.randint(0x20, 0x60, (-(-m // 16), k // 16), generator=g, dtype=torch.uint8)
        sc = codes.view(torch.float8_e4m3fn).float().repeat_interleave(16, 0)[:m]
        elem = (torch.tensor(1.0) / (sc * (torch.tensor(1.0) / enc))).repeat_interleave(16, 1)
        pool = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 4.0])
        t = pool[torch.randint(0, len(pool), (m, k), generator=g)]
        t = t * (torch.randint(0, 2, (m, k), generator=g) * 2 - 1)
        x = (t / elem).to(dtype).float()
        fi = torch.finfo(dtype)
        ulp = torch.exp2(torch.floor(torch.log2(x.abs()))) * fi.eps
        x = x + ulp * torch.randint(-1, 2, (m, k), generator=g)
        x[:, ::16] = (sc / mult).repeat_interleave(16, 1)[:, ::16]
        x[0, 0] = gamax
    elif case == "scale_ties_global":
        # The same with an inexact global scale: group amaxes whose product with the fp32
        # multiplier (448 * 6 / amax) * fp32(1/6) lands on or a few ulps around an E4M3
        # midpoint, so the order of TE's roundings decides the E4M3 scale.
        # 1392 (exact in every input dtype) is a global amax for which
        # fl(fl(2688 / 1392) * fl(1/6)) != fl(fl(2688 / 1392) / 6).
        gamax = torch.tensor(1392.0)
        enc = torch.tensor(2688.0) / gamax
        mult = enc * (torch.tensor(1.0) / torch.tensor(6.0))
        assert mult != enc / torch.tensor(6.0)
        e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (e4m3[1:] + e4m3[:-1]) / 2
        base = (mids / mult).to(dtype).float()
        amaxes = (
            torch.cat(
                [base] + [torch.nextafter(base, torch.full_like(base, d * 1e30)) for d in (1, -1)]
            )
            .to(dtype)
            .float()
        )
        amaxes = amaxes[(amaxes > 0) & (amaxes <= gamax)]
        groups = amaxes[torch.randint(0, len(amaxes), (m, k // 16), generator=g)]
        x = (torch.rand(m, k, generator=g) * 2 - 1) * groups.repeat_interleave(16, 1)
        x[:, ::16] = groups
        x[0, 0] = gamax
    elif case == "zeros":
        x = torch.zeros(m, k)
    elif case == "neg_zeros":
        x = -torch.zeros(m, k)
        x[1, 3] = 1.0
    elif case == "zero_groups":
        x[:, 16:32] = 0.0
        x[16:32, :] = -0.0
        x[5, 40:48] = 0.0
    elif case == "huge":
        x = x * (big / 8)
        x[3, 5] = big
        x[7, 9] = -big
    elif case == "huge_and_tiny":
        # Groups whose decode scale underflows to 0 next to a huge global amax.
        x[:, :16] = big
        x[:, 16:32] *= tiny
        x[:, 32:48] *= 1e-30 if dtype != torch.float16 else 1e-6
    elif case == "subnormal":
        sub = tiny * torch.finfo(dtype).eps
        x = torch.randint(-8, 9, (m, k), generator=g).float() * sub
        x[2, :] = torch.randn(k, generator=g) * tiny
    elif case == "e4m3_subnormal_scales":
        x = x * torch.exp2(-torch.arange(k // 16).float() * 2.5).repeat_interleave(16)
        x[0, 0] = 1e4 if dtype != torch.float16 else 6e4
    elif case == "nan":
        x[4, 17] = float("nan")
    elif case == "nan_only":
        x = torch.full((m, k), float("nan"))
    elif case == "inf":
        x[6, 3] = float("inf")
    elif case == "neg_inf":
        x[9, 33] = float("-inf")
        x[30, 2] = float("inf")
    elif case == "nan_inf":
        x[6, 3] = float("inf")
        x[20, 50] = float("nan")
    else:
        raise AssertionError(case)
    return x.reshape(*shape[:-1], k).to(dtype)


CASES = [
    "randn",
    "heavy_tail",
    "thresholds",
    "thresholds_pow2",
    "thresholds_global",
    "scale_ties",
    "scale_ties_global",
    "zeros",
    "neg_zeros",
    "zero_groups",
    "huge",
    "huge_and_tiny",
    "subnormal",
    "e4m3_subnormal_scales",
    "nan",
    "nan_only",
    "inf",
    "neg_inf",
    "nan_inf",
]


# --------------------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
def test_bit_exact_with_te_reference(te_ref, case, dtype, block):
    x = make_input(case, dtype)
    assert_bit_exact(quantize_nvfp4(x, block), ref_quantize(te_ref, x, block))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
def test_bit_exact_with_rht(te_ref, case, dtype, block):
    """RHT on: TE's reference transforms (in the input dtype) and quantizes its column-wise
    copy; the amax is taken after the transform."""
    x = make_input(case, dtype)
    q = quantize_nvfp4(x, block, rht=True)
    assert q.rht
    assert_bit_exact(q, ref_quantize(te_ref, x, block, rht=True))


@pytest.mark.parametrize("shape", [(40, 64), (17, 32), (2, 24, 48), (3, 16, 16), (1, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
def test_bit_exact_shapes(te_ref, shape, dtype, block):
    """Rows not a multiple of 16 (a zero-padded last tile for 16x16: scales
    ``[ceil(M/16), K/16]``) and leading dims flattened into rows, as TE does."""
    x = make_input("heavy_tail", dtype, shape=shape, seed=3)
    q = quantize_nvfp4(x, block)
    m = math.prod(shape[:-1])
    assert q.data.shape == (m, shape[-1] // 2)
    assert q.scale_inv.shape == (m if block == (1, 16) else -(-m // 16), shape[-1] // 16)
    assert q.shape == x.shape and q.dtype == dtype
    assert_bit_exact(q, ref_quantize(te_ref, x, block))


@pytest.mark.parametrize("amax", ["exact", "small", "large", 0.0, float("inf"), "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
def test_bit_exact_given_global_amax(te_ref, amax, dtype, block):
    """A given global amax (e.g. one reduced over a data-parallel group): too small clamps
    the decode scales at 448 and the elements at +-6; 0 and inf are TE's special cases."""
    x = make_input("heavy_tail", dtype, seed=5)
    true = x.float().abs().amax()
    given = {
        "exact": float(true),
        "small": float(true) / 50,
        "large": float(true) * 1e3,
        "tensor": torch.tensor([float(true) * 1.37]),
    }.get(amax, amax)
    q = quantize_nvfp4(x, block, global_amax=given)
    assert_bit_exact(q, ref_quantize(te_ref, x, block, global_amax=given))


def test_rht_matrix_and_signs_are_te_s(te_ref, tmp_path):
    """This module's own sign constants equal the reference's ``get_wgrad_sign_vector()`` and
    the one TE's production quantizer uses (``tensor/nvfp4_tensor.py``, read as source); its
    matrix equals the reference's ``_build_hadamard_matrix(...) / 4``; it is orthogonal."""
    assert list(RHT_SIGNS) == te_ref.get_wgrad_sign_vector().tolist()
    tree = ast.parse(upstream_file(TE_WHEEL, TENSOR_MEMBER, tmp_path).read_text())
    fn = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "get_wgrad_sign_vector"
    )
    literal = next(n for n in ast.walk(fn) if isinstance(n, ast.List))
    assert list(RHT_SIGNS) == ast.literal_eval(literal)
    for dtype in DTYPES:
        ref = (
            te_ref.NVFP4QuantizerRef._build_hadamard_matrix(16, torch.device("cpu"), dtype, True)
            * 0.25
        )
        assert torch.equal(rht_matrix(dtype), ref)
    r = rht_matrix()
    assert torch.equal(r @ r.T, torch.eye(16))


def test_e2m1_decode_matches_reference_for_every_byte(te_ref):
    every = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    ref = te_ref.cast_from_fp4x2(every, torch.float32)
    ours = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))[unpack_e2m1(every).long()]
    assert torch.equal(bits(ours), bits(ref))
    assert torch.equal(pack_e2m1(unpack_e2m1(every)), every)


@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
def test_dequantize(te_ref, block):
    """E2M1 value * (E4M3 decode * global decode), decoded with the reference's own
    ``cast_from_fp4x2``; ``undo_rht`` maps RHT-domain values back."""
    x = make_input("heavy_tail", torch.bfloat16, seed=7)
    q = quantize_nvfp4(x, block)
    values = te_ref.cast_from_fp4x2(q.data, torch.float32)
    factor = q.scale_inv.float() * (1.0 / q.global_encode_scale)
    if block == (16, 16):
        factor = factor.repeat_interleave(16, 0)
    expected = values * factor.repeat_interleave(16, 1)
    assert torch.equal(dequantize_nvfp4(q), expected)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    qr = quantize_nvfp4(x, block, rht=True)
    back = dequantize_nvfp4(qr, undo_rht=True)
    assert torch.allclose(
        back.reshape(-1, 16) @ rht_matrix(),
        dequantize_nvfp4(qr).reshape(-1, 16),
        atol=1e-5 * float(back.abs().max()),
        rtol=0,
    )


# --------------------------------------------------------------------------- SQNR


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(10 * torch.log10((x * x).sum() / ((x - y) ** 2).sum()))


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sqnr_floor(block, rht, dtype):
    """Gaussian data with 0.1% outliers (x20). Measured (torch 2.13 CPU, seeded): 1x16 20.7 dB
    (19.9 with RHT); 16x16 13.5 dB (one outlier raises a whole 256-element tile's scale),
    18.1 dB with RHT, which spreads outliers over 16 columns. The floors leave about 1.5 dB.
    Stochastic rounding costs about 3.4 dB (it trades error for unbiasedness)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 1024, generator=g)
    x[torch.rand(256, 1024, generator=g) < 1e-3] *= 20
    x = x.to(dtype)
    floor = {
        ((1, 16), False): 19.0,
        ((1, 16), True): 18.5,
        ((16, 16), False): 12.0,
        ((16, 16), True): 16.5,
    }[block, rht]
    q = quantize_nvfp4(x, block, rht=rht)
    assert sqnr_db(x, dequantize_nvfp4(q, undo_rht=True)) >= floor
    qs = quantize_nvfp4(
        x, block, rht=rht, stochastic=True, generator=torch.Generator().manual_seed(1)
    )
    assert sqnr_db(x, dequantize_nvfp4(qs, undo_rht=True)) >= floor - 4.5


# --------------------------------------------------------------------------- stochastic


GRID = torch.tensor(E2M1_VALUES)


def scaled_values(q: NVFP4Tensor, x: torch.Tensor) -> torch.Tensor:
    """The exact pre-rounding values: x times the element multiplier of its group, clamped."""
    m, k = q.data.shape[0], q.data.shape[1] * 2
    s = q.scale_inv.float()
    if q.block == (16, 16):
        s = s.repeat_interleave(16, 0)[:m]
    enc = torch.clamp(1.0 / (s * (1.0 / q.global_encode_scale)), max=FLT_MAX)
    return torch.clamp(x.reshape(m, k).float() * enc.repeat_interleave(16, 1), -6, 6)


def signed_values(q: NVFP4Tensor) -> torch.Tensor:
    lut = torch.cat([GRID, -GRID])
    return lut[unpack_e2m1(q.data).long()]


@pytest.mark.parametrize("case", ["randn", "thresholds", "heavy_tail", "zero_groups", "nan"])
@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
def test_stochastic_keeps_scales_and_picks_a_neighbour(te_ref, case, block):
    x = make_input(case, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    q = quantize_nvfp4(x, block, stochastic=True, generator=gen)
    ref_data, ref_scale, ref_amax = ref_quantize(te_ref, x, block)
    assert_same_scales(q, ref_scale, ref_amax)
    v = scaled_values(q, x)
    got = signed_values(q)
    a = v.abs()
    lo = GRID[(torch.bucketize(a, GRID, right=True) - 1).clamp(0, 7)]
    hi = GRID[torch.bucketize(a, GRID, right=False).clamp(0, 7)]
    ok = ~torch.isnan(v)
    assert ((got.abs() >= lo) & (got.abs() <= hi))[ok].all()
    on_grid = ok & (lo == a)
    assert torch.equal(got[on_grid].abs(), a[on_grid])  # exact values never move
    # signs: as round-to-nearest (a negative value rounding to 0 keeps its sign bit)
    assert torch.equal(unpack_e2m1(q.data) >> 3, unpack_e2m1(ref_data) >> 3)


@pytest.mark.parametrize("block", BLOCKS, ids=["1x16", "16x16"])
def test_stochastic_rounding_is_unbiased(block):
    """Every row holds the same 64 values and one global amax is given, so every row has the
    same scales: 16384 independent draws per value. The mean of the E2M1 values must match
    the exact scaled value within 5 standard errors (exact per element:
    ``gap * sqrt(p (1 - p) / n)``); round-to-nearest on the same data is far outside that."""
    g = torch.Generator().manual_seed(4)
    row = (torch.rand(1, 64, generator=g) * 2 - 1) * torch.tensor(
        [1.0, 0.3, 7.0, 0.01]
    ).repeat_interleave(16)
    n = 16384
    x = row.expand(n, 64).contiguous()
    amax = float(row.abs().max())
    q = quantize_nvfp4(
        x, block, global_amax=amax, stochastic=True, generator=torch.Generator().manual_seed(9)
    )
    v = scaled_values(q, x)
    assert torch.equal(v, v[:1].expand_as(v))
    target = v[0].double()
    mean = signed_values(q).double().mean(dim=0)
    a = target.abs()
    lo = GRID.double()[(torch.bucketize(a, GRID.double(), right=True) - 1).clamp(0, 7)]
    hi = GRID.double()[(torch.bucketize(a, GRID.double(), right=True)).clamp(0, 7)]
    gap = hi - lo
    p = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, 1), 0)
    se = gap * torch.sqrt(p * (1 - p) / n)
    err = (mean - target).abs()
    assert (err <= 5 * se + 1e-12).all(), float((err / (se + 1e-30)).max())
    assert float((mean - target).mean().abs()) < 2e-3  # no net drift over the 64 values
    rn = signed_values(quantize_nvfp4(x[:1], block, global_amax=amax))[0].double()
    assert int(((rn - target).abs() > 5 * se + 1e-12).sum()) > 32  # RN is biased here


def test_stochastic_rounding_is_deterministic_given_the_generator():
    x = make_input("randn", torch.float32)
    a = quantize_nvfp4(x, stochastic=True, generator=torch.Generator().manual_seed(123))
    b = quantize_nvfp4(x, stochastic=True, generator=torch.Generator().manual_seed(123))
    c = quantize_nvfp4(x, stochastic=True, generator=torch.Generator().manual_seed(124))
    assert torch.equal(a.data, b.data) and torch.equal(bits(a.scale_inv), bits(b.scale_inv))
    assert not torch.equal(a.data, c.data)
    gen = torch.Generator().manual_seed(123)
    first = quantize_nvfp4(x, stochastic=True, generator=gen)
    second = quantize_nvfp4(x, stochastic=True, generator=gen)  # the state advanced
    assert torch.equal(first.data, a.data) and not torch.equal(second.data, a.data)
    torch.manual_seed(5)
    d = quantize_nvfp4(x, stochastic=True)
    torch.manual_seed(5)
    assert torch.equal(d.data, quantize_nvfp4(x, stochastic=True).data)
    assert d.stochastic and not quantize_nvfp4(x).stochastic


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, key, words",
    [
        ({"x": torch.zeros(4, 40)}, "x", "multiple of 16"),
        ({"x": torch.zeros(16, 24), "block": (16, 16)}, "x", "multiple of 16"),
        ({"x": torch.zeros(32)}, "x", "2 dims"),
        ({"x": torch.zeros(4, 16, dtype=torch.float64)}, "x", "float64"),
        ({"x": torch.zeros(4, 16, dtype=torch.float8_e4m3fn)}, "x", "dtype"),
        ({"x": [[1.0] * 16]}, "x", "torch.Tensor"),
        ({"block": (1, 32)}, "block", "(1, 16) or (16, 16)"),
        ({"block": 16}, "block", "(1, 16) or (16, 16)"),
        ({"block": (32, 32)}, "block", "(1, 16) or (16, 16)"),
        ({"global_amax": -1.0}, "global_amax", ">= 0"),
        ({"global_amax": float("nan")}, "global_amax", ">= 0"),
        ({"global_amax": torch.ones(2)}, "global_amax", "one-element"),
        ({"global_amax": "1"}, "global_amax", "number"),
        ({"rht": 1}, "rht", "True or False"),
        ({"stochastic": "yes"}, "stochastic", "True or False"),
        ({"stochastic": True, "generator": 3}, "generator", "torch.Generator"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, key, words):
    kwargs = {"x": torch.zeros(16, 32), **kwargs}
    with pytest.raises(FP8ConfigError) as err:
        quantize_nvfp4(**kwargs)
    assert err.value.key == key
    msg = str(err.value)
    assert words in msg and f"`{key}`" in msg, msg
    assert "\n" not in msg


def test_dequantize_refuses_other_types():
    with pytest.raises(FP8ConfigError) as err:
        dequantize_nvfp4(torch.zeros(4, 16))
    assert err.value.key == "q"


def test_needs_no_grad_and_keeps_the_input():
    x = make_input("randn", torch.float32).requires_grad_()
    before = x.detach().clone()
    q = quantize_nvfp4(x, (16, 16), rht=True, global_amax=torch.tensor(9.0, requires_grad=True))
    assert not q.global_amax.requires_grad and torch.equal(x.detach(), before)


def test_list_block_and_empty_tensor():
    x = make_input("randn", torch.float32, shape=(16, 32))
    assert torch.equal(quantize_nvfp4(x, [16, 16]).data, quantize_nvfp4(x, (16, 16)).data)
    e = quantize_nvfp4(torch.zeros(0, 32), (16, 16))
    assert e.data.shape == (0, 16) and e.scale_inv.shape == (0, 2)
    assert dequantize_nvfp4(e).shape == (0, 32)
