"""The GPU a config targets (``--hardware``, ``fp8.hardware``), judged for the config's host.

A recipe names both sides (``mxfp8`` trains and generates in MXFP8), but a host runs only its
own: megatron-core, NeMo 2, Megatron-Bridge and Transformer Engine train, vLLM generates, NeMo
RL does both (:data:`nemo_fp8_plugin.capabilities.HOST_SIDES`). ``apply`` refuses what the
host cannot run there, in the host's terms and with the recipe docs/recipes.md names for it
(``fp8_subchannel`` for pretraining where NeMo RL gets ``fp8_blockwise``); a side the host
does not run is not its concern. ``explain`` and ``doctor`` report the same problems
(:func:`nemo_fp8_plugin.capabilities.hardware_problems` with the host's sides).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..capabilities import hardware_problems, host_sides
from ..errors import FP8ConfigError

if TYPE_CHECKING:
    from ..config import FP8Request

__all__ = ["targeted"]


def targeted(request: FP8Request | None, host: str | None) -> FP8Request | None:
    """``request`` with its spec set to the target GPU it states (``request.hardware``, found
    with ``check_hardware=False``), once nothing ``host`` runs is stopped there.

    Raises :class:`FP8ConfigError` with the first problem, keyed by where the target was
    stated (``--hardware`` / ``fp8.hardware``) or by the field the fix changes
    (``fp8.pow2_scales``). When only a side ``host`` does not run cannot run there (vLLM
    serving a recipe whose training Transformer Engine cannot run on that GPU), the spec keeps
    no target, as ``explain``'s does, and nothing is refused."""
    if request is None or request.hardware is None:
        return request
    spec, arch = request.spec, request.hardware
    problems = hardware_problems(spec, arch, host_sides(host), request.keys)
    errors = [p for p in problems if p.level == "error"]
    if errors:
        first = errors[0]
        key = request.hardware_key if first.key == "hardware" else f"fp8.{first.key}"
        raise FP8ConfigError(first.message, key=key)
    try:
        return dataclasses.replace(request, spec=spec.replace(hardware=arch))
    except FP8ConfigError:  # the other side's problem: not this host's
        return request
