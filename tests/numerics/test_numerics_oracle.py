"""torchao 0.18 as an independent oracle, with the known disagreements asserted.

* Tensorwise: ``torchao.float8`` (``hp_tensor_to_float8_dynamic``) agrees with TE's current
  scaling on ordinary data. It clamps amax to 1e-12 and lets NaN propagate, so it differs
  from TE where amax is 0 (TE: scale 1; torchao: 448 / 1e-12), where amax is inf (TE: scale
  1, finite values saturate; torchao: scale 0), where the scale overflows fp32 (TE:
  FLT_MAX; torchao: inf), and where the tensor holds a NaN (TE ignores it in the amax).
* MXFP8: ``MXTensor.to_mx(..., scaling_mode=RCEIL)`` agrees with TE's MXFP8 cast on
  ordinary data, and on a block holding an inf (both multiply by 2^-127, TE's ``exp2f_rcp``
  since TE PR 2647, so the inf saturates to 448). NaN propagates through torchao's amax (TE
  ignores NaN). A block whose amax is at most fp8_max * 2^-127 (scale byte 0) is multiplied
  by 1.0 in torchao, which follows an older TE ``exp2f_rcp`` (its code cites it), so its
  values flush to 0; TE 2.20.2 multiplies by 2^127.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from nemo_fp8_plugin.numerics import fp8_dtype, fp8_max, quantize_mxfp8, quantize_per_tensor

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, ScaleCalculationMode

DTYPES = [torch.float32, torch.bfloat16]


def torchao_tensorwise(x, fmt, pow2):
    t = hp_tensor_to_float8_dynamic(
        x,
        fp8_dtype(fmt),
        LinearMMConfig(),
        scaling_granularity=ScalingGranularity.TENSORWISE,
        round_scales_to_power_of_2=pow2,
    )
    return t._data, t._scale


def bytes_of(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_tensorwise_matches_torchao(dtype, fmt, pow2, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 96, generator=gen) * 10.0 ** (seed - 2)).to(dtype)
    data, scale = torchao_tensorwise(x, fmt, pow2)
    q = quantize_per_tensor(x, fmt, pow2_scales=pow2)
    assert torch.equal(bytes_of(q.data), bytes_of(data))
    assert torch.equal(q.scale_inv, torch.reciprocal(scale.double()).float())


def test_tensorwise_amax_zero_disagrees():
    x = torch.zeros(8, 16)
    data, scale = torchao_tensorwise(x, "e4m3", False)
    q = quantize_per_tensor(x)
    assert torch.equal(bytes_of(q.data), bytes_of(data))  # both all zeros
    assert float(q.scale_inv) == 1.0  # TE: scale 1
    assert float(scale) == pytest.approx(448.0 / 1e-12)  # torchao: 448 / EPS


def test_tensorwise_inf_amax_disagrees():
    x = torch.tensor([[1.0, 1000.0, math.inf]])
    data, scale = torchao_tensorwise(x, "e4m3", False)
    q = quantize_per_tensor(x)
    assert float(q.scale_inv) == 1.0 and float(scale) == 0.0
    assert q.data.float().tolist() == [[1.0, 448.0, 448.0]]  # TE saturates with scale 1
    assert data.float()[0, :2].tolist() == [0.0, 0.0]  # torchao zeroes finite values


def test_tensorwise_nan_disagrees():
    x = torch.tensor([[1.0, 2.0, math.nan]])
    data, _ = torchao_tensorwise(x, "e4m3", False)
    q = quantize_per_tensor(x)
    assert q.data.float()[0, :2].tolist() == [224.0, 448.0]  # NaN ignored by the amax
    assert torch.isnan(data.float()).all()  # torchao: NaN everywhere


def test_tensorwise_scale_overflow_disagrees():
    x = torch.full((4,), 1e-38)
    _, scale = torchao_tensorwise(x, "e4m3", False)
    q = quantize_per_tensor(x)
    flt_max = np.float32(np.finfo(np.float32).max)
    assert q.scale_inv.numpy() == np.float32(1.0) / flt_max  # TE: scale FLT_MAX
    assert float(scale) == pytest.approx(448.0 / 1e-12)  # torchao: its 1e-12 amax floor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("seed", range(4))
def test_mxfp8_matches_torchao_rceil(dtype, fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 256, generator=gen)
    # blocks spread over 2^-40 .. 2^40 so that many exponents are exercised
    x = x * torch.exp2(torch.randint(-40, 40, (128, 8, 1), generator=gen).float()).repeat(
        1, 1, 32
    ).reshape(128, 256)
    x = x.to(dtype)
    t = MXTensor.to_mx(x, fp8_dtype(fmt), 32, scaling_mode=ScaleCalculationMode.RCEIL)
    q = quantize_mxfp8(x, 32, fmt)
    assert torch.equal(q.scale_inv.view(torch.uint8), t.scale.view(torch.uint8))
    assert torch.equal(bytes_of(q.data), bytes_of(t.qdata))


def test_mxfp8_zero_block_agrees():
    x = torch.zeros(2, 64)
    x[1, 32:] = 3.0
    t = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    q = quantize_mxfp8(x)
    assert torch.equal(q.scale_inv.view(torch.uint8), t.scale.view(torch.uint8))
    assert q.scale_inv.view(torch.uint8)[0, 0] == 0  # amax 0 -> 0x00 in both


def test_mxfp8_nan_block_disagrees():
    x = torch.ones(1, 32)
    x[0, 3] = math.nan
    t = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    q = quantize_mxfp8(x)
    assert q.scale_inv.view(torch.uint8)[0, 0] == 127 - 8  # TE ignores the NaN (amax 1)
    assert t.scale.view(torch.uint8)[0, 0] == 255  # torchao: NaN scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_inf_block_agrees(dtype, fmt):
    """A block holding an inf: scale byte 0xFE and multiplier 2^-127 in both (TE's
    exp2f_rcp since PR 2647; older TE multiplied by 0.0 and turned the inf into NaN)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=gen) * 2.0**120
    x[0, 5], x[1, 40], x[3, 0] = math.inf, -math.inf, math.inf
    x = x.to(dtype)
    t = MXTensor.to_mx(x, fp8_dtype(fmt), 32, scaling_mode=ScaleCalculationMode.RCEIL)
    q = quantize_mxfp8(x, 32, fmt)
    assert q.scale_inv.view(torch.uint8)[0, 0] == 254
    assert torch.equal(q.scale_inv.view(torch.uint8), t.scale.view(torch.uint8))
    assert torch.equal(bytes_of(q.data), bytes_of(t.qdata))
    assert float(q.data[0, 5].float()) == fp8_max(fmt)  # the inf saturates
    assert (q.data[0, :32].float() != 0).sum() > 1  # finite values keep 2^-127-scaled codes


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_tiny_block_disagrees(fmt):
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([2.0**-119, -3 * 2.0**-122, 2.0**-130])
    t = MXTensor.to_mx(x, fp8_dtype(fmt), 32, scaling_mode=ScaleCalculationMode.RCEIL)
    q = quantize_mxfp8(x, 32, fmt)
    assert q.scale_inv.view(torch.uint8)[0, 0] == t.scale.view(torch.uint8)[0, 0] == 0
    assert q.data.float()[0, :3].tolist() == [256.0, -96.0, 0.125]  # x * 2^127
    assert (t.qdata.float() == 0).all()  # torchao: x * 1.0
