"""FP8 GEMM emulation: ``a @ b.T`` from two :class:`QTensor` operands.

Each operand is dequantized in fp32 (``data * scale_inv`` per tile) and one fp32 GEMM runs
on the results. A product of two FP8 values is exact in fp32, and the scales are applied
per tile before accumulation, so this is the block-scaled GEMM's math with fp32
accumulation. It is not bit-identical to a particular GPU kernel: cuBLAS and DeepGEMM
accumulate in their own order (and Hopper's FP8 tensor cores keep fewer accumulator bits
between promotions); no reference can fix that order.
"""

from __future__ import annotations

import torch

from ..errors import FP8ConfigError
from .quantize import QTensor

__all__ = ["fp8_gemm"]


def fp8_gemm(
    a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b.T`` for ``a`` ``[..., K]`` (row-wise tiles along K) and ``b`` ``[N, K]``.

    Args:
        a: the left operand, e.g. activations ``[M, K]`` (leading dims are kept).
        b: the right operand, e.g. a linear layer's weight ``[N, K]``.
        out_dtype: dtype of the result (the GEMM accumulates in fp32 regardless).
        bias: optional ``[N]`` added in fp32 before the final cast (a GEMM epilogue).

    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    if not isinstance(a, QTensor) or not isinstance(b, QTensor):
        raise FP8ConfigError("fp8_gemm takes two QTensor operands", key="a")
    if b.data.dim() != 2 or a.data.shape[-1] != b.data.shape[-1]:
        raise FP8ConfigError(
            f"fp8_gemm needs a [..., K] and b [N, K]; got a "
            f"{tuple(a.data.shape)} and b {tuple(b.data.shape)}",
            key="b",
            value=tuple(b.data.shape),
        )
    a32 = a.dequantize(torch.float32)
    b32 = b.dequantize(torch.float32)
    out = torch.matmul(a32, b32.t())
    if bias is not None:
        out = out + bias.float()
    return out if out_dtype == torch.float32 else out.to(out_dtype)
