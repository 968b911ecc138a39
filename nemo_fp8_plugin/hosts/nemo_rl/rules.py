"""NeMo RL's spelling of the BF16 rules: ``policy.generation.vllm_cfg.num_first_layers_in_bf16`` /
``num_last_layers_in_bf16`` / ``quantization_ignored_layer_kws`` for generation;
``policy.megatron_cfg.model_overrides.{first_last_layers_bf16, num_layers_at_start_in_bf16,
num_layers_at_end_in_bf16}`` for training (NeMo RL merges ``model_overrides`` into the
Megatron-Bridge model provider, a megatron-core ``TransformerConfig``, before it builds the
model: ``nemo_rl/models/megatron/setup.py``, ``_merge_model_overrides``), and a warning for
every rule its training side cannot express (per-module globs: megatron-core takes them as a
``quant_recipe`` object, which a YAML override cannot build)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...rules import ModelDescription
from ...rules.names import builtin_high_precision
from ...rules.resolve import (
    is_module_rule,
    plain_keyword,
    resolve,
    rule_label,
    side_rules,
)
from ...spec import BF16Rules, RecipeSpec
from .. import Message, RuleIssueKind, Spelling

__all__ = ["to_nemo_rl", "training_layer_overrides"]


def _training_side_issues(
    spec: RecipeSpec | BF16Rules,
    rules: BF16Rules,
    model: ModelDescription | None,
    host: str,
    where: str,
) -> list[Message]:
    out = []
    harmless: set[str] = set()
    if model is not None:  # rules that only name routers / the output layer lose nothing
        decided: dict[str, list[str]] = {}
        for d in resolve(spec, model, "training").decisions:
            if is_module_rule(d.rule):
                decided.setdefault(d.rule, []).append(d.module)
        harmless = {
            label for label, mods in decided.items() if all(builtin_high_precision(m) for m in mods)
        }
    for i, p in enumerate(rules.modules):
        if rule_label(i, p) not in harmless:
            text = f"{where} has no per-module keys; training runs the modules it matches in FP8"
            kind = RuleIssueKind.TRAINING_UNEXPRESSIBLE
            out.append(Message(text, host, rule_label(i, p), kind, (i,), (p,)))
    return out


def to_nemo_rl(spec: RecipeSpec | BF16Rules, model: ModelDescription | None = None) -> Spelling:
    """NeMo RL's spelling as writes: the vLLM generation keys under
    ``policy.generation.vllm_cfg``, the first/last training layers under
    ``policy.megatron_cfg.model_overrides``, and a warning for every rule its Megatron
    training side cannot express (kind :attr:`~.RuleIssueKind.TRAINING_UNEXPRESSIBLE`)."""
    rules, training_on, generation_on = side_rules(spec)
    warnings: list[Message] = []
    vllm_cfg: dict[str, Any] = {}
    model_overrides: dict[str, Any] = {}
    if training_on and rules.acts_on("training"):
        if rules.first or rules.last:
            model_overrides = training_layer_overrides(rules)
        warnings += _training_side_issues(
            spec,
            rules,
            model,
            "nemo-rl",
            "NeMo RL's training side (policy.megatron_cfg: fp8_cfg, and model_overrides, "
            "which cannot build megatron-core's quant_recipe object)",
        )
    if generation_on and rules.acts_on("generation"):
        if rules.first:
            vllm_cfg["num_first_layers_in_bf16"] = rules.first
        if rules.last:
            vllm_cfg["num_last_layers_in_bf16"] = rules.last
        keywords, warns = _nemo_rl_keywords(spec, rules, model)
        warnings += warns
        if keywords:
            vllm_cfg["quantization_ignored_layer_kws"] = keywords
    elif generation_on and model is not None and model.vllm_quantizes_router:
        keywords, warns = _nemo_rl_keywords(spec, BF16Rules(), model)
        warnings += warns
        if keywords:
            vllm_cfg["quantization_ignored_layer_kws"] = keywords
    out = Spelling(warnings=warnings)
    for key, value in vllm_cfg.items():
        out.set(f"policy.generation.vllm_cfg.{key}", value)
    for key, value in model_overrides.items():
        out.set(f"policy.megatron_cfg.model_overrides.{key}", value)
    return out


def training_layer_overrides(rules: BF16Rules) -> dict[str, Any]:
    """``model_overrides`` for ``rules.first`` / ``last``: all three fields, since
    Megatron-Bridge's providers default the counts to 0 and megatron-core's to 1."""
    return {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": rules.first,
        "num_layers_at_end_in_bf16": rules.last,
    }


def _nemo_rl_keywords(
    spec: RecipeSpec | BF16Rules, rules: BF16Rules, model: ModelDescription | None
) -> tuple[list[str], list[Message]]:
    """Substring keywords for ``quantization_ignored_layer_kws``.

    NeMo RL keeps every Hugging Face parameter whose ``model.``-prefixed name contains a
    keyword out of FP8 (``nemo_rl/models/generation/fp8.py``). A glob ``*word*`` is that
    keyword exactly. With a model description, other globs are expanded, modules vLLM fuses
    with a matched one are added (vLLM refuses a fused module whose parts disagree), and a
    keyword that would catch modules the rules keep in FP8 is reported.
    """
    warnings: list[Message] = []
    keywords: list[str] = []
    source: dict[str, str] = {}
    untranslated: list[str] = []
    for i, p in enumerate(rules.modules):
        kw = plain_keyword(p)
        if kw is not None:
            if kw not in keywords:
                keywords.append(kw)
                source[kw] = rule_label(i, p)
        else:
            untranslated.append(rule_label(i, p))
    if model is None:
        for label in untranslated:
            text = (
                "quantization_ignored_layer_kws takes substrings, not globs; without a model "
                "description (--model or --model-config) this pattern cannot be expanded"
            )
            warnings.append(Message(text, "nemo-rl", label))
        return keywords, warnings

    res = resolve(spec, model, "generation")
    names = model.hf_linear_modules
    fl_layers = set(range(rules.first))
    if rules.last:
        fl_layers |= set(range(model.num_layers - rules.last, model.num_layers))
    required: set[str] = set()
    for d in res.decisions:
        if d.precision != "bf16" or not d.rule or d.layer in fl_layers:
            continue
        builtin = builtin_high_precision(d.module)
        if builtin == "output_head" or (builtin == "router" and not model.vllm_quantizes_router):
            continue  # vLLM's FP8 method never quantizes these: no keyword needed
        if is_module_rule(d.rule) or builtin == "router":
            required.update(model.vllm_members(d.module))
    # Keywords may also catch what is BF16 anyway, or what vLLM never quantizes.
    allowed = set(required)
    for d in res.decisions:
        builtin = builtin_high_precision(d.module)
        if (
            d.precision == "bf16"
            or d.layer in fl_layers
            or builtin == "output_head"
            or (builtin == "router" and not model.vllm_quantizes_router)
        ):
            allowed.update(model.vllm_members(d.module))

    position = {n: i for i, n in enumerate(names)}

    def caught(kw: str) -> set[str]:
        return {n for n in names if kw in n}

    covered: set[str] = set()
    for kw in keywords:
        got = caught(kw)
        extra = sorted(got - allowed, key=position.__getitem__)
        if extra:
            text = (
                f"keyword {kw!r} also matches {len(extra)} module(s) the rules keep in FP8 (e.g. "
                f"{extra[0]}); NeMo RL matches keywords as substrings of parameter names"
            )
            warnings.append(Message(text, "nemo-rl", source[kw]))
        covered |= got
    missing = [n for n in names if n in required and n not in covered]
    added: list[str] = []
    while missing:
        kw = _pick_keyword(missing[0], model, caught, allowed)
        added.append(kw)
        covered |= caught(kw)
        missing = [n for n in missing if n not in covered]
    return keywords + added, warnings


def _pick_keyword(
    name: str, model: ModelDescription, caught: Callable[[str], set[str]], allowed: set[str]
) -> str:
    """The shortest substring that catches ``name`` and nothing the rules keep in FP8:
    a trailing run of name components (no layer index), the fused-MoE prefix, or the
    full name."""
    parts = name.split(".")
    candidates = []
    for k in range(1, len(parts) + 1):
        tail = parts[-k:]
        if any(t.isdigit() for t in tail):
            break
        candidates.append(".".join(tail))
    unit = model.vllm_module(name)
    if unit and unit.endswith(".mlp.experts"):
        candidates.append(unit + ".")
    candidates.append(name)
    for cand in candidates:
        if caught(cand) <= allowed:
            return cand
    return name
