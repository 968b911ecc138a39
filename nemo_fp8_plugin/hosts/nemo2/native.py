"""NeMo 2's own defaults for the ``MegatronMixedPrecision`` arguments the adapter writes
(``NeMo2Adapter.default``), and the reader of a config already FP8 in its ``trainer.plugins``
block (``NeMo2Adapter.read_native``).

The defaults are recorded from NeMo 2.7.3's ``MegatronMixedPrecision.__init__``
(``nemo/lightning/pytorch/plugins/mixed_precision.py``; importing it pulls in torch and
Lightning); ``tests/hosts/test_read_native.py`` reads the installed file with :mod:`ast`
and compares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...dotted import get_path
from .. import NO_DEFAULT, HostContext, NativeRecipe
from ..native import FP8_FIELD_DEFAULTS

__all__ = ["PLUGIN_DEFAULTS", "argument_default", "read_native"]

PLUGIN_DEFAULTS: dict[str, Any] = {
    **FP8_FIELD_DEFAULTS,
    "autocast_enabled": False,
    "grad_reduce_in_fp32": True,
    "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
}
"""``MegatronMixedPrecision`` argument -> its default in NeMo 2.7.3 (those with a constant
default that the adapter writes; ``fp8_param_gather``'s ``None`` is resolved by NeMo)."""


def argument_default(key: str, data: Mapping[str, Any]) -> Any:
    """What NeMo 2 does with an argument of the ``MegatronMixedPrecision`` plugin the
    config does not give."""
    parent, _, leaf = key.rpartition(".")
    plugin = get_path(data, parent)
    if parent != "trainer.plugins" or not isinstance(plugin, Mapping):
        return NO_DEFAULT
    # An overlay (no ``_target_``) merges into a factory's plugin, whose values are unknown here.
    if not str(plugin.get("_target_", "")).endswith("MegatronMixedPrecision"):
        return NO_DEFAULT
    return PLUGIN_DEFAULTS.get(leaf, NO_DEFAULT)


def _plugin(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """``(dotted key, block)`` of the ``MegatronMixedPrecision`` plugin (a mapping, or one
    item of a list of plugins)."""
    plugins = get_path(config, "trainer.plugins")
    items = [("trainer.plugins", plugins)]
    if isinstance(plugins, list):
        items = [(f"trainer.plugins[{i}]", p) for i, p in enumerate(plugins)]
    for where, block in items:
        if not isinstance(block, Mapping):
            continue
        if str(block.get("_target_", "")).endswith("MegatronMixedPrecision"):
            return where, block
        if where == "trainer.plugins" and "_target_" not in block:  # an overlay's plugin fields
            return where, block
    return None


def read_native(ctx: HostContext) -> NativeRecipe | None:
    from ..native import match_recipe, megatron_fields

    found = _plugin(ctx.resolved)
    if found is None:
        return None
    where, block = found
    scaling, fields, read, unmatched = megatron_fields(block, f"{where}.", PLUGIN_DEFAULTS)
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
