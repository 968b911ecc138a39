"""Element and scale formats (their constants derived from torch and the bit layouts) and the
argument checks shared by the numerics package.

Only torch and the plugin's stdlib-only error type are imported here. The maxima come from
``torch.finfo`` where torch has the dtype, as torchao does (``torchao/prototype/mx_formats/
constants.py``, torchao 0.18: ``F8E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max``), and from
the bit layout where it has none (E2M1, which torch stores only packed two to a byte). The
torch-free capability table (:data:`nemo_fp8_plugin.capabilities.FORMAT_MAX`) states the same
numbers; ``tests/test_capabilities.py`` checks that both agree.
"""

from __future__ import annotations

import math

import torch

from ..errors import FP8ConfigError, format_value

__all__ = [
    "FORMATS",
    "E4M3_MAX",
    "E5M2_MAX",
    "E2M1_MAX",
    "E2M1_EXP_BIAS",
    "E2M1_MANTISSA_BITS",
    "E8M0_EXPONENT_BIAS",
    "E8M0_NAN",
    "E8M0_MAX",
    "E8M0_MIN",
    "fp8_dtype",
    "fp8_max",
    "check_format",
    "check_input_dtype",
    "input_dtype_max",
    "check_bool",
    "check_eps",
    "check_scale_tensor",
]

FORMATS = ("e4m3", "e5m2")
"""Element formats: ``"e4m3"`` (``torch.float8_e4m3fn``, max 448) and ``"e5m2"``
(``torch.float8_e5m2``, max 57344)."""

_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""448: E4M3 (``float8_e4m3fn``: 4 exponent bits, bias 7, 3 mantissa bits, no infinity; only
S.1111.111 is NaN, so the largest is 1.75 * 2**8)."""

E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)
"""57344: E5M2 (IEEE-like, bias 15, infinities: the largest is 1.75 * 2**15)."""

E2M1_EXP_BIAS = 1
"""FP4 E2M1's exponent bias (OCP MX specification v1.0, section 5.3.3)."""

E2M1_MANTISSA_BITS = 1
"""FP4 E2M1's mantissa bits."""

_E2M1_EXP_BITS = 2

E2M1_MAX = 2.0 ** (2**_E2M1_EXP_BITS - 1 - E2M1_EXP_BIAS) * (
    1.0 + (2**E2M1_MANTISSA_BITS - 1) / 2**E2M1_MANTISSA_BITS
)
"""6: FP4 E2M1 (no infinity or NaN; the largest exponent field 3 with bias 1 is 2**2, times
1.5), NVFP4's element format. torch has no ``finfo`` for its packed ``float4_e2m1fn_x2``."""

E8M0_EXPONENT_BIAS = 127
"""E8M0 (``torch.float8_e8m0fnu``): a byte ``e`` is the scale ``2**(e - 127)``."""

E8M0_NAN = 0xFF
"""The E8M0 byte that is NaN (the format has no zero and no infinity)."""

E8M0_MAX = float(torch.finfo(torch.float8_e8m0fnu).max)
"""2**127 (byte 0xFE)."""

E8M0_MIN = float(torch.finfo(torch.float8_e8m0fnu).tiny)
"""2**-127 (byte 0x00)."""

_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
_FROM_DTYPE = {v: k for k, v in _DTYPES.items()}

# Inputs Transformer Engine quantizes; anything else would be rounded before the cast.
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_format(fmt: str | torch.dtype) -> str:
    """Normalise ``fmt`` (``"e4m3"``, ``"e5m2"`` or the torch float8 dtype) to its name."""
    if isinstance(fmt, torch.dtype) and fmt in _FROM_DTYPE:
        return _FROM_DTYPE[fmt]
    if isinstance(fmt, str) and fmt.lower() in _DTYPES:
        return fmt.lower()
    raise FP8ConfigError(
        f"unknown FP8 element format {fmt!r}", key="fmt", value=fmt, hint="use 'e4m3' or 'e5m2'"
    )


def fp8_dtype(fmt: str | torch.dtype) -> torch.dtype:
    """The torch float8 dtype of a format name."""
    return _DTYPES[check_format(fmt)]


def fp8_max(fmt: str | torch.dtype) -> float:
    """Largest finite magnitude of a format (448 for E4M3, 57344 for E5M2)."""
    return _MAX[check_format(fmt)]


def check_input_dtype(x: torch.Tensor, name: str = "x") -> None:
    """Refuse inputs other than fp32/bf16/fp16 (TE quantizes only those)."""
    if not isinstance(x, torch.Tensor):
        raise FP8ConfigError(f"expected a tensor, got {type(x).__name__}", key=name)
    if x.layout != torch.strided:
        raise FP8ConfigError(
            f"cannot quantize a {x.layout} tensor",
            key=name,
            value=str(x.layout),
            hint="convert it to a dense tensor first (.to_dense())",
        )
    if x.dtype not in _INPUT_DTYPES:
        raise FP8ConfigError(
            f"cannot quantize a {x.dtype} tensor",
            key=name,
            value=str(x.dtype),
            hint="convert it to float32, bfloat16 or float16 first",
        )


def input_dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of the input dtype: block scaling's stand-in for an infinite scale."""
    return float(torch.finfo(dtype).max)


def check_bool(value: object, name: str) -> bool:
    """A flag argument: ``True`` or ``False`` only (``"false"`` or ``1`` is a mistake, never
    read as a boolean)."""
    if not isinstance(value, bool):
        raise FP8ConfigError(
            f"expected True or False, got {type(value).__name__} {format_value(value)}",
            key=name,
            value=value,
        )
    return value


def check_eps(value: object, name: str = "eps") -> float:
    """The amax floor: a finite real number >= 0 (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FP8ConfigError(
            f"expected a number >= 0, got {type(value).__name__} {format_value(value)}",
            key=name,
            value=value,
        )
    eps = float(value)
    if not math.isfinite(eps) or eps < 0.0:
        raise FP8ConfigError(f"expected a finite number >= 0, got {eps!r}", key=name, value=value)
    return eps


def check_scale_tensor(value: object, name: str) -> None:
    """A given per-tensor scale: a one-element floating-point tensor, not NaN and not
    negative (checked for CPU tensors only: reading a GPU value would synchronise the
    device at every delayed-scaling cast)."""
    if not isinstance(value, torch.Tensor):
        raise FP8ConfigError(
            f"expected a one-element float tensor, got {type(value).__name__}", key=name
        )
    if value.numel() != 1 or not value.dtype.is_floating_point:
        raise FP8ConfigError(
            f"expected a one-element float tensor, got {value.dtype} of shape {tuple(value.shape)}",
            key=name,
            value=tuple(value.shape),
        )
    if value.is_meta:  # no value to cast with (the cast raised NotImplementedError)
        raise FP8ConfigError("a meta tensor holds no value", key=name, value="meta")
    if value.device.type == "cpu":
        v = float(value.detach().reshape(()))
        if not v >= 0.0:  # NaN compares false
            raise FP8ConfigError(
                f"expected a scale >= 0, got {v!r}",
                key=name,
                value=v,
                hint="a scale is fp8_max / amax: never NaN or negative",
            )
