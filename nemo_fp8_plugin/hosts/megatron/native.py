"""megatron-core's own defaults for the fields the adapter writes, and the reader of a config
already FP8 in those fields (:meth:`MegatronAdapter.default`, :meth:`MegatronAdapter.read_native`).

The defaults are recorded from megatron-core 0.16.1's ``TransformerConfig`` and
``DistributedDataParallelConfig`` dataclasses (``transformer/transformer_config.py``,
``distributed/distributed_data_parallel_config.py``); importing megatron-core takes half a
minute and pulls in torch, so ``apply`` never does, and
``tests/hosts/megatron/test_megatron_native.py`` reads both files of the installed
megatron-core with :mod:`ast` and compares.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...dotted import get_path
from .. import NO_DEFAULT, HostContext, NativeRecipe
from ..native import FP8_FIELD_DEFAULTS

__all__ = ["TRANSFORMER_CONFIG_DEFAULTS", "DDP_DEFAULTS", "field_default", "read_native"]

TRANSFORMER_CONFIG_DEFAULTS: dict[str, Any] = {
    **FP8_FIELD_DEFAULTS,
    "fp8_param": False,
    "num_layers_at_start_in_bf16": 1,
    "num_layers_at_end_in_bf16": 1,
    "fp4_param": False,
}
"""``TransformerConfig`` field -> its default in megatron-core 0.16.1 (the FP8/FP4 fields the
adapter writes). ``fp8_recipe`` / ``fp4_recipe`` are left out on purpose, here and in NeMo 2's
and Bridge's tables: they name the recipe, their defaults differ between hosts (megatron-core
and NeMo 2 ``delayed``, Bridge ``tensorwise``) and may change between releases, so they are
always written."""

DDP_DEFAULTS: dict[str, Any] = {
    "fp8_param_gather": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
}
"""``DistributedDataParallelConfig`` field -> its default in megatron-core 0.16.1."""

_COUNTS = ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")


def field_default(section: str, key: str, data: Mapping[str, Any], *, ddp: str | None) -> Any:
    """What an absent ``key`` (dotted) means to megatron-core: the ``TransformerConfig``
    default for a field of ``section``, the ``DistributedDataParallelConfig`` default for one
    of ``ddp`` (its section; None: DDP fields sit at the root, Megatron-LM's layout). The
    first/last layer counts are inert while ``first_last_layers_bf16`` is off (they then
    mean what a count of 0 means, no BF16 layer) and always written while it is on."""
    parent, _, leaf = key.rpartition(".")
    if parent == section and leaf in TRANSFORMER_CONFIG_DEFAULTS:
        if leaf in _COUNTS:
            # written whenever they count: NeMo 2's and Bridge's defaults are 0, megatron-core's 1
            on = get_path(data, f"{section}.first_last_layers_bf16", False)
            return NO_DEFAULT if on else 0
        return TRANSFORMER_CONFIG_DEFAULTS[leaf]
    if (parent == ddp or (ddp is None and not parent)) and leaf in DDP_DEFAULTS:
        return DDP_DEFAULTS[leaf]
    return NO_DEFAULT


def read_native(ctx: HostContext) -> NativeRecipe | None:
    """The recipe the config's ``TransformerConfig`` fields (its ``language_model:`` /
    ``model:`` section) already spell, or None when they turn no FP8 on."""
    from ..native import match_recipe, megatron_fields
    from . import section_path

    name = section_path(ctx.resolved)[0]
    section = ctx.resolved.get(name)
    if not isinstance(section, Mapping):
        return None
    scaling, fields, read, unmatched = megatron_fields(
        section, f"{name}.", TRANSFORMER_CONFIG_DEFAULTS
    )
    if scaling is None and not unmatched:
        return None
    if scaling is None:
        return NativeRecipe("megatron", None, tuple(read), unmatched=tuple(unmatched))
    fields["training"] = "fp8"
    return match_recipe(
        "megatron",
        scaling,
        fields,
        read=read,
        unmatched=unmatched,
        env_note="the training environment's TE variables tell them apart, not the config",
    )
