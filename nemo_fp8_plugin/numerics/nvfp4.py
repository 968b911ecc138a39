"""NVFP4 (Transformer Engine's ``NVFP4BlockScaling``), bit for bit, in eager torch.

NVFP4 stores E2M1 elements (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, under two
levels of scale:

* one fp32 *global* encode scale per tensor, ``448 * 6 / global_amax`` (an amax of 0 gives
  an infinite quotient, capped at FLT_MAX; an infinite amax gives 0, replaced by 1);
* one E4M3 *decode* scale per 1x16 group of a row (activations, gradients) or per 16x16
  tile (weights, TE's "2D" quantization): ``vec_max * (global_encode * fp32(1/6))``, capped at
  FLT_MAX, clamped to 448 and rounded to E4M3. The element multiplier is
  ``1 / (decode * global_decode)`` (capped at FLT_MAX), ``global_decode = 1 / global_encode``;
  the scaled values are clamped to +-6 and rounded to E2M1.

Rounding to E2M1 is round-to-nearest with ties to the even code (so 0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); a negative value that rounds to zero keeps
its sign (code 8), ``-0.0`` and NaN give code 0. Amaxes propagate NaN (``torch.amax``), so
one NaN makes the whole tensor's scales NaN and its codes 0; inf gives a global amax of inf.
A NaN scale is written as the canonical E4M3 NaN ``0x7F`` (the sign bit TE's reference leaves
on one depends on torch's CPU SIMD lanes, so it carries no meaning).

The optional random Hadamard transform (RHT, TE applies it to the wgrad operands) multiplies
every 16 consecutive elements of the last dim by ``diag(signs) @ H16 / 4`` (Sylvester H16,
TE's fixed sign vector), in the input dtype, before any amax is taken. Stochastic rounding
(TE applies it to gradients) keeps the scales and rounds each scaled value to one of its two
E2M1 neighbours with probability proportional to closeness, from ``torch.rand`` drawn with
the given generator: unbiased, and deterministic for a given generator state.

On a CPU, :func:`quantize_nvfp4` and :func:`fake_quant_nvfp4` run the single-pass C++
kernel of :mod:`._cpu` (same bits: the RHT stays the torch matmul the reference runs, and
stochastic rounding reads the same ``torch.rand`` draws, passed in);
:func:`quantize_nvfp4_reference` is the eager path, kept reachable by name.

The oracle is TE 2.20.2's own pure-torch reference
(``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``), which
``tests/numerics/test_numerics_nvfp4.py`` runs against this module; see ``docs/nvfp4.md``. This file
imports only torch, the plugin's error type, the format constants, the size check every quantizer
applies (``LIMITS.tensor_elements``) and the CPU kernel loader.

Over 600 lines on purpose: the format, its checks, the kernel path and the eager reference it
must match bit for bit stay side by side.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F

from ..errors import FP8ConfigError
from . import _cpu
from .formats import E2M1_MAX
from .formats import E4M3_MAX as _E4M3_MAX
from .reference import check_size

__all__ = [
    "NVFP4Tensor",
    "quantize_nvfp4",
    "quantize_nvfp4_reference",
    "fake_quant_nvfp4",
    "dequantize_nvfp4",
    "NVFP4_BLOCKS",
    "NVFP4_GROUP",
    "E2M1_MAX",
    "E2M1_VALUES",
    "RHT_SIGNS",
    "rht_matrix",
    "random_hadamard_transform",
    "nvfp4_global_encode_scale",
    "pack_e2m1",
    "unpack_e2m1",
]

NVFP4_GROUP = 16
"""Elements per E4M3 decode scale along the last dim (and rows per tile for 16x16)."""

NVFP4_BLOCKS = ((1, NVFP4_GROUP), (NVFP4_GROUP, NVFP4_GROUP))
"""Accepted ``block`` values: 1x16 groups (activations, gradients), 16x16 tiles (weights)."""

NVFP4Block: TypeAlias = "tuple[int, int] | list[int]"
"""An NVFP4 ``block`` argument: one of :data:`NVFP4_BLOCKS`, as a tuple or a list."""

_FLT_MAX = float(torch.finfo(torch.float32).max)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes by code (codes 8-15 are the same magnitudes, negative)."""

# Round to nearest: a magnitude moves past boundary i (between E2M1_VALUES[i] and [i+1]) when
# it is above it, or exactly on it when the upper code is the even one (ties to even).
_RN_BOUNDARIES = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TE's fixed ("random") sign vector of the 16-point Hadamard transform used for wgrad."""


# --------------------------------------------------------------------------- result type


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor (plain logical layout, not TE's swizzled cuBLAS layout).

    The source ``[..., K]`` is viewed as ``[M, K]`` with ``M`` the product of the leading
    dims (as TE does); ``dequantize()`` gives back ``shape``.
    """

    data: torch.Tensor
    """uint8 ``[M, K/2]``: two E2M1 codes per byte, column ``2j`` in the low nibble, ``2j+1`` in
    the high nibble; bit 3 of a code is its sign."""

    scale_inv: torch.Tensor
    """``torch.float8_e4m3fn`` decode scales: ``[M, K/16]`` for 1x16 groups, one per 16x16 tile
    ``[ceil(M/16), K/16]`` for 16x16."""

    global_amax: torch.Tensor
    """0-d fp32: the tensor amax the global scale came from (after the RHT when ``rht``)."""

    block: tuple[int, int]
    shape: torch.Size
    """Logical shape of the source tensor."""
    dtype: torch.dtype
    """dtype of the source tensor."""
    rht: bool = False
    """Whether ``data`` holds the random-Hadamard-transformed tensor."""
    stochastic: bool = False

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def global_encode_scale(self) -> torch.Tensor:
        """0-d fp32 ``448 * 6 / global_amax`` with TE's special cases."""
        return nvfp4_global_encode_scale(self.global_amax)

    @property
    def global_scale_inv(self) -> torch.Tensor:
        """0-d fp32 ``1 / global_encode_scale``, the second decode factor."""
        enc = self.global_encode_scale
        return torch.ones_like(enc) / enc

    def codes(self) -> torch.Tensor:
        """The E2M1 codes unpacked to uint8 ``[M, K]``."""
        return unpack_e2m1(self.data)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, *, undo_rht: bool = False
    ) -> torch.Tensor:
        """See :func:`dequantize_nvfp4`."""
        return dequantize_nvfp4(self, dtype, undo_rht=undo_rht)

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, block={self.block}, rht={self.rht}, "
            f"stochastic={self.stochastic}, scale_inv={tuple(self.scale_inv.shape)})"
        )


# --------------------------------------------------------------------------- helpers


def nvfp4_global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``448 * 6 / global_amax``, correctly rounded; infinite -> FLT_MAX; 0 -> 1 (an
    infinite amax). NaN stays NaN."""
    amax = global_amax.float()
    enc = torch.full_like(amax, _E4M3_MAX * E2M1_MAX) / amax  # tensor / tensor: exact rounding
    enc = torch.clamp(enc, max=_FLT_MAX)
    return torch.where(enc == 0, torch.ones_like(enc), enc)


def _sylvester(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix: entry (i, j) is (-1)^popcount(i & j)."""
    idx = torch.arange(n)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return 1.0 - 2.0 * parity.to(torch.float32)


def rht_matrix(
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The 16 x 16 RHT matrix ``diag(RHT_SIGNS) @ H16 / 4`` (orthogonal; entries +-1/4, exact
    in every float dtype). A row vector ``v`` of 16 is transformed as ``v @ rht_matrix()``."""
    return _rht(dtype, torch.device(device) if device is not None else None).clone()


@functools.lru_cache(maxsize=32)
def _rht(dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """:func:`rht_matrix`, built once per dtype and device (read only: callers never write
    to it; the emulation transforms every wgrad operand with it)."""
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    m = signs[:, None] * _sylvester(NVFP4_GROUP) * 0.25
    return m.to(dtype=dtype, device=device)


def random_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """The RHT over each 16 consecutive elements of the last dim, as one matmul in ``x.dtype``
    (TE's reference does the same, so its rounding in bf16/fp16 is the matmul's)."""
    if x.shape[-1] % NVFP4_GROUP:
        raise FP8ConfigError(
            f"the random Hadamard transform needs the last dim of `x` divisible by "
            f"{NVFP4_GROUP}, got shape {tuple(x.shape)}",
            key="x",
            value=tuple(x.shape),
        )
    rows = x.contiguous().reshape(-1, NVFP4_GROUP)
    return (rows @ _rht(x.dtype, x.device)).reshape(x.shape)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[M, K]`` (K even) -> bytes ``[M, K/2]``, even column in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """Bytes ``[M, K/2]`` -> uint8 codes ``[M, K]`` (inverse of :func:`pack_e2m1`)."""
    lo = data & 0x0F
    hi = data >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)


def _magnitude_rn(a: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude code (0-7) of ``a`` in [0, 6], round to nearest, ties to even. NaN -> 0."""
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for boundary, tie_goes_up in _RN_BOUNDARIES:
        moved = (a >= boundary) if tie_goes_up else (a > boundary)
        mag += moved.to(torch.uint8)
    return mag


def _magnitude_sr(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude code of ``a`` in [0, 6]: the lower neighbour, or the upper one when
    ``u < (a - lower) / (upper - lower)`` (``u`` uniform in [0, 1)). NaN -> 0."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=a.device)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, len(E2M1_VALUES) - 1)
    hi = (lo + 1).clamp(max=len(E2M1_VALUES) - 1)
    lo_v, hi_v = grid[lo], grid[hi]
    gap = hi_v - lo_v
    # a - lo_v and the division by a power of two (0.5, 1 or 2) are exact in fp32.
    p = torch.where(
        gap > 0, (a - lo_v) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(a)
    )
    mag = lo + (u < p).to(lo.dtype)
    return torch.where(torch.isnan(a), torch.zeros_like(mag), mag).to(torch.uint8)


def _e2m1_codes(v: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """E2M1 codes (uint8 0-15) of fp32 ``v`` already clamped to +-6."""
    a = v.abs()
    mag = _magnitude_rn(a) if u is None else _magnitude_sr(a, u)
    sign = (v < 0).to(torch.uint8) << 3  # -0.0 and NaN: no sign bit
    return mag | sign


# --------------------------------------------------------------------------- checks


def _check_inputs(
    x: torch.Tensor,
    block: object,
    global_amax: object,
    rht: object,
    stochastic: object,
    generator: object,
) -> tuple[tuple[int, int], torch.Tensor | None]:
    if not isinstance(x, torch.Tensor):
        raise FP8ConfigError(
            f"quantize_nvfp4 expects a torch.Tensor `x`, got {type(x).__name__}",
            key="x",
            value=type(x).__name__,
        )
    if x.dtype not in _INPUT_DTYPES:
        raise FP8ConfigError(
            f"tensor `x` has dtype {x.dtype}; NVFP4 quantizes float32, bfloat16 or float16",
            key="x",
            value=str(x.dtype),
        )
    if x.layout != torch.strided:
        raise FP8ConfigError(
            f"cannot quantize a {x.layout} tensor",
            key="x",
            value=str(x.layout),
            hint="convert it to a dense tensor first (.to_dense())",
        )
    if x.dim() < 2:
        raise FP8ConfigError(
            f"tensor `x` must have at least 2 dims ([..., K]), got shape {tuple(x.shape)}",
            key="x",
            value=tuple(x.shape),
        )
    if x.shape[-1] == 0:
        raise FP8ConfigError(
            f"tensor `x` has shape {tuple(x.shape)}: its last dim (K) is 0",
            key="x",
            value=tuple(x.shape),
        )
    if x.shape[-1] % NVFP4_GROUP:
        raise FP8ConfigError(
            f"tensor `x` has shape {tuple(x.shape)}: its last dim {x.shape[-1]} is not a "
            f"multiple of {NVFP4_GROUP} (one E4M3 scale per {NVFP4_GROUP} elements)",
            key="x",
            value=tuple(x.shape),
            hint="pad K to a multiple of 16",
        )
    if isinstance(block, list):
        block = tuple(block)
    if not (
        isinstance(block, tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in block)
        and block in NVFP4_BLOCKS
    ):
        raise FP8ConfigError(
            f"NVFP4 `block` must be (1, 16) or (16, 16), got {block!r}", key="block", value=block
        )
    # from the shape, before a byte is allocated (an expanded view of 2^40 elements)
    check_size(x, block[0], NVFP4_GROUP)
    for name, flag in (("rht", rht), ("stochastic", stochastic)):
        if not isinstance(flag, bool):
            raise FP8ConfigError(
                f"`{name}` must be True or False, got {flag!r}", key=name, value=flag
            )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise FP8ConfigError(
            f"`generator` must be a torch.Generator or None, got {type(generator).__name__}",
            key="generator",
            value=type(generator).__name__,
        )
    if global_amax is not None:
        global_amax = _check_global_amax(global_amax, x.device)
    return block, global_amax


def _check_global_amax(global_amax: object, device: torch.device) -> torch.Tensor:
    if isinstance(global_amax, bool) or not isinstance(global_amax, (int, float, torch.Tensor)):
        raise FP8ConfigError(
            f"`global_amax` must be a number or a one-element tensor, got "
            f"{type(global_amax).__name__}",
            key="global_amax",
            value=type(global_amax).__name__,
        )
    if isinstance(global_amax, torch.Tensor):
        if global_amax.is_meta:
            raise FP8ConfigError(
                "`global_amax` is a meta tensor: it holds no value",
                key="global_amax",
                value="meta",
            )
        if global_amax.numel() != 1 or not global_amax.is_floating_point():
            raise FP8ConfigError(
                f"`global_amax` must be a one-element float tensor, got shape "
                f"{tuple(global_amax.shape)} {global_amax.dtype}",
                key="global_amax",
                value=tuple(global_amax.shape),
            )
        amax = global_amax.detach().reshape(()).to(device=device, dtype=torch.float32)
    else:
        amax = torch.tensor(float(global_amax), dtype=torch.float32, device=device)
    if bool(torch.isnan(amax)) or bool(amax < 0):
        raise FP8ConfigError(
            f"`global_amax` must be >= 0 (inf allowed), got {amax.item()}",
            key="global_amax",
            value=amax.item(),
        )
    return amax


# --------------------------------------------------------------------------- quantize


def _cpu_lib(x: torch.Tensor) -> _cpu.CpuKernels | None:
    """The C++ library for a non-empty CPU tensor (None: the eager path)."""
    if x.device.type != "cpu" or x.numel() == 0:
        return None
    from .fused import cpu_fake_quant_enabled  # the FP8 fake quantizers' switch

    return _cpu.kernels() if cpu_fake_quant_enabled() else None


def _prepare(
    x: torch.Tensor,
    block: NVFP4Block,
    global_amax: float | torch.Tensor | None,
    rht: bool,
    stochastic: bool,
    generator: torch.Generator | None,
) -> tuple[tuple[int, int], torch.Tensor | None, torch.Tensor]:
    """Checks, the RHT (a torch matmul, as the reference), the global amax and the uniform
    draws of stochastic rounding, for the C++ path."""
    block, amax_in = _check_inputs(x, block, global_amax, rht, stochastic, generator)
    x2 = x.reshape(-1, x.shape[-1])
    if rht:
        x2 = random_hadamard_transform(x2)
    return block, amax_in, x2.contiguous()


def _cpu_global_amax(
    lib: _cpu.CpuKernels, x2: torch.Tensor, amax_in: torch.Tensor | None
) -> torch.Tensor:
    if amax_in is not None:
        return amax_in.to(torch.float32)
    amax = lib.amax_nan(x2)
    return torch.tensor(math.nan if math.isnan(amax) else amax, dtype=torch.float32)


def _draws(
    x2: torch.Tensor, stochastic: bool, generator: torch.Generator | None
) -> torch.Tensor | None:
    if not stochastic:
        return None
    return torch.rand(x2.shape, generator=generator, dtype=torch.float32, device=x2.device)


@torch.no_grad()
def quantize_nvfp4(
    x: torch.Tensor,
    block: NVFP4Block = (1, 16),
    *,
    global_amax: float | torch.Tensor | None = None,
    rht: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` (``[..., K]``, K a multiple of 16; float32, bfloat16 or float16) to NVFP4.

    Args:
        x: the tensor; leading dims are flattened into ``M`` rows.
        block: ``(1, 16)`` (one decode scale per 16 elements of a row) or ``(16, 16)`` (one per
            16x16 tile; a last partial tile of rows is zero-padded, which never raises an amax).
        global_amax: the per-tensor amax to scale with (a number or one-element tensor, >= 0);
            default ``max |x|`` (after the RHT), NaN-propagating as TE's reference.
        rht: apply the 16-point random Hadamard transform to the last dim first (TE does this
            to the wgrad operands: pass the transposed tensor, ``x.t()``, whose last dim is the
            GEMM's reduction dim).
        stochastic: stochastic rounding of the elements (scales unchanged).
        generator: the ``torch.Generator`` the stochastic rounding draws from (on ``x``'s
            device); ``None`` draws from torch's default generator.

    Returns:
        :class:`NVFP4Tensor`. On a CPU the C++ kernel computes it, else
        :func:`quantize_nvfp4_reference`; the same bits.

    Raises:
        FP8ConfigError: naming ``x``, ``block``, ``global_amax``, ``rht``, ``stochastic`` or
            ``generator``.
    """
    lib = _cpu_lib(x) if isinstance(x, torch.Tensor) else None
    if lib is None or x.dtype not in _INPUT_DTYPES:
        return quantize_nvfp4_reference(
            x, block, global_amax=global_amax, rht=rht, stochastic=stochastic, generator=generator
        )
    block, amax_in, x2 = _prepare(x, block, global_amax, rht, stochastic, generator)
    amax = _cpu_global_amax(lib, x2, amax_in)
    u = _draws(x2, stochastic, generator)
    data, scales, _ = lib.nvfp4(x2, block[0], float(amax), u, packed=True, fake=False)
    assert data is not None and scales is not None  # packed=True computes both
    return NVFP4Tensor(
        data=data,
        scale_inv=scales,
        global_amax=amax,
        block=block,
        shape=x.shape,
        dtype=x.dtype,
        rht=rht,
        stochastic=stochastic,
    )


@torch.no_grad()
def fake_quant_nvfp4(
    x: torch.Tensor,
    block: NVFP4Block = (1, 16),
    *,
    rht: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``dequantize_nvfp4(quantize_nvfp4(x, ...), torch.float32, undo_rht=rht)`` (the
    emulated linear's NVFP4 operand), on a CPU in one C++ pass that writes the fp32 values
    without packing; the same bits as the two calls."""
    lib = _cpu_lib(x) if isinstance(x, torch.Tensor) else None
    if lib is None or x.dtype not in _INPUT_DTYPES:
        q = quantize_nvfp4(x, block, rht=rht, stochastic=stochastic, generator=generator)
        return dequantize_nvfp4(q, torch.float32, undo_rht=rht)
    block, amax_in, x2 = _prepare(x, block, None, rht, stochastic, generator)
    amax = _cpu_global_amax(lib, x2, amax_in)
    u = _draws(x2, stochastic, generator)
    _, _, out = lib.nvfp4(x2, block[0], float(amax), u, packed=False, fake=True)
    assert out is not None  # fake=True computes it
    if rht:
        m, k = out.shape
        out = (out.reshape(-1, NVFP4_GROUP) @ _rht(torch.float32, out.device).T).reshape(m, k)
    return out.reshape(x.shape)


@torch.no_grad()
def quantize_nvfp4_reference(
    x: torch.Tensor,
    block: NVFP4Block = (1, 16),
    *,
    global_amax: float | torch.Tensor | None = None,
    rht: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Tensor:
    """The eager reference of :func:`quantize_nvfp4`: the same arguments, result and errors."""
    block, amax_in = _check_inputs(x, block, global_amax, rht, stochastic, generator)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if rht:
        x2 = random_hadamard_transform(x2)
    m, k = x2.shape
    bm = block[0]
    n_groups = k // NVFP4_GROUP

    xf = x2.float()
    if amax_in is None:
        # NaN-propagating (torch.amax), as TE's reference: one NaN makes the tensor NaN-scaled.
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=xf.device)
    else:
        amax = amax_in
    amax = amax.to(torch.float32)

    rows_t = -(-m // bm)
    if xf.numel() == 0:
        return NVFP4Tensor(
            data=torch.empty((m, k // 2), dtype=torch.uint8, device=x.device),
            scale_inv=torch.empty((rows_t, n_groups), dtype=torch.float8_e4m3fn, device=x.device),
            global_amax=amax,
            block=block,
            shape=shape,
            dtype=x.dtype,
            rht=rht,
            stochastic=stochastic,
        )

    # Per-group (1x16) or per-tile (16x16) amax, fp32, NaN-propagating.
    padded = F.pad(xf, (0, 0, 0, rows_t * bm - m)) if rows_t * bm != m else xf
    tiles = padded.reshape(rows_t, bm, n_groups, NVFP4_GROUP)
    vec_max = tiles.abs().amax(dim=(1, 3))  # [rows_t, n_groups]

    global_enc = nvfp4_global_encode_scale(amax)
    global_dec = torch.ones_like(global_enc) / global_enc
    # The 1/6 is folded into the global multiplier (one fp32 product), not divided per block.
    one_sixth = torch.ones_like(global_enc) / torch.full_like(global_enc, E2M1_MAX)
    multiplier = global_enc * one_sixth
    decode = torch.clamp(vec_max * multiplier, max=_FLT_MAX)
    decode = torch.clamp(decode, min=-_E4M3_MAX, max=_E4M3_MAX)
    # One canonical NaN (E4M3 0x7F): the sign bit torch's CPU min/clamp leave on a NaN
    # depends on the element's SIMD lane, which is noise, not numerics.
    decode = torch.where(torch.isnan(decode), torch.full_like(decode, float("nan")), decode)
    decode = decode.to(torch.float8_e4m3fn)

    denom = decode.float() * global_dec
    encode = torch.clamp(torch.ones_like(denom) / denom, max=_FLT_MAX)  # 1/0 -> FLT_MAX
    encode = encode.repeat_interleave(bm, dim=0)[:m] if bm > 1 else encode
    scaled = xf.reshape(m, n_groups, NVFP4_GROUP) * encode.unsqueeze(-1)
    scaled = torch.clamp(scaled, -E2M1_MAX, E2M1_MAX).reshape(m, k)

    u = None
    if stochastic:
        u = torch.rand(scaled.shape, generator=generator, dtype=torch.float32, device=scaled.device)
    data = pack_e2m1(_e2m1_codes(scaled, u))
    return NVFP4Tensor(
        data=data,
        scale_inv=decode,
        global_amax=amax,
        block=block,
        shape=shape,
        dtype=x.dtype,
        rht=rht,
        stochastic=stochastic,
    )


def dequantize_nvfp4(
    q: NVFP4Tensor, dtype: torch.dtype = torch.float32, *, undo_rht: bool = False
) -> torch.Tensor:
    """``E2M1 value * (decode_scale * global_scale_inv)`` in fp32, shaped like the source and
    returned in ``dtype``.

    This is the exact product the quantizer inverted. TE's GEMM applies the global part as
    ``global_amax / (6 * 448)`` per operand in its epilogue instead, which can differ from
    ``1 / global_encode`` in the last bit. With ``rht`` the values are in the transformed
    domain (a GEMM whose two operands are both transformed needs nothing more); ``undo_rht``
    applies the inverse transform (the transpose of :func:`rht_matrix`) in fp32.
    """
    if not isinstance(q, NVFP4Tensor):
        raise FP8ConfigError(
            f"dequantize_nvfp4 expects an NVFP4Tensor `q`, got {type(q).__name__}",
            key="q",
            value=type(q).__name__,
        )
    codes = unpack_e2m1(q.data).long()
    m, k = codes.shape
    lut = torch.tensor(
        E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device
    )
    values = lut[codes].reshape(m, k // NVFP4_GROUP, NVFP4_GROUP)
    factor = q.scale_inv.float() * q.global_scale_inv
    bm = q.block[0]
    if bm > 1:
        factor = factor.repeat_interleave(bm, dim=0)[:m]
    out = (values * factor.unsqueeze(-1)).reshape(m, k)
    if undo_rht and q.rht:
        out = (out.reshape(-1, NVFP4_GROUP) @ _rht(torch.float32, out.device).T).reshape(m, k)
    out = out.reshape(q.shape)
    return out if dtype == torch.float32 else out.to(dtype)
