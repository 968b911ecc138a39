"""The vLLM names each part of the ``nemo_fp8`` method needs, and whether a release has them.

Which releases have each part is a row of :data:`nemo_fp8_plugin.stacks.FACTS` (``vllm``,
``nemo_fp8:<feature>``), read from each release's own source by the tests
(``tests/test_stacks_vllm_source.py`` parses every name of :data:`API_USES` in the wheels;
nothing parses vLLM's source at run time). The method asks :func:`unsupported` at load, per
layer, for the running release:

* a tested release (:data:`nemo_fp8_plugin.stacks.TESTED`) is answered by its row;
* an untested one (a release between two read, or newer than every one read) lacks the part
  when the row's range says so; otherwise the running vLLM itself is asked: each name of the
  part is imported and each keyword the method passes is looked up in the signature
  (:func:`probe`). An untested release is never assumed to have what the newest read has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ApiUse",
    "API_USES",
    "FEATURES",
    "ENGINE_ARGS_WRITTEN",
    "fact_name",
    "probe",
    "unsupported",
    "Unsupported",
]


@dataclass(frozen=True)
class ApiUse:
    """One vLLM name the ``nemo_fp8`` method relies on.

    Attributes:
        feature: the part of the method that needs it (one of :data:`FEATURES`).
        module: the dotted vLLM module it is imported from.
        name: the name imported.
        keywords: the keyword parameters the method passes to it (a function or class),
            which the release's signature must accept.
    """

    feature: str
    module: str
    name: str
    keywords: tuple[str, ...] = ()


FEATURES = ("config", "block_linear", "mx_linear", "moe", "block_moe", "mx_moe", "kv")
"""Parts of the method, each needing its own vLLM names; each is the stacks fact
``nemo_fp8:<feature>`` (:func:`fact_name`), whose ``doc`` says what it serves."""

_LINEAR = "vllm.model_executor.layers.linear"
_MOE = "vllm.model_executor.layers.fused_moe"
_KERNELS = "vllm.model_executor.kernels.linear"
_QUANT = "vllm.model_executor.layers.quantization"

API_USES: tuple[ApiUse, ...] = (
    # Registration and the config (config.py, __init__.register).
    ApiUse("config", f"{_QUANT}", "register_quantization_config"),
    ApiUse("config", f"{_QUANT}.base_config", "QuantizationConfig"),
    ApiUse("config", "vllm.config", "get_current_vllm_config"),
    ApiUse("config", _LINEAR, "LinearBase"),
    ApiUse("config", "vllm.model_executor.layers.attention", "Attention"),
    ApiUse("config", "vllm.model_executor.layers.attention", "MLAAttention"),
    ApiUse("config", "vllm.platforms", "current_platform"),
    # Block-FP8 and BF16 linear layers (linear.py, kernels.py).
    ApiUse("block_linear", _LINEAR, "LinearMethodBase"),
    ApiUse("block_linear", _LINEAR, "UnquantizedLinearMethod"),
    ApiUse("block_linear", "vllm.model_executor.utils", "set_weight_attrs"),
    ApiUse("block_linear", "vllm.model_executor.parameter", "BlockQuantScaleParameter"),
    ApiUse("block_linear", "vllm.model_executor.parameter", "GroupQuantScaleParameter"),
    ApiUse("block_linear", "vllm.model_executor.parameter", "ModelWeightParameter"),
    ApiUse("block_linear", f"{_QUANT}.utils.fp8_utils", "validate_fp8_block_shape"),
    ApiUse(
        "block_linear",
        _KERNELS,
        "init_fp8_linear_kernel",
        (
            "activation_quant_key",
            "weight_quant_key",
            "weight_shape",
            "input_dtype",
            "out_dtype",
            "module_name",
        ),
    ),
    ApiUse("block_linear", f"{_QUANT}.utils.quant_utils", "GroupShape"),
    ApiUse(
        "block_linear",
        f"{_QUANT}.utils.quant_utils",
        "create_fp8_quant_key",
        ("static", "group_shape"),
    ),
    ApiUse(
        "block_linear",
        f"{_QUANT}.input_quant_fp8",
        "QuantFP8",
        (
            "static",
            "group_shape",
            "num_token_padding",
            "column_major_scales",
            "tma_aligned_scales",
            "use_ue8m0",
        ),
    ),
    # MXFP8 linear layers.
    ApiUse("mx_linear", _KERNELS, "init_mxfp8_linear_kernel", ("weight_shape",)),
    # Fused-MoE experts (moe.py): shared, then block FP8.
    ApiUse("moe", _MOE, "RoutedExperts"),
    ApiUse("moe", _MOE, "UnquantizedFusedMoEMethod"),
    ApiUse("moe", _MOE, "FusedMoEMethodBase"),
    ApiUse("moe", _MOE, "FusedMoeWeightScaleSupported"),
    ApiUse("block_moe", f"{_QUANT}.utils.fp8_utils", "validate_fp8_block_shape_moe"),
    ApiUse(
        "block_moe",
        f"{_MOE}.config",
        "fp8_w8a8_moe_quant_config",
        ("w1_scale", "w2_scale", "w1_bias", "w2_bias", "block_shape"),
    ),
    ApiUse(
        "block_moe",
        f"{_MOE}.fused_moe",
        "fused_experts",
        (
            "topk_weights",
            "topk_ids",
            "activation",
            "apply_router_weight_on_input",
            "global_num_experts",
            "expert_map",
            "quant_config",
        ),
    ),
    ApiUse("block_moe", "vllm.utils.deep_gemm", "is_deep_gemm_e8m0_used"),
    # MXFP8 fused-MoE experts.
    ApiUse("mx_moe", f"{_MOE}.oracle.mxfp8", "select_mxfp8_moe_backend", ("config",)),
    ApiUse(
        "mx_moe",
        f"{_MOE}.oracle.fp8",
        "make_fp8_moe_quant_config",
        ("fp8_backend", "w1_scale", "w2_scale", "a1_scale", "a2_scale", "block_shape", "layer"),
    ),
    ApiUse(
        "mx_moe",
        f"{_MOE}.oracle.fp8",
        "convert_to_fp8_moe_kernel_format",
        ("fp8_backend", "layer", "w13", "w2", "w13_scale", "w2_scale"),
    ),
    ApiUse(
        "mx_moe",
        f"{_MOE}.oracle.fp8",
        "make_fp8_moe_kernel",
        ("moe_quant_config", "moe_config", "fp8_backend", "experts_cls", "routing_tables"),
    ),
    # KV-cache scales (kv.py).
    ApiUse("kv", f"{_QUANT}.kv_cache", "BaseKVCacheMethod"),
)
"""Every vLLM name the ``nemo_fp8`` method imports (a test checks the list against the
method's own imports), by the feature that needs it."""

ENGINE_ARGS_WRITTEN = ("quantization", "hf_overrides", "kv_cache_dtype")
"""The ``EngineArgs`` fields :func:`~nemo_fp8_plugin.hosts.vllm.engine_kwargs` writes (every
release read has them)."""


def fact_name(feature: str) -> str:
    """The stacks fact of a feature: ``nemo_fp8:<feature>``."""
    return f"nemo_fp8:{feature}"


def _accepts(obj: Callable[..., Any], keywords: tuple[str, ...]) -> list[str]:
    """The keywords of ``keywords`` that ``obj``'s signature does not take (none when it takes
    ``**kwargs`` or has no readable signature)."""
    import inspect

    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    names = {p.name for p in params}
    return [kw for kw in keywords if kw not in names]


@functools.cache
def probe(feature: str) -> tuple[str, ...]:
    """What the running vLLM lacks of ``feature``'s names: ``"module.name"`` for a name that
    does not import, ``"module.name(keyword)"`` for a keyword its signature refuses."""
    import importlib

    problems: list[str] = []
    for use in API_USES:
        if use.feature != feature:
            continue
        label = f"{use.module}.{use.name}"
        try:
            obj = getattr(importlib.import_module(use.module), use.name)
        except (ImportError, AttributeError):
            problems.append(label)
            continue
        problems += [f"{label}({kw})" for kw in _accepts(obj, use.keywords)]
    return tuple(problems)


@dataclass(frozen=True)
class Unsupported:
    """Why a vLLM release cannot serve a feature.

    Attributes:
        feature: the part of the method (:data:`FEATURES`).
        what: what it serves (the stacks fact's ``doc``).
        minimum: the first release read that has it.
        why: the upstream fact (a release read), or the names the running vLLM lacks.
    """

    feature: str
    what: str
    minimum: str
    why: str


def unsupported(feature: str, version: str) -> Unsupported | None:
    """Why vLLM ``version`` cannot serve ``feature`` (see the module docstring), or None.

    A version the stacks table marks untested is asked directly (:func:`probe`): the caller
    passes the running vLLM's version, so the probe is of that release."""
    from ...stacks import lookup

    answer = lookup("vllm", fact_name(feature), version)
    assert answer.fact is not None, feature
    fact = answer.fact
    if answer.present is False:
        return Unsupported(feature, fact.doc, fact.minimum, fact.source)
    if answer.tested:
        return None
    missing = probe(feature)
    if not missing:
        return None
    return Unsupported(
        feature,
        fact.doc,
        fact.minimum,
        f"this untested release lacks {', '.join(missing)}",
    )
