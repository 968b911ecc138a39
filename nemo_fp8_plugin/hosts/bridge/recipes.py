"""Megatron-Bridge's named mixed-precision recipes (``mixed_precision: bf16_with_mxfp8_mixed``),
as Bridge 0.6.2's ``megatron/bridge/training/mixed_precision.py`` registers them.

Like every other host fact (``stacks.FACTS``), the recipes are recorded from the release's own
file, never read from a host at run time: importing Bridge needs Transformer Engine and torch,
and config-only commands stay free of both. ``tests/bridge_source.py`` parses the 0.6.2 wheel's
file (each ``@register``-ed function: ``MixedPrecisionConfig(<field>=<literal>, ...)``, or
another recipe with fields set on it) and ``tests/hosts/bridge/test_bridge_names.py`` checks
that :data:`RECORDED_RECIPES` is what it registers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..native import FP8_FIELD_DEFAULTS

if TYPE_CHECKING:
    from ...spec import RecipeSpec

__all__ = [
    "SOURCE",
    "MIXED_PRECISION_DEFAULTS",
    "RECORDED_RECIPES",
    "RECIPE_DEFAULTS",
    "bridge_recipes",
    "recipe_fields",
    "as_recorded",
    "base_of",
    "spelt_as_recipe",
    "difference",
]

SOURCE = "megatron/bridge/training/mixed_precision.py"
"""Bridge's module holding ``MixedPrecisionConfig`` and its recipe registry, in its wheel."""

MIXED_PRECISION_DEFAULTS: dict[str, Any] = {
    **FP8_FIELD_DEFAULTS,
    "fp32": False,
    "fp16": False,
    "bf16": False,
    "autocast_enabled": False,
    "grad_reduce_in_fp32": True,
    "fp8_param_gather": False,
    "fp4_param_gather": False,
    "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
}
"""``MixedPrecisionConfig`` field -> its default in Megatron-Bridge 0.6.2 (the constant ones
the adapter writes)."""

_MIRRORED = ("fp8_param", "fp4_param")
"""Fields Bridge's ``MixedPrecisionConfig.__setattr__`` keeps equal to ``fp8_param_gather`` /
``fp4_param_gather`` from construction on: left out, the ``*_gather`` field says it."""

_BF16 = {
    "bf16": True,
    "params_dtype": "torch.bfloat16",
    "pipeline_dtype": "torch.bfloat16",
}
_FP16 = {
    "fp16": True,
    "params_dtype": "torch.float16",
    "pipeline_dtype": "torch.float16",
    "grad_reduce_in_fp32": False,
}

RECORDED_RECIPES: dict[str, dict[str, Any]] = {
    "bf16_mixed": {**_BF16},
    "fp16_mixed": {**_FP16},
    "bf16_with_fp8_delayed_scaling_mixed": {
        **_BF16,
        "fp8": "hybrid",
        "fp8_recipe": "delayed",
        "fp8_amax_history_len": 1024,
        "fp8_amax_compute_algo": "max",
        "fp8_param_gather": True,
    },
    "fp16_with_fp8_delayed_scaling_mixed": {
        **_FP16,
        "fp8": "hybrid",
        "fp8_recipe": "delayed",
        "fp8_amax_history_len": 1024,
        "fp8_amax_compute_algo": "max",
        "fp8_param_gather": True,
    },
    "bf16_with_mxfp8_mixed": {
        **_BF16,
        "fp8": "e4m3",
        "fp8_recipe": "mxfp8",
        "fp8_param_gather": True,
        "reuse_grad_buf_for_mxfp8_param_ag": True,
    },
    "fp16_with_mxfp8_mixed": {
        **_FP16,
        "fp8": "e4m3",
        "fp8_recipe": "mxfp8",
        "fp8_param_gather": True,
        "reuse_grad_buf_for_mxfp8_param_ag": True,
    },
    "bf16_with_fp8_current_scaling_mixed": {
        **_BF16,
        "fp8": "hybrid",
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 1,
        "fp8_param_gather": True,
    },
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": {
        **_BF16,
        "fp8": "hybrid",
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 2,
        "num_layers_at_end_in_bf16": 2,
        "fp8_param_gather": True,
    },
    "nanov2_bf16_with_fp8_current_scaling_mixed": {
        **_BF16,
        "fp8": "hybrid",
        "fp8_recipe": "blockwise",
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 2,
        "num_layers_at_end_in_bf16": 2,
        "fp8_param_gather": True,
    },
    "fp16_with_fp8_current_scaling_mixed": {
        **_FP16,
        "fp8": "hybrid",
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 1,
        "fp8_param_gather": True,
    },
    "bf16_with_fp8_subchannel_scaling_mixed": {**_BF16, "fp8": "hybrid", "fp8_recipe": "blockwise"},
    "fp16_with_fp8_subchannel_scaling_mixed": {**_FP16, "fp8": "hybrid", "fp8_recipe": "blockwise"},
    "bf16_with_nvfp4_mixed": {**_BF16, "fp4": "e2m1", "fp4_param_gather": True},
    "nemotron_3_super_bf16_with_nvfp4_mixed": {
        **_BF16,
        "fp4": "e2m1",
        "fp4_param_gather": True,
        "first_last_layers_bf16": True,
        "num_layers_at_end_in_bf16": 14,
    },
    "nemotron_3_ultra_bf16_with_nvfp4_mixed": {
        **_BF16,
        "fp4": "e2m1",
        "fp4_param_gather": True,
        "first_last_layers_bf16": True,
        "num_layers_at_end_in_bf16": 16,
    },
}
"""Bridge 0.6.2's registered recipes: name -> the ``MixedPrecisionConfig`` fields it sets to
other than the class defaults (dtypes as import paths; ``fp8_param`` / ``fp4_param`` left out:
they mirror the ``*_gather`` fields)."""


def bridge_recipes() -> tuple[str, dict[str, dict[str, Any]]]:
    """``(where they were read, recipes)``: Bridge 0.6.2's registry, as recorded."""
    return "Megatron-Bridge 0.6.2's registry", RECORDED_RECIPES


def recipe_fields(name: str) -> dict[str, Any] | None:
    """The fields Bridge's recipe ``name`` (or its hyphenated alias) sets, or None when Bridge
    registers no such recipe."""
    return bridge_recipes()[1].get(name.replace("-", "_"))


# --------------------------------------------------------------------------- our recipes as Bridge's


RECIPE_DEFAULTS = {"fp8_recipe": "tensorwise", "fp4_recipe": "nvfp4"}
"""``MixedPrecisionConfig``'s defaults for the two recipe fields (megatron-core's differ): what a
recipe of :data:`RECORDED_RECIPES` that does not list them uses."""


def _class_default(key: str) -> Any:
    return {**MIXED_PRECISION_DEFAULTS, **RECIPE_DEFAULTS}.get(key)


def as_recorded(fields: dict[str, Any]) -> dict[str, Any]:
    """A full ``MixedPrecisionConfig`` mapping (dtypes as ``{_target_: torch.X}`` or import
    paths) in the form of :data:`RECORDED_RECIPES`: the fields off Bridge's defaults, without
    the mirrored ones, and without ``fp8_recipe`` when no FP8 is on (it is inert then)."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict) and "_target_" in value:
            value = value["_target_"]
        if key not in _MIRRORED and _class_default(key) != value:
            out[key] = value
    if out.get("fp8") is None:
        out.pop("fp8_recipe", None)
    return out


def base_of(fields: dict[str, Any]) -> str:
    """``"fp16"`` or ``"bf16"``: the base recipe a Bridge recipe's fields start from."""
    return "fp16" if fields.get("fp16") else "bf16"


def spelt_as_recipe(spec: RecipeSpec, base: str, model: Any = None) -> dict[str, Any]:
    """What ``spec`` sets on Bridge's ``<base>_mixed()``, in the form of :data:`RECORDED_RECIPES`
    (``quant_recipe`` included: no Bridge recipe has per-module rules)."""
    from . import base_fields, mixed_precision_fields

    writes = {w.key: w.value for w in mixed_precision_fields(spec, model).writes}
    return as_recorded({**base_fields(base), **writes})


def difference(name: str, spec: RecipeSpec, model: Any = None) -> dict[str, tuple[Any, Any]] | None:
    """Field -> (Bridge's recipe ``name``'s value, ``spec``'s) where they differ (empty: the
    same recipe), or None when Bridge registers no recipe ``name``."""
    theirs = recipe_fields(name)
    if theirs is None:
        return None
    ours = spelt_as_recipe(spec, base_of(theirs), model)
    return {
        k: (theirs.get(k, _class_default(k)), ours.get(k, _class_default(k)))
        for k in sorted(set(theirs) | set(ours))
        if theirs.get(k) != ours.get(k)
    }
