"""The token alignment FP8/FP4 training needs in NeMo RL, before the run: which sequence
length keys to raise, and what cannot work (the model-dimension checks are shared by every
host: :func:`nemo_fp8_plugin.hosts.check_model_shape`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...capabilities import capability, token_alignment
from ...dotted import get_path
from ...errors import FP8ConfigError
from ...spec import RecipeSpec

__all__ = ["SEQUENCE_KEY", "sequence_alignment"]

SEQUENCE_KEY = "policy.make_sequence_length_divisible_by"
"""What NeMo RL pads unpacked training sequences to a multiple of."""

DYNAMIC_ROUND_KEY = "policy.dynamic_batching.sequence_length_round"
"""What NeMo RL rounds dynamic batches' sequence lengths to a multiple of."""

ALIGNMENT_KEYS = (SEQUENCE_KEY, DYNAMIC_ROUND_KEY)
"""The keys :func:`sequence_alignment` may write."""


def _packing_divisor(spec: RecipeSpec) -> int:
    """What NeMo RL's packer pads packed sequences to for an ``fp8_cfg`` recipe: 128 for
    block scaling, 32 for MXFP8, 16 for the others (``nemo_rl/models/megatron/data.py``,
    ``_get_pack_sequence_parameters_for_megatron``), before the TP (sequence parallel) and
    2 x CP factors."""
    row = capability(spec.scaling)
    return 128 if row.is_block else 32 if row.is_mx else 16


def sequence_alignment(spec: RecipeSpec, resolved: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """``({dotted key: value to write}, notes)`` for the sequence lengths of ``resolved``.

    Packed sequences: NeMo RL pads them itself for its ``fp8_cfg`` recipes, so nothing is
    written; nvfp4 reaches the model through ``model_overrides``, which the packer does not
    know, so packing is refused. Unpacked: ``make_sequence_length_divisible_by`` (and
    ``dynamic_batching.sequence_length_round`` when dynamic batching is on) must be a multiple
    of :func:`~nemo_fp8_plugin.capabilities.token_alignment`; unset or a divisor of it (too
    small) is raised to it, with a note; anything else cannot work and is refused."""
    if spec.training != "fp8":
        return {}, []
    from ..alignment import parallel_sizes
    from .values import resolved_value

    sizes = parallel_sizes(resolved, resolved_value)
    need = token_alignment(
        spec.scaling,
        tensor_parallel=sizes.tensor_parallel,
        sequence_parallel=sizes.sequence_parallel,
        context_parallel=sizes.context_parallel,
    )
    why = (
        f"{spec.name}'s GEMMs need the tokens per rank to be a multiple of "
        f"{capability(spec.scaling).token_align} (Transformer Engine)"
        + (
            f", times TP {sizes.tensor_parallel} with sequence parallelism"
            if sizes.sequence_parallel
            else ""
        )
        + (f", times 2 x CP {sizes.context_parallel}" if sizes.context_parallel > 1 else "")
    )
    if resolved_value(resolved, "policy.sequence_packing.enabled", False) is True:
        return {}, [_packed(spec, why, need)]
    keys = [SEQUENCE_KEY]
    if resolved_value(resolved, "policy.dynamic_batching.enabled", False) is True:
        keys.append(DYNAMIC_ROUND_KEY)
    writes: dict[str, Any] = {}
    notes: list[str] = []
    for key in keys:
        value = resolved_value(resolved, key)
        written = get_path(resolved, key)
        shown = f"{written} (= {value})" if written != value else f"{value}"
        if value is None or (_count(value) and need % value == 0 and value < need):
            writes[key] = need
            notes.append(
                f"nemo-rl: {key} set to {need} (was {'unset' if value is None else shown}): {why}"
            )
        elif not _count(value) or value % need:
            raise FP8ConfigError(
                f"{shown} cannot work: {why}, so it must be a multiple of {need}",
                key=key,
                value=written,
                hint=f"use {need} or a multiple of it",
            )
    return writes, notes


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _packed(spec: RecipeSpec, why: str, need: int) -> str:
    if capability(spec.scaling).is_nvfp4:
        raise FP8ConfigError(
            f"NeMo RL pads packed sequences for its fp8_cfg recipes only, and {spec.name} "
            f"reaches the model through model_overrides, so packed batches would not be "
            f"aligned: {why}, i.e. {need}",
            key="policy.sequence_packing.enabled",
            value=True,
            hint=f"set policy.sequence_packing.enabled: false (apply then sets {SEQUENCE_KEY})",
        )
    return (
        f"nemo-rl: sequence packing is on, and NeMo RL pads packed sequences to a "
        f"multiple of {_packing_divisor(spec)} (x TP with sequence parallelism, x 2 CP) for "
        f"fp8_cfg recipes itself; {SEQUENCE_KEY} is left as it is"
    )
