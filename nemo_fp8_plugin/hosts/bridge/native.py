"""The reader of a Megatron-Bridge config already FP8 in its ``mixed_precision`` block
(``BridgeAdapter.read_native``): a ``MixedPrecisionConfig`` mapping, or the name of a Bridge
recipe whose fields this package records (:data:`~nemo_fp8_plugin.hosts.bridge.BRIDGE_RECIPE_FIELDS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import HostContext, NativeRecipe

__all__ = ["read_native"]


def read_native(ctx: HostContext) -> NativeRecipe | None:
    from ..native import match_recipe, megatron_fields
    from . import BRIDGE_RECIPE_FIELDS

    block: Any = ctx.resolved.get("mixed_precision")
    where = "mixed_precision."
    read: list[tuple[str, Any]] = []
    if isinstance(block, str):
        if block not in BRIDGE_RECIPE_FIELDS:
            if "fp8" in block or "fp4" in block:
                return NativeRecipe(
                    "bridge",
                    None,
                    (("mixed_precision", block),),
                    unmatched=(
                        f"mixed_precision: {block!r}: a Megatron-Bridge recipe whose fields "
                        f"live in Bridge's code, not read here",
                    ),
                )
            return None
        read.append(("mixed_precision", block))
        block, where = BRIDGE_RECIPE_FIELDS[block], f"mixed_precision={block}:"
    if not isinstance(block, Mapping):
        return None
    scaling, fields, found, unmatched = megatron_fields(block, where, {})
    if scaling is None:
        if not unmatched:
            return None
        return NativeRecipe("bridge", None, tuple(found), unmatched=tuple(unmatched))
    # Bridge's spelling of FP8 (FP4) parameters is the DDP gather of them
    gather = "fp4_param_gather" if block.get("fp4") else "fp8_param_gather"
    if block.get(gather) is not None:
        fields["fp8_param"] = bool(block[gather])
        found.append((f"{where}{gather}", block[gather]))
    fields["training"] = "fp8"
    return match_recipe(
        "bridge",
        scaling,
        fields,
        read=read + found,
        unmatched=unmatched,
        env_note="the training environment's TE variables tell them apart, not the config",
    )
