"""Resolving BF16 rules to one decision per module, per side.

Sides and their units:

* ``training``: megatron-core modules (``decoder.layers.3.self_attention.linear_qkv``);
* ``generation``: vLLM modules (``model.layers.3.self_attn.qkv_proj``), each fusing one
  or more Hugging Face modules.

A glob decides a unit when it matches the unit's own name, or the unit's modules under
the other naming (so ``"*a_proj*"``, written in HF names, keeps Megatron's
``linear_kv_down_proj`` in BF16, and ``"output_layer"`` keeps vLLM's ``lm_head``). When a
glob matches only some of the modules a host fuses into one GEMM (``"*q_proj*"`` against
``linear_qkv``), the whole unit stays BF16 -- a GEMM has one precision -- and a warning
says so. Rules apply in order: ``first``, ``last``, then ``modules`` as written; the
first that matches decides. Modules no rule matches run in FP8, except those no host runs
in FP8 at all (output head, MoE router; see :func:`~.names.builtin_high_precision`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, TypeGuard

from ..errors import FP8ConfigError
from ..spec import BF16Rules, RecipeSpec
from .models import ModelDescription
from .names import (
    builtin_high_precision,
    generic_counterparts,
    generic_members,
    generic_siblings,
    generic_unit,
    layer_index,
    strip_param_suffix,
)

__all__ = [
    "SIDES",
    "LayerDecision",
    "Resolution",
    "resolve",
    "keeps_bf16",
    "module_filter",
    "rule_label",
    "is_module_rule",
    "template",
]

SIDES = ("training", "generation")
"""``training`` resolves megatron-core module names, ``generation`` vLLM/HF names."""


@dataclass(frozen=True)
class LayerDecision:
    """The precision of one module on one side, and the rule that decided it."""

    module: str
    """Module name under the side's naming (Megatron for training, vLLM for generation)."""

    layer: int | None
    """Transformer-layer index, None outside the layer stack (output head)."""

    precision: str
    """``"fp8"`` or ``"bf16"``."""

    recipe: str | None
    """The FP8 recipe's name when ``precision`` is fp8, else None."""

    rule: str | None
    """The deciding rule's label (``bf16_layers.first``, ``bf16_layers.modules[1]='*b_proj*'``,
    ``builtin:output_head``, ``builtin:router``, ``training: bf16``), None for FP8 by default."""

    side: str = "training"
    """``training`` or ``generation``."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "layer": self.layer,
            "module": self.module,
            "precision": self.precision,
            "recipe": self.recipe,
            "rule": self.rule,
        }


@dataclass
class Resolution:
    """Every module's decision on one side, plus what the rules did wrong or needlessly."""

    side: str
    model: str
    decisions: list[LayerDecision] = field(default_factory=list)
    unmatched_rules: list[str] = field(default_factory=list)
    """Labels of ``modules`` patterns that match no module on this side."""
    warnings: list[str] = field(default_factory=list)
    """Shadowed rules, rules splitting a fused module, rules no module on this side matches."""
    notes: list[str] = field(default_factory=list)
    """Harmless facts: a rule matching only modules that never run in FP8."""
    partial: dict[str, list[str]] = field(default_factory=dict)
    """Rule label -> units it matched only in part (kept BF16 whole)."""
    unmatched_at: dict[str, int] = field(default_factory=dict)
    """Rule label of :attr:`unmatched_rules` -> the index of its warning in :attr:`warnings`."""

    def bf16_modules(self) -> list[str]:
        return [d.module for d in self.decisions if d.precision == "bf16"]

    def by_module(self) -> dict[str, LayerDecision]:
        return {d.module: d for d in self.decisions}

    @cached_property
    def module_index(self) -> dict[str, LayerDecision]:
        """:meth:`by_module`, built once: a resolution is complete when it is returned, and
        a per-name lookup (:func:`keeps_bf16` with a model) asks it once per parameter."""
        return self.by_module()


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class _Rule:
    label: str
    key: str
    pattern: str
    match: Callable[[str], Any]


def rule_label(index: int, pattern: str) -> str:
    """Label of the ``index``-th ``modules`` pattern: ``bf16_layers.modules[1]='*b_proj*'``."""
    return f"bf16_layers.modules[{index}]={pattern!r}"


def is_module_rule(label: str | None) -> TypeGuard[str]:
    return label is not None and label.startswith("bf16_layers.modules[")


def check_rule_work(rules: BF16Rules, names: int, what: str) -> None:
    """Refuse, before any matching, ``bf16_layers.modules`` rules whose matching would run
    past the limits: more rules than ``LIMITS.bf16_rules``, or more (rule, module name) pairs
    than ``LIMITS.rule_checks`` against the ``names`` module names of ``what`` (each rule is
    tried on every name: thousands of rules, or a few on a model of a million expert
    projections, took minutes)."""
    from ..errors import LIMITS, check_limit

    count = len(rules.modules)
    if not count:
        return
    key = "bf16_layers.modules"
    check_limit(count, LIMITS.bf16_rules, "module rules", key=key, value=count)
    check_limit(
        count * names,
        LIMITS.rule_checks,
        f"{count} module rule(s) x {names} module names of {what}: pairs to match",
        key=key,
        value=count,
        hint="fewer, broader rules (a `*` for a layer number); limits: docs/refusals.md",
    )


def module_rules(rules: BF16Rules) -> list[_Rule]:
    return [
        _Rule(
            rule_label(i, p), f"bf16_layers.modules[{i}]", p, re.compile(fnmatch.translate(p)).match
        )
        for i, p in enumerate(rules.modules)
    ]


def _split_spec(spec: RecipeSpec | BF16Rules) -> tuple[BF16Rules, str | None, dict[str, bool]]:
    if isinstance(spec, RecipeSpec):
        return (
            spec.bf16_layers,
            spec.name,
            {"training": spec.training == "fp8", "generation": spec.generation == "fp8"},
        )
    if isinstance(spec, BF16Rules):
        return spec, None, {"training": True, "generation": True}
    raise TypeError(f"expected a RecipeSpec or BF16Rules, got {type(spec).__name__}")


def _check_side(side: str) -> None:
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")


def _check_counts(rules: BF16Rules, num_layers: int, model: str) -> None:
    """first/last that contradict the model: errors naming the rule."""
    if rules.first > num_layers:
        raise FP8ConfigError(
            f"keeps {rules.first} leading layers in BF16 but {model} has {num_layers}",
            key="bf16_layers.first",
            value=rules.first,
        )
    if rules.last > num_layers:
        raise FP8ConfigError(
            f"keeps {rules.last} trailing layers in BF16 but {model} has {num_layers}",
            key="bf16_layers.last",
            value=rules.last,
        )
    if (rules.first or rules.last) and rules.first + rules.last >= num_layers:
        key = "bf16_layers.last" if rules.last else "bf16_layers.first"
        raise FP8ConfigError(
            f"first ({rules.first}) + last ({rules.last}) cover all {num_layers} "
            f"layers of {model}: no layer would run in FP8",
            key=key,
            value=rules.last if rules.last else rules.first,
            hint="lower first/last, or set training: bf16 / generation: bf16",
        )


def template(name: str) -> str:
    """A module name with its layer index replaced by ``*`` (for grouping across layers)."""
    return re.sub(r"((?:^|\.)(?:layers|layer|h|blocks)\.)\d+(?=\.|$)", r"\1*", name, count=1)


# --------------------------------------------------------------------------- resolve


def resolve(spec: RecipeSpec | BF16Rules, model: ModelDescription, side: str) -> Resolution:
    """Decide every linear module of ``model`` on ``side`` (``training`` or ``generation``).

    Raises :class:`FP8ConfigError` for rules that contradict the model (``first`` or
    ``last`` beyond its layer count, ``first + last`` covering every layer, module rules
    that leave nothing in FP8). Unmatched, shadowed and fused-splitting rules are
    reported in the result, not raised.
    """
    _check_side(side)
    cache = model.__dict__.setdefault("_resolution_cache", {})
    rules, recipe, on = _split_spec(spec)
    cache_key = (rules, recipe, on[side], side)
    if cache_key in cache:
        return cache[cache_key]
    res = _resolve(rules, recipe, on[side], model, side)
    cache[cache_key] = res
    return res


def _resolve(
    rules: BF16Rules, recipe: str | None, side_on: bool, model: ModelDescription, side: str
) -> Resolution:
    res = Resolution(side=side, model=model.name)
    acts = side_on and rules.acts_on(side)
    n = model.num_layers
    if acts:
        _check_counts(rules, n, model.name)
    mrules = module_rules(rules) if acts else []
    decided: dict[str, list[str]] = {r.label: [] for r in mrules}  # units each rule decided
    matched = {r.label: 0 for r in mrules}
    shadowers: dict[str, set[str]] = {r.label: set() for r in mrules}
    partial: dict[str, list[str]] = {}

    if side == "training":
        units = [(mg, model.hf_names(mg)) for mg in model.megatron_linear_modules]
    else:
        units = list(model.vllm_modules)
    if acts:
        names = len(units) + sum(len(members) for _, members in units)
        check_rule_work(rules, names, f"{model.name} ({side})")
    mg_of = model._hf_to_mg.get

    for unit, members in units:
        layer = layer_index(unit)
        rule: str | None = None
        if not side_on:
            rule = f"{side}: bf16"
        elif acts and layer is not None and layer < rules.first:
            rule = "bf16_layers.first"
        elif acts and layer is not None and layer >= n - rules.last and rules.last:
            rule = "bf16_layers.last"
        for r in mrules:
            state = _match_unit(r.match, unit, members, side, mg_of)
            if not state:
                continue
            matched[r.label] += 1
            if rule is None:
                rule = r.label
                decided[r.label].append(unit)
                if state == "partial":
                    partial.setdefault(r.label, []).append(unit)
            else:
                shadowers[r.label].add(rule)
        if rule is None:
            builtin = builtin_high_precision(unit)
            if builtin:
                rule = f"builtin:{builtin}"
        precision = "fp8" if rule is None else "bf16"
        res.decisions.append(
            LayerDecision(
                unit, layer, precision, recipe if precision == "fp8" else None, rule, side
            )
        )

    naming = "Megatron" if side == "training" else "vLLM / Hugging Face"
    leaves = _leaves(units)  # once: each unmatched rule's hint reads the same list
    for r in mrules:
        if not matched[r.label]:
            res.unmatched_rules.append(r.label)
            res.unmatched_at[r.label] = len(res.warnings)
            res.warnings.append(
                f"{r.label} matches no {side} module of {model.name} "
                f"({naming} names{_nearby(r.pattern, leaves)})"
            )
        elif not decided[r.label]:
            by = ", ".join(sorted(shadowers[r.label]))
            res.warnings.append(
                f"{r.label} has no effect on the {side} side: every module it "
                f"matches is already kept in BF16 by {by}"
            )
        elif all(builtin_high_precision(u) for u in decided[r.label]):
            res.notes.append(
                f"{r.label} only matches modules that never run in FP8 "
                f"({', '.join(sorted({template(u) for u in decided[r.label]}))}); "
                f"it changes nothing"
            )
    for label, units_hit in partial.items():
        shown = sorted({template(u) for u in units_hit})
        res.warnings.append(
            f"{label} matches only part of {len(units_hit)} fused {side} module(s) "
            f"({', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}); one GEMM has one "
            f"precision, so each whole module stays BF16"
        )
    res.partial = partial
    if acts and mrules:
        capable = [d for d in res.decisions if not builtin_high_precision(d.module)]
        if capable and all(d.precision == "bf16" for d in capable):
            first_rule = next(r for r in mrules if decided[r.label])
            raise FP8ConfigError(
                f"keeps every {side} module of {model.name} in BF16: nothing would run in FP8",
                key=first_rule.key,
                value=first_rule.pattern,
                hint=f"to run {side} in BF16 set `{side}: bf16` instead",
            )
    return res


def _match_unit(
    match: Callable[[str], Any],
    unit: str,
    members: tuple[str, ...],
    side: str,
    mg_of: Callable[[str], str | None],
) -> str | None:
    """``"full"``, ``"partial"`` or None: does a pattern cover a unit?"""
    if match(unit):
        return "full"
    if not members:
        return None
    if side == "training":
        hits = sum(1 for h in members if match(h))
    else:
        hits = 0
        mg_hit: dict[str, bool] = {}  # a fused MoE module's 768 parts share 2 Megatron names
        for h in members:
            if match(h):
                hits += 1
                continue
            mg = mg_of(h)
            if mg is not None:
                hit = mg_hit.get(mg)
                if hit is None:
                    hit = mg_hit[mg] = bool(match(mg))
                hits += hit
    if not hits:
        return None
    return "full" if hits == len(members) else "partial"


def _leaves(units: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """The module leaves (last name parts) of ``units``, sorted."""
    return sorted(
        {u.rsplit(".", 1)[-1] for u, _ in units}
        | {h.rsplit(".", 1)[-1] for _, hs in units for h in hs[:3]}
    )


def _nearby(pattern: str, leaves: list[str]) -> str:
    """A hint with module leaves (:func:`_leaves`) that resemble the pattern's words."""
    import difflib

    words = [w for w in re.split(r"[^A-Za-z0-9_]+", pattern) if w]
    near = []
    for w in words:
        near += difflib.get_close_matches(w, leaves, n=3, cutoff=0.6)
    near = list(dict.fromkeys(near))
    if near:
        return f"; similar names: {', '.join(near)}"
    return f"; its modules end in {', '.join(leaves[:8])}{', ...' if len(leaves) > 8 else ''}"


# --------------------------------------------------------------------------- per name


def keeps_bf16(
    rules: RecipeSpec | BF16Rules,
    module_name: str,
    *,
    side: str,
    num_layers: int | None,
    model: ModelDescription | None = None,
) -> str | None:
    """The deciding rule's label when ``module_name`` stays BF16 on ``side``, None for FP8.

    ``module_name`` may use either naming, and may be a parameter name (``...q_proj.weight``).
    With ``model`` the answer is exactly :func:`resolve`'s. Without it the name alone
    decides: its layer index (``layers.<i>``) for ``first``/``last`` (``last`` needs
    ``num_layers``), and the globs against the name, its counterparts under the other
    naming and the modules a host fuses with it -- conservatively BF16 when any of them
    matches, as :func:`resolve` does for fused modules.
    """
    _check_side(side)
    brules, recipe, on = _split_spec(rules)
    name = strip_param_suffix(module_name)
    if model is not None:
        found = _decision_by_name(rules, model, side, name)
        if found is not None:
            return found.rule if found.precision == "bf16" else None
    return _generic_decider(brules, on[side], side, num_layers)(name)


def _decision_by_name(
    spec: RecipeSpec | BF16Rules, model: ModelDescription, side: str, name: str
) -> LayerDecision | None:
    index = resolve(spec, model, side).module_index
    found = index.get(name)
    if found is not None:
        return found
    if side == "training":
        mg = model.megatron_name(name)
        return index.get(mg) if mg else None
    unit = model.vllm_module(name)
    if unit is not None:
        return index.get(unit)
    hfs = model.hf_names(name)
    if hfs:
        unit = model.vllm_module(hfs[0])
        return index.get(unit) if unit else None
    return None


@lru_cache(maxsize=256)
def _generic_decider(
    rules: BF16Rules, side_on: bool, side: str, num_layers: int | None
) -> Callable[[str], str | None]:
    """A name -> label function for rules without a model description (cached: the refit
    quantizer asks once per parameter)."""
    if not side_on:
        return lambda name: f"{side}: bf16"
    acts = rules.acts_on(side)
    if acts and rules.last and num_layers is None:
        raise FP8ConfigError(
            "bf16_layers.last needs the model's number of layers",
            key="bf16_layers.last",
            value=rules.last,
            hint="pass num_layers (or a model description)",
        )
    if acts and num_layers is not None:
        _check_counts(rules, num_layers, "the model")
    mrules = module_rules(rules) if acts else []

    def decide(name: str) -> str | None:
        name = strip_param_suffix(name)
        if acts:
            layer = layer_index(name)
            if layer is not None:
                if layer < rules.first:
                    return "bf16_layers.first"
                # num_layers is set whenever rules.last is (refused above otherwise)
                if rules.last and num_layers is not None and layer >= num_layers - rules.last:
                    return "bf16_layers.last"
            if mrules:
                candidates = _candidates(name, side)
                for r in mrules:
                    if any(r.match(c) for c in candidates):
                        return r.label
        builtin = builtin_high_precision(name)
        return f"builtin:{builtin}" if builtin else None

    return decide


@lru_cache(maxsize=1 << 16)
def _candidates(name: str, side: str) -> frozenset[str]:
    """The name, the modules that share its GEMM on ``side``, and their counterparts."""
    out = {name}
    out.update(generic_members(name))  # a fused vLLM module name: its HF parts
    if side == "generation":
        for n in list(out):
            out.update(generic_siblings(n))
            unit = generic_unit(n)
            if unit:
                out.add(unit)
                out.update(generic_members(unit))
    for n in list(out):
        for cp in generic_counterparts(n):
            out.add(cp)
            # The other members of the Megatron module (q_proj -> linear_qkv -> k_proj, v_proj).
            out.update(generic_counterparts(cp))
    return frozenset(out)


def module_filter(
    spec: RecipeSpec | BF16Rules,
    *,
    num_layers: int | None,
    side: str = "training",
    model: ModelDescription | None = None,
) -> Callable[[str, object], bool]:
    """A ``(name, module) -> bool`` filter for the emulation converter: True = convert to FP8.

    False for modules the rules keep in BF16 on ``side`` and for modules no host runs in
    FP8 (output head, MoE router). ``model`` makes the answer exact (see :func:`keeps_bf16`).
    """
    _check_side(side)
    if model is not None:
        resolve(spec, model, side)  # fail early on contradictory rules

        def convert(name: str, module: object = None) -> bool:
            return keeps_bf16(spec, name, side=side, num_layers=num_layers, model=model) is None

        return convert
    brules, _, on = _split_spec(spec)
    decide = _generic_decider(brules, on[side], side, num_layers)

    def convert_generic(name: str, module: object = None) -> bool:
        return decide(name) is None

    return convert_generic


GLOB_CHARS = re.compile(r"[*?\[\]]")
"""Characters that make a ``bf16_layers.modules`` pattern a glob rather than an exact name."""


def side_rules(spec: RecipeSpec | BF16Rules) -> tuple[BF16Rules, bool, bool]:
    """``(rules, training side in FP8, generation side in FP8)``; bare rules act on both."""
    if isinstance(spec, RecipeSpec):
        return spec.bf16_layers, spec.training == "fp8", spec.generation == "fp8"
    return spec, True, True


def plain_keyword(pattern: str) -> str | None:
    """``"*a_proj*"`` -> ``"a_proj"``: the substring a glob of the form ``*word*`` stands for."""
    if len(pattern) > 2 and pattern.startswith("*") and pattern.endswith("*"):
        inner = pattern[1:-1]
        if inner and not GLOB_CHARS.search(inner):
            return inner
    return None
