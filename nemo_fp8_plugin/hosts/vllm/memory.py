"""Memory pre-flight for colocated RL: how large vLLM's KV cache will be, and whether to pin it.

Colocated RL (NeMo RL's ``policy.generation.colocated.enabled``) puts the trainer and the
vLLM engine on the same GPUs; vLLM sleeps while the trainer steps and wakes up for the
rollouts, re-mapping its weights and KV cache. The KV cache takes what
``gpu_memory_utilization`` leaves after the weights, so a vLLM release that sizes it
differently moves the wake-up past the GPU's memory: moving vLLM 0.20 -> 0.25.1 grew the KV
cache of NVIDIA's colocated Llama-3.1-8B FP8 recipe from 19.8 to 34.3 GiB at the same
``gpu_memory_utilization: 0.5``, and the engine ran out of memory at wake-up next to the
Megatron policy; the fix pins ``kv_cache_memory_bytes``, which takes precedence over
``gpu_memory_utilization`` (NVIDIA-NeMo/RL#3280; NeMo RL's
``grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml`` pins 20 GiB under
``policy.generation.vllm_kwargs``, where 0.25's profiling sized about 34).

:func:`estimate_kv_cache` gives, without a GPU:

* the weights one GPU holds, from the model's shape (:mod:`nemo_fp8_plugin.rules.models`)
  and the recipe (FP8 weights at one byte plus their scales, the layers the rules keep in
  BF16 and the embeddings at two), divided by the tensor-parallel size;
* the KV cache as ``gpu_memory_utilization x GPU memory - weights``, flagged as an estimate
  (vLLM's profiling also sets aside its activation peak and, on CUDA, graph memory, and how
  much it sets aside changes between releases: that is how 0.25 grew the cache); with
  ``kv_cache_memory_bytes`` set, that value;
* hints: pin ``kv_cache_memory_bytes`` when the engine is colocated, the value is unset and
  its vLLM has :data:`LARGER_KV_CACHE` (a row of the version table, measured by NeMo RL, not
  read from vLLM's source; a vLLM newer than every release read is untested, and the hint
  says that whether it does is unknown); the weights exceed the budget; a pinned cache and
  the weights exceed the GPU.

GPU memory comes from the ``--hardware`` name: the size an ``nvidia-smi`` name carries
(``NVIDIA H100 80GB HBM3``), else :data:`GPU_MEMORY_GIB`. Standard library only (config-only
commands call it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ...errors import FP8ConfigError, format_value

if TYPE_CHECKING:
    from ...rules import ModelDescription
    from ...spec import RecipeSpec
    from ...stacks import Lookup

__all__ = [
    "GPU_MEMORY_GIB",
    "LARGER_KV_CACHE",
    "KVCacheEstimate",
    "MemoryHint",
    "estimate_kv_cache",
    "gpu_memory_bytes",
    "weight_bytes",
]

GIB = 2**30

GPU_MEMORY_GIB: dict[str, float] = {
    "h100": 80,
    "h800": 80,
    "h200": 141,
    "h20": 96,
    "gh200": 96,
    "a100": 80,
    "a800": 80,
    "a40": 48,
    "a30": 24,
    "a10": 24,
    "a10g": 24,
    "l4": 24,
    "l40": 48,
    "l40s": 48,
    "b200": 180,
    "gb200": 186,
    "b300": 288,
    "gb300": 288,
    "rtxpro6000": 96,
    "rtx5090": 32,
    "rtx4090": 24,
}
"""Memory per GPU as NVIDIA names it (H100 80 GB, H200 141 GB, B200 180 GB), taken as GiB:
the total a device reports is within about 1% of it (an H100 80GB: 79.6 GiB). GPUs sold
with two sizes (A100 40/80 GB, GH200 96/144 GB) take the larger; an ``nvidia-smi`` name
(``NVIDIA A100-SXM4-40GB``) says which."""

LARGER_KV_CACHE = "gpu_memory_utilization:larger_kv_cache"
"""The ``vllm`` row of :data:`nemo_fp8_plugin.stacks.FACTS` whose releases get the pinning
hint: at the same ``gpu_memory_utilization`` their KV cache is larger than the release before
made it (NVIDIA-NeMo/RL#3280)."""

_SIZE = re.compile(r"(\d{2,4})\s*gb", re.IGNORECASE)


@dataclass(frozen=True)
class MemoryHint:
    """One finding of the pre-flight.

    Attributes:
        code: ``pin_kv_cache``, ``weights_exceed_budget``, ``pinned_exceeds_memory`` or
            ``unknown_gpu_memory``.
        key: the vLLM setting it concerns (``kv_cache_memory_bytes``,
            ``gpu_memory_utilization``) or None.
        message: one sentence for the user.
        source: the upstream evidence, or None.
    """

    code: str
    key: str | None
    message: str
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KVCacheEstimate:
    """What one GPU of the engine holds.

    Attributes:
        gpu: the GPU name the memory was read for, or None.
        gpu_memory_bytes: its memory, or None when unknown.
        gpu_memory_utilization: the fraction vLLM may use.
        weight_bytes: the weights per GPU (an estimate from the model's shape).
        kv_cache_bytes: the KV cache: ``kv_cache_memory_bytes`` when set, else the estimate
            ``gpu_memory_utilization x memory - weights`` (negative: the weights do not fit);
            None when the GPU's memory is unknown.
        estimated: True when ``kv_cache_bytes`` is the estimate, False when it is pinned.
        assumptions: what the weight count assumed or left out.
        hints: the findings (:class:`MemoryHint`).
    """

    gpu: str | None
    gpu_memory_bytes: int | None
    gpu_memory_utilization: float
    weight_bytes: int
    kv_cache_bytes: int | None
    estimated: bool
    assumptions: tuple[str, ...] = ()
    hints: tuple[MemoryHint, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["assumptions"] = list(self.assumptions)
        out["hints"] = [h.to_dict() for h in self.hints]
        return out


def gpu_memory_bytes(hardware: str) -> int | None:
    """The memory of the GPU ``hardware`` names (a GPU or ``nvidia-smi`` name), or None for
    an architecture name (``hopper``: an H100 and an H200 differ) or an unknown GPU."""
    from ...capabilities import arch_by_name

    if not isinstance(hardware, str) or arch_by_name(hardware) is None:
        return None
    size = _SIZE.search(hardware)
    if size is not None:
        return int(size.group(1)) * GIB
    text = re.sub(r"[\s_-]", "", hardware.lower()).removeprefix("nvidia").removeprefix("geforce")
    for gpu in sorted(GPU_MEMORY_GIB, key=len, reverse=True):  # "h200" before "h20"
        if text.startswith(gpu):
            return int(GPU_MEMORY_GIB[gpu] * GIB)
    return None


# --------------------------------------------------------------------------- weights


class _Shape:
    """The sizes the weight count needs: the model description's, and the config's where
    given (attention heads, MLA ranks, vocabulary)."""

    def __init__(self, model: ModelDescription, config: Mapping[str, Any] | None) -> None:
        cfg = dict(config or {})
        if isinstance(cfg.get("text_config"), Mapping) and "hidden_size" not in cfg:
            cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k != "text_config"}}
        self.cfg = cfg
        self.assumptions: list[str] = []
        self.h = model.hidden_size
        heads = self._int("num_attention_heads")
        head_dim = self._int("head_dim") or (self.h // heads if heads else None)
        kv = self._int("num_key_value_heads") or heads
        if heads and head_dim:
            self.q_dim, self.kv_dim = heads * head_dim, (kv or heads) * head_dim
        else:
            self.q_dim = self.kv_dim = self.h
            self.assumptions.append(
                "attention counted as 4 x hidden^2 per layer (heads unknown: no grouped-query "
                "attention assumed, an upper bound)"
            )
        self.heads = heads
        self.vocab = self._int("vocab_size")
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if self.vocab is None:
            self.assumptions.append(
                "embedding and output head not counted (vocab_size unknown: pass the model's "
                "config.json)"
            )
        shared = self._int("shared_expert_intermediate_size")
        self.shared_ffn = shared or model.moe_ffn_hidden_size * max(model.num_shared_experts, 1)

    def _int(self, key: str) -> int | None:
        value = self.cfg.get(key)
        return value if type(value) is int and value > 0 else None

    def mla(self, leaf: str) -> int | None:
        q_lora, kv_lora = self._int("q_lora_rank"), self._int("kv_lora_rank")
        nope, rope = self._int("qk_nope_head_dim"), self._int("qk_rope_head_dim")
        v_dim, heads = self._int("v_head_dim"), self.heads
        if None in (kv_lora, nope, rope, v_dim, heads):
            return None
        assert kv_lora and nope and rope and v_dim and heads
        if leaf == "fused_qkv_a_proj":
            return self.h * ((q_lora or 0) + kv_lora + rope)
        if leaf == "kv_a_proj_with_mqa":
            return self.h * (kv_lora + rope)
        if leaf == "q_b_proj":
            return (q_lora or 0) * heads * (nope + rope)
        if leaf == "q_proj":
            return self.h * heads * (nope + rope)
        if leaf == "kv_b_proj":
            return kv_lora * heads * (nope + v_dim)
        if leaf == "o_proj":
            return heads * v_dim * self.h
        return None


def _unit_params(
    unit: str, members: tuple[str, ...], model: ModelDescription, shape: _Shape
) -> int | None:
    """Parameters of one vLLM unit, or None when its size is not known from the shape."""
    leaf = unit.rsplit(".", 1)[-1]
    h = shape.h
    if model.family == "deepseek" and leaf in (
        "fused_qkv_a_proj",
        "kv_a_proj_with_mqa",
        "q_b_proj",
        "q_proj",
        "kv_b_proj",
        "o_proj",
    ):
        return shape.mla(leaf)
    shared = ".shared_expert" in unit
    ffn = shape.shared_ffn if shared else model.ffn_hidden_size
    if leaf == "qkv_proj":
        return h * (shape.q_dim + 2 * shape.kv_dim)
    if leaf == "o_proj":
        return shape.q_dim * h
    if leaf == "gate_up_proj":
        return 2 * h * ffn
    if leaf in ("down_proj", "up_proj"):
        return h * ffn
    if leaf == "experts":
        return len(members) * h * model.moe_ffn_hidden_size
    if leaf in ("gate", "router"):
        return model.num_experts * h
    if leaf == "shared_expert_gate":
        return h
    if leaf == "lm_head":
        return None if shape.vocab is None else shape.vocab * h
    return None


def weight_bytes(
    spec: RecipeSpec, model: ModelDescription, *, config: Mapping[str, Any] | None = None
) -> tuple[int, tuple[str, ...]]:
    """The bytes of a model's weights as the engine holds them under ``spec``, and what the
    count assumed. Linear units the recipe quantizes: one byte per weight plus their scales
    (fp32 per block tile, or one E8M0 byte per MX group); units the rules keep in high
    precision, the embedding and (untied) output head: two bytes. Norms and biases are left
    out (well under 0.1% of a transformer's weights)."""
    from ...capabilities import capability
    from ...rules import keeps_bf16

    shape = _Shape(model, config)
    fp8 = spec.generation == "fp8"
    row = capability(spec.scaling)
    tile = math.prod(spec.weight_block) if spec.weight_block else None  # None: per tensor
    scale_bytes = 4 if row.is_block else 1
    total = 0
    unknown: list[str] = []
    for unit, members in model.vllm_modules:
        params = _unit_params(unit, members, model, shape)
        if params is None:
            leaf = unit.rsplit(".", 1)[-1]
            if leaf not in unknown and not (leaf == "lm_head" and shape.vocab is None):
                unknown.append(leaf)
            continue
        if unit.endswith("lm_head") and shape.tied:
            continue  # the embedding's bytes, counted below
        quantized = fp8 and all(
            keeps_bf16(spec, m, side="generation", num_layers=model.num_layers, model=model) is None
            for m in members
        )
        scales = math.ceil(params / tile) if tile else 1
        total += params + scales * scale_bytes if quantized else 2 * params
    if shape.vocab is not None:
        total += 2 * shape.vocab * shape.h
    notes = list(shape.assumptions)
    if unknown:
        notes.append(f"modules of unknown size not counted: {', '.join(unknown)}")
    return total, tuple(notes)


# --------------------------------------------------------------------------- the estimate


def _fraction(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise FP8ConfigError(
            f"expected a fraction in (0, 1], got {format_value(value)}", key=key, value=value
        )
    return float(value)


def _positive_int(value: Any, key: str, *, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if type(value) is not int or value < 1:
        raise FP8ConfigError(
            f"expected a positive integer, got {format_value(value)}", key=key, value=value
        )
    return value


def estimate_kv_cache(
    spec: RecipeSpec,
    model: ModelDescription,
    *,
    gpu_memory_utilization: float,
    hardware: str | None = None,
    gpu_memory: int | None = None,
    tensor_parallel_size: int = 1,
    vllm_version: str | None = None,
    kv_cache_memory_bytes: int | None = None,
    colocated: bool = True,
    config: Mapping[str, Any] | None = None,
) -> KVCacheEstimate:
    """The KV cache one GPU of a (colocated) vLLM engine will get, and the hints.

    Args:
        spec: the recipe (its generation precision, tiles and BF16 rules weigh the weights).
        model: a :class:`~nemo_fp8_plugin.rules.models.ModelDescription`.
        gpu_memory_utilization: the engine's setting (vLLM's default is 0.9).
        hardware: the GPU (``--hardware``: ``h100``, ``NVIDIA H100 80GB HBM3``).
        gpu_memory: its memory in bytes, instead of ``hardware``'s.
        tensor_parallel_size: the engine's; the weights are split over it.
        vllm_version: the stack's vLLM; None gives no version hint.
        kv_cache_memory_bytes: the engine's setting, when set.
        colocated: the engine shares its GPUs with the trainer.
        config: the model's Hugging Face ``config.json`` mapping, for the sizes the
            description lacks (attention heads, vocabulary, MLA ranks).
    """
    util = _fraction(gpu_memory_utilization, "gpu_memory_utilization")
    tp = _positive_int(tensor_parallel_size, "tensor_parallel_size", optional=False)
    assert tp is not None
    pinned = _positive_int(kv_cache_memory_bytes, "kv_cache_memory_bytes")
    memory = _positive_int(gpu_memory, "gpu_memory")
    if memory is None and hardware is not None:
        memory = gpu_memory_bytes(hardware)
    weights, assumptions = weight_bytes(spec, model, config=config)
    weights = math.ceil(weights / tp)
    hints: list[MemoryHint] = []
    if memory is None:
        hints.append(
            MemoryHint(
                "unknown_gpu_memory",
                None,
                f"the memory of {format_value(hardware)} is not known: name the GPU "
                f"(h100, h200, b200) for a KV-cache estimate"
                if hardware
                else "no GPU named: name it (--hardware h100) for a KV-cache estimate",
            )
        )
    kv: int | None
    if pinned is not None:
        kv, estimated = pinned, False
        if memory is not None and pinned + weights > memory:
            hints.append(
                MemoryHint(
                    "pinned_exceeds_memory",
                    "kv_cache_memory_bytes",
                    f"kv_cache_memory_bytes ({pinned / GIB:.1f} GiB) and the weights "
                    f"({weights / GIB:.1f} GiB per GPU) exceed the GPU's "
                    f"{memory / GIB:.0f} GiB",
                )
            )
    else:
        kv = None if memory is None else int(util * memory) - weights
        estimated = True
        if memory is not None and kv is not None and kv <= 0:
            hints.append(
                MemoryHint(
                    "weights_exceed_budget",
                    "gpu_memory_utilization",
                    f"the weights ({weights / GIB:.1f} GiB per GPU) leave no KV cache in "
                    f"gpu_memory_utilization {util} of {memory / GIB:.0f} GiB",
                )
            )
    grows = None if vllm_version is None else _larger_kv_cache(vllm_version)
    if colocated and pinned is None and grows is not None and (grows.present or grows.newer):
        size = "" if kv is None or kv <= 0 else f" (about {kv / GIB:.1f} GiB here, an estimate)"
        row = grows.fact
        assert row is not None
        if grows.newer:
            message = (
                f"vLLM {vllm_version} is untested (newer than every release read): whether "
                f"it sizes the KV cache from gpu_memory_utilization {util}{size} as vLLM from "
                f"{row.minimum} does is unknown; there, {row.doc}"
            )
        else:
            untested = "" if grows.tested else " (untested)"
            message = (
                f"vLLM {vllm_version}{untested} sizes the KV cache from gpu_memory_utilization "
                f"{util}{size}: {row.doc}"
            )
        hints.append(
            MemoryHint(
                "pin_kv_cache",
                "kv_cache_memory_bytes",
                message,
                "NVIDIA-NeMo/RL#3280",
            )
        )
    gpu = hardware if memory is not None and gpu_memory is None else None
    return KVCacheEstimate(
        gpu=gpu,
        gpu_memory_bytes=memory,
        gpu_memory_utilization=util,
        weight_bytes=weights,
        kv_cache_bytes=kv,
        estimated=estimated,
        assumptions=assumptions,
        hints=tuple(hints),
    )


def _larger_kv_cache(version: str) -> Lookup:
    """The version table's answer (``stacks.Lookup``) for :data:`LARGER_KV_CACHE`."""
    from ...stacks import lookup, newest_tested, parse_version

    if not isinstance(version, str) or parse_version(version) is None:
        raise FP8ConfigError(
            f"expected a vLLM version such as {newest_tested('vllm')}, got {format_value(version)}",
            key="vllm_version",
            value=version,
        )
    return lookup("vllm", LARGER_KV_CACHE, version)
