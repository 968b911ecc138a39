"""Alignment before the run: the model dimensions and sequence lengths a recipe's GEMMs need,
read from a host config together with its parallel sizes.

What a recipe needs is in the capability table (:func:`nemo_fp8_plugin.capabilities.
token_alignment`, :func:`~nemo_fp8_plugin.capabilities.dimension_problems`, from Transformer
Engine 2.20's ``assert_dim_for_fp8_exec``, ``get_align_size_for_quantization`` and the MXFP8 /
NVFP4 quantizers' ``is_quantizable``); this module finds the tensor, sequence and context
parallel sizes a config states (NeMo RL ``policy.megatron_cfg``, NeMo 2
``trainer.strategy``, Megatron-Bridge / megatron-core ``model:``), with ``${...}``
interpolations resolved by the caller's ``value`` reader (NeMo RL's resolvers:
:func:`nemo_fp8_plugin.hosts.nemo_rl.values.resolved_value`), so ``explain``, ``doctor CONFIG`` and
``apply`` can say before any GPU is touched that a hidden size, a TP split or a sequence
length cannot run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import get_path
from ..errors import FP8ConfigError, format_value

if TYPE_CHECKING:
    from ..rules import ModelDescription
    from ..spec import Finding, RecipeSpec

__all__ = ["ParallelSizes", "parallel_sizes", "dimension_findings", "PARALLEL_SECTIONS"]

PARALLEL_SECTIONS = ("policy.megatron_cfg", "trainer.strategy", "model", "language_model", "")
"""Where configs keep ``tensor_model_parallel_size`` and friends, first match wins: NeMo RL,
NeMo 2 (``MegatronStrategy``), Megatron-Bridge providers / megatron-core ``model:``,
Megatron-LM's ``--yaml-cfg`` layout, and the root (Megatron-LM flat arguments)."""


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel sizes a config states (1 / false when it states none).

    Attributes:
        tensor_parallel: ``tensor_model_parallel_size``.
        expert_tensor_parallel: ``expert_tensor_parallel_size`` (megatron-core's default: the
            tensor parallel size).
        sequence_parallel: ``sequence_parallel``.
        context_parallel: ``context_parallel_size``.
        where: the section they were read from (``policy.megatron_cfg.``, ``model.``, or
            ``""``), prefixed to key names in messages.
    """

    tensor_parallel: int = 1
    expert_tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    where: str = ""


Reader = Callable[[Mapping[str, Any], str], Any]
"""``(config, dotted key) -> value`` as the host reads it (interpolations resolved)."""


def _size(config: Mapping[str, Any], dotted: str, default: int, value_of: Reader) -> int:
    value = value_of(config, dotted)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FP8ConfigError(
            f"expected a positive integer, got {format_value(value)}", key=dotted, value=value
        )
    return value


def parallel_sizes(config: Mapping[str, Any], value_of: Reader | None = None) -> ParallelSizes:
    """The :class:`ParallelSizes` of ``config`` (the first section of
    :data:`PARALLEL_SECTIONS` that states ``tensor_model_parallel_size``), each value read
    with ``value_of`` (default: as written)."""
    value_of = value_of or get_path
    for section in PARALLEL_SECTIONS:
        prefix = f"{section}." if section else ""
        node = get_path(config, section) if section else config
        if not isinstance(node, Mapping) or "tensor_model_parallel_size" not in node:
            continue
        tp = _size(config, f"{prefix}tensor_model_parallel_size", 1, value_of)
        etp = _size(config, f"{prefix}expert_tensor_parallel_size", tp, value_of)
        sp = value_of(config, f"{prefix}sequence_parallel")
        cp = _size(config, f"{prefix}context_parallel_size", 1, value_of)
        return ParallelSizes(tp, etp, bool(sp) and tp > 1, cp, prefix)
    return ParallelSizes()


def dimension_findings(
    spec: RecipeSpec,
    model: ModelDescription,
    config: Mapping[str, Any],
    value_of: Reader | None = None,
) -> list[Finding]:
    """:meth:`RecipeSpec.check_dims` for ``model`` (a
    :class:`~nemo_fp8_plugin.rules.ModelDescription`) split as ``config`` splits it: dense
    sizes over the tensor parallel size, expert sizes over the expert tensor parallel size.
    A finding the TP split causes is keyed by the config's own TP key."""
    if spec.training != "fp8":
        return []
    sizes = parallel_sizes(config, value_of)
    dims = model.dims()
    moe = {k: dims.pop(k) for k in ("moe_ffn_hidden_size",) if k in dims}
    found = spec.check_dims(dims, tensor_parallel=sizes.tensor_parallel)
    tp_key = {"tensor_model_parallel_size": f"{sizes.where}tensor_model_parallel_size"}
    if moe:
        extra = spec.check_dims(moe, tensor_parallel=sizes.expert_tensor_parallel)
        tp_key_moe = f"{sizes.where}expert_tensor_parallel_size"
        found += [
            type(f)(
                f.level, tp_key_moe if f.key == "tensor_model_parallel_size" else f.key, f.message
            )
            for f in extra
        ]
    return [type(f)(f.level, tp_key.get(f.key, f.key), f.message) for f in found]
