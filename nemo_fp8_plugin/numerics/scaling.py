"""Scale arithmetic of Transformer Engine's kernels, as vectorised torch.

Every function here is a plain composition of torch ops that ``torch.compile`` can trace
(the fused path compiles the very same functions), and that runs unchanged on CUDA tensors.

Division: ``fp8_max / amax`` must be the correctly rounded fp32 quotient (``__fdiv_rn`` in TE).
We divide in float64 and round once to float32. Because float64 carries more than
2 * 24 + 2 significand bits, this double rounding equals a single correctly rounded fp32
division for every input, and it does not depend on how a backend lowers fp32 division
(Triton's default fp32 division is approximate; its float64 division is not).
"""

from __future__ import annotations

import torch

__all__ = [
    "nan_ignoring_abs",
    "scale_from_amax",
    "reciprocal",
    "saturating_cast",
    "e8m0_from_amax",
    "e8m0_quant_multiplier",
    "e8m0_data_factors",
    "FLT_MAX",
]

FLT_MAX = float(torch.finfo(torch.float32).max)

# 0xFF800000 as a signed int32: sign and exponent bits of an fp32.
_SIGN_EXP_MASK = -8388608


def nan_ignoring_abs(xf: torch.Tensor) -> torch.Tensor:
    """``|x|`` with NaN replaced by 0, so that a max over it behaves like CUDA's ``fmaxf``
    (TE's amax ignores NaN; an inf still propagates)."""
    a = xf.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def scale_from_amax(
    amax: torch.Tensor, fp8_max: float, *, pow2: bool, eps: float, value_for_inf: float
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (``common/recipe/recipe_common.cuh``), elementwise.

    Args:
        amax: fp32 tensor of amaxes (any shape).
        fp8_max: 448 (E4M3) or 57344 (E5M2).
        pow2: clear the 23 mantissa bits of the scale (round down to a power of two).
        eps: floor for amax (``amax < eps -> eps``), compared in fp32.
        value_for_inf: the scale used when ``fp8_max / amax`` overflows: FLT_MAX for
            per-tensor scaling, the input dtype's max for block scaling.

    Returns:
        fp32 scales (``data = x * scale``): 1 where amax is 0, inf or NaN.
    """
    amax = amax.float()
    if eps > 0.0:
        eps_t = torch.full((), eps, dtype=torch.float32, device=amax.device)
        amax = torch.where(amax < eps_t, eps_t, amax)
    amax_d = amax.double()
    # tensor / tensor: a python scalar over a tensor becomes reciprocal-then-multiply.
    scale = (torch.full_like(amax_d, fp8_max) / amax_d).float()
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if pow2:
        scale = (scale.view(torch.int32) & _SIGN_EXP_MASK).view(torch.float32)
    special = torch.isinf(amax) | (amax == 0) | torch.isnan(amax)
    return torch.where(special, torch.ones_like(scale), scale)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``1 / scale`` (TE stores ``scale_inv`` this way)."""
    scale_d = scale.double()
    return (torch.ones_like(scale_d) / scale_d).float()


def saturating_cast(xf: torch.Tensor, fmt_max: float, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even cast with saturation (clamp to +-max first; NaN stays NaN).

    Clamping first matters: torch's CPU cast saturates to E4M3 but overflows to inf for
    E5M2, and other builds differ; TE's ``cvt.rn.satfinite`` saturates both.
    """
    return xf.clamp(-fmt_max, fmt_max).to(dtype)


def e8m0_from_amax(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """MXFP8 block exponent (biased E8M0 byte, as int32) from a block amax.

    ``val = amax * fp32(1 / fp8_max)`` (one fp32 multiply), then rounded up to a power of
    two as PTX ``cvt.rp.satfinite.ue8m0x2.f32`` does: exponent + 1 whenever a mantissa bit
    is set, except that values up to 2^-127 map to 0x00 and 0xFE never rounds up. 0 -> 0x00,
    inf -> 0xFE, NaN -> 0xFF.
    """
    rcp = torch.full((), 1.0 / fp8_max, dtype=torch.float32, device=amax.device)
    val = amax.float() * rcp
    bits = val.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    round_up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    e = exp + round_up.to(torch.int32)
    e = torch.where(torch.isinf(val), torch.full_like(e, 0xFE), e)
    e = torch.where(torch.isnan(val), torch.full_like(e, 0xFF), e)
    return e


def e8m0_quant_multiplier(e: torch.Tensor) -> torch.Tensor:
    """The factor TE multiplies data by before the cast, ``ptx::exp2f_rcp(e)`` as of TE PR
    2647 (every 2.1x/2.20 release; TE 2.20.2's CuTeDSL ``exp2f_rcp`` spells it out): the bit
    pattern ``(254 - e) << 23`` read as fp32, i.e. ``2^(127 - e)`` for every byte up to 0xFD
    (byte 0 gives 2^127, no special case), 0xFE gives 2^-127 (``0x00400000``, a subnormal)
    and 0xFF gives NaN. (Older TE kernels returned 1.0 for byte 0 and +0.0 for 0xFE.)"""
    bits = ((254 - e) << 23).to(torch.int32)
    bits = torch.where(e == 254, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return bits.view(torch.float32)


def e8m0_data_factors(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m1, m2)`` with ``(x * m1) * m2`` casting to exactly the FP8 bits of
    ``x * e8m0_quant_multiplier(e)``, without a subnormal operand.

    ``m1 = 2^(127 - e)`` except 2^-126 for e = 0xFE, and ``m2`` is 0.5 there, 1.0 elsewhere.
    Both products are exact wherever the result can be a nonzero FP8 value (``|x * 2^-127| >=
    2^-17`` needs ``|x| >= 2^110``, so ``x * 2^-126`` is a normal fp32); below that both
    spellings cast to zero. The split keeps the result independent of a backend that
    flushes subnormal operands (the 2^-127 constant) to zero.
    """
    m1 = e8m0_quant_multiplier(torch.where(e == 254, torch.full_like(e, 253), e))
    m2 = torch.where(e == 254, torch.full_like(m1, 0.5), torch.ones_like(m1))
    return m1, m2
