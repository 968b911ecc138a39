"""Reference quantizers: Transformer Engine's FP8 casts, bit for bit, in eager torch.

Three families, each returning a :class:`QTensor`:

* :func:`quantize_per_tensor_reference` - one fp32 scale for the whole tensor (TE current
  scaling, ``Float8CurrentScaling``); :func:`quantize_with_scale_reference` casts with a
  given scale (TE delayed scaling, see :mod:`.delayed`).
* :func:`quantize_blockwise_reference` - one fp32 scale per 1x128 or 128x128 tile (TE
  ``Float8BlockScaling``, DeepSeek-V3, vLLM block FP8).
* :func:`quantize_mxfp8_reference` - one E8M0 scale per 32 elements (OCP MXFP8, TE
  ``MXFP8BlockScaling``).

The semantics are TE's kernels, stated rule by rule with their upstream files in
``docs/numerics.md``, which also lists where the code follows a kernel's edge case and where
torchao differs. These functions are the truth every
faster path is tested against, bit for bit: the public :mod:`.quantize` functions dispatch to
the single-pass CPU kernels (:mod:`._cpu`) or the compiled ones (:mod:`.fused`) and fall back
to these. No Python loop runs over blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F

from ..errors import LIMITS, FP8ConfigError, check_limit
from .formats import (
    check_bool,
    check_eps,
    check_format,
    check_input_dtype,
    check_scale_tensor,
    fp8_dtype,
    fp8_max,
    input_dtype_max,
)
from .scaling import (
    FLT_MAX,
    e8m0_data_factors,
    e8m0_from_amax,
    nan_ignoring_abs,
    reciprocal,
    saturating_cast,
    scale_from_amax,
)

__all__ = [
    "QTensor",
    "check_size",
    "quantize_per_tensor_reference",
    "quantize_with_scale_reference",
    "quantize_blockwise_reference",
    "quantize_mxfp8_reference",
    "tensor_amax",
    "check_block",
    "check_mx_block",
    "check_rank",
    "BlockLike",
]

BlockLike: TypeAlias = "int | tuple[int, int] | list[int]"
"""A tile shape as the quantizers take it: ``(rows, cols)``, or an int ``n`` for ``(1, n)``."""


@dataclass
class QTensor:
    """A quantized tensor: float8 data plus the scales that dequantize it.

    ``dequantize() == data.float() * scale_inv`` broadcast over each tile.
    """

    data: torch.Tensor
    """Float8 values (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``), same shape as the
    source tensor."""

    scale_inv: torch.Tensor
    """Dequantization scales (``1 / scale``), plain logical layout (not TE's padded cuBLAS
    layout): per tensor a 0-d fp32 tensor; block ``(bm, bn)`` on ``[..., M, K]`` an fp32
    ``[..., ceil(M/bm), ceil(K/bn)]`` (``(1, 128)`` -> ``[M, ceil(K/128)]``, ``(128, 128)``
    -> ``[ceil(M/128), ceil(K/128)]``); MXFP8 a ``torch.float8_e8m0fnu`` tensor
    ``[..., ceil(K/32)]`` (1x32) or ``[..., ceil(M/32), ceil(K/32)]`` (32x32, 32x1)."""

    fmt: str
    """Element format: ``"e4m3"`` or ``"e5m2"``."""

    block: tuple[int, int] | None
    """Scale tile ``(rows, cols)``; None means one scale for the whole tensor."""

    @property
    def is_mx(self) -> bool:
        """True for MXFP8 (E8M0 scales)."""
        return self.scale_inv.dtype == torch.float8_e8m0fnu

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def scale_inv_fp32(self) -> torch.Tensor:
        """``scale_inv`` as fp32 (E8M0 bytes become 2^(e-127); 0xFF becomes NaN)."""
        return self.scale_inv.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` computed in fp32, returned in ``dtype``."""
        out = dequantize_fp32(self.data, self.scale_inv_fp32(), self.block)
        return out if dtype == torch.float32 else out.to(dtype)

    def __repr__(self) -> str:
        return (
            f"QTensor(shape={tuple(self.data.shape)}, fmt={self.fmt!r}, block={self.block}, "
            f"scale_inv={tuple(self.scale_inv.shape)} {self.scale_inv.dtype})"
        )


# --------------------------------------------------------------------------- helpers


def check_block(block: object, *, key: str = "block") -> tuple[int, int]:
    """Normalise a tile shape: an int ``n`` means ``(1, n)``; a pair of positive ints."""
    if isinstance(block, int) and not isinstance(block, bool):
        block = (1, block)
    if (
        isinstance(block, (tuple, list))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        return (int(block[0]), int(block[1]))
    raise FP8ConfigError(
        f"expected a tile shape (rows, cols) of positive ints, got {block!r}", key=key, value=block
    )


def check_size(x: torch.Tensor, bm: int = 1, bn: int = 1, *, key: str = "x") -> None:
    """Refuse a tensor whose element count padded to whole ``bm x bn`` tiles exceeds
    ``LIMITS.tensor_elements``: counted from the shape, before any allocation (a zero-stride
    view's ``contiguous()`` or a huge tile's padding would allocate it). A ``block`` dim
    larger than the tensor's is what pads, so the refusal names ``block`` then."""
    if x.dim() == 0:
        return
    shape = list(x.shape)
    rows = shape[-2] if len(shape) >= 2 else 1
    lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
    padded = lead * (-(-rows // bm) * bm) * (-(-shape[-1] // bn) * bn)
    within = x.numel() <= LIMITS.tensor_elements  # then only the padding is too much
    check_limit(
        padded,
        LIMITS.tensor_elements,
        f"a tensor of shape {tuple(shape)}"
        + (f" with {bm}x{bn} tiles" if (bm, bn) != (1, 1) else "")
        + " has too many elements"
        + (" once padded to whole tiles" if within else ""),
        key="block" if within else key,
        value=(bm, bn) if within else tuple(shape),
    )


def _pad_to_tiles(xf: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """Zero-pad the last two dims up to multiples of the tile (zeros never raise an amax)."""
    m, k = xf.shape[-2], xf.shape[-1]
    pm, pk = (-m) % bm, (-k) % bn
    if pm or pk:
        xf = F.pad(xf, (0, pk, 0, pm))
    return xf


def _tiled(xf: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """View ``[..., M, K]`` (dims multiples of the tile) as ``[..., M/bm, bm, K/bn, bn]``."""
    *lead, m, k = xf.shape
    return xf.reshape(*lead, m // bm, bm, k // bn, bn)


def _tile_amax(tiles: torch.Tensor) -> torch.Tensor:
    return nan_ignoring_abs(tiles).amax(dim=(-3, -1))


def _expand_tiles(s: torch.Tensor) -> torch.Tensor:
    return s.unsqueeze(-1).unsqueeze(-3)


def dequantize_fp32(
    data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """fp32 ``data * scale_inv`` with ``scale_inv`` broadcast over its tiles."""
    d = data.float()
    if block is None:
        return d * scale_inv
    bm, bn = block
    if d.dim() == 1:
        d = d.unsqueeze(0)
        scale_inv = scale_inv.unsqueeze(0)
        return dequantize_fp32(d, scale_inv, block).squeeze(0)
    if bm == 1 and scale_inv.dim() == d.dim():
        # row-wise tiles: [..., M, K] with scales [..., M, Kt]
        k = d.shape[-1]
        kt = scale_inv.shape[-1]
        if k % bn:
            d = F.pad(d, (0, kt * bn - k))
        out = (d.reshape(*d.shape[:-1], kt, bn) * scale_inv.unsqueeze(-1)).reshape(
            *d.shape[:-1], kt * bn
        )
        return out[..., :k] if k % bn else out
    m, k = d.shape[-2], d.shape[-1]
    padded = _pad_to_tiles(d, bm, bn)
    out = (_tiled(padded, bm, bn) * _expand_tiles(scale_inv)).reshape(padded.shape)
    return out[..., :m, :k] if padded.shape != d.shape else out


# --------------------------------------------------------------------------- per tensor


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring ``max |x|`` as a 0-d fp32 tensor (0 for an empty tensor)."""
    check_size(x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return nan_ignoring_abs(x.float()).amax()


def quantize_with_scale_reference(
    x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3", scale_inv: torch.Tensor | None = None
) -> QTensor:
    """Cast ``x`` with a given per-tensor fp32 ``scale`` (delayed scaling's cast).

    ``scale_inv`` defaults to the correctly rounded ``1 / scale``; delayed scaling passes
    the one stored in its state.
    """
    check_input_dtype(x)
    fmt = check_format(fmt)
    check_scale_tensor(scale, "scale")
    if scale_inv is not None:
        check_scale_tensor(scale_inv, "scale_inv")
    check_size(x)
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(())
    data = saturating_cast(x.float() * scale, fp8_max(fmt), fp8_dtype(fmt))
    if scale_inv is None:
        scale_inv = reciprocal(scale)
    return QTensor(data, scale_inv.to(device=x.device, dtype=torch.float32).reshape(()), fmt, None)


def quantize_per_tensor_reference(
    x: torch.Tensor, fmt: str = "e4m3", pow2_scales: bool = False, eps: float = 0.0
) -> QTensor:
    """Per-tensor current scaling (TE ``Float8CurrentScaling``).

    ``amax = max |x|`` (NaN ignored), ``scale = fp8_max / amax`` (FLT_MAX if that overflows,
    1 if amax is 0 or inf), optional power-of-2 rounding, ``data = sat_cast(x * scale)``,
    ``scale_inv = 1 / scale`` (0-d fp32). Any shape.
    """
    check_input_dtype(x)
    fmt = check_format(fmt)
    pow2 = check_bool(pow2_scales, "pow2_scales")
    eps = check_eps(eps)
    check_size(x)
    scale = scale_from_amax(tensor_amax(x), fp8_max(fmt), pow2=pow2, eps=eps, value_for_inf=FLT_MAX)
    return quantize_with_scale_reference(x, scale, fmt)


# --------------------------------------------------------------------------- block scaling


def check_rank(x: torch.Tensor, ranks: tuple[int, ...], what: str) -> None:
    """Refuse a tensor whose rank is not in ``ranks`` (``key="x"``)."""
    if x.dim() not in ranks:
        raise FP8ConfigError(
            f"{what} takes a tensor of rank {' or '.join(map(str, ranks))}, "
            f"got shape {tuple(x.shape)}",
            key="x",
            value=tuple(x.shape),
        )


def block_quantize_core(
    x: torch.Tensor, bm: int, bn: int, fmt: str, pow2: bool, eps: float, value_for_inf: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``[..., M, K]`` whose last two dims are multiples of ``(bm, bn)``.

    Returns ``(data [..., M, K], scale [..., M/bm, K/bn])`` with ``scale`` the quantization
    scale (not its inverse). Traceable by torch.compile.
    """
    tiles = _tiled(x.float(), bm, bn)
    scale = scale_from_amax(
        _tile_amax(tiles), fp8_max(fmt), pow2=pow2, eps=eps, value_for_inf=value_for_inf
    )
    data = saturating_cast(tiles * _expand_tiles(scale), fp8_max(fmt), fp8_dtype(fmt))
    return data.reshape(x.shape), scale


def quantize_blockwise_reference(
    x: torch.Tensor,
    block: BlockLike = (1, 128),
    fmt: str = "e4m3",
    pow2_scales: bool = False,
    eps: float = 0.0,
) -> QTensor:
    """The eager reference of ``numerics.quantize.quantize_blockwise``: the same arguments,
    result and errors (the C++ and compiled kernels are checked against it)."""
    check_input_dtype(x)
    check_rank(x, (2, 3), "quantize_blockwise")
    fmt = check_format(fmt)
    bm, bn = check_block(block)
    check_size(x, bm, bn)
    pow2 = check_bool(pow2_scales, "pow2_scales")
    eps = check_eps(eps)
    m, k = x.shape[-2], x.shape[-1]
    padded = _pad_to_tiles(x.float(), bm, bn)
    data, scale = block_quantize_core(padded, bm, bn, fmt, pow2, eps, input_dtype_max(x.dtype))
    if padded.shape != x.shape:
        data = data[..., :m, :k].contiguous()
    return QTensor(data, reciprocal(scale), fmt, (bm, bn))


def check_mx_block(block: object) -> tuple[int, int]:
    """An MXFP8 block: ``32`` / ``(1, 32)``, ``(32, 1)`` or ``(32, 32)``."""
    bm, bn = check_block(block)
    if (bm, bn) not in ((1, 32), (32, 1), (32, 32)):
        raise FP8ConfigError(
            f"MXFP8 blocks are 1x32, 32x1 or 32x32, got {bm}x{bn}", key="block", value=block
        )
    return bm, bn


# --------------------------------------------------------------------------- MXFP8


def mx_quantize_core(
    x: torch.Tensor, bm: int, bn: int, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize ``[..., M, K]`` with dims multiples of ``(bm, bn)``.

    Returns ``(data, e)`` with ``e`` the biased E8M0 exponents as int32. Traceable.
    """
    tiles = _tiled(x.float(), bm, bn)
    e = e8m0_from_amax(_tile_amax(tiles), fp8_max(fmt))
    data = saturating_cast(mx_scale_tiles(tiles, e), fp8_max(fmt), fp8_dtype(fmt))
    return data.reshape(x.shape), e


def mx_scale_tiles(tiles: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``tiles * exp2f_rcp(e)`` per tile (fp32, before the cast), through
    :func:`~.scaling.e8m0_data_factors`. Traceable."""
    m1, m2 = e8m0_data_factors(e)
    return tiles * _expand_tiles(m1) * _expand_tiles(m2)


def e8m0_tensor(e: torch.Tensor) -> torch.Tensor:
    """int32 biased exponents -> ``torch.float8_e8m0fnu`` (the raw byte)."""
    return e.to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_mxfp8_reference(x: torch.Tensor, block: BlockLike = 32, fmt: str = "e4m3") -> QTensor:
    """The eager reference of ``numerics.quantize.quantize_mxfp8``: the same arguments,
    result and errors (the C++ and compiled kernels are checked against it)."""
    check_input_dtype(x)
    fmt = check_format(fmt)
    bm, bn = check_mx_block(block)
    check_size(x, bm, bn)
    if bm == 1:
        check_rank(x, tuple(range(1, 9)), "quantize_mxfp8")
        # the row count spelled out: reshape(-1, 0) of an empty tensor is ambiguous
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() != 2 else x
    else:
        check_rank(x, (2, 3), f"quantize_mxfp8 with {bm}x{bn} blocks")
        x2 = x
    m, k = x2.shape[-2], x2.shape[-1]
    padded = _pad_to_tiles(x2.float(), bm, bn)
    data, e = mx_quantize_core(padded, bm, bn, fmt)
    if padded.shape != x2.shape:
        data = data[..., :m, :k].contiguous()
    scale_inv = e8m0_tensor(e)
    if bm == 1:
        data = data.reshape(x.shape)
        scale_inv = scale_inv.reshape(*x.shape[:-1], scale_inv.shape[-1])
    return QTensor(data, scale_inv, fmt, (bm, bn))


def num_tiles(n: int, b: int) -> int:
    """``ceil(n / b)``."""
    return math.ceil(n / b)
