"""NeMo RL's own FP8 start-up asserts, run before NeMo RL runs them.

Each release's ``nemo_rl/algorithms/grpo.py`` (``setup``, vLLM backend) stops the job at step
0 on an FP8 configuration it cannot run, and its ``ClippedPGLossFn`` on a truncation setting
it cannot read; :func:`startup_problems` states the same conditions on a whole (resolved)
configuration, one :class:`FP8ConfigError` each, naming the key to change, the release and the
upstream line. ``apply`` and ``explain`` refuse the first (the NeMo RL adapter runs them on
the configuration it would write); ``doctor`` can list them all.

The lines cited are each release's (``tests/hosts/nemo_rl/test_nemo_rl_startup.py`` reads
them in the three source trees): they moved, the conditions did not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ...dotted import get_path
from ...errors import FP8ConfigError

__all__ = ["ASSERTS", "KV_CACHE_DTYPES", "importance_sampling_required", "startup_problems"]

_VLLM = "policy.generation.vllm_cfg"
_MEGATRON = "policy.megatron_cfg"
_IS = "loss_fn.use_importance_sampling_correction"
_REPLAY = "policy.router_replay.enabled"

ASSERTS: dict[str, dict[str, tuple[str, int]]] = {
    # grpo.py setup(), backend == "vllm"
    "fp8_generation_needs_importance_sampling": {
        "0.6.0": ("nemo_rl/algorithms/grpo.py", 662),
        "0.7.0": ("nemo_rl/algorithms/grpo.py", 1000),
        "main-2026-08-22": ("nemo_rl/algorithms/grpo.py", 1322),
    },
    "fp8_kv_cache_not_dtensor": {
        "0.6.0": ("nemo_rl/algorithms/grpo.py", 672),
        "0.7.0": ("nemo_rl/algorithms/grpo.py", 1010),
        "main-2026-08-22": ("nemo_rl/algorithms/grpo.py", 1332),
    },
    "fp8_kv_cache_not_async": {
        "0.6.0": ("nemo_rl/algorithms/grpo.py", 675),
        "0.7.0": ("nemo_rl/algorithms/grpo.py", 1013),
        "main-2026-08-22": ("nemo_rl/algorithms/grpo.py", 1335),
    },
    "fp8_kv_cache_needs_pipeline_size_1": {
        "0.6.0": ("nemo_rl/algorithms/grpo.py", 678),
        "0.7.0": ("nemo_rl/algorithms/grpo.py", 1016),
        "main-2026-08-22": ("nemo_rl/algorithms/grpo.py", 1338),
    },
    # nemo_rl/models/generation/vllm/quantization/fp8.py init_fp8
    "kv_cache_dtype_values": {
        "0.6.0": ("nemo_rl/models/generation/vllm/quantization/fp8.py", 164),
        "0.7.0": ("nemo_rl/models/generation/vllm/quantization/fp8.py", 164),
        "main-2026-08-22": ("nemo_rl/models/generation/vllm/quantization/fp8.py", 199),
    },
    # nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn.__init__
    "truncation_needs_importance_sampling": {
        "0.6.0": ("nemo_rl/algorithms/loss/loss_functions.py", 213),
        "0.7.0": ("nemo_rl/algorithms/loss/loss_functions.py", 277),
        "main-2026-08-22": ("nemo_rl/algorithms/loss/loss_functions.py", 293),
    },
    "truncation_ratio_positive": {
        "0.6.0": ("nemo_rl/algorithms/loss/loss_functions.py", 216),
        "0.7.0": ("nemo_rl/algorithms/loss/loss_functions.py", 288),
        "main-2026-08-22": ("nemo_rl/algorithms/loss/loss_functions.py", 304),
    },
    "truncation_type_known": {
        "0.6.0": ("nemo_rl/algorithms/loss/loss_functions.py", 219),
        "0.7.0": ("nemo_rl/algorithms/loss/loss_functions.py", 280),
        "main-2026-08-22": ("nemo_rl/algorithms/loss/loss_functions.py", 296),
    },
    # nemo_rl/models/megatron/router_replay.py validate_router_replay_config (v0.7.0 on), run
    # by the Megatron policy's setup
    "router_replay_needs_vllm": {
        "0.7.0": ("nemo_rl/models/megatron/router_replay.py", 57),
        "main-2026-08-22": ("nemo_rl/models/megatron/router_replay.py", 60),
    },
    "router_replay_needs_megatron": {
        "0.7.0": ("nemo_rl/models/megatron/router_replay.py", 59),
        "main-2026-08-22": ("nemo_rl/models/megatron/router_replay.py", 62),
    },
    "router_replay_no_virtual_pipeline": {
        "0.7.0": ("nemo_rl/models/megatron/router_replay.py", 63),
        "main-2026-08-22": ("nemo_rl/models/megatron/router_replay.py", 66),
    },
}
"""Assert name -> release -> (file, line) of the condition in that release's NeMo RL (the
releases that have it)."""

_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\}")
"""A plain ``${a.b.c}`` reference (OmegaConf resolves it to that key's value)."""

_REFERENCE_HOPS = 16

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""The ``vllm_cfg.kv_cache_dtype`` values NeMo RL's ``init_fp8`` takes (it raises otherwise)."""

TRUNCATION_TYPES = ("tis", "icepop", "seq-mask-tis")
"""The truncation types ``ClippedPGLossFn`` takes."""


def _where(name: str, release: str | None) -> str:
    from ...stacks import release_label

    found = ASSERTS[name].get(release or "")
    cite = f" ({found[0]} ~{found[1]})" if found else ""
    return f"{release_label(release)} stops at start-up{cite}"


def importance_sampling_required(release: str | None, state: str) -> str:
    """The refusal of FP8 generation without the importance-sampling correction, its key's
    ``state`` first (``"is not true"``)."""
    where = _where("fp8_generation_needs_importance_sampling", release)
    return f"{state}, and FP8 generation (vllm_cfg.precision: fp8) requires it: {where}"


def startup_problems(config: Mapping[str, Any], release: str | None) -> list[FP8ConfigError]:
    """What NeMo RL ``release`` refuses at start-up of ``config`` (a whole configuration, its
    ``defaults:`` merged and ``${...}`` resolved), one error each, naming the key to change:
    FP8 generation without the importance-sampling correction; an FP8 KV cache with the
    DTensor policy, asynchronous rollouts or pipeline parallelism; a KV cache dtype it does
    not take; a truncation setting its loss asserts on. Empty for a config without a vLLM
    ``policy.generation`` (the asserts are in its vLLM branch)."""
    from .releases import TRUNCATION_KEYS, truncation

    out: list[FP8ConfigError] = []
    resolved: list[Mapping[str, Any]] = []

    def value(key: str, default: Any = None) -> Any:
        found = get_path(config, key, default)
        for _ in range(_REFERENCE_HOPS):  # ${policy.precision}: followed without OmegaConf
            ref = _REFERENCE.fullmatch(found) if isinstance(found, str) else None
            if ref is None:
                break
            found = get_path(config, ref.group(1), default)
        if isinstance(found, str) and "${" in found:  # a resolver: NeMo RL's own (OmegaConf)
            if not resolved:
                from .values import interpolated

                resolved.append(interpolated(config))
            found = get_path(resolved[0], key, default)
        return found

    if value(_REPLAY) is True and ASSERTS["router_replay_needs_vllm"].get(release or ""):
        out += _router_replay_problems(value, release)
    generation = value("policy.generation")
    if not isinstance(generation, Mapping) or value("policy.generation.backend") != "vllm":
        return out
    precision = value(f"{_VLLM}.precision")
    kv = value(f"{_VLLM}.kv_cache_dtype", "auto")
    importance = value(_IS, False) is True
    if precision == "fp8" and not importance:
        out.append(
            FP8ConfigError(
                importance_sampling_required(release, "is not true"),
                key=_IS,
                value=value(_IS),
                hint="set it true (leave importance_sampling on in the fp8: block), or "
                "generate in BF16",
            )
        )
    if kv is not None and kv not in KV_CACHE_DTYPES:
        out.append(
            FP8ConfigError(
                f"is not one of {', '.join(KV_CACHE_DTYPES)}, which NeMo RL takes: "
                f"{_where('kv_cache_dtype_values', release)}",
                key=f"{_VLLM}.kv_cache_dtype",
                value=kv,
                hint="use auto, or fp8 with FP8 generation (fp8: {kv_cache: fp8})",
            )
        )
    elif isinstance(kv, str) and kv.startswith("fp8"):
        out += _kv_cache_problems(value, kv, release)
    out += _truncation_problems(
        {k: value(k) for k in TRUNCATION_KEYS}, importance, release, truncation
    )
    return out


def _router_replay_problems(value: Callable[..., Any], release: str | None) -> list[FP8ConfigError]:
    """Router replay (``policy.router_replay.enabled``) as NeMo RL's Megatron policy validates
    it: vLLM generation, the Megatron policy (elsewhere nothing replays), no virtual pipeline."""
    out = []
    off = "or turn router replay off (router_replay: false in the fp8: block)"
    backend = value("policy.generation.backend")
    if backend != "vllm":
        out.append(
            FP8ConfigError(
                f"is {backend!r}, and router replay needs vLLM generation: "
                f"{_where('router_replay_needs_vllm', release)}",
                key="policy.generation.backend",
                value=backend,
                hint=f"use backend: vllm, {off}",
            )
        )
    if value(f"{_MEGATRON}.enabled") is not True:
        found = ASSERTS["router_replay_needs_megatron"][release or ""]
        out.append(
            FP8ConfigError(
                f"is not true, and NeMo RL replays routing in its Megatron policy only "
                f"({found[0]} ~{found[1]}): with the DTensor policy router replay does nothing",
                key=f"{_MEGATRON}.enabled",
                value=value(f"{_MEGATRON}.enabled"),
                hint=f"train on Megatron (policy.megatron_cfg.enabled: true), {off}",
            )
        )
    vpp = value(f"{_MEGATRON}.virtual_pipeline_model_parallel_size")
    if vpp not in (None, 1):
        out.append(
            FP8ConfigError(
                f"is {vpp}, and router replay does not run with virtual pipeline parallelism: "
                f"{_where('router_replay_no_virtual_pipeline', release)}",
                key=f"{_MEGATRON}.virtual_pipeline_model_parallel_size",
                value=vpp,
                hint=f"set it to null or 1, {off}",
            )
        )
    return out


def _kv_cache_problems(
    value: Callable[..., Any], kv: str, release: str | None
) -> list[FP8ConfigError]:
    out = []
    hint = "or keep the KV cache in BF16: kv_cache: auto in the fp8: block"
    if value("policy.dtensor_cfg.enabled") is not False:
        out.append(
            FP8ConfigError(
                f"is not false, and an FP8 KV cache (kv_cache_dtype: {kv}) needs the Megatron "
                f"policy: {_where('fp8_kv_cache_not_dtensor', release)}",
                key="policy.dtensor_cfg.enabled",
                value=value("policy.dtensor_cfg.enabled"),
                hint=f"train on Megatron (policy.megatron_cfg.enabled: true, dtensor_cfg.enabled: "
                f"false), {hint}",
            )
        )
    if value(f"{_VLLM}.async_engine") is True:
        out.append(
            FP8ConfigError(
                f"is true, and an FP8 KV cache (kv_cache_dtype: {kv}) does not run with "
                f"asynchronous rollouts: {_where('fp8_kv_cache_not_async', release)}",
                key=f"{_VLLM}.async_engine",
                value=True,
                hint=f"set async_engine: false, {hint}",
            )
        )
    pp = value(f"{_MEGATRON}.pipeline_model_parallel_size", 1)
    if pp != 1:
        out.append(
            FP8ConfigError(
                f"is {pp}, and an FP8 KV cache (kv_cache_dtype: {kv}) needs 1: "
                f"{_where('fp8_kv_cache_needs_pipeline_size_1', release)}",
                key=f"{_MEGATRON}.pipeline_model_parallel_size",
                value=pp,
                hint=f"set it to 1, {hint}",
            )
        )
    return out


def _truncation_problems(
    values: Mapping[str, Any],
    importance: bool,
    release: str | None,
    truncation: Callable[[Mapping[str, Any], str | None], tuple[Any, Any, Any]],
) -> list[FP8ConfigError]:
    kind, ratio, _low = truncation(values, release)
    if kind is None and ratio is None:
        return []
    type_key, ratio_key = (
        "loss_fn.truncated_importance_sampling_type",
        ("loss_fn.truncated_importance_sampling_ratio"),
    )
    if not importance:
        return [
            FP8ConfigError(
                f"turns truncated importance sampling on ({kind}), which needs "
                f"loss_fn.use_importance_sampling_correction: true: "
                f"{_where('truncation_needs_importance_sampling', release)}",
                key=type_key if kind is not None else ratio_key,
                value=kind if kind is not None else ratio,
                hint="turn the correction on, or set the truncation type to null",
            )
        ]
    if not _positive(ratio):
        return [
            FP8ConfigError(
                f"must be a positive number with truncated_importance_sampling_type: {kind}: "
                f"{_where('truncation_ratio_positive', release)}",
                key=ratio_key,
                value=ratio,
                hint="set the ratio (e.g. 2.0), or set the truncation type to null",
            )
        ]
    if kind not in TRUNCATION_TYPES:
        return [
            FP8ConfigError(
                f"must be one of {', '.join(TRUNCATION_TYPES)} when the ratio is set: "
                f"{_where('truncation_type_known', release)}",
                key=type_key,
                value=kind,
                hint="set the type, or the ratio to null",
            )
        ]
    return []


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value == value  # not NaN
        and 0 < value < float("inf")
    )
