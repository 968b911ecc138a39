"""The public quantizers: Transformer Engine's FP8 casts, bit for bit, on the fastest exact
kernel for the tensor.

Three families, each returning a :class:`QTensor`:

* :func:`quantize_per_tensor` - one fp32 scale for the whole tensor (TE current scaling,
  ``Float8CurrentScaling``); :func:`quantize_with_scale` casts with a given scale (TE
  delayed scaling, see :mod:`.delayed`).
* :func:`quantize_blockwise` - one fp32 scale per 1x128 or 128x128 tile (TE
  ``Float8BlockScaling``, DeepSeek-V3, vLLM block FP8).
* :func:`quantize_mxfp8` - one E8M0 scale per 32 elements (OCP MXFP8, TE
  ``MXFP8BlockScaling``).

Each checks its arguments (``FP8ConfigError`` naming the argument) and then picks a kernel:

* CPU tensors of at least :func:`kernel_min_numel` elements: the single-pass C++ kernels of
  :mod:`._cpu` (one read of the input, eight-lane FP8 encoding, OpenMP threads), built on
  first use and cached; tiles whose width is not a multiple of 8 (MXFP8 32x1) and smaller
  tensors take the reference.
* CUDA tensors from 2^20 elements (block scaling and MXFP8): the compiled kernels of
  :mod:`.fused` (Triton); per-tensor scaling runs the reference there (a few device kernels).
* Otherwise, or when a kernel is unavailable (no compiler, ``NEMO_FP8_CPU_KERNEL=0``,
  ``NEMO_FP8_FUSED=0``): the eager reference, :func:`quantize_blockwise_reference`,
  :func:`quantize_mxfp8_reference`, :func:`quantize_per_tensor_reference` and
  :func:`quantize_with_scale_reference` (module :mod:`.reference`), which every kernel is
  tested against bit for bit and which stay public for tests and comparisons.

Every path returns the same bits, so the choice never changes a result.
"""

from __future__ import annotations

import math
import os

import torch

from ..errors import FP8ConfigError
from . import _cpu
from . import fused as _fused
from .formats import (
    check_bool,
    check_eps,
    check_format,
    check_input_dtype,
    check_scale_tensor,
    fp8_max,
    input_dtype_max,
)
from .reference import (
    BlockLike,
    QTensor,
    block_quantize_core,
    check_block,
    check_mx_block,
    check_rank,
    check_size,
    dequantize_fp32,
    e8m0_tensor,
    mx_quantize_core,
    mx_scale_tiles,
    num_tiles,
    quantize_blockwise_reference,
    quantize_mxfp8_reference,
    quantize_per_tensor_reference,
    quantize_with_scale_reference,
    tensor_amax,
)
from .scaling import FLT_MAX, reciprocal, scale_from_amax

__all__ = [
    "QTensor",
    "quantize_per_tensor",
    "quantize_with_scale",
    "quantize_blockwise",
    "quantize_mxfp8",
    "quantize_per_tensor_reference",
    "quantize_with_scale_reference",
    "quantize_blockwise_reference",
    "quantize_mxfp8_reference",
    "tensor_amax",
    "check_block",
    "kernel_for",
    "kernel_min_numel",
    "block_quantize_core",
    "mx_quantize_core",
    "mx_scale_tiles",
    "dequantize_fp32",
    "e8m0_tensor",
    "num_tiles",
]


def _min_numel_from_env(default: int = 4096) -> int:
    # A tuning knob read once at import: a value that is not an integer >= 0 is named in one
    # warning and the default kept (importing the numerics must not fail on it).
    raw = os.environ.get("NEMO_FP8_CPU_KERNEL_MIN_NUMEL")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        import warnings

        warnings.warn(
            f"NEMO_FP8_CPU_KERNEL_MIN_NUMEL={raw[:40]!r} is not an integer >= 0; using {default}",
            RuntimeWarning,
            stacklevel=2,
        )
        return default
    return value


_MIN_NUMEL = {"value": _min_numel_from_env()}


def kernel_min_numel(value: int | None = None) -> int:
    """The size (elements) from which CPU tensors go to the C++ kernels (default 4096,
    ``NEMO_FP8_CPU_KERNEL_MIN_NUMEL``); below it the eager reference is as fast and needs no
    build. Pass ``value`` to change it; returns the previous value."""
    before = _MIN_NUMEL["value"]
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FP8ConfigError(
                f"expected an integer >= 0, got {value!r}", key="value", value=value
            )
        _MIN_NUMEL["value"] = value
    return before


def kernel_for(x: torch.Tensor, bn: int = 8) -> str:
    """The kernel the public quantizers use for ``x`` with tiles ``bn`` wide: ``"cpu"``
    (C++), ``"fused"`` (compiled, CUDA) or ``"reference"`` (eager)."""
    n = x.numel()
    if x.device.type == "cpu":
        if n >= max(1, _MIN_NUMEL["value"]) and bn % 8 == 0 and _cpu.kernels() is not None:
            return "cpu"
        return "reference"
    if n >= _fused._state["min_numel"] and _fused.fused_enabled():
        return "fused"
    return "reference"


def _lead3(x: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` or ``[E, N, K]`` as a contiguous ``[B, M, K]`` (a view when possible)."""
    x = x.detach()
    x3 = x.unsqueeze(0) if x.dim() == 2 else x
    return x3.contiguous()


def quantize_blockwise(
    x: torch.Tensor,
    block: BlockLike = (1, 128),
    fmt: str = "e4m3",
    pow2_scales: bool = False,
    eps: float = 0.0,
) -> QTensor:
    """Block scaling (TE ``Float8BlockScaling``): one fp32 scale per ``block`` tile.

    Args:
        x: ``[M, K]`` (fp32, bf16 or fp16), or ``[E, N, K]`` for a stack of MoE expert
            weights, quantized per expert (tiles never cross experts).
        block: ``(1, 128)`` (activations, gradients) or ``(128, 128)`` (weights); any
            ``(rows, cols)`` of positive ints works. An int ``n`` means ``(1, n)``.
        fmt: ``"e4m3"`` or ``"e5m2"`` (or the torch float8 dtype).
        pow2_scales: ``True`` to round scales down to powers of two (TE's default; NeMo RL
            sets ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` for fp32 scales). A bool only.
        eps: amax floor, a finite number >= 0.

    Per tile: ``amax`` (NaN ignored; out-of-range elements of partial tiles count as 0),
    ``scale = fp8_max / amax`` (the input dtype's max if that overflows, 1 if amax is 0 or
    inf), ``data = sat_cast(x * scale)``, ``scale_inv = 1 / scale``. ``scale_inv`` is
    ``[ceil(M/bm), ceil(K/bn)]``, or ``[E, ceil(N/bm), ceil(K/bn)]`` for 3-D input; data
    keeps the input shape. Runs on :func:`kernel_for`'s kernel; same bits as
    :func:`quantize_blockwise_reference`.
    """
    check_input_dtype(x)
    check_rank(x, (2, 3), "quantize_blockwise")
    fmt = check_format(fmt)
    bm, bn = check_block(block)
    check_size(x, bm, bn)
    pow2 = check_bool(pow2_scales, "pow2_scales")
    eps = check_eps(eps)
    kind = kernel_for(x, bn)
    if kind == "cpu":
        lib = _cpu.kernels()
        assert lib is not None
        data, sinv = lib.tiles(
            _lead3(x), bm, bn, fmt, mx=False, pow2=pow2, eps=eps, vinf=input_dtype_max(x.dtype)
        )
        return QTensor(data.reshape(x.shape), sinv if x.dim() == 3 else sinv[0], fmt, (bm, bn))
    if kind == "fused":
        return _fused.quantize_blockwise_fused(x, (bm, bn), fmt, pow2, eps)
    return quantize_blockwise_reference(x, (bm, bn), fmt, pow2, eps)


def quantize_mxfp8(x: torch.Tensor, block: BlockLike = 32, fmt: str = "e4m3") -> QTensor:
    """OCP MXFP8 (TE ``MXFP8BlockScaling``): one E8M0 scale per 32 elements.

    Args:
        x: any rank >= 1 for 1x32 blocks along the last dim; rank 2 or 3 for 32x32 and 32x1.
        block: ``32`` or ``(1, 32)`` (row-wise), ``(32, 1)`` (TE's column-wise copy,
            expressed on the untransposed tensor: the same bits as 1x32 on its transpose) or
            ``(32, 32)`` (TE ``enable_2d_quantization`` weights).
        fmt: ``"e4m3"`` (default) or ``"e5m2"``.

    Per block: ``e = ceil_pow2(amax * fp32(1/fp8_max))`` as the biased E8M0 exponent (amax 0
    -> 0x00, inf -> 0xFE), ``data = sat_cast(x * 2^(127 - e))`` (TE's ``exp2f_rcp``: 2^127
    for byte 0, 2^-127 for 0xFE, so an inf saturates to +-fp8_max), ``scale_inv`` = the E8M0
    byte, ``[..., K/32]``. TE requires dims divisible by 32; here a partial block is
    zero-padded like a partial block-scaling tile. Same bits as
    :func:`quantize_mxfp8_reference`.
    """
    check_input_dtype(x)
    fmt = check_format(fmt)
    bm, bn = check_mx_block(block)
    check_size(x, bm, bn)
    if bm == 1:
        check_rank(x, tuple(range(1, 9)), "quantize_mxfp8")
    else:
        check_rank(x, (2, 3), f"quantize_mxfp8 with {bm}x{bn} blocks")
    kind = kernel_for(x, bn)
    if kind == "cpu":
        lib = _cpu.kernels()
        assert lib is not None
        rows = math.prod(x.shape[:-1])
        x3 = x.detach().reshape(1, rows, x.shape[-1]) if bm == 1 else _lead3(x)
        data, e = lib.tiles(x3.contiguous(), bm, bn, fmt, mx=True)
        if bm == 1:
            e = e.reshape(*x.shape[:-1], e.shape[-1])
        elif x.dim() == 2:
            e = e[0]
        return QTensor(data.reshape(x.shape), e.view(torch.float8_e8m0fnu), fmt, (bm, bn))
    if kind == "fused":
        return _fused.quantize_mxfp8_fused(x, (bm, bn), fmt)
    return quantize_mxfp8_reference(x, (bm, bn), fmt)


def quantize_per_tensor(
    x: torch.Tensor, fmt: str = "e4m3", pow2_scales: bool = False, eps: float = 0.0
) -> QTensor:
    """Per-tensor current scaling (TE ``Float8CurrentScaling``).

    ``amax = max |x|`` (NaN ignored), ``scale = fp8_max / amax`` (FLT_MAX if that overflows,
    1 if amax is 0 or inf), optional power-of-2 rounding (``pow2_scales``, a bool),
    ``data = sat_cast(x * scale)``, ``scale_inv = 1 / scale`` (0-d fp32). Any shape. On the
    CPU from :func:`kernel_min_numel` elements: one threaded amax pass and one cast pass of
    the C++ kernels; same bits as :func:`quantize_per_tensor_reference`.
    """
    check_input_dtype(x)
    fmt = check_format(fmt)
    pow2 = check_bool(pow2_scales, "pow2_scales")
    eps = check_eps(eps)
    check_size(x)
    if kernel_for(x) != "cpu":
        return quantize_per_tensor_reference(x, fmt, pow2, eps)
    lib = _cpu.kernels()
    assert lib is not None
    xc = x.detach().contiguous()
    amax = torch.tensor(lib.amax(xc), dtype=torch.float32)
    scale = scale_from_amax(amax, fp8_max(fmt), pow2=pow2, eps=eps, value_for_inf=FLT_MAX)
    data = lib.scaled_cast(xc, float(scale), fmt)
    return QTensor(data, reciprocal(scale), fmt, None)


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3", scale_inv: torch.Tensor | None = None
) -> QTensor:
    """Cast ``x`` with a given per-tensor fp32 ``scale`` (delayed scaling's cast):
    ``data = sat_cast(x * scale)``. ``scale_inv`` defaults to the correctly rounded
    ``1 / scale``; delayed scaling passes the one stored in its state. Same bits as
    :func:`quantize_with_scale_reference`."""
    check_input_dtype(x)
    fmt = check_format(fmt)
    check_scale_tensor(scale, "scale")
    if scale_inv is not None:
        check_scale_tensor(scale_inv, "scale_inv")
    check_size(x)
    if kernel_for(x) != "cpu" or scale.device.type != "cpu":
        return quantize_with_scale_reference(x, scale, fmt, scale_inv)
    lib = _cpu.kernels()
    assert lib is not None
    s = scale.detach().to(torch.float32).reshape(())
    data = lib.scaled_cast(x.detach().contiguous(), float(s), fmt)
    sinv = reciprocal(s) if scale_inv is None else scale_inv.detach().to(torch.float32).reshape(())
    return QTensor(data, sinv, fmt, None)
