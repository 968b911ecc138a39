"""vLLM's generation-side FP8 numerics, bit for bit, in eager torch.

The trainer quantizes as Transformer Engine does (:mod:`.quantize`: ``scale = 448 / amax``,
``q = cast(x * scale)``, ``scale_inv = 1 / scale``). vLLM's engine does not. These functions
reproduce what vLLM computes (0.17.1 to 0.34.0; where releases differ, a parameter names the
release's rule), read from its source
(``vllm/model_executor/layers/quantization/input_quant_fp8.py``,
``vllm/model_executor/layers/quantization/utils/fp8_utils.py``, ``vllm/utils/deep_gemm.py``),
so that a CPU experiment's engine side carries the same mismatch a GPU engine does:

* :func:`quantize_activation_vllm`: dynamic per-token-group activation quantization as
  ``QuantFP8(static=False, group_shape=GroupShape(1, 128)).forward_native`` computes it
  (the code vLLM runs on CPU, and on CUDA under its default torch.compile/Inductor mode, where
  custom ops are off): per group of ``group_size`` along the last dim, ``amax`` in the input
  dtype (NaN propagates), ``s = fp32(amax) / 448``; with ``ue8m0`` ``s = exp2(ceil(log2(s)))``
  (torch's ``log2``, so the rounding is that of the op, not an exact exponent bump); and the
  floor ``s = max(s, 1 / (448 * 512))``, whose place differs by release (:data:`FLOOR_ORDER`):
  up to vLLM 0.32 it comes *after* the rounding, so a zero or tiny group's UE8M0 scale is
  ``1/229376``, not a power of two; from 0.34 *before* it, so that scale is ``2^-17``. Then
  ``q = cast(clamp(x / s, -448, 448))`` with the division in fp32; ``s`` is the stored scale
  (the ``scale_inv`` of a :class:`QTensor`). A last partial group is zero-padded (padding
  never raises an amax). A NaN in a group makes its scale and every code of the group NaN;
  an infinite element makes the scale inf, the group's finite elements 0 and the infinite
  one NaN.
* :func:`requantize_ue8m0`: DeepGEMM's weight side with ``VLLM_USE_DEEP_GEMM_E8M0=1``
  (``requant_weight_ue8m0_inplace`` + ``per_block_cast_to_fp8(use_ue8m0=True)``): each
  block-FP8 weight is dequantized with its fp32 scales, then requantized per tile with
  ``sf = 2^ceil(log2(max(amax, 1e-4) / 448))`` and ``q = cast(w * (1 / sf))`` (no clamp).
* :func:`quantize_activation`: the one entry point by name, ``"vllm"``,
  ``"vllm_deepgemm_ue8m0"`` or ``"trainer"`` (TE's numerics, :func:`.quantize_blockwise`).

Where vLLM's CUDA kernel (``per_token_group_fp8_quant``, used when the ``quant_fp8`` custom op
is enabled, e.g. ``enforce_eager=True``) differs from ``forward_native``: it floors the
*amax* at ``1e-10`` instead of the scale at ``1/229376``, so groups with ``amax < 1/512``
get other scales and codes; its ``fmaxf`` reduction drops NaNs instead of propagating them;
its UE8M0 rounding bumps the exponent bits, where torch's fp32 ``log2`` can round a scale a
few ulps above a power of two onto it. Other groups quantize alike (``docs/hosts/vllm.md``).

Imports only torch and :mod:`nemo_fp8_plugin.errors` (and this package's :mod:`.quantize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import FP8ConfigError
from .formats import E4M3_MAX
from .quantize import QTensor, quantize_blockwise

__all__ = [
    "NUMERICS",
    "VLLM_FP8_MAX",
    "VLLM_MIN_SCALE",
    "DEEPGEMM_AMAX_FLOOR",
    "FLOOR_ORDER",
    "quantize_activation",
    "quantize_activation_vllm",
    "requantize_ue8m0",
]

NUMERICS = ("vllm", "vllm_deepgemm_ue8m0", "trainer")
"""Generation numerics by name (the recipe field ``generation_numerics``): ``vllm``
(``QuantFP8.forward_native``, fp32 scales), ``vllm_deepgemm_ue8m0`` (the same with UE8M0
power-of-2 scales, and weights requantized as DeepGEMM's E8M0 mode does), ``trainer``
(Transformer Engine's numerics, which no vLLM GPU kernel computes)."""

VLLM_FP8_MAX = E4M3_MAX
"""E4M3's largest finite value, vLLM's ``_FP8_MAX`` on CUDA and CPU (not ROCm's fnuz 224)."""

VLLM_MIN_SCALE = 1.0 / (VLLM_FP8_MAX * 512.0)
"""vLLM's ``_FP8_MIN_SCALING_FACTOR``: the floor of every dynamic activation scale."""

DEEPGEMM_AMAX_FLOOR = 1e-4
"""The amax floor of vLLM's ``per_block_cast_to_fp8`` (DeepGEMM weight requantization)."""

FLOOR_ORDER = ("after_rounding", "before_rounding")
"""Where ``QuantFP8.forward_native`` applies its scale floor relative to the UE8M0 rounding:
``after_rounding`` (vLLM 0.17.1 ... 0.32.0, ``input_quant_fp8.py``: round, then clamp) or
``before_rounding`` (vLLM 0.34.0: clamp, then round). Which release does which is the stacks
fact ``QuantFP8.forward_native:floor_before_ue8m0`` (the vLLM method passes its release's)."""

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise FP8ConfigError(f"expected a tensor, got {type(x).__name__}", key="x")
    if x.dtype not in _INPUT_DTYPES:
        raise FP8ConfigError(
            f"vLLM quantizes bfloat16, float16 or float32 activations, got {x.dtype}",
            key="x",
            value=str(x.dtype),
        )
    if x.dim() < 1:
        raise FP8ConfigError("expected a tensor of rank >= 1, got a 0-d tensor", key="x")


def quantize_activation_vllm(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    ue8m0: bool = False,
    column_major_scales: bool = False,
    floor: str = "after_rounding",
) -> QTensor:
    """vLLM's dynamic 1 x ``group_size`` activation quantization (``forward_native``).

    Args:
        x: ``[..., K]`` in bf16, fp16 or fp32 (any rank >= 1).
        group_size: elements per group along the last dim (vLLM's block FP8 uses 128).
        ue8m0: round each scale up to a power of two first (``use_ue8m0=True``: DeepGEMM's
            E8M0 mode, or the plugin's power-of-2 recipes on vLLM's kernels).
        column_major_scales: return the scales with vLLM's column-major strides (the
            values are the same; DeepGEMM's kernels ask for this layout).
        floor: where the scale floor goes relative to the UE8M0 rounding (:data:`FLOOR_ORDER`:
            the vLLM release's); without ``ue8m0`` both give the same scales.

    Returns:
        A :class:`QTensor`: ``data`` float8_e4m3fn of ``x``'s shape, ``scale_inv`` the
        stored fp32 scales ``[..., ceil(K / group_size)]``, ``block = (1, group_size)``.
    """
    _check_input(x)
    if floor not in FLOOR_ORDER:
        raise FP8ConfigError(
            f"floor must be one of {', '.join(FLOOR_ORDER)}, got {floor!r}",
            key="floor",
            value=floor,
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise FP8ConfigError(
            f"group_size must be a positive int, got {group_size!r}",
            key="group_size",
            value=group_size,
        )
    shape = x.shape
    k = shape[-1]
    groups = (k + group_size - 1) // group_size
    padded = groups * group_size
    xp = F.pad(x, (0, padded - k)) if padded != k else x
    grouped = xp.reshape(-1, groups, group_size)
    # The max runs in the input dtype (exact), then widens: as vLLM, so a NaN propagates.
    amax = grouped.abs().max(dim=-1, keepdim=True)[0].float()
    scale = amax / VLLM_FP8_MAX
    if floor == "before_rounding":
        scale = scale.clamp(min=VLLM_MIN_SCALE)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    if floor == "after_rounding":
        scale = scale.clamp(min=VLLM_MIN_SCALE)
    # bf16/fp16 / fp32 promotes to fp32: the division happens in fp32.
    data = (grouped / scale).clamp(-VLLM_FP8_MAX, VLLM_FP8_MAX).to(torch.float8_e4m3fn)
    data = data.reshape(-1, padded)
    if padded != k:
        data = data[..., :k]
    data = data.reshape(shape)
    scale = scale.reshape(*shape[:-1], groups)
    if column_major_scales and scale.dim() >= 2:
        scale = scale.transpose(-2, -1).contiguous().transpose(-2, -1)
    return QTensor(data=data, scale_inv=scale, fmt="e4m3", block=(1, group_size))


def requantize_ue8m0(q: QTensor) -> QTensor:
    """A block-FP8 weight as vLLM's DeepGEMM kernel holds it with ``VLLM_USE_DEEP_GEMM_E8M0=1``.

    ``requant_weight_ue8m0_inplace``: per matrix (a 3-D ``[E, N, K]`` stack matrix by
    matrix), ``w = fp32(q) * s`` with each fp32 tile scale repeated over its tile and cropped,
    then ``per_block_cast_to_fp8(w, block, use_ue8m0=True)``: zero-pad to whole tiles,
    ``amax = max(max|w|, 1e-4)`` per tile (NaN propagates), ``sf = 2^ceil(log2(amax / 448))``,
    ``q' = cast(w * (1 / sf))`` without a clamp, ``sf`` the new fp32 scale. MXFP8 (E8M0)
    weights are returned unchanged, as vLLM leaves them.
    """
    if not isinstance(q, QTensor):
        raise FP8ConfigError("requantize_ue8m0 takes a QTensor", key="q")
    if q.is_mx:
        return q
    if q.block is None or q.data.dtype != torch.float8_e4m3fn or q.data.dim() not in (2, 3):
        raise FP8ConfigError(
            "requantize_ue8m0 takes a block-scaled float8_e4m3fn weight [N, K] or [E, N, K]",
            key="q",
            value=repr(q),
        )
    bm, bk = q.block
    m, k = q.data.shape[-2], q.data.shape[-1]
    s = q.scale_inv.to(torch.float32)
    s_exp = torch.repeat_interleave(torch.repeat_interleave(s, bm, dim=-2), bk, dim=-1)
    w = q.data.to(torch.float32) * s_exp[..., :m, :k]
    pm, pk = (-m) % bm, (-k) % bk
    wp = F.pad(w, (0, pk, 0, pm)) if pm or pk else w
    lead = wp.shape[:-2]
    tiles = wp.reshape(*lead, (m + pm) // bm, bm, (k + pk) // bk, bk)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp(DEEPGEMM_AMAX_FLOOR)
    sf = amax / VLLM_FP8_MAX
    sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
    data = (tiles * (1.0 / sf)).to(torch.float8_e4m3fn).reshape(wp.shape)[..., :m, :k]
    scale = sf.reshape(*lead, tiles.shape[-4], tiles.shape[-2])
    return QTensor(data=data.contiguous(), scale_inv=scale, fmt="e4m3", block=(bm, bk))


def quantize_activation(
    x: torch.Tensor,
    numerics: str,
    block: tuple[int, int] = (1, 128),
    *,
    pow2_scales: bool = False,
    eps: float = 0.0,
    floor: str = "after_rounding",
) -> QTensor:
    """Quantize an activation ``[..., K]`` per ``block`` group as generation does.

    Args:
        x: the GEMM input, bf16, fp16 or fp32.
        numerics: ``"vllm"``, ``"vllm_deepgemm_ue8m0"`` or ``"trainer"`` (:data:`NUMERICS`).
        block: ``(1, group)``; vLLM's block FP8 uses ``(1, 128)``.
        pow2_scales: the recipe's ``pow2_scales``. Under ``"vllm"`` it selects UE8M0 scales
            (what the ``nemo_fp8`` method makes vLLM's kernels compute for a power-of-2
            recipe); under ``"trainer"`` TE's power-of-2 rounding. ``"vllm_deepgemm_ue8m0"``
            is UE8M0 either way.
        eps: the recipe's ``amax_epsilon``, applied under ``"trainer"`` only (vLLM's
            quantizer has its fixed floor, :data:`VLLM_MIN_SCALE`).
        floor: the vLLM release's place of that floor (:data:`FLOOR_ORDER`), for the two
            ``vllm`` numerics.

    Returns:
        A :class:`QTensor` usable by :func:`nemo_fp8_plugin.numerics.fp8_gemm`.
    """
    if not isinstance(numerics, str) or numerics not in NUMERICS:
        raise FP8ConfigError(
            f"expected one of {', '.join(NUMERICS)}, got {numerics!r}",
            key="generation_numerics",
            value=numerics,
        )
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or block[0] != 1
        or isinstance(block[1], bool)
        or not isinstance(block[1], int)
        or block[1] <= 0
    ):
        raise FP8ConfigError(
            f"activation groups are (1, n), got {block!r}", key="block", value=block
        )
    if numerics == "trainer":
        if x.dim() < 2:
            q = quantize_blockwise(
                x.reshape(1, -1), (1, block[1]), "e4m3", bool(pow2_scales), float(eps)
            )
            return QTensor(q.data.reshape(x.shape), q.scale_inv[0], q.fmt, q.block)
        x2 = x.reshape(-1, x.shape[-1])
        q = quantize_blockwise(x2, (1, block[1]), "e4m3", bool(pow2_scales), float(eps))
        return QTensor(
            q.data.reshape(x.shape),
            q.scale_inv.reshape(*x.shape[:-1], q.scale_inv.shape[-1]),
            q.fmt,
            q.block,
        )
    ue8m0 = numerics == "vllm_deepgemm_ue8m0" or bool(pow2_scales)
    return quantize_activation_vllm(x, block[1], ue8m0=ue8m0, floor=floor)
