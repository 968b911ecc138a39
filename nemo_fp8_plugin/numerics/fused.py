"""Fused (``torch.compile``) versions of the reference quantizers, bit-identical to them.

The eager functions in :mod:`.reference` are the reference. The public quantizers
(:mod:`.quantize`) use these kernels for CUDA tensors; on a CPU they use the single-pass C++
kernels of :mod:`._cpu`, which are faster there (docs/performance.md), and these stay
reachable by name. The fake quantizers (``fake_quant_*``, the emulated linear's operands)
run on a CPU tensor as one C++ pass (quantize, then dequantize with torch's own float8 ->
fp32 table, one read and one write per tile) at any size, whenever the library loads and
the fused path is on; ``fused_mode(False)`` keeps them eager. The kernels here compute the same values with a formulation that
``torch.compile`` turns into one or two tight loops (C++/OpenMP on CPU, Triton on CUDA):

* amax: ``where(|x| == |x|, |x|, 0)`` (a vector compare) instead of ``isnan``;
* scale: the same float64 division and special cases as the reference;
* rounding to the FP8 grid without a float8 conversion (the emulation's fake-quant path):
  Veltkamp's split ``c = a*(2^(23-m) + 1); c - (c - a)`` rounds ``a = |v|`` to ``m``
  mantissa bits, to nearest even, and ``(a + q*2^23) - q*2^23`` rounds the subnormal range
  to its step ``q`` (both checked against torch's cast for every fp32 input in range).
  x86 CPUs without AVX-512 convert to and from float8 one element at a time, which
  otherwise dominates the kernel.
* data (the refit/benchmark path): one compiled kernel does amax, scale, multiply and the
  float8 cast (``cvt.rn.satfinite`` on CUDA; on an AVX2 CPU the cast is a per-element
  routine, which bounds this path there; see docs/performance.md).

Compiled functions are cached per variant (kind, tile, format, scale options, input dtype,
device, shape and strides), each with its own code object, compiled with static shapes
(Inductor's dynamic-shape CPU kernels measured several times slower). A new weight shape
costs one compile (seconds; Inductor's on-disk cache makes it cheap in later processes).

If compiling fails (no C++ compiler, an unsupported backend), a warning is issued once and
everything runs eagerly from then on. ``NEMO_FP8_FUSED=0`` (or :func:`fused_mode`) keeps
everything eager.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import torch

from . import _cpu
from .formats import (
    check_bool,
    check_eps,
    check_format,
    check_input_dtype,
    fp8_dtype,
    fp8_max,
    input_dtype_max,
)
from .reference import (
    BlockLike,
    QTensor,
    _expand_tiles,
    _tiled,
    check_block,
    check_mx_block,
    check_rank,
    check_size,
    mx_scale_tiles,
    quantize_blockwise_reference,
    quantize_mxfp8_reference,
    quantize_per_tensor_reference,
    quantize_with_scale_reference,
    tensor_amax,
)
from .scaling import FLT_MAX, e8m0_from_amax

__all__ = [
    "fused_enabled",
    "fused_mode",
    "quantize_blockwise_fused",
    "quantize_mxfp8_fused",
    "fake_quant_blockwise",
    "fake_quant_mxfp8",
    "fake_quant_per_tensor",
    "fake_quant_with_scale",
    "compile_failed",
    "cpu_fake_quant_enabled",
]


def _min_numel_from_env(default: int = 1 << 20) -> int:
    # A tuning knob read once at import: a value that is not an integer >= 0 (``abc``, 5000
    # digits: int() refuses those too) is named in one warning and the default kept, as
    # quantize.py does for NEMO_FP8_CPU_KERNEL_MIN_NUMEL (importing must not fail on it).
    raw = os.environ.get("NEMO_FP8_FUSED_MIN_NUMEL")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        warnings.warn(
            f"NEMO_FP8_FUSED_MIN_NUMEL={raw[:40]!r} is not an integer >= 0; using {default}",
            RuntimeWarning,
            stacklevel=2,
        )
        return default
    return value


class _State(TypedDict):
    enabled: bool
    """``NEMO_FP8_FUSED``, or :func:`fused_mode` while it is active."""
    failed: str | None
    """The compile error that switched the fused path off."""
    min_numel: int
    """Below this many elements the fake quantizers stay eager."""


_lock = threading.Lock()
_cache: dict[tuple, Callable] = {}
_state: _State = {
    "enabled": os.environ.get("NEMO_FP8_FUSED", "1").strip() not in ("0", "false", "no"),
    "failed": None,
    "min_numel": _min_numel_from_env(),
}

# (mantissa bits, smallest normal, subnormal step) per format
_GRID = {"e4m3": (3, 2.0**-6, 2.0**-9), "e5m2": (2, 2.0**-14, 2.0**-16)}


def fused_enabled() -> bool:
    """Whether quantizers use compiled kernels (on unless disabled or compiling failed)."""
    return _state["enabled"] and _state["failed"] is None


def compile_failed() -> str | None:
    """The error that switched the fused path off, or None."""
    return _state["failed"]


@contextlib.contextmanager
def fused_mode(enabled: bool, min_numel: int | None = None) -> Iterator[None]:
    """Temporarily turn the fused path on or off (``with fused_mode(False):`` runs the
    eager reference), optionally changing the size below which the emulation's
    fake-quantization stays eager (``NEMO_FP8_FUSED_MIN_NUMEL``, default 2^20 elements)."""
    before = (_state["enabled"], _state["min_numel"])
    _state["enabled"] = bool(enabled)
    if min_numel is not None:
        _state["min_numel"] = int(min_numel)
    try:
        yield
    finally:
        _state["enabled"], _state["min_numel"] = before


def _specialize(impl: Callable, name: str, **static: Any) -> Callable:
    """A fresh function (own code object) calling ``impl(*args, **static)``."""
    namespace: dict = {}
    source = f"def {name}(*args):\n    return _impl(*args, **_static)\n"
    exec(
        compile(source, f"<nemo_fp8_plugin fused {name}>", "exec"),  # fixed source text
        {"_impl": impl, "_static": static},
        namespace,
    )
    return namespace[name]


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))


def _compiled(key: tuple, impl: Callable, static: dict) -> Callable:
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                name = f"nemo_fp8_{impl.__name__.strip('_')}_{len(_cache)}"
                fn = torch.compile(_specialize(impl, name, **static), fullgraph=True, dynamic=False)
                _cache[key] = fn
    return fn


def _disable(exc: BaseException) -> None:
    _state["failed"] = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        "nemo_fp8_plugin.numerics: torch.compile of the fused quantizer failed "
        f"({type(exc).__name__}: {str(exc)[:200]}); using the eager reference "
        "from now on (slower, same results)",
        RuntimeWarning,
        stacklevel=4,
    )


def _use_fused(x: torch.Tensor, force: bool) -> bool:
    return fused_enabled() and x.numel() > 0 and (force or x.numel() >= _state["min_numel"])


def _run(kind: str, impl: Callable, static: dict, args: tuple, eager: Callable) -> Any:
    """Call the compiled variant of ``impl`` for these arguments; on a compile error warn
    once and fall back to ``eager``."""
    key = (kind, tuple(sorted(static.items()))) + tuple(
        _signature(a) for a in args if isinstance(a, torch.Tensor)
    )
    try:
        return _compiled(key, impl, static)(*args)
    except Exception as exc:  # any backend failure means: run eagerly
        _disable(exc)
        return eager()


# --------------------------------------------------------------------------- kernel pieces


def _abs_no_nan(xf: torch.Tensor) -> torch.Tensor:
    a = xf.abs()
    return torch.where(a == a, a, torch.zeros_like(a))


def _scale(amax: torch.Tensor, fmax: float, pow2: bool, eps: float, vinf: float) -> torch.Tensor:
    """The reference's ``scale_from_amax`` for a NaN-free amax, with compares only."""
    if eps > 0.0:
        amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    ad = amax.double()
    s = (torch.full_like(ad, fmax) / ad).float()
    inf = float("inf")
    s = torch.where(s == inf, torch.full_like(s, vinf), s)
    if pow2:
        s = (s.view(torch.int32) & -8388608).view(torch.float32)
    return torch.where((amax == 0) | (amax == inf), torch.ones_like(s), s)


def _inv(s: torch.Tensor) -> torch.Tensor:
    sd = s.double()
    return (torch.ones_like(sd) / sd).float()


def _round_to_grid(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values clamped to +-fp8_max -> the nearest FP8 value (ties to even), as fp32.

    Normal range: Veltkamp's split ``c = a * (2^(23-m) + 1); c - (c - a)`` rounds ``a`` to
    ``m`` mantissa bits, to nearest even. Subnormal range: ``(a + q*2^23) - q*2^23`` rounds
    to the step ``q``. Both were checked against torch's cast for every fp32 value from the
    format's 2^-11 (E4M3) / 2^-18 (E5M2) up to its max, and tests keep a sample of it.
    """
    mbits, min_normal, step = _GRID[fmt]
    a = v.abs()
    c = a * float(2 ** (23 - mbits) + 1)
    normal = c - (c - a)
    big = step * float(2**23)
    sub = (a + big) - big
    return torch.copysign(torch.where(a < min_normal, sub, normal), v)


def _tile_scale(
    x: torch.Tensor, bm: int, bn: int, fmt: str, pow2: bool, eps: float, vinf: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tiles = _tiled(x.float(), bm, bn)
    amax = _abs_no_nan(tiles).amax(dim=(-3, -1))
    return tiles, _scale(amax, fp8_max(fmt), pow2, eps, vinf)


# --------------------------------------------------------------------------- kernels


def _saturate(v: torch.Tensor, fmax: float) -> torch.Tensor:
    """Clamp to +-fmax keeping a NaN's sign: Inductor's CPU clamp turns every NaN into the
    x86 default NaN (sign set), which casts to 0xFF where the reference writes 0x7F."""
    return torch.where(v == v, v.clamp(-fmax, fmax), v)


def _block_cast(
    x: torch.Tensor, *, bm: int, bn: int, fmt: str, pow2: bool, eps: float, vinf: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tiles, s = _tile_scale(x, bm, bn, fmt, pow2, eps, vinf)
    fmax = fp8_max(fmt)
    v = _saturate(tiles * _expand_tiles(s), fmax)
    return v.to(fp8_dtype(fmt)).reshape(x.shape), _inv(s)


def _block_fq(
    x: torch.Tensor, *, bm: int, bn: int, fmt: str, pow2: bool, eps: float, vinf: float
) -> torch.Tensor:
    tiles, s = _tile_scale(x, bm, bn, fmt, pow2, eps, vinf)
    fmax = fp8_max(fmt)
    r = _round_to_grid((tiles * _expand_tiles(s)).clamp(-fmax, fmax), fmt)
    return (r * _expand_tiles(_inv(s))).reshape(x.shape)


def _mx_exponent(x: torch.Tensor, bm: int, bn: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    tiles = _tiled(x.float(), bm, bn)
    return tiles, e8m0_from_amax(_abs_no_nan(tiles).amax(dim=(-3, -1)), fp8_max(fmt))


def _mx_cast(x: torch.Tensor, *, bm: int, bn: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    tiles, e = _mx_exponent(x, bm, bn, fmt)
    fmax = fp8_max(fmt)
    v = _saturate(mx_scale_tiles(tiles, e), fmax)
    return v.to(fp8_dtype(fmt)).reshape(x.shape), e.to(torch.uint8)


def _mx_fq(x: torch.Tensor, *, bm: int, bn: int, fmt: str) -> torch.Tensor:
    tiles, e = _mx_exponent(x, bm, bn, fmt)
    fmax = fp8_max(fmt)
    r = _round_to_grid(mx_scale_tiles(tiles, e).clamp(-fmax, fmax), fmt)
    # 2^(e - 127) from the exponent bits; e == 0 is 2^-127, a subnormal (fraction bit 22).
    # e == 255 (a NaN amax) cannot occur: the amax ignores NaN.
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 1 << 22)).to(torch.int32)
    return (r * _expand_tiles(bits.view(torch.float32))).reshape(x.shape)


def _tensor_fq(x: torch.Tensor, *, fmt: str, pow2: bool, eps: float) -> torch.Tensor:
    xf = x.float()
    s = _scale(_abs_no_nan(xf).amax(), fp8_max(fmt), pow2, eps, FLT_MAX)
    fmax = fp8_max(fmt)
    return _round_to_grid((xf * s).clamp(-fmax, fmax), fmt) * _inv(s)


def _scaled_fq(
    x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, *, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    fmax = fp8_max(fmt)
    return (
        _round_to_grid((xf * scale).clamp(-fmax, fmax), fmt) * scale_inv,
        _abs_no_nan(xf).amax(),
    )


# --------------------------------------------------------------------------- drivers


def cpu_fake_quant_enabled() -> bool:
    """Whether the fake quantizers may take the C++ CPU kernels: the fused switch
    (``NEMO_FP8_FUSED``, :func:`fused_mode`), whatever became of torch.compile."""
    return bool(_state["enabled"])


def _cpu_kernels(x: torch.Tensor, dims: tuple[int, ...] | None = (2,)) -> _cpu.CpuKernels | None:
    """The C++ CPU library when it handles ``x`` (a CPU tensor of an input dtype, non-empty,
    of a rank in ``dims``, None for any rank) and the fused path is on, else None."""
    if not cpu_fake_quant_enabled() or x.device.type != "cpu" or x.numel() == 0:
        return None
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if dims is not None and x.dim() not in dims:
        return None
    return _cpu.kernels()


def _divisible(x: torch.Tensor, bm: int, bn: int) -> bool:
    return x.dim() >= 2 and x.shape[-2] % bm == 0 and x.shape[-1] % bn == 0


def quantize_blockwise_fused(
    x: torch.Tensor,
    block: BlockLike = (1, 128),
    fmt: str = "e4m3",
    pow2_scales: bool = False,
    eps: float = 0.0,
) -> QTensor:
    """:func:`~.reference.quantize_blockwise_reference` through compiled kernels (same bits).

    Inputs whose last two dims are not multiples of the tile, and empty ones, take the
    eager path; 3-D expert stacks are processed as one ``[E*N, K]`` matrix when ``N`` is a
    multiple of the tile rows (tiles never cross experts then).
    """
    check_input_dtype(x)
    check_rank(x, (2, 3), "quantize_blockwise_fused")
    fmt = check_format(fmt)
    bm, bn = check_block(block)
    check_size(x, bm, bn)
    pow2 = check_bool(pow2_scales, "pow2_scales")
    eps = check_eps(eps)

    def eager() -> QTensor:
        return quantize_blockwise_reference(x, (bm, bn), fmt, pow2, eps)

    if not _divisible(x, bm, bn) or not _use_fused(x, True):
        return eager()
    static = dict(bm=bm, bn=bn, fmt=fmt, pow2=pow2, eps=eps, vinf=input_dtype_max(x.dtype))
    x2 = x.reshape(-1, x.shape[-1])
    try:
        key = ("block_cast", tuple(sorted(static.items())), _signature(x2))
        data, sinv = _compiled(key, _block_cast, static)(x2)
    except Exception as exc:  # any backend failure means: run eagerly
        _disable(exc)
        return eager()
    lead = x.shape[:-2]
    if lead:
        sinv = sinv.reshape(*lead, -1, sinv.shape[-1])
    return QTensor(data.reshape(x.shape), sinv, fmt, (bm, bn))


def quantize_mxfp8_fused(x: torch.Tensor, block: BlockLike = 32, fmt: str = "e4m3") -> QTensor:
    """:func:`~.reference.quantize_mxfp8_reference` through compiled kernels (same bits);
    2-D and 3-D inputs with whole blocks, anything else eagerly."""
    check_input_dtype(x)
    fmt = check_format(fmt)
    bm, bn = check_mx_block(block)
    check_size(x, bm, bn)

    def eager() -> QTensor:
        return quantize_mxfp8_reference(x, (bm, bn), fmt)

    if x.dim() not in (2, 3) or not _divisible(x, bm, bn) or not _use_fused(x, True):
        return eager()
    static = dict(bm=bm, bn=bn, fmt=fmt)
    x2 = x.reshape(-1, x.shape[-1])
    try:
        key = ("mx_cast", tuple(sorted(static.items())), _signature(x2))
        data, e = _compiled(key, _mx_cast, static)(x2)
    except Exception as exc:  # any backend failure means: run eagerly
        _disable(exc)
        return eager()
    lead = x.shape[:-2]
    if lead:
        e = e.reshape(*lead, -1, e.shape[-1])
    return QTensor(data.reshape(x.shape), e.view(torch.float8_e8m0fnu), fmt, (bm, bn))


def fake_quant_blockwise(
    x: torch.Tensor,
    block: BlockLike,
    fmt: str,
    pow2_scales: bool = False,
    eps: float = 0.0,
    *,
    force: bool = False,
) -> torch.Tensor:
    """``quantize_blockwise(x, ...).dequantize()`` (fp32) in one compiled kernel (2-D
    inputs with whole tiles; smaller than the size threshold runs eagerly unless ``force``)."""
    bm, bn = check_block(block)
    check_size(x, bm, bn)
    fmt = check_format(fmt)
    pow2 = check_bool(pow2_scales, "pow2_scales")
    eps = check_eps(eps)

    def eager() -> torch.Tensor:
        return quantize_blockwise_reference(x, (bm, bn), fmt, pow2, eps).dequantize()

    lib = _cpu_kernels(x)
    if lib is not None:  # one pass in C++, any tile (partial tiles as the reference pads)
        vinf = input_dtype_max(x.dtype)
        return lib.fake_quant_tiles(
            x.contiguous(), bm, bn, fmt, mx=False, pow2=pow2, eps=eps, vinf=vinf
        )
    if x.dim() != 2 or not _divisible(x, bm, bn) or not _use_fused(x, force):
        return eager()
    static = dict(bm=bm, bn=bn, fmt=fmt, pow2=pow2, eps=eps, vinf=input_dtype_max(x.dtype))
    return _run("block_fq", _block_fq, static, (x,), eager)


def fake_quant_mxfp8(
    x: torch.Tensor, block: BlockLike, fmt: str, *, force: bool = False
) -> torch.Tensor:
    """``quantize_mxfp8(x, ...).dequantize()`` (fp32) in one compiled kernel; the same MXFP8
    tiles as ``quantize_mxfp8`` are accepted (1x32, 32x1, 32x32)."""
    bm, bn = check_mx_block(block)
    check_size(x, bm, bn)
    fmt = check_format(fmt)

    def eager() -> torch.Tensor:
        return quantize_mxfp8_reference(x, (bm, bn), fmt).dequantize()

    lib = _cpu_kernels(x)
    if lib is not None:
        return lib.fake_quant_tiles(x.contiguous(), bm, bn, fmt, mx=True)
    if x.dim() != 2 or not _divisible(x, bm, bn) or not _use_fused(x, force):
        return eager()
    return _run("mx_fq", _mx_fq, dict(bm=bm, bn=bn, fmt=fmt), (x,), eager)


def fake_quant_per_tensor(
    x: torch.Tensor, fmt: str, pow2_scales: bool = False, eps: float = 0.0, *, force: bool = False
) -> torch.Tensor:
    """``quantize_per_tensor(x, ...).dequantize()`` (fp32), compiled."""
    check_input_dtype(x)
    check_size(x)
    fmt = check_format(fmt)
    pow2 = check_bool(pow2_scales, "pow2_scales")
    eps = check_eps(eps)

    def eager() -> torch.Tensor:
        return quantize_per_tensor_reference(x, fmt, pow2, eps).dequantize()

    lib = _cpu_kernels(x, None)
    if lib is not None:  # amax pass, then one cast-and-decode pass
        xc = x.contiguous()
        scale, scale_inv = lib.scale_from_amax(lib.amax(xc), fmt, pow2=pow2, eps=eps, vinf=FLT_MAX)
        return lib.fake_quant_scaled(xc, scale, scale_inv, fmt, amax=False)[0]
    if not _use_fused(x, force):
        return eager()
    return _run("tensor_fq", _tensor_fq, dict(fmt=fmt, pow2=pow2, eps=eps), (x,), eager)


def fake_quant_with_scale(
    x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fmt: str, *, force: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling's cast: ``(dequantized fp32, amax of x)`` for a given scale."""
    check_input_dtype(x)
    check_size(x)
    fmt = check_format(fmt)

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        q = quantize_with_scale_reference(x, scale, fmt, scale_inv=scale_inv)
        return q.dequantize(), tensor_amax(x)

    lib = _cpu_kernels(x, None)
    if lib is not None and scale.device.type == "cpu" and scale_inv.device.type == "cpu":
        # one pass: cast with the given scale and the amax delayed scaling records
        out, amax = lib.fake_quant_scaled(
            x.contiguous(), float(scale.float()), float(scale_inv.float()), fmt, amax=True
        )
        return out, torch.tensor(amax, dtype=torch.float32)
    if not _use_fused(x, force):
        return eager()
    return _run("scaled_fq", _scaled_fq, dict(fmt=fmt), (x, scale, scale_inv), eager)
