"""The token alignment FP8/FP4 training needs in NeMo RL, before the run: which sequence
length keys to raise, and what cannot work (the model-dimension checks are shared by every
host: :func:`nemo_fp8_plugin.hosts.check_model_shape`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...capabilities import capability, token_alignment
from ...dotted import get_path
from ...errors import FP8ConfigError
from ...kinds import kind
from ...spec import RecipeSpec
from .. import Message

if TYPE_CHECKING:
    from ...stacks import HostFact

__all__ = [
    "SEQUENCE_KEY",
    "SELF_PACKING_FACT",
    "SELF_PACKING_MODELS",
    "model_self_packs",
    "sequence_alignment",
]

SEQUENCE_KEY = "policy.make_sequence_length_divisible_by"
"""What NeMo RL pads unpacked training sequences to a multiple of."""

DYNAMIC_ROUND_KEY = "policy.dynamic_batching.sequence_length_round"
"""What NeMo RL rounds dynamic batches' sequence lengths to a multiple of."""

MODEL_KEY = "policy.model_name"
"""The Hugging Face model NeMo RL trains."""

SELF_PACKING_FACT = "delegate_pack_to_model:"
"""Prefix of the :data:`nemo_fp8_plugin.stacks.FACTS` names (host ``nemo-rl``) of models that
pack sequences inside their own forward, so NeMo RL hands them an unpacked ``[B, S]`` batch
and its packer's FP8 padding never runs (NeMo RL main 7ea279a,
``models/policy/workers/megatron_policy_worker.py:147-165`` ``_model_self_packs_for_cp``:
``model_owns_packing`` or a ``Qwen3VLModel``; sets ``delegate_pack_to_model`` at :607).
The rest of the name is the model-name prefix (lowercased basename, ``_`` read as ``-``), the
fact's ``doc`` the model it names."""


def _self_packing_facts() -> list[HostFact]:
    from ...stacks import FACTS

    return [f for f in FACTS if f.host == "nemo-rl" and f.name.startswith(SELF_PACKING_FACT)]


SELF_PACKING_MODELS: tuple[tuple[str, str], ...] = tuple(
    (f.name[len(SELF_PACKING_FACT) :], f.doc) for f in _self_packing_facts()
)
"""``(model-name prefix, what it is)`` of every self-packing model any NeMo RL version knows
(from :data:`nemo_fp8_plugin.stacks.FACTS`; every NeMo RL version: :func:`model_self_packs`)."""


def _basename(model_name: Any) -> str | None:
    if not isinstance(model_name, str) or not model_name.strip():
        return None
    return model_name.strip().rstrip("/").rsplit("/", 1)[-1].lower().replace("_", "-")


def model_self_packs(model_name: Any) -> str | None:
    """What ``model_name`` is when it packs sequences itself in NeMo RL (a
    :data:`SELF_PACKING_FACT` fact), else None. Every NeMo RL release counts, the ones the
    fact does not name too: the cautious answer is the per-sequence alignment (padding a
    sequence that needed none costs little; a sequence TE's GEMM cannot take fails the run)."""
    base = _basename(model_name)
    if base is None:
        return None
    for f in _self_packing_facts():
        if base.startswith(f.name[len(SELF_PACKING_FACT) :]):
            return f.doc
    return None


def _in_model_table(model_name: Any) -> bool:
    from ...rules.models import describe_model

    if _basename(model_name) is None:
        return False
    try:
        describe_model(model_name, key=MODEL_KEY)
    except FP8ConfigError:
        return False
    return True


def sequence_alignment(
    spec: RecipeSpec,
    resolved: Mapping[str, Any],
    nemo_rl_version: str | None = None,
    known: bool | None = None,
) -> tuple[dict, list[Message]]:
    """``({dotted key: value to write}, notes)`` for the sequence lengths of ``resolved``.

    Packed sequences: NeMo RL pads them itself for its ``fp8_cfg`` recipes, so nothing is
    written; nvfp4 reaches the model through ``model_overrides``, which the packer does not
    know, so packing is refused. Except where the model packs inside its forward
    (:data:`SELF_PACKING_MODELS`) or is not in the model table (it might): there each
    sequence must carry the alignment itself, so ``make_sequence_length_divisible_by`` is
    set, to TE's alignment x TP (whether or not sequence parallelism is on) x 2 CP.
    Unpacked: ``make_sequence_length_divisible_by`` (and
    ``dynamic_batching.sequence_length_round`` when dynamic batching is on) must be a multiple
    of :func:`~nemo_fp8_plugin.capabilities.token_alignment`; unset or a divisor of it (too
    small) is raised to it, with a note; anything else cannot work and is refused.
    ``known``: whether ``policy.model_name`` is in the model table (None: looked up)."""
    if spec.training != "fp8":
        return {}, []
    from ..alignment import parallel_sizes
    from .values import resolved_value

    sizes = parallel_sizes(resolved, resolved_value)
    model_name = resolved_value(resolved, MODEL_KEY)
    self_packs = model_self_packs(model_name)
    if known is None:
        known = _in_model_table(model_name)
    cautious = self_packs is not None or not known
    tp_factor = sizes.sequence_parallel or (cautious and sizes.tensor_parallel > 1)
    need = token_alignment(
        spec.scaling,
        tensor_parallel=sizes.tensor_parallel,
        sequence_parallel=tp_factor,
        context_parallel=sizes.context_parallel,
    )
    why = (
        f"{spec.name}'s GEMMs need the tokens per rank to be a multiple of "
        f"{capability(spec.scaling).token_align} (Transformer Engine)"
        + (f", times TP {sizes.tensor_parallel}" if tp_factor else "")
        + (f", times 2 x CP {sizes.context_parallel}" if sizes.context_parallel > 1 else "")
    )
    if cautious:
        why += (
            f"; {self_packs} packs sequences in its own forward (NeMo RL's "
            "delegate_pack_to_model), so NeMo RL's packer does not pad them"
            if self_packs
            else f"; {model_name!r} is not in the model table, so TP is counted as if "
            "sequence parallel and packing as if the model packed itself"
        )
    packed = resolved_value(resolved, "policy.sequence_packing.enabled", False) is True
    pads = kind(spec.scaling).nemo_rl_pack_align
    if packed and self_packs is None and (not cautious or not pads):
        return {}, [_packed(spec, why, need)]
    keys = [SEQUENCE_KEY]
    if resolved_value(resolved, "policy.dynamic_batching.enabled", False) is True:
        keys.append(DYNAMIC_ROUND_KEY)
    return _raise_to(resolved, keys, need, why)


def _raise_to(
    resolved: Mapping[str, Any], keys: list[str], need: int, why: str
) -> tuple[dict[str, Any], list[Message]]:
    from .values import resolved_value

    writes: dict[str, Any] = {}
    notes: list[Message] = []
    for key in keys:
        value = resolved_value(resolved, key)
        written = get_path(resolved, key)
        shown = f"{written} (= {value})" if written != value else f"{value}"
        if value is None or (_count(value) and need % value == 0 and value < need):
            writes[key] = need
            was = "unset" if value is None else shown
            notes.append(Message(f"{key} set to {need} (was {was}): {why}", "nemo-rl"))
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


def _packed(spec: RecipeSpec, why: str, need: int) -> Message:
    pads = kind(spec.scaling).nemo_rl_pack_align
    if not pads:
        raise FP8ConfigError(
            f"NeMo RL pads packed sequences for its fp8_cfg recipes only, and {spec.name} "
            f"reaches the model through model_overrides, so packed batches would not be "
            f"aligned: {why}, i.e. {need}",
            key="policy.sequence_packing.enabled",
            value=True,
            hint=f"set policy.sequence_packing.enabled: false (apply then sets {SEQUENCE_KEY})",
        )
    return Message(
        f"sequence packing is on, and NeMo RL pads packed sequences to a multiple of {pads} "
        f"(x TP with sequence parallelism, x 2 CP) for fp8_cfg recipes itself; {SEQUENCE_KEY} "
        f"is left as it is",
        "nemo-rl",
    )
