"""RL in FP8: importance-sampling correction, mismatch metrics, sequence masking, the
trainer-side refit quantizer and its verification, FP8 checkpoint export and per-step scale
refresh.

Everything here is framework-neutral torch. Names load lazily so that importing one part
does not pay for the others.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazily loaded names, for type checkers and IDEs
    from .export import export_fp8_checkpoint
    from .importance import (
        gen_kl_error,
        importance_weights,
        kl_estimate,
        mismatch_metrics,
        policy_kl_error,
    )
    from .kv_scales import KVScaleCalibrator, refresh_scales
    from .refit import RefitLayoutError, quantize_for_refit
    from .sequence_mask import sequence_error_mask
    from .verify import verify_refit

# public name -> submodule that defines it
_EXPORTS = {
    "importance_weights": "importance",
    "mismatch_metrics": "importance",
    "gen_kl_error": "importance",
    "policy_kl_error": "importance",
    "kl_estimate": "importance",
    "sequence_error_mask": "sequence_mask",
    "quantize_for_refit": "refit",
    "RefitLayoutError": "refit",
    "export_fp8_checkpoint": "export",
    "KVScaleCalibrator": "kv_scales",
    "refresh_scales": "kv_scales",
    "verify_refit": "verify",
}

__all__ = [
    "KVScaleCalibrator",
    "RefitLayoutError",
    "export_fp8_checkpoint",
    "gen_kl_error",
    "importance_weights",
    "kl_estimate",
    "mismatch_metrics",
    "policy_kl_error",
    "quantize_for_refit",
    "refresh_scales",
    "sequence_error_mask",
    "verify_refit",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
