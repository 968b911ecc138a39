"""torchao 0.18 as an independent oracle, with the known disagreements asserted.

* Tensorwise: ``torchao.float8`` (``hp_tensor_to_float8_dynamic``) agrees with TE's current
  scaling on ordinary data. It clamps amax to 1e-12 and lets NaN propagate, so it differs
  from TE where amax is 0 (TE: scale 1; torchao: 448 / 1e-12), where amax is inf (TE: scale
  1, finite values saturate; torchao: scale 0), where the scale overflows fp32 (TE:
  FLT_MAX; torchao: inf), and where the tensor holds a NaN (TE ignores it in the amax).
* MXFP8: ``MXTensor.to_mx(..., scaling_mode=RCEIL)`` agrees with TE's MXFP8 cast on
  ordinary data. NaN propagates through its amax (TE ignores NaN), and a block with an inf
  gets multiplier 2^-127 (TE's current kernel: 0.0), so the inf element becomes 448
  (torchao) instead of NaN (TE).
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
    t = hp_tensor_to_float8_dynamic(x, fp8_dtype(fmt), LinearMMConfig(),
                                    scaling_granularity=ScalingGranularity.TENSORWISE,
                                    round_scales_to_power_of_2=pow2)
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
    assert float(q.scale_inv) == 1.0                     # TE: scale 1
    assert float(scale) == pytest.approx(448.0 / 1e-12)  # torchao: 448 / EPS


def test_tensorwise_inf_amax_disagrees():
    x = torch.tensor([[1.0, 1000.0, math.inf]])
    data, scale = torchao_tensorwise(x, "e4m3", False)
    q = quantize_per_tensor(x)
    assert float(q.scale_inv) == 1.0 and float(scale) == 0.0
    assert q.data.float().tolist() == [[1.0, 448.0, 448.0]]  # TE saturates with scale 1
    assert data.float()[0, :2].tolist() == [0.0, 0.0]        # torchao zeroes finite values


def test_tensorwise_nan_disagrees():
    x = torch.tensor([[1.0, 2.0, math.nan]])
    data, _ = torchao_tensorwise(x, "e4m3", False)
    q = quantize_per_tensor(x)
    assert q.data.float()[0, :2].tolist() == [224.0, 448.0]  # NaN ignored by the amax
    assert torch.isnan(data.float()).all()                   # torchao: NaN everywhere


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
        1, 1, 32).reshape(128, 256)
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


def test_mxfp8_nan_and_inf_blocks_disagree():
    x = torch.ones(2, 32)
    x[0, 3] = math.nan
    x[1, 5] = math.inf
    t = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    q = quantize_mxfp8(x)
    ours = q.scale_inv.view(torch.uint8)[:, 0].tolist()
    theirs = t.scale.view(torch.uint8)[:, 0].tolist()
    assert ours[0] == 127 - 8 and theirs[0] == 255  # TE ignores the NaN (amax 1)
    assert ours[1] == theirs[1] == 254               # inf amax -> 0xFE in both
    assert math.isnan(float(q.data[1, 5].float()))   # TE multiplies by 0.0: inf * 0
    assert float(t.qdata[1, 5].float()) == fp8_max("e4m3")  # torchao: 2^-127, saturates
