"""Megatron-Bridge's own defaults for the ``MixedPrecisionConfig`` fields the adapter writes
(``BridgeAdapter.default``; :data:`~nemo_fp8_plugin.hosts.bridge.recipes.MIXED_PRECISION_DEFAULTS`,
compared with the wheel's file by ``tests/hosts/test_read_native.py``), and the reader of a Megatron-Bridge config already FP8 in its ``mixed_precision`` block
(``BridgeAdapter.read_native``): a ``MixedPrecisionConfig`` mapping, or the name of a Bridge
recipe, whose fields :mod:`~nemo_fp8_plugin.hosts.bridge.recipes` reads from Bridge's source."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...dotted import get_path
from .. import NO_DEFAULT, HostContext, NativeRecipe
from .recipes import MIXED_PRECISION_DEFAULTS

__all__ = ["MIXED_PRECISION_DEFAULTS", "field_default", "read_native"]


def field_default(key: str, data: Mapping[str, Any]) -> Any:
    """What Bridge does with a ``MixedPrecisionConfig`` field the ``mixed_precision`` block
    does not set."""
    from . import MIXED_PRECISION_TARGETS

    parent, _, leaf = key.rpartition(".")
    block = get_path(data, parent)
    if parent != "mixed_precision" or not isinstance(block, Mapping):
        return NO_DEFAULT
    if block.get("_target_") not in MIXED_PRECISION_TARGETS:
        return NO_DEFAULT
    return MIXED_PRECISION_DEFAULTS.get(leaf, NO_DEFAULT)


def read_native(ctx: HostContext) -> NativeRecipe | None:
    from ..native import match_recipe, megatron_fields
    from .recipes import RECIPE_DEFAULTS, bridge_recipes, recipe_fields

    block: Any = ctx.resolved.get("mixed_precision")
    where = "mixed_precision."
    read: list[tuple[str, Any]] = []
    if isinstance(block, str):
        fields = recipe_fields(block)
        if fields is None:
            if "fp8" in block or "fp4" in block:
                return NativeRecipe(
                    "bridge",
                    None,
                    (("mixed_precision", block),),
                    unmatched=(
                        f"mixed_precision: {block!r}: no recipe of that name in "
                        f"{bridge_recipes()[0]}",
                    ),
                )
            return None
        read.append(("mixed_precision", block))
        block, where = {**RECIPE_DEFAULTS, **fields}, f"mixed_precision={block}:"
    if not isinstance(block, Mapping):
        return None
    scaling, fields, found, unmatched = megatron_fields(block, where, MIXED_PRECISION_DEFAULTS)
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
