"""megatron-core's spelling of the BF16 rules: ``first_last_layers_bf16`` /
``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16`` for ``first``/``last``, and for
``modules`` a ``quant_recipe`` mapping (the schema of ``megatron/core/quantization/quant_config.py``:
``RecipeConfig.from_config_dict`` takes it as is; Megatron-LM reads the same YAML through
``--te-precision-config-file``). NeMo 2 and Megatron-Bridge reuse it."""

from __future__ import annotations

import re
from typing import Any

from ...rules import ModelDescription
from ...rules.names import MEGATRON_TO_HF_LEAVES, builtin_high_precision, layer_index
from ...rules.resolve import (
    is_module_rule,
    module_rules,
    resolve,
    rule_label,
    side_rules,
    template,
)
from ...spec import BF16Rules, RecipeSpec
from .. import Message, RuleIssueKind, Spelling

__all__ = ["to_megatron", "BF16_QUANT_CONFIG"]

BF16_QUANT_CONFIG = {
    "transformer_engine_config_type": "TEQuantizationParams",
    "training_recipe": {},
}
"""megatron-core per-module config that forces BF16: a TE recipe with no FP8/FP4 recipe
disables the autocast for the module (``_get_fp8_autocast_for_quant_recipe``)."""

_PP_WARNING = (
    "megatron-core matches quant_recipe patterns against stage-local module names "
    "(decoder.layers.<i> restarts at 0 on every pipeline stage), so these layer-specific "
    "patterns are right only with pipeline_model_parallel_size 1"
)


def to_megatron(spec: RecipeSpec | BF16Rules, model: ModelDescription | None = None) -> Spelling:
    """megatron-core's spelling of the training-side rules, as writes keyed by field name.

    Keys (only those needed): ``first_last_layers_bf16``, ``num_layers_at_start_in_bf16``,
    ``num_layers_at_end_in_bf16`` (both written: megatron-core defaults each to 1), and
    ``quant_recipe`` (a ``RecipeConfig`` dict: one ``bf16`` config and ordered glob matchers
    over Megatron module names; needs Transformer Engine modules to take effect). Each
    warning records what falls short of which rules (untranslatable, passed as is, right with
    pipeline size 1 only).
    """
    rules, training_on, _ = side_rules(spec)
    out = Spelling()
    if not training_on or not rules.acts_on("training") or rules.empty:
        return out
    if rules.first or rules.last:
        out.set("first_last_layers_bf16", True)
        out.set("num_layers_at_start_in_bf16", rules.first)
        out.set("num_layers_at_end_in_bf16", rules.last)
    if rules.modules:
        if model is not None:
            patterns, found = _megatron_patterns(spec, model)
        else:
            patterns, found = _megatron_patterns_generic(rules)
        out.warnings += found
        if patterns:
            out.set("quant_recipe", quant_recipe_mapping(patterns))
    return out


def quant_recipe_mapping(patterns: list[str]) -> dict[str, Any]:
    """megatron-core's ``RecipeConfig`` mapping keeping the modules ``patterns`` match in BF16."""
    return {
        "configs": {"bf16": dict(BF16_QUANT_CONFIG, training_recipe={})},
        "matchers": {
            f"bf16_{i}": {"config": "bf16", "type": "glob", "pattern": p, "enabled": True}
            for i, p in enumerate(patterns)
        },
    }


def _experts_glob(name: str) -> str:
    """Cover TE's grouped experts (``experts.linear_fc1``) and the sequential form
    (``experts.local_experts.<e>.linear_fc1``) with one glob."""
    return re.sub(r"\.mlp\.experts\.(linear_fc[12])$", r".mlp.experts.*\1", name)


def _megatron_patterns(
    spec: RecipeSpec | BF16Rules, model: ModelDescription
) -> tuple[list[str], list[Message]]:
    res = resolve(spec, model, "training")
    bf16 = {d.module for d in res.decisions if d.precision == "bf16"}
    # Routers and the output layer are not TE modules: megatron-core never runs them in FP8.
    by_rules = [
        d.module
        for d in res.decisions
        if is_module_rule(d.rule) and not builtin_high_precision(d.module)
    ]
    by_template: dict[str, list[str]] = {}
    for mg in model.megatron_linear_modules:
        by_template.setdefault(template(mg), []).append(mg)
    patterns: list[str] = []
    layer_specific = False
    done: set[str] = set()
    for mg in by_rules:
        t = template(mg)
        if t in done:
            continue
        done.add(t)
        group = by_template[t]
        if all(m in bf16 for m in group):
            patterns.append(_experts_glob(t))
        else:
            for m in group:
                if m in by_rules:
                    patterns.append(_experts_glob(m))
                    layer_specific = layer_specific or layer_index(m) is not None
    issues: list[Message] = []
    if layer_specific:
        labels = sorted(
            {
                d.rule
                for d in res.decisions
                if is_module_rule(d.rule)
                and template(d.module) in done
                and not all(m in bf16 for m in by_template[template(d.module)])
            }
        )
        named = [
            (i, p) for i, p in enumerate(side_rules(spec)[0].modules) if rule_label(i, p) in labels
        ]
        issues = [
            Message(
                _PP_WARNING,
                "megatron",
                ", ".join(labels),
                RuleIssueKind.STAGE_LOCAL,
                tuple(i for i, _ in named),
                tuple(p for _, p in named),
            )
        ]
    return patterns, issues


# Layer indices the name-only translation probes: a pattern that matches the same leaf at
# all of them does not depend on the layer.
_PROBE_LAYERS = (0, 1, 2, 7, 10, 31, 99, 125)


def _megatron_patterns_generic(rules: BF16Rules) -> tuple[list[str], list[Message]]:
    """Translate globs by module leaf when no model description is at hand."""
    patterns: list[str] = []
    issues: list[Message] = []
    mg_leaves = [mg for mg, _ in MEGATRON_TO_HF_LEAVES]
    for index, r in enumerate(module_rules(rules)):
        found = False
        if r.match("output_layer") or any(
            r.match(f"decoder.layers.{k}.{lf}") for lf in mg_leaves for k in _PROBE_LAYERS
        ):
            patterns.append(r.pattern)  # already a Megatron-name glob: used verbatim
            found = True
        if r.match("lm_head"):
            found = True  # the output layer never runs in FP8: nothing to spell
        for mg_leaf, hf_leaves in MEGATRON_TO_HF_LEAVES:
            coverage = set()
            for hf in hf_leaves:
                hits = [
                    bool(r.match(f"model.layers.{k}.{hf.replace('*', '0')}")) for k in _PROBE_LAYERS
                ]
                coverage.add("all" if all(hits) else "some" if any(hits) else "none")
            if "some" in coverage:
                text = (
                    "names particular layers in Hugging Face names; without a model "
                    "description it cannot be translated to megatron-core names (pass --model "
                    "or --model-config)"
                )
                kind = RuleIssueKind.UNTRANSLATABLE
                issues.append(Message(text, "megatron", r.label, kind, (index,), (r.pattern,)))
                found = True
            elif "all" in coverage:
                patterns.append(_experts_glob(f"decoder.layers.*.{mg_leaf}"))
                found = True
        if not found:
            text = (
                "matches no known megatron-core or Hugging Face module name; without a model "
                "description it is passed as is"
            )
            kind = RuleIssueKind.PASSED_AS_IS
            issues.append(Message(text, "megatron", r.label, kind, (index,), (r.pattern,)))
            patterns.append(r.pattern)
    return list(dict.fromkeys(patterns)), list(dict.fromkeys(issues))
