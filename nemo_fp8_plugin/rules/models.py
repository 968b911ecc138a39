"""Model descriptions: layer count, sizes, and every linear module under each naming.

A :class:`ModelDescription` is all the rule resolution needs; it is built without the
model, without torch and without network, from one of:

* the built-in table (:data:`BUILTIN_MODELS`), keyed by the names users' configs carry
  (``meta-llama/Llama-3.1-8B-Instruct``, ``moonshotai/Moonlight-16B-A3B-Instruct``,
  ``Qwen/Qwen3-30B-A3B``, ``llama3.1-8b``, NeMo factory and config-class names such as
  ``llama31_8b`` or ``Llama31Config8B``);
* a Hugging Face ``config.json`` (a path to the file or to the checkpoint directory);
* a megatron-core ``TransformerConfig`` (or a mapping with its field names, as in the
  ``model:`` section of a Megatron YAML), through :func:`from_transformer_config`.

Over 600 lines on purpose: one :class:`ModelDescription` built from every source (HF config,
megatron-core fields, hybrid layouts, the built-in table) through the same ``_build``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from ..errors import LIMITS, FP8ConfigError, check_limit, format_value
from .names import layer_index

__all__ = [
    "ModelDescription",
    "describe_model",
    "from_hf_config",
    "from_transformer_config",
    "BUILTIN_MODELS",
    "HF_MODEL_TYPES",
]


@dataclass(frozen=True)
class ModelDescription:
    """The linear modules of one architecture, under Megatron and Hugging Face / vLLM names.

    Built by :func:`describe_model`; immutable. Expert modules are listed per expert on the
    Hugging Face side (as checkpoints name them) and per layer on the Megatron side (TE's
    grouped GEMM, ``mlp.experts.linear_fc1``), as the hosts run them.
    """

    name: str
    """The model's name as given (HF id, short name, or the config path)."""

    family: str
    """Architecture family: ``llama`` (also Mistral, Qwen2/Qwen3 dense), ``qwen3_moe``,
    ``deepseek`` (DeepSeek-V2/V3, Moonlight, Kimi-K2: MLA + MoE) or ``gpt`` (Megatron GPT)."""

    num_layers: int
    """Transformer layers (multi-token-prediction layers excluded)."""

    hidden_size: int
    """Model width."""

    ffn_hidden_size: int
    """Hidden size of the dense MLPs."""

    num_experts: int = 0
    """Routed experts per MoE layer; 0 for dense models."""

    moe_ffn_hidden_size: int = 0
    """Hidden size of one routed expert; 0 for dense models."""

    num_shared_experts: int = 0
    """Shared experts per MoE layer (DeepSeek style), fused into one MLP by every host."""

    megatron_linear_modules: tuple[str, ...] = ()
    """Fully qualified megatron-core module names, in model order: ``decoder.layers.0.
    self_attention.linear_qkv``, ..., ``decoder.layers.3.mlp.router``, ``decoder.layers.3.mlp.
    experts.linear_fc1``, ..., ``output_layer``."""

    hf_linear_modules: tuple[str, ...] = ()
    """Fully qualified Hugging Face module names (unfused, one per expert), in model order:
    ``model.layers.0.self_attn.q_proj``, ..., ``lm_head``."""

    megatron_to_hf: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """The name mapping: each Megatron module and the HF modules it holds
    (``linear_qkv`` -> ``q_proj``, ``k_proj``, ``v_proj``)."""

    vllm_modules: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """vLLM's modules (what it quantizes as one unit) and the HF modules each fuses:
    ``model.layers.0.self_attn.qkv_proj`` -> q/k/v; ``model.layers.3.mlp.experts`` -> every
    expert's projections."""

    vllm_quantizes_router: bool = False
    """True where vLLM's FP8 method would quantize the MoE router unless told not to
    (Qwen3-MoE passes its quant config to ``mlp.gate``; DeepSeek's gate never takes one)."""

    source: str = "built-in"
    """Where the description came from: ``built-in``, a ``config.json`` path, or
    ``TransformerConfig``."""

    layer_kinds: tuple[str, ...] = ()
    """Hybrid models only (empty otherwise: every layer is attention + MLP or MoE): what each
    layer holds, by index: its sequence mixer, ``attention``, ``linear_attention`` (Qwen3.5's
    Gated DeltaNet) or ``mamba`` (Nemotron-H's Mamba-2), and/or its MLP, ``mlp`` or ``moe``,
    joined by ``+`` (``linear_attention+moe``; a Nemotron-H layer holds one of them). Which
    linear modules a layer has follows from it, and so do the per-layer rules and tables."""

    # ------------------------------------------------------------------ lookups

    @cached_property
    def _mg_to_hf(self) -> dict[str, tuple[str, ...]]:
        return dict(self.megatron_to_hf)

    @cached_property
    def _hf_to_mg(self) -> dict[str, str]:
        return {hf: mg for mg, hfs in self.megatron_to_hf for hf in hfs}

    @cached_property
    def _unit_members(self) -> dict[str, tuple[str, ...]]:
        return dict(self.vllm_modules)

    @cached_property
    def _hf_to_unit(self) -> dict[str, str]:
        return {hf: unit for unit, hfs in self.vllm_modules for hf in hfs}

    def hf_names(self, megatron_name: str) -> tuple[str, ...]:
        """HF modules held by a Megatron module (empty when it has none)."""
        return self._mg_to_hf.get(megatron_name, ())

    def megatron_name(self, hf_name: str) -> str | None:
        """The Megatron module holding an HF module, or None."""
        return self._hf_to_mg.get(hf_name)

    def vllm_module(self, hf_name: str) -> str | None:
        """The vLLM module that runs an HF module (``k_proj`` -> ``qkv_proj``), or None."""
        return self._hf_to_unit.get(hf_name)

    def vllm_members(self, vllm_name: str) -> tuple[str, ...]:
        """HF modules fused into a vLLM module."""
        return self._unit_members.get(vllm_name, ())

    def dims(self) -> dict[str, int]:
        """GEMM dimensions for :meth:`RecipeSpec.check_dims` (tile divisibility)."""
        out = {"hidden_size": self.hidden_size, "ffn_hidden_size": self.ffn_hidden_size}
        if self.num_experts:
            out["moe_ffn_hidden_size"] = self.moe_ffn_hidden_size
        return out

    def summary(self) -> dict[str, Any]:
        """Plain data for reports (no module lists)."""
        return {
            "name": self.name,
            "family": self.family,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_experts": self.num_experts,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
            "num_shared_experts": self.num_shared_experts,
            "source": self.source,
            "megatron_linear_modules": len(self.megatron_linear_modules),
            "hf_linear_modules": len(self.hf_linear_modules),
            **({"layer_kinds": _kind_counts(self.layer_kinds)} if self.layer_kinds else {}),
        }

    @staticmethod
    def layer_of(name: str) -> int | None:
        """Transformer-layer index of a module name under either naming."""
        return layer_index(name)


def _kind_counts(kinds: tuple[str, ...]) -> dict[str, int]:
    """``{"linear_attention+moe": 30, "attention+moe": 10}``, in first-seen order."""
    out: dict[str, int] = {}
    for kind in kinds:
        out[kind] = out.get(kind, 0) + 1
    return out


# --------------------------------------------------------------------------- construction


def _build(
    name: str,
    family: str,
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    moe_layers: frozenset[int] = frozenset(),
    num_experts: int = 0,
    moe_ffn_hidden_size: int = 0,
    num_shared_experts: int = 0,
    mla: bool = False,
    q_lora: bool = False,
    gated: bool = True,
    vllm_quantizes_router: bool = False,
    source: str = "built-in",
) -> ModelDescription:
    # Names are built per layer and expert (3 linears each): bound the product, not only each.
    check_limit(
        num_layers * (3 * len(moe_layers) * num_experts // max(num_layers, 1) + 16),
        LIMITS.modules,
        f"{source}: {num_layers} layers x {num_experts} experts: linear modules",
        key="num_experts" if num_experts else "num_layers",
    )
    mg_map: list[tuple[str, tuple[str, ...]]] = []
    units: list[tuple[str, tuple[str, ...]]] = []
    hf_all: list[str] = []

    def add(mg: str | None, hfs: tuple[str, ...]) -> None:
        if mg is not None:
            mg_map.append((mg, hfs))

    for i in range(num_layers):
        mgp, hfp = f"decoder.layers.{i}", f"model.layers.{i}"
        layer_units: list[tuple[str, tuple[str, ...]]] = []
        # attention
        if mla:
            q_leaves = ["q_a_proj", "q_b_proj"] if q_lora else ["q_proj"]
            if q_lora:
                add(f"{mgp}.self_attention.linear_q_down_proj", (f"{hfp}.self_attn.q_a_proj",))
                add(f"{mgp}.self_attention.linear_q_up_proj", (f"{hfp}.self_attn.q_b_proj",))
            else:
                add(f"{mgp}.self_attention.linear_q_proj", (f"{hfp}.self_attn.q_proj",))
            add(
                f"{mgp}.self_attention.linear_kv_down_proj",
                (f"{hfp}.self_attn.kv_a_proj_with_mqa",),
            )
            add(f"{mgp}.self_attention.linear_kv_up_proj", (f"{hfp}.self_attn.kv_b_proj",))
            add(f"{mgp}.self_attention.linear_proj", (f"{hfp}.self_attn.o_proj",))
            hf_attn = [f"{hfp}.self_attn.{lf}" for lf in q_leaves] + [
                f"{hfp}.self_attn.kv_a_proj_with_mqa",
                f"{hfp}.self_attn.kv_b_proj",
                f"{hfp}.self_attn.o_proj",
            ]
            if q_lora:  # vLLM fuses the two down-projections (packed_modules_mapping)
                layer_units.append(
                    (
                        f"{hfp}.self_attn.fused_qkv_a_proj",
                        (f"{hfp}.self_attn.q_a_proj", f"{hfp}.self_attn.kv_a_proj_with_mqa"),
                    )
                )
                layer_units.append((f"{hfp}.self_attn.q_b_proj", (f"{hfp}.self_attn.q_b_proj",)))
            else:
                layer_units.append((f"{hfp}.self_attn.q_proj", (f"{hfp}.self_attn.q_proj",)))
                layer_units.append(
                    (
                        f"{hfp}.self_attn.kv_a_proj_with_mqa",
                        (f"{hfp}.self_attn.kv_a_proj_with_mqa",),
                    )
                )
            layer_units.append((f"{hfp}.self_attn.kv_b_proj", (f"{hfp}.self_attn.kv_b_proj",)))
            layer_units.append((f"{hfp}.self_attn.o_proj", (f"{hfp}.self_attn.o_proj",)))
        else:
            qkv = (f"{hfp}.self_attn.q_proj", f"{hfp}.self_attn.k_proj", f"{hfp}.self_attn.v_proj")
            add(f"{mgp}.self_attention.linear_qkv", qkv)
            add(f"{mgp}.self_attention.linear_proj", (f"{hfp}.self_attn.o_proj",))
            hf_attn = list(qkv) + [f"{hfp}.self_attn.o_proj"]
            layer_units.append((f"{hfp}.self_attn.qkv_proj", qkv))
            layer_units.append((f"{hfp}.self_attn.o_proj", (f"{hfp}.self_attn.o_proj",)))
        hf_all.extend(hf_attn)
        # MLP
        if i in moe_layers:
            router = f"{hfp}.mlp.gate"
            add(f"{mgp}.mlp.router", (router,))
            gates = tuple(f"{hfp}.mlp.experts.{e}.gate_proj" for e in range(num_experts))
            ups = tuple(f"{hfp}.mlp.experts.{e}.up_proj" for e in range(num_experts))
            downs = tuple(f"{hfp}.mlp.experts.{e}.down_proj" for e in range(num_experts))
            fc1 = tuple(n for pair in zip(gates, ups) for n in pair)
            add(f"{mgp}.mlp.experts.linear_fc1", fc1)
            add(f"{mgp}.mlp.experts.linear_fc2", downs)
            experts = tuple(n for e in range(num_experts) for n in (gates[e], ups[e], downs[e]))
            hf_all.append(router)
            hf_all.extend(experts)
            layer_units.append((router, (router,)))
            layer_units.append((f"{hfp}.mlp.experts", experts))
            if num_shared_experts:
                sg, su, sd = (
                    f"{hfp}.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")
                )
                add(f"{mgp}.mlp.shared_experts.linear_fc1", (sg, su))
                add(f"{mgp}.mlp.shared_experts.linear_fc2", (sd,))
                hf_all.extend((sg, su, sd))
                layer_units.append((f"{hfp}.mlp.shared_experts.gate_up_proj", (sg, su)))
                layer_units.append((sd, (sd,)))
        else:
            down = f"{hfp}.mlp.down_proj"
            if gated:
                g, u = f"{hfp}.mlp.gate_proj", f"{hfp}.mlp.up_proj"
                add(f"{mgp}.mlp.linear_fc1", (g, u))
                hf_all.extend((g, u, down))
                layer_units.append((f"{hfp}.mlp.gate_up_proj", (g, u)))
            else:
                u = f"{hfp}.mlp.up_proj"
                add(f"{mgp}.mlp.linear_fc1", (u,))
                hf_all.extend((u, down))
                layer_units.append((u, (u,)))
            add(f"{mgp}.mlp.linear_fc2", (down,))
            layer_units.append((down, (down,)))
        units.extend(layer_units)
    return _with_output_layer(
        name,
        family,
        (mg_map, hf_all, units),
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        moe=(num_experts, moe_ffn_hidden_size, num_shared_experts) if moe_layers else (0, 0, 0),
        vllm_quantizes_router=vllm_quantizes_router and bool(moe_layers),
        source=source,
    )


def _with_output_layer(
    name: str,
    family: str,
    modules: tuple[list, list, list],
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    moe: tuple[int, int, int],
    vllm_quantizes_router: bool,
    source: str,
    layer_kinds: tuple[str, ...] = (),
) -> ModelDescription:
    """The description of a model whose layers' modules are built: ``modules`` is
    ``(megatron -> HF map, HF names, vLLM units)``, to which the output head is added (the
    same ``output_layer`` / ``lm_head`` in every family); ``moe`` is ``(experts, expert FFN
    size, shared experts)``, zeros for a dense model."""
    mg_map, hf_all, units = modules
    mg_map.append(("output_layer", ("lm_head",)))
    hf_all.append("lm_head")
    units.append(("lm_head", ("lm_head",)))
    num_experts, moe_ffn_hidden_size, num_shared_experts = moe
    return ModelDescription(
        name=name,
        family=family,
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
        num_shared_experts=num_shared_experts,
        megatron_linear_modules=tuple(mg for mg, _ in mg_map),
        hf_linear_modules=tuple(hf_all),
        megatron_to_hf=tuple(mg_map),
        vllm_modules=tuple(units),
        vllm_quantizes_router=vllm_quantizes_router,
        source=source,
        layer_kinds=layer_kinds,
    )


# --------------------------------------------------------------------------- hybrid models

_Modules = tuple[list[tuple[str, tuple[str, ...]]], list[str], list[tuple[str, tuple[str, ...]]]]
"""One layer's ``(Megatron name -> HF names, HF names, vLLM unit -> HF names)``."""


def _unit(mg: str, hfs: tuple[str, ...], unit: str | None = None) -> _Modules:
    """One Megatron module holding ``hfs``, run by vLLM as one unit (``unit``, default the
    single HF module)."""
    return [(mg, hfs)], list(hfs), [(unit or hfs[0], hfs)]


def _join(*parts: _Modules) -> _Modules:
    mg: list = []
    hf: list = []
    units: list = []
    for m, h, u in parts:
        mg += m
        hf += h
        units += u
    return mg, hf, units


def _attention(mgp: str, hfp: str, attn: str) -> _Modules:
    qkv = tuple(f"{hfp}.{attn}.{p}_proj" for p in "qkv")
    return _join(
        _unit(f"{mgp}.self_attention.linear_qkv", qkv, f"{hfp}.{attn}.qkv_proj"),
        _unit(f"{mgp}.self_attention.linear_proj", (f"{hfp}.{attn}.o_proj",)),
    )


def _experts(mgp: str, hfp: str, mlp: str, experts: int, gated: bool, router: str) -> _Modules:
    """A router and routed experts (TE grouped GEMM on the Megatron side, one fused vLLM
    FusedMoE unit): ``gate_proj`` / ``up_proj`` / ``down_proj`` per expert when ``gated``,
    ``up_proj`` / ``down_proj`` otherwise (Nemotron-H's squared-ReLU experts)."""
    ups = ("gate_proj", "up_proj") if gated else ("up_proj",)
    fc1 = tuple(f"{hfp}.{mlp}.experts.{e}.{u}" for e in range(experts) for u in ups)
    fc2 = tuple(f"{hfp}.{mlp}.experts.{e}.down_proj" for e in range(experts))
    every = tuple(
        n for e in range(experts) for n in (*fc1[e * len(ups) : (e + 1) * len(ups)], fc2[e])
    )
    mg = [
        (f"{mgp}.mlp.router", (f"{hfp}.{mlp}.{router}",)),
        (f"{mgp}.mlp.experts.linear_fc1", fc1),
        (f"{mgp}.mlp.experts.linear_fc2", fc2),
    ]
    hf = [f"{hfp}.{mlp}.{router}", *every]
    units = [(f"{hfp}.{mlp}.{router}", (f"{hfp}.{mlp}.{router}",)), (f"{hfp}.{mlp}.experts", every)]
    return mg, hf, units


def _dense_mlp(mgp: str, hfp: str, mlp: str, megatron_mlp: str, gated: bool) -> _Modules:
    down = f"{hfp}.{mlp}.down_proj"
    if gated:
        gu = (f"{hfp}.{mlp}.gate_proj", f"{hfp}.{mlp}.up_proj")
        fc1 = _unit(f"{mgp}.{megatron_mlp}.linear_fc1", gu, f"{hfp}.{mlp}.gate_up_proj")
    else:
        fc1 = _unit(f"{mgp}.{megatron_mlp}.linear_fc1", (f"{hfp}.{mlp}.up_proj",))
    return _join(fc1, _unit(f"{mgp}.{megatron_mlp}.linear_fc2", (down,)))


def _qwen35_layer(i: int, kind: str, experts: int, shared: bool) -> _Modules:
    """Qwen3.5 (HF ``Qwen3_5DecoderLayer``; vLLM ``qwen3_5.py`` / ``qwen3_next.py``; megatron-
    core's Gated DeltaNet as the layer's ``self_attention``, ``ssm/gated_delta_net.py``)."""
    mgp, hfp = f"decoder.layers.{i}", f"model.layers.{i}"
    mixer, _, mlp = kind.partition("+")
    if mixer == "linear_attention":
        la = f"{hfp}.linear_attn"
        qkvz = (f"{la}.in_proj_qkv", f"{la}.in_proj_z")
        ba = (f"{la}.in_proj_b", f"{la}.in_proj_a")
        # Megatron fuses the four input projections into one in_proj; vLLM into two
        # (packed_modules_mapping in_proj_qkvz / in_proj_ba).
        parts: list[_Modules] = [
            (
                [(f"{mgp}.self_attention.in_proj", qkvz + ba)],
                [*qkvz, *ba],
                [(f"{la}.in_proj_qkvz", qkvz), (f"{la}.in_proj_ba", ba)],
            ),
            _unit(f"{mgp}.self_attention.out_proj", (f"{la}.out_proj",)),
        ]
    else:
        parts = [_attention(mgp, hfp, "self_attn")]
    if mlp == "moe":
        parts.append(_experts(mgp, hfp, "mlp", experts, True, "gate"))
        if shared:  # one shared expert; its scalar gate (shared_expert_gate) stays unquantized
            parts.append(_dense_mlp(mgp, hfp, "mlp.shared_expert", "mlp.shared_experts", True))
    else:
        parts.append(_dense_mlp(mgp, hfp, "mlp", "mlp", True))
    return _join(*parts)


def _nemotron_h_layer(i: int, kind: str, experts: int, shared: bool) -> _Modules:
    """Nemotron-H (HF ``NemotronHBlock``: one mixer per layer under ``backbone.layers.<i>.
    mixer``; megatron-core ``MambaModel``: ``mixer`` for Mamba, ``self_attention`` / ``mlp``
    otherwise; vLLM ``nemotron_h.py``, which renames ``backbone`` to ``model``)."""
    mgp, hfp = f"decoder.layers.{i}", f"backbone.layers.{i}"
    if kind == "mamba":
        mg, hf, units = _join(
            _unit(f"{mgp}.mixer.in_proj", (f"{hfp}.mixer.in_proj",)),
            _unit(f"{mgp}.mixer.out_proj", (f"{hfp}.mixer.out_proj",)),
        )
    elif kind == "attention":
        mg, hf, units = _attention(mgp, hfp, "mixer")
    elif kind == "mlp":
        mg, hf, units = _dense_mlp(mgp, hfp, "mixer", "mlp", False)
    else:
        parts = [_experts(mgp, hfp, "mixer", experts, False, "gate")]
        if shared:
            parts.append(_dense_mlp(mgp, hfp, "mixer.shared_experts", "mlp.shared_experts", False))
        mg, hf, units = _join(*parts)
    # vLLM's modules are named as it runs them (hf_to_vllm_mapper: backbone -> model).
    return mg, hf, [("model." + u.removeprefix("backbone."), m) for u, m in units]


_HYBRID_LAYERS = {"qwen3_5": _qwen35_layer, "nemotron_h": _nemotron_h_layer}


def _build_hybrid(
    name: str,
    family: str,
    kinds: tuple[str, ...],
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    num_experts: int = 0,
    moe_ffn_hidden_size: int = 0,
    num_shared_experts: int = 0,
    source: str,
) -> ModelDescription:
    """A description from the per-layer ``kinds`` (:attr:`ModelDescription.layer_kinds`)."""
    moe_layers = sum(1 for k in kinds if k.endswith("moe"))
    check_limit(
        len(kinds) * 16 + 3 * moe_layers * num_experts,
        LIMITS.modules,
        f"{source}: {len(kinds)} layers x {num_experts} experts: linear modules",
        key="num_experts" if num_experts else "num_hidden_layers",
    )
    layer = _HYBRID_LAYERS[family]
    mg_map, hf_all, units = _join(
        *(layer(i, kind, num_experts, bool(num_shared_experts)) for i, kind in enumerate(kinds))
    )
    return _with_output_layer(
        name,
        family,
        (mg_map, hf_all, units),
        num_layers=len(kinds),
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        moe=(num_experts, moe_ffn_hidden_size, num_shared_experts) if moe_layers else (0, 0, 0),
        # vLLM builds both routers as GateLinear without a quant config (qwen3_next.py,
        # nemotron_h.py, vLLM 0.32): they are never quantized.
        vllm_quantizes_router=False,
        source=source,
        layer_kinds=kinds,
    )


def _qwen35_kinds(cfg: Mapping, layers: int, moe: bool, source: str) -> tuple[str, ...]:
    """Per-layer kinds from ``layer_types`` (``linear_attention`` / ``full_attention``), else
    ``full_attention_interval`` (every N-th layer full attention; HF's default 4)."""
    types = cfg.get("layer_types")
    if types is None:
        every = _get_int(cfg, "full_attention_interval", source, default=4, minimum=1)
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    if (
        not isinstance(types, list)
        or len(types) != layers
        or any(t not in ("linear_attention", "full_attention") for t in types)
    ):
        raise FP8ConfigError(
            f"{source}: expected {layers} entries, each linear_attention or full_attention",
            key="layer_types",
            value=types,
        )
    mlp = "moe" if moe else "mlp"
    return tuple(
        ("attention" if t == "full_attention" else "linear_attention") + "+" + mlp for t in types
    )


def _from_qwen35(cfg: Mapping, name: str, source: str, moe: bool) -> ModelDescription:
    layers = _get_int(cfg, "num_hidden_layers", source, minimum=1)
    check_limit(layers, LIMITS.layers, f"{source}: transformer layers", key="num_hidden_layers")
    hidden = _get_int(cfg, "hidden_size", source, minimum=1)
    kinds = _qwen35_kinds(cfg, layers, moe, source)
    if not moe:
        ffn = _get_int(cfg, "intermediate_size", source, minimum=1)
        return _build_hybrid(
            name, "qwen3_5", kinds, hidden_size=hidden, ffn_hidden_size=ffn, source=source
        )
    experts = _get_int(cfg, "num_experts", source, minimum=1)
    check_limit(experts, LIMITS.experts, f"{source}: experts", key="num_experts")
    moe_ffn = _get_int(cfg, "moe_intermediate_size", source, minimum=1)
    shared = _get_int(cfg, "shared_expert_intermediate_size", source, default=0)
    # The MoE config has no dense MLP (no intermediate_size): the shared expert's width is the
    # one dense GEMM size there is.
    return _build_hybrid(
        name,
        "qwen3_5",
        kinds,
        hidden_size=hidden,
        ffn_hidden_size=shared or moe_ffn,
        num_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        num_shared_experts=1 if shared else 0,
        source=source,
    )


_NEMOTRON_H_BLOCKS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
"""``hybrid_override_pattern`` characters (megatron-core ``ssm/mamba_hybrid_layer_allocation
.py`` Symbols; HF ``NemotronHConfig``), one layer each."""


def _from_nemotron_h(cfg: Mapping, name: str, source: str) -> ModelDescription:
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(_NEMOTRON_H_BLOCKS):
        raise FP8ConfigError(
            f"{source}: expected a string of {''.join(_NEMOTRON_H_BLOCKS)} (one per layer)",
            key="hybrid_override_pattern",
            value=pattern,
        )
    layers = _get_int(cfg, "num_hidden_layers", source, default=len(pattern), minimum=1)
    check_limit(layers, LIMITS.layers, f"{source}: layers", key="num_hidden_layers")
    if layers != len(pattern):
        raise FP8ConfigError(
            f"{source}: num_hidden_layers is {layers} but hybrid_override_pattern has "
            f"{len(pattern)} layers",
            key="hybrid_override_pattern",
            value=pattern,
        )
    kinds = tuple(_NEMOTRON_H_BLOCKS[c] for c in pattern)
    experts = _get_int(cfg, "n_routed_experts", source, default=None) if "E" in pattern else 0
    check_limit(experts, LIMITS.experts, f"{source}: experts", key="n_routed_experts")
    return _build_hybrid(
        name,
        "nemotron_h",
        kinds,
        hidden_size=_get_int(cfg, "hidden_size", source, minimum=1),
        ffn_hidden_size=_get_int(cfg, "intermediate_size", source, minimum=1),
        num_experts=experts,
        moe_ffn_hidden_size=_get_int(cfg, "moe_intermediate_size", source, default=None),
        num_shared_experts=_get_int(cfg, "n_shared_experts", source, default=None),
        source=source,
    )


_HYBRID_TYPES = {
    "qwen3_5": lambda c, n, s: _from_qwen35(c, n, s, moe=False),
    "qwen3_5_text": lambda c, n, s: _from_qwen35(c, n, s, moe=False),
    "qwen3_5_moe": lambda c, n, s: _from_qwen35(c, n, s, moe=True),
    "qwen3_5_moe_text": lambda c, n, s: _from_qwen35(c, n, s, moe=True),
    "nemotron_h": _from_nemotron_h,
}
"""Hybrid ``model_type`` values (a VL checkpoint's ``text_config`` has the ``_text`` one)."""


# --------------------------------------------------------------------------- Hugging Face configs

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
_DEEPSEEK_LIKE = ("deepseek_v2", "deepseek_v3", "kimi_k2")
HF_MODEL_TYPES = _LLAMA_LIKE + ("qwen3_moe",) + _DEEPSEEK_LIKE + tuple(_HYBRID_TYPES)
"""``model_type`` values of a Hugging Face ``config.json`` that :func:`from_hf_config` reads."""


def _get_int(cfg: Mapping, key: str, where: str, *, default: Any = ..., minimum: int = 0) -> int:
    value = cfg.get(key, default)
    if value is ...:
        raise FP8ConfigError(
            f"{where} has no {key!r}",
            key=key,
            hint="a Hugging Face config.json of a decoder model carries it",
        )
    if value is None and default is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FP8ConfigError(
            f"{where}: expected an integer >= {minimum}, got {format_value(value)}",
            key=key,
            value=value,
        )
    return value


def from_hf_config(
    cfg: Mapping[str, Any], *, name: str | None = None, source: str = "config.json"
) -> ModelDescription:
    """A description from a Hugging Face ``config.json`` mapping (no ``transformers`` needed)."""
    if not isinstance(cfg, Mapping):
        raise FP8ConfigError(f"{source}: expected a JSON object, got {format_value(cfg)}")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = {
            **cfg["text_config"],
            "model_type": cfg["text_config"].get("model_type", cfg.get("model_type")),
        }
    model_type = cfg.get("model_type")
    name = name or cfg.get("_name_or_path") or str(model_type)
    if model_type not in HF_MODEL_TYPES:
        raise FP8ConfigError(
            f"{source}: model_type {format_value(model_type)} is not one the rules know",
            key="model_type",
            value=model_type,
            hint=f"supported: {', '.join(HF_MODEL_TYPES)}; for a Megatron model "
            f"give its TransformerConfig fields",
        )
    if model_type in _HYBRID_TYPES:
        return _HYBRID_TYPES[model_type](cfg, name, source)
    layers = _get_int(cfg, "num_hidden_layers", source, minimum=1)
    check_limit(layers, LIMITS.layers, f"{source}: transformer layers", key="num_hidden_layers")
    hidden = _get_int(cfg, "hidden_size", source, minimum=1)
    ffn = _get_int(cfg, "intermediate_size", source, minimum=1)
    if model_type in _LLAMA_LIKE:
        return _build(
            name, "llama", num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, source=source
        )
    if model_type == "qwen3_moe":
        experts = _get_int(cfg, "num_experts", source, minimum=1)
        check_limit(experts, LIMITS.experts, f"{source}: experts", key="num_experts")
        moe_ffn = _get_int(cfg, "moe_intermediate_size", source, minimum=1)
        step = _get_int(cfg, "decoder_sparse_step", source, default=1, minimum=1)
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise FP8ConfigError(
                f"{source}: expected a list of layer indices", key="mlp_only_layers", value=dense
            )
        moe = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return _build(
            name,
            "qwen3_moe",
            num_layers=layers,
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            moe_layers=moe,
            num_experts=experts,
            moe_ffn_hidden_size=moe_ffn,
            vllm_quantizes_router=True,
            source=source,
        )
    # DeepSeek-V2/V3 style: MLA attention, first_k_dense_replace dense layers, then MoE.
    experts = _get_int(cfg, "n_routed_experts", source, default=None)
    check_limit(experts, LIMITS.experts, f"{source}: experts", key="n_routed_experts")
    moe_ffn = _get_int(cfg, "moe_intermediate_size", source, default=None)
    shared = _get_int(cfg, "n_shared_experts", source, default=None)
    first_dense = _get_int(cfg, "first_k_dense_replace", source, default=0)
    freq = _get_int(cfg, "moe_layer_freq", source, default=1, minimum=1)
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and (isinstance(q_lora, bool) or not isinstance(q_lora, int)):
        raise FP8ConfigError(
            f"{source}: expected an integer or null", key="q_lora_rank", value=q_lora
        )
    moe = frozenset(i for i in range(layers) if experts and i >= first_dense and i % freq == 0)
    return _build(
        name,
        "deepseek",
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        moe_layers=moe,
        num_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        num_shared_experts=shared,
        mla=True,
        q_lora=bool(q_lora),
        source=source,
    )


# --------------------------------------------------------------------------- megatron-core


def from_transformer_config(
    cfg: Any, *, name: str = "megatron-gpt", source: str = "TransformerConfig"
) -> ModelDescription:
    """A description from a megatron-core ``TransformerConfig`` (duck-typed: no import) or
    a mapping with its field names (the ``model:`` section of a Megatron YAML)."""
    get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))

    def integer(key: str, default: Any, minimum: int = 0) -> int:
        value = get(key, default)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise FP8ConfigError(
                f"expected an integer >= {minimum}, got {format_value(value)}",
                key=f"model.{key}",
                value=value,
            )
        return value

    layers = integer("num_layers", None, 1)
    check_limit(layers, LIMITS.layers, "transformer layers", key="model.num_layers")
    hidden = integer("hidden_size", None, 1)
    if not layers or not hidden:
        raise FP8ConfigError(
            "a Megatron model description needs num_layers and hidden_size",
            key="model.num_layers" if not layers else "model.hidden_size",
        )
    ffn = integer("ffn_hidden_size", None) or 4 * hidden
    experts = integer("num_moe_experts", None)
    check_limit(experts, LIMITS.experts, "experts", key="model.num_moe_experts")
    moe_ffn = integer("moe_ffn_hidden_size", None) or (ffn if experts else 0)
    shared_size = integer("moe_shared_expert_intermediate_size", None)
    freq = get("moe_layer_freq", 1)
    if experts:
        if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
            moe = frozenset(i for i in range(layers) if i % freq == 0)
        elif (
            isinstance(freq, (list, tuple))
            and len(freq) == layers
            and all(f in (0, 1) for f in freq)
        ):
            moe = frozenset(i for i, f in enumerate(freq) if f)
        else:
            raise FP8ConfigError(
                f"expected an integer or a list of {layers} zeros and ones, "
                f"got {format_value(freq)}",
                key="model.moe_layer_freq",
                value=freq,
            )
    else:
        moe = frozenset()
    mla = bool(get("multi_latent_attention", False))
    q_lora = get("q_lora_rank", None)
    gated = bool(get("gated_linear_unit", False))
    shared = (shared_size // moe_ffn) if (shared_size and moe_ffn) else (1 if shared_size else 0)
    return _build(
        name,
        "deepseek" if mla else "gpt",
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        moe_layers=moe,
        num_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        num_shared_experts=shared,
        mla=mla,
        q_lora=bool(q_lora),
        gated=gated,
        source=source,
    )


# --------------------------------------------------------------------------- built-in table


def _dense(model_type: str, layers: int, hidden: int, ffn: int) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": ffn,
    }


def _qwen3_moe(layers: int, hidden: int, ffn: int, experts: int, moe_ffn: int) -> dict[str, Any]:
    moe = {"num_experts": experts, "moe_intermediate_size": moe_ffn, "decoder_sparse_step": 1}
    return {**_dense("qwen3_moe", layers, hidden, ffn), **moe, "mlp_only_layers": []}


def _deepseek(
    layers: int,
    hidden: int,
    ffn: int,
    experts: int,
    moe_ffn: int,
    shared: int,
    first_dense: int,
    q_lora: int | None,
) -> dict[str, Any]:
    return {
        "model_type": "deepseek_v3",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "n_routed_experts": experts,
        "moe_intermediate_size": moe_ffn,
        "n_shared_experts": shared,
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
        "q_lora_rank": q_lora,
        "kv_lora_rank": 512,
    }


def _qwen35(layers: int, hidden: int, ffn: int) -> dict[str, Any]:
    return {**_dense("qwen3_5_text", layers, hidden, ffn), "full_attention_interval": 4}


def _qwen35_moe(
    layers: int, hidden: int, experts: int, moe_ffn: int, shared_ffn: int
) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_experts": experts,
        "moe_intermediate_size": moe_ffn,
        "shared_expert_intermediate_size": shared_ffn,
        "full_attention_interval": 4,
    }


def _nemotron_h(
    pattern: str, hidden: int, ffn: int, experts: int, moe_ffn: int, shared_ffn: int
) -> dict[str, Any]:
    return {
        "model_type": "nemotron_h",
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "n_routed_experts": experts,
        "moe_intermediate_size": moe_ffn,
        "moe_shared_expert_intermediate_size": shared_ffn,
        "n_shared_experts": 1,
    }


def _gpt(layers: int, hidden: int, ffn: int) -> dict[str, Any]:
    return {
        "megatron": True,
        "num_layers": layers,
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
        "gated_linear_unit": False,
    }


# Sizes from the models' published config.json files (and NeMo 2's matching config classes).
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "llama2-7b": _dense("llama", 32, 4096, 11008),
    "llama2-13b": _dense("llama", 40, 5120, 13824),
    "llama2-70b": _dense("llama", 80, 8192, 28672),
    "llama3-8b": _dense("llama", 32, 4096, 14336),
    "llama3-70b": _dense("llama", 80, 8192, 28672),
    "llama3.1-8b": _dense("llama", 32, 4096, 14336),
    "llama3.1-70b": _dense("llama", 80, 8192, 28672),
    "llama3.1-405b": _dense("llama", 126, 16384, 53248),
    "llama3.2-1b": _dense("llama", 16, 2048, 8192),
    "llama3.2-3b": _dense("llama", 28, 3072, 8192),
    "llama3.3-70b": _dense("llama", 80, 8192, 28672),
    # Qwen2.5 (model_type qwen2): Qwen/Qwen2.5-*/config.json on Hugging Face; 1.5B is NeMo
    # RL's grpo_math_1B.yaml default (policy.model_name: Qwen/Qwen2.5-1.5B).
    "qwen2.5-0.5b": _dense("qwen2", 24, 896, 4864),
    "qwen2.5-1.5b": _dense("qwen2", 28, 1536, 8960),
    "qwen2.5-7b": _dense("qwen2", 28, 3584, 18944),
    "qwen3-0.6b": _dense("qwen3", 28, 1024, 3072),
    "qwen3-1.7b": _dense("qwen3", 28, 2048, 6144),
    "qwen3-4b": _dense("qwen3", 36, 2560, 9728),
    "qwen3-8b": _dense("qwen3", 36, 4096, 12288),
    "qwen3-14b": _dense("qwen3", 40, 5120, 17408),
    "qwen3-32b": _dense("qwen3", 64, 5120, 25600),
    "qwen3-30b-a3b": _qwen3_moe(48, 2048, 6144, 128, 768),
    "qwen3-235b-a22b": _qwen3_moe(94, 4096, 12288, 128, 1536),
    # Qwen3.5, the sizes of each Hugging Face config.json (text_config): Qwen/Qwen3.5-9B
    # (32 layers, 4096 hidden, 12288 intermediate, full_attention_interval 4) and
    # Qwen/Qwen3.5-35B-A3B (40 layers, 2048 hidden, 256 experts of 512, one shared expert of
    # 512, full_attention_interval 4), as quoted from those files in public model notes; the
    # 35B-A3B sizes match slime's scripts/models/qwen3.5-35B-A3B.sh (THUDM/slime) and the 27B
    # (64 layers, 5120, 17408) its qwen3.5-27B.sh. NeMo RL trains the 9B and 35B-A3B Base
    # models (examples/configs/recipes/llm/dapo-qwen3.5-*-megatron*.yaml). Second-hand: the
    # config.json files themselves were not read (Hugging Face is not reachable here).
    "qwen3.5-9b": _qwen35(32, 4096, 12288),
    "qwen3.5-27b": _qwen35(64, 5120, 17408),
    "qwen3.5-35b-a3b": _qwen35_moe(40, 2048, 256, 512, 512),
    # Nemotron-3 Nano 30B-A3B (HF model_type nemotron_h), its config.json as quoted in
    # Megatron-Bridge's NemotronH bridge tests and slime's scripts/models/
    # nemotron-nano-30B-A3B.sh: 52 layers "MEMEM*EMEMEM*..." (23 Mamba-2, 23 MoE, 6 attention),
    # hidden 2688, 128 routed experts of 1856 plus one shared of 3712. NeMo RL's QA-GRPO and
    # DPO examples train it (examples/modelopt/qa_grpo_nano3_megatron.yaml).
    "nemotron-3-nano-30b-a3b": _nemotron_h(
        "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", 2688, 1856, 128, 1856, 3712
    ),
    "deepseek-v3": _deepseek(61, 7168, 18432, 256, 2048, 1, 3, 1536),
    "deepseek-v2-lite": _deepseek(27, 2048, 10944, 64, 1408, 2, 1, None),
    "moonlight-16b-a3b": _deepseek(27, 2048, 11264, 64, 1408, 2, 1, None),
    "gpt-126m": _gpt(12, 768, 3072),
    "gpt-5b": _gpt(24, 4096, 16384),
    "gpt-7b": _gpt(32, 4096, 10880),
    "gpt-20b": _gpt(44, 6144, 24576),
    "gpt-40b": _gpt(48, 8192, 32768),
    "gpt-175b": _gpt(96, 12288, 49152),
}
"""Canonical short name -> Hugging Face config fields (``megatron: True`` entries hold
megatron-core ``TransformerConfig`` fields instead: Megatron GPT has no HF checkpoint)."""

_ALIASES = {
    "deepseek-r1": "deepseek-v3",
    "deepseekv3": "deepseek-v3",
    "deepseek-v3.1": "deepseek-v3",
    "deepseekv2lite": "deepseek-v2-lite",
    "moonlight-16b": "moonlight-16b-a3b",
    "moonlight": "moonlight-16b-a3b",
    "qwen3-600m": "qwen3-0.6b",
    "qwen3-1p7b": "qwen3-1.7b",
    "nvidia-nemotron-3-nano-30b-a3b": "nemotron-3-nano-30b-a3b",
    "nemotron-3-nano": "nemotron-3-nano-30b-a3b",
    "nemotron3-nano": "nemotron-3-nano-30b-a3b",
    "nano3": "nemotron-3-nano-30b-a3b",
    "gpt3-126m": "gpt-126m",
    "gpt3-5b": "gpt-5b",
    "gpt3-7b": "gpt-7b",
    "gpt3-20b": "gpt-20b",
    "gpt3-40b": "gpt-40b",
    "gpt3-175b": "gpt-175b",
}

# Trailing tokens that name a variant of the same architecture (chat tuning, release, dtype).
_VARIANT_TOKENS = {
    "instruct",
    "base",
    "chat",
    "hf",
    "fp8",
    "it",
    "2507",
    "thinking",
    "0324",
    "0528",
    "bf16",
}


def _normalize(name: str) -> str:
    """``meta-llama/Meta-Llama-3.1-8B-Instruct`` -> ``llama3.1-8b``; ``llama31_8b`` ->
    ``llama3.1-8b``; ``Qwen3Config30B_A3B`` -> ``qwen3-30b-a3b``."""
    base = name.strip().rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].lower().replace("_", "-")
    base = re.sub(r"^meta-", "", base)
    m = re.match(r"^([a-z]+\d*)(?:config|modelprovider)(.*)$", base)  # NeMo / Bridge class names
    if m:
        base = m.group(1) + ("-" + m.group(2).lstrip("-") if m.group(2) else "")
    base = re.sub(r"^llama-(\d)", r"llama\1", base)
    base = re.sub(r"^llama(\d)(\d)-", r"llama\1.\2-", base)  # NeMo factories: llama31_8b
    base = re.sub(r"^llama(\d)-(\d)-", r"llama\1.\2-", base)  # Llama-3-1-8B style
    tokens = base.split("-")
    while len(tokens) > 1 and tokens[-1] in _VARIANT_TOKENS:
        tokens.pop()
    base = "-".join(tokens)
    return _ALIASES.get(base, base)


@lru_cache(maxsize=64)
def _builtin(canonical: str, shown_name: str) -> ModelDescription:
    fields = BUILTIN_MODELS[canonical]
    if fields.get("megatron"):
        return from_transformer_config(fields, name=shown_name, source="built-in")
    return from_hf_config(fields, name=shown_name, source="built-in")


def describe_model(
    name_or_path: Any, *, key: str = "model", base_dir: str | Path | None = None
) -> ModelDescription:
    """The description of a model, from its name, a ``config.json`` path, or a config object.

    ``name_or_path`` may be a :class:`ModelDescription` (returned as is), a path to a Hugging
    Face ``config.json`` or to a checkpoint directory holding one (relative paths are tried
    under ``base_dir`` first), a name from the built-in table (HF ids and short names; the
    basename of a path that does not exist is tried too), a mapping (HF config fields, or
    megatron-core fields when it has ``num_layers``) or a megatron-core ``TransformerConfig``.
    Nothing is ever downloaded. An unknown name raises :class:`FP8ConfigError` under ``key``
    asking for ``--model-config``.
    """
    if isinstance(name_or_path, ModelDescription):
        return name_or_path
    if isinstance(name_or_path, Mapping):
        if "num_layers" in name_or_path:
            return from_transformer_config(name_or_path)
        return from_hf_config(name_or_path, source="mapping")
    if not isinstance(name_or_path, (str, Path)):
        if hasattr(name_or_path, "num_layers") and hasattr(name_or_path, "hidden_size"):
            return from_transformer_config(name_or_path)
        raise FP8ConfigError(
            f"expected a model name or a config.json path, got {format_value(name_or_path)}",
            key=key,
            value=name_or_path,
        )
    text = str(name_or_path).strip()
    if not text:
        raise FP8ConfigError("empty model name", key=key, value=text)
    path = _existing_config(Path(text).expanduser(), base_dir)
    if path is not None:
        return _from_config_file(path, key)
    canonical = _normalize(text)
    if canonical in BUILTIN_MODELS:
        return _builtin(canonical, text)
    looks_like_path = text.endswith(".json") or text.startswith((".", "/", "~"))
    what = "no such file" if looks_like_path else "no built-in description"
    raise FP8ConfigError(
        f"unknown model {format_value(text)}: {what}",
        key=key,
        value=text,
        hint="pass --model-config PATH (a Hugging Face config.json or a checkpoint directory; "
        "nothing is downloaded), or --model with one of: " + ", ".join(sorted(BUILTIN_MODELS)),
    )


def _existing_config(path: Path, base_dir: str | Path | None) -> Path | None:
    candidates = [path]
    if base_dir is not None and not path.is_absolute():
        candidates.insert(0, Path(base_dir) / path)
    for cand in candidates:
        try:
            if cand.is_file():
                return cand
            if cand.is_dir() and (cand / "config.json").is_file():
                return cand / "config.json"
        except OSError:
            continue
    return None


def _from_config_file(path: Path, key: str) -> ModelDescription:
    from .._io import read_user_json

    # a regular file within LIMITS.config_bytes, nesting and digits bounded
    data = read_user_json(path, key=key, what="config.json")
    # Errors name the JSON field (key) and carry the file path in the message.
    if isinstance(data, Mapping) and "num_layers" in data and "num_hidden_layers" not in data:
        return from_transformer_config(data, name=str(path), source=str(path))
    return from_hf_config(data, name=str(path), source=str(path))
