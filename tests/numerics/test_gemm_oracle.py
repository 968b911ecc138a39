"""``fp8_gemm`` against an independent implementation: torch's own ``torch._scaled_mm``
(its CPU kernel), which shares no code with the plugin's numerics.

Exact where the arithmetic allows it: with E4M3 operands holding small integers and
power-of-two scales every partial sum is exact in fp32, so any accumulation order gives the
same bits and the two must agree with ``torch.equal``. On general data the two accumulate
in different orders; they must agree to fp32 rounding of a K-term sum.
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8_plugin.numerics import fp8_gemm, quantize_per_tensor
from nemo_fp8_plugin.numerics.quantize import QTensor


def _scaled_mm(a: QTensor, b: QTensor) -> torch.Tensor:
    return torch._scaled_mm(
        a.data,
        b.data.t(),
        scale_a=a.scale_inv.reshape(()).float(),
        scale_b=b.scale_inv.reshape(()).float(),
        out_dtype=torch.float32,
    )


def _qt(data: torch.Tensor, scale_inv: float) -> QTensor:
    q = quantize_per_tensor(data.float())
    return QTensor(
        data=data.to(torch.float8_e4m3fn),
        scale_inv=torch.tensor(scale_inv),
        block=q.block,
        fmt="e4m3",
    )


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 8.0), (2.0**-10, 2.0**6)])
def test_integer_operands_agree_bit_for_bit(scales):
    g = torch.Generator().manual_seed(7)
    a = torch.randint(-4, 5, (16, 64), generator=g).float()
    b = torch.randint(-4, 5, (24, 64), generator=g).float()
    qa, qb = _qt(a, scales[0]), _qt(b, scales[1])
    assert torch.equal(fp8_gemm(qa, qb), _scaled_mm(qa, qb))


def test_random_operands_agree_to_fp32_rounding():
    g = torch.Generator().manual_seed(11)
    a = quantize_per_tensor(torch.randn(32, 256, generator=g))
    b = quantize_per_tensor(torch.randn(48, 256, generator=g) * 0.02)
    ours, theirs = fp8_gemm(a, b), _scaled_mm(a, b)
    assert ours.shape == theirs.shape == (32, 48)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())
    # and the check can fail: a wrong scale is caught
    wrong = QTensor(data=b.data, scale_inv=b.scale_inv * 2, block=b.block, fmt=b.fmt)
    assert not torch.allclose(fp8_gemm(a, wrong), theirs, rtol=1e-3)
