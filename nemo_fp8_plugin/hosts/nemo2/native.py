"""The reader of a NeMo 2 config already FP8 in its ``trainer.plugins``
``MegatronMixedPrecision`` block (``NeMo2Adapter.read_native``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...dotted import get_path
from .. import HostContext, NativeRecipe

__all__ = ["read_native"]


def _plugin(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """``(dotted key, block)`` of the ``MegatronMixedPrecision`` plugin (a mapping, or one
    item of a list of plugins)."""
    plugins = get_path(config, "trainer.plugins")
    items = [("trainer.plugins", plugins)]
    if isinstance(plugins, list):
        items = [(f"trainer.plugins[{i}]", p) for i, p in enumerate(plugins)]
    for where, block in items:
        if isinstance(block, Mapping) and str(block.get("_target_", "")).endswith(
            "MegatronMixedPrecision"
        ):
            return where, block
    return None


def read_native(ctx: HostContext) -> NativeRecipe | None:
    from ..native import match_recipe, megatron_fields

    found = _plugin(ctx.resolved)
    if found is None:
        return None
    where, block = found
    scaling, fields, read, unmatched = megatron_fields(block, f"{where}.", {})
    if scaling is None:
        if not unmatched:
            return None
        return NativeRecipe("nemo2", None, tuple(read), unmatched=tuple(unmatched))
    if block.get("fp8_param_gather") is not None:  # the plugin's FP8 parameters
        fields["fp8_param"] = bool(block["fp8_param_gather"])
        read.append((f"{where}.fp8_param_gather", block["fp8_param_gather"]))
    fp4_param = get_path(ctx.resolved, "model.config.fp4_param")
    if block.get("fp4") and fp4_param is not None:
        fields["fp8_param"] = bool(fp4_param)
        read.append(("model.config.fp4_param", fp4_param))
    fields["training"] = "fp8"
    return match_recipe(
        "nemo2",
        scaling,
        fields,
        read=read,
        unmatched=unmatched,
        env_note="the training environment's TE variables tell them apart, not the config",
    )
