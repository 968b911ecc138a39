"""Bad input to the numerics API: refused with FP8ConfigError naming the argument, before
any allocation; an unparsable tuning variable at import is a warning, not a failure. Also
the E8M0 rounding edge of the eager reference, pinned by values worked out from the rule."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nemo_fp8_plugin.errors import LIMITS, FP8ConfigError
from nemo_fp8_plugin.numerics import fused as F
from nemo_fp8_plugin.numerics import quantize as Q
from nemo_fp8_plugin.numerics import reference as R
from nemo_fp8_plugin.numerics.scaling import e8m0_from_amax


@pytest.mark.parametrize("raw", ["abc", "9" * 5000, "-3"])
def test_bad_fused_min_numel_at_import_warns_and_keeps_the_default(raw):
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from nemo_fp8_plugin.numerics import fused\n"
        "print(fused._state['min_numel'])\n"
    )
    env = {"NEMO_FP8_FUSED_MIN_NUMEL": raw, "PATH": "/usr/bin:/bin"}
    import os

    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == str(1 << 20)
    assert "NEMO_FP8_FUSED_MIN_NUMEL=" in proc.stderr and "using 1048576" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_good_fused_min_numel_is_used(monkeypatch):
    monkeypatch.setenv("NEMO_FP8_FUSED_MIN_NUMEL", "77")
    assert F._min_numel_from_env() == 77
    monkeypatch.delenv("NEMO_FP8_FUSED_MIN_NUMEL")
    assert F._min_numel_from_env() == 1 << 20


HUGE_BLOCK = [
    lambda x: Q.quantize_blockwise(x, (1, 2**40)),
    lambda x: Q.quantize_blockwise(x, (2**40, 1)),
    lambda x: R.quantize_blockwise_reference(x, (1, 2**40)),
    lambda x: F.fake_quant_blockwise(x, (1, 2**40), "e4m3"),
    lambda x: F.quantize_blockwise_fused(x, (2**40, 128)),
]


@pytest.mark.parametrize("call", HUGE_BLOCK)
def test_a_huge_block_is_refused_before_allocating(call):
    with pytest.raises(FP8ConfigError, match="once padded to whole tiles") as err:
        call(torch.ones(4, 8))
    assert err.value.key == "block"


HUGE_VIEW = [
    lambda x: Q.quantize_blockwise(x.reshape(2**20, 2**20)),
    lambda x: Q.quantize_mxfp8(x),
    lambda x: R.quantize_mxfp8_reference(x),
    lambda x: Q.quantize_per_tensor(x),
    lambda x: R.quantize_per_tensor_reference(x),
    lambda x: Q.quantize_with_scale(x, torch.tensor(1.0)),
    lambda x: F.fake_quant_mxfp8(x.reshape(2**20, 2**20), (1, 32), "e4m3"),
]


@pytest.mark.parametrize("call", HUGE_VIEW)
def test_a_zero_stride_view_of_2_40_elements_is_refused(call):
    x = torch.zeros(1).expand(2**40)  # 8 bytes of storage, 4 TB if made contiguous
    with pytest.raises(FP8ConfigError, match="too many elements") as err:
        call(x)
    assert err.value.key == "x"
    assert str(LIMITS.tensor_elements) in str(err.value)


def test_the_limit_is_the_one_in_force(monkeypatch):
    monkeypatch.setattr(LIMITS, "tensor_elements", 100)
    Q.quantize_blockwise(torch.ones(1, 100), (1, 100))
    with pytest.raises(FP8ConfigError):
        Q.quantize_blockwise(torch.ones(1, 101), (1, 101))
    with pytest.raises(FP8ConfigError, match="once padded"):
        Q.quantize_blockwise(torch.ones(1, 64), (1, 128))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 64), (2, 0, 5)])
def test_quantize_mxfp8_of_an_empty_tensor(shape):
    x = torch.empty(shape)
    for fn in (Q.quantize_mxfp8, R.quantize_mxfp8_reference):
        q = fn(x)
        assert q.data.shape == x.shape and q.data.dtype == torch.float8_e4m3fn
        lead, k = shape[:-1], shape[-1]
        assert tuple(q.scale_inv.shape) == (*lead, -(-k // 32))
        assert q.dequantize().shape == x.shape


@pytest.mark.parametrize("bad", [float("nan"), -1.0, -float("inf")])
@pytest.mark.parametrize("which", ["scale", "scale_inv"])
def test_quantize_with_scale_refuses_a_nan_or_negative_scale(bad, which):
    x = torch.ones(8)
    kw = {"scale": torch.tensor(1.0), "scale_inv": torch.tensor(1.0)}
    kw[which] = torch.tensor(bad)
    for fn in (Q.quantize_with_scale, R.quantize_with_scale_reference):
        with pytest.raises(FP8ConfigError, match="expected a scale >= 0") as err:
            fn(x, kw["scale"], "e4m3", kw["scale_inv"])
        assert err.value.key == which


def _e8m0_of_bits(bits: int) -> int:
    """The reference's E8M0 byte for a block whose ``amax * fp32(1/fp8_max)`` has exactly
    the fp32 bit pattern ``bits`` (fp8_max = 1.0 makes that product the amax itself)."""
    amax = torch.tensor([bits], dtype=torch.int32).view(torch.float32)
    return int(e8m0_from_amax(amax, 1.0)[0])


def test_e8m0_rounding_edge_against_the_rule():
    """OCP MX v1.0 / PTX ``cvt.rp.satfinite.ue8m0x2.f32`` (TE's rule): round up to a power
    of two 2^(e-127). The smallest E8M0 value is 2^-127 (byte 0x00), whose fp32 bits are the
    subnormal 0x00400000 (mantissa exactly 0x400000): it is exact, so it stays 0x00; one
    ulp above rounds up to 2^-126 (0x01); anything below rounds up to 2^-127 (0x00). For a
    normal value a mantissa of 0x400000 is 1.5 * 2^k, which rounds up to 2^(k+1)."""
    assert _e8m0_of_bits(0x00400000) == 0x00  # 2^-127 exactly
    assert _e8m0_of_bits(0x00400001) == 0x01  # just above 2^-127 -> 2^-126
    assert _e8m0_of_bits(0x003FFFFF) == 0x00  # below -> 2^-127
    assert _e8m0_of_bits(0x00000001) == 0x00  # the smallest subnormal -> 2^-127
    assert _e8m0_of_bits(0x00800000) == 0x01  # 2^-126 exactly
    assert _e8m0_of_bits(0x3F800000) == 0x7F  # 1.0 exactly
    assert _e8m0_of_bits(0x3FC00000) == 0x80  # 1.5: mantissa 0x400000 -> 2.0
    assert _e8m0_of_bits(0x3F800001) == 0x80  # one ulp above 1.0 -> 2.0
    assert _e8m0_of_bits(0x7F000000) == 0xFE  # 2^127 exactly
    assert _e8m0_of_bits(0x7F400000) == 0xFE  # 1.5 * 2^127 saturates at 2^127


def test_e8m0_edge_through_the_mxfp8_reference():
    """The same edge through quantize_mxfp8_reference (fp8_max 448): a block whose amax
    times fp32(1/448) lands on 2^-127 exactly keeps byte 0x00."""
    rcp = torch.tensor(1 / 448, dtype=torch.float32)
    target = torch.tensor([0x00400000], dtype=torch.int32).view(torch.float32)
    amax = (target / rcp).reshape(())
    while float(amax * rcp) != float(target):  # step to an amax whose product is exact
        amax = torch.nextafter(amax, torch.tensor(1.0))
    x = torch.zeros(1, 32)
    x[0, 5] = amax
    assert (amax * rcp).view(torch.int32) == 0x00400000
    assert R.quantize_mxfp8_reference(x).scale_inv.view(torch.uint8).tolist() == [[0x00]]
    above = amax
    while int((above * rcp).view(torch.int32)) == 0x00400000:  # the first amax past it
        above = torch.nextafter(above, torch.tensor(1.0))
    x[0, 5] = above
    assert R.quantize_mxfp8_reference(x).scale_inv.view(torch.uint8).tolist() == [[0x01]]


@pytest.mark.parametrize("block", [(1, 64), (16, 16), (1, 16)])
def test_fake_quant_mxfp8_takes_only_mxfp8_tiles(block):
    """The fused fake quantizer accepts what quantize_mxfp8 accepts: a non-MX tile is refused
    naming the block, not quantized with a tile no MXFP8 kernel has."""
    x = torch.randn(64, 64)
    with pytest.raises(FP8ConfigError, match="MXFP8 blocks are") as err:
        F.fake_quant_mxfp8(x, block, "e4m3")
    assert err.value.key == "block"
