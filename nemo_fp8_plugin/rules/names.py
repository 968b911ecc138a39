"""Module names on both sides and the mapping between them.

Megatron (training) and Hugging Face / vLLM (generation) name the same linear layers
differently, and fuse different groups of them into one GEMM:

megatron-core (after ``decoder.layers.<i>.``) -> Hugging Face (after ``model.layers.<i>.``)
-> vLLM module:

- ``self_attention.linear_qkv`` -> ``self_attn.q_proj``/``k_proj``/``v_proj`` -> ``self_attn.qkv_proj``
- ``self_attention.linear_proj`` -> ``self_attn.o_proj``
- MLA: ``linear_q_proj`` -> ``q_proj`` (no q LoRA, e.g. Moonlight); ``linear_q_down_proj`` ->
  ``q_a_proj``; ``linear_q_up_proj`` -> ``q_b_proj``; ``linear_kv_down_proj`` ->
  ``kv_a_proj_with_mqa``; ``linear_kv_up_proj`` -> ``kv_b_proj``. vLLM fuses ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj`` when the model has a q LoRA (DeepSeek-V3).
- ``mlp.linear_fc1`` -> ``mlp.gate_proj``/``up_proj`` -> ``mlp.gate_up_proj``; ``mlp.linear_fc2``
  -> ``mlp.down_proj``
- ``mlp.router`` -> ``mlp.gate``
- ``mlp.experts.linear_fc1`` / ``linear_fc2`` (TE grouped GEMM; ``experts.local_experts.<e>.*``
  without it) -> ``mlp.experts.<e>.gate_proj``/``up_proj`` / ``down_proj`` -> ``mlp.experts`` (one
  fused MoE module per layer)
- ``mlp.shared_experts.linear_fc1``/``fc2`` -> ``mlp.shared_experts.gate_proj``/``up_proj`` /
  ``down_proj`` (vLLM: ``shared_experts.gate_up_proj``)
- ``output_layer`` -> ``lm_head``

The pairs are those of Megatron-Bridge's checkpoint converters (``megatron/bridge/models/*``);
the vLLM groups are the models' ``packed_modules_mapping`` (one GEMM, one precision).

This module is standard library only: the refit quantizer and the emulation converter
call it on GPU machines that have nothing but torch.
"""

from __future__ import annotations

import re

__all__ = [
    "layer_index",
    "strip_param_suffix",
    "generic_counterparts",
    "generic_siblings",
    "generic_unit",
    "generic_members",
    "builtin_high_precision",
    "MEGATRON_TO_HF_LEAVES",
]

# Component names that hold the transformer-layer index: Megatron and Llama-style HF use
# `layers`, BERT `layer`, GPT-2 `h`, some vision/other models `blocks`.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?=\.|$)")

# Parameter leaves a caller may pass instead of a module name (TE's grouped GEMMs store
# `weight0`, `weight1`, ...; FP8 checkpoints carry `weight_scale_inv`).
_PARAM_SUFFIX_RE = re.compile(
    r"\.(?:weight\d*|bias\d*|weight_scale_inv|weight_scale|input_scale|_extra_state|"
    r"layer_norm_weight|layer_norm_bias|e_score_correction_bias|expert_bias)$"
)

MEGATRON_TO_HF_LEAVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attention.linear_proj", ("self_attn.o_proj",)),
    ("self_attention.linear_q_proj", ("self_attn.q_proj",)),
    ("self_attention.linear_q_down_proj", ("self_attn.q_a_proj",)),
    ("self_attention.linear_q_up_proj", ("self_attn.q_b_proj",)),
    ("self_attention.linear_kv_down_proj", ("self_attn.kv_a_proj_with_mqa",)),
    ("self_attention.linear_kv_up_proj", ("self_attn.kv_b_proj",)),
    ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.linear_fc2", ("mlp.down_proj",)),
    ("mlp.router", ("mlp.gate",)),
    (
        "mlp.shared_experts.linear_fc1",
        ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    ),
    ("mlp.shared_experts.linear_fc2", ("mlp.shared_experts.down_proj",)),
    ("mlp.experts.linear_fc1", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj")),
    ("mlp.experts.linear_fc2", ("mlp.experts.*.down_proj",)),
)
"""Megatron leaf (after ``decoder.layers.<i>.``) -> Hugging Face leaves (after
``model.layers.<i>.``). ``*`` stands for the expert index."""

# HF leaves vLLM runs as one GEMM (its models' packed_modules_mapping).
_HF_FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
)

_HF_TO_MEGATRON: dict[str, list[str]] = {}
for _mg, _hfs in MEGATRON_TO_HF_LEAVES:
    for _hf in _hfs:
        _HF_TO_MEGATRON.setdefault(_hf, []).append(_mg)
_MEGATRON_LEAVES = dict(MEGATRON_TO_HF_LEAVES)

_EXPERT_HF_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_MG_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")


def layer_index(name: str) -> int | None:
    """The transformer-layer index in a module name (``decoder.layers.3.mlp`` -> 3), or None
    for modules outside the layer stack (``output_layer``, ``lm_head``) and for Megatron's
    multi-token-prediction block (``mtp.layers.<i>``, not a decoder layer)."""
    if name.startswith("mtp.") or ".mtp." in name:
        return None
    found = _LAYER_RE.search(name)
    return int(found.group(1)) if found else None


def strip_param_suffix(name: str) -> str:
    """A module name from a parameter name (``...q_proj.weight`` -> ``...q_proj``)."""
    return _PARAM_SUFFIX_RE.sub("", name)


def _split(name: str) -> tuple[str, str, str] | None:
    """(side, prefix with the layer index, leaf) for a name inside a decoder layer."""
    m = re.match(r"^((?:.*?\.)?decoder\.layers\.\d+)\.(.+)$", name)
    if m:
        return "megatron", m.group(1), m.group(2)
    m = re.match(r"^((?:.*?\.)?(?:layers|layer|h|blocks)\.\d+)\.(.+)$", name)
    if m:
        return "hf", m.group(1), m.group(2)
    return None


def _hf_prefix(megatron_prefix: str) -> str:
    return re.sub(r"(?:^|.*\.)decoder\.layers\.(\d+)$", r"model.layers.\1", megatron_prefix)


def _megatron_prefix(hf_prefix: str) -> str:
    return "decoder.layers." + hf_prefix.rsplit(".", 1)[1]


def generic_counterparts(name: str) -> list[str]:
    """Names of the same module in the other naming, from the name alone (no model).

    An expert index the other side does not carry becomes ``*``; an HF ``q_proj`` maps to
    both ``linear_qkv`` (GQA) and ``linear_q_proj`` (MLA) because the name alone cannot
    tell them apart.
    """
    name = strip_param_suffix(name)
    if name in ("output_layer",) or name.endswith(".output_layer"):
        return ["lm_head"]
    if name == "lm_head" or name.endswith(".lm_head"):
        return ["output_layer"]
    parts = _split(name)
    if parts is None:
        return []
    side, prefix, leaf = parts
    if side == "megatron":
        hf_prefix = _hf_prefix(prefix)
        m = _EXPERT_MG_RE.match(leaf)
        if m:
            idx, fc = m.groups()
            leaves = (
                [f"mlp.experts.{idx}.gate_proj", f"mlp.experts.{idx}.up_proj"]
                if fc == "linear_fc1"
                else [f"mlp.experts.{idx}.down_proj"]
            )
            return [f"{hf_prefix}.{lf}" for lf in leaves]
        return [f"{hf_prefix}.{lf}" for lf in _MEGATRON_LEAVES.get(leaf, ())]
    mg_prefix = _megatron_prefix(prefix)
    m = _EXPERT_HF_RE.match(leaf)
    if m:
        idx, proj = m.groups()
        fc = "linear_fc2" if proj == "down_proj" else "linear_fc1"
        return [
            f"{mg_prefix}.mlp.experts.{fc}",
            f"{mg_prefix}.mlp.experts.local_experts.{idx}.{fc}",
        ]
    return [f"{mg_prefix}.{mg}" for mg in _HF_TO_MEGATRON.get(leaf, ())]


def generic_siblings(name: str) -> list[str]:
    """Other HF modules that vLLM fuses with ``name`` into one GEMM (and so one precision)."""
    name = strip_param_suffix(name)
    parts = _split(name)
    if parts is None or parts[0] != "hf":
        return []
    _, prefix, leaf = parts
    for group in _HF_FUSED_GROUPS:
        if leaf in group:
            return [f"{prefix}.{lf}" for lf in group if lf != leaf]
    return []


def generic_unit(name: str) -> str | None:
    """The vLLM module that runs an HF module (``...mlp.experts.7.up_proj`` ->
    ``...mlp.experts``; ``...self_attn.k_proj`` -> ``...self_attn.qkv_proj``)."""
    name = strip_param_suffix(name)
    parts = _split(name)
    if parts is None or parts[0] != "hf":
        return None
    _, prefix, leaf = parts
    if _EXPERT_HF_RE.match(leaf):
        return f"{prefix}.mlp.experts"
    if leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        return f"{prefix}.self_attn.qkv_proj"
    if leaf in ("mlp.gate_proj", "mlp.up_proj"):
        return f"{prefix}.mlp.gate_up_proj"
    if leaf in ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"):
        return f"{prefix}.mlp.shared_experts.gate_up_proj"
    return None


_VLLM_FUSED_LEAVES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.fused_qkv_a_proj": ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_experts.gate_up_proj": (
        "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.up_proj",
    ),
    "mlp.experts": ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.*.down_proj"),
}


def generic_members(name: str) -> list[str]:
    """HF modules inside a fused vLLM module name (``...qkv_proj`` -> q/k/v; ``...mlp.experts``
    -> every expert's projections, the expert index as ``*``); empty for other names."""
    name = strip_param_suffix(name)
    parts = _split(name)
    if parts is None or parts[0] != "hf":
        return []
    _, prefix, leaf = parts
    return [f"{prefix}.{lf}" for lf in _VLLM_FUSED_LEAVES.get(leaf, ())]


_ROUTERS = (".mlp.router", ".mlp.gate", ".mixer.gate", ".mlp.shared_expert_gate")
"""Routing modules: megatron-core's router, Hugging Face / vLLM ``mlp.gate`` (Qwen, DeepSeek),
Nemotron-H's ``mixer.gate`` and Qwen3.5's scalar ``mlp.shared_expert_gate`` (vLLM builds the
last two without a quant config: ``nemotron_h.py`` GateLinear, ``qwen3_next.py``
ReplicatedLinear ``quant_config=None``, vLLM 0.32)."""


def builtin_high_precision(name: str) -> str | None:
    """Why a module never runs in FP8 on any host, or None.

    ``output_head``: megatron-core's ``output_layer`` is a plain (non-TE) linear and vLLM's
    ``lm_head`` is an embedding-style module its FP8 method skips. ``router``: megatron-core
    computes MoE routing outside TE (in fp32 with ``moe_router_dtype``); the plugin keeps
    the router in high precision on the generation side too, so both sides agree (vLLM
    would otherwise quantize Qwen3-MoE's ``mlp.gate``).
    """
    name = strip_param_suffix(name)
    if name in ("output_layer", "lm_head") or name.endswith((".output_layer", ".lm_head")):
        return "output_head"
    if name.endswith(_ROUTERS) or name in ("mlp.router", "mlp.gate"):
        return "router"
    return None
