"""One BF16 rule set in every host's own keys, as plain data (no host import).

* :func:`to_megatron`: ``first_last_layers_bf16`` / ``num_layers_at_start_in_bf16`` /
  ``num_layers_at_end_in_bf16`` for ``first``/``last``, and for ``modules`` a megatron-core
  ``quant_recipe`` mapping (the schema of ``megatron/core/quantization/quant_config.py``:
  ``RecipeConfig.from_config_dict`` takes it as is; Megatron-LM reads the same YAML through
  ``--te-precision-config-file``).
* :func:`to_nemo_rl`: ``policy.generation.vllm_cfg.num_first_layers_in_bf16`` /
  ``num_last_layers_in_bf16`` / ``quantization_ignored_layer_kws``. NeMo RL's Megatron
  training side (``policy.megatron_cfg.fp8_cfg``) has no BF16-layer keys: a warning per rule.
* :func:`to_vllm`: ``ignored_layers`` (vLLM's FP8 ``quantization_config``), exact module
  names as vLLM's ``is_layer_skipped`` compares them.

Each returns :class:`nemo_fp8_plugin.hosts.HostKeys`; ``warnings`` name the rule and the
host for everything the host cannot express.
"""

from __future__ import annotations

import re
from typing import Any

from ..hosts import HostKeys
from ..spec import BF16Rules, RecipeSpec
from .models import ModelDescription
from .names import MEGATRON_TO_HF_LEAVES, builtin_high_precision, layer_index
from .resolve import _module_rules, is_module_rule, resolve, rule_label, template

__all__ = ["to_megatron", "to_nemo_rl", "to_vllm", "BF16_QUANT_CONFIG", "plain_keyword"]

BF16_QUANT_CONFIG = {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}
"""megatron-core per-module config that forces BF16: a TE recipe with no FP8/FP4 recipe
disables the autocast for the module (``_get_fp8_autocast_for_quant_recipe``)."""

_GLOB_CHARS = re.compile(r"[*?\[\]]")
_PP_WARNING = ("megatron-core matches quant_recipe patterns against stage-local module names "
               "(decoder.layers.<i> restarts at 0 on every pipeline stage), so these layer-specific "
               "patterns are right only with pipeline_model_parallel_size 1")


def _rules_of(spec: RecipeSpec | BF16Rules) -> tuple[BF16Rules, bool, bool]:
    if isinstance(spec, RecipeSpec):
        return spec.bf16_layers, spec.training == "fp8", spec.generation == "fp8"
    return spec, True, True


def plain_keyword(pattern: str) -> str | None:
    """``"*a_proj*"`` -> ``"a_proj"``: the substring a glob of the form ``*word*`` stands for."""
    if len(pattern) > 2 and pattern.startswith("*") and pattern.endswith("*"):
        inner = pattern[1:-1]
        if inner and not _GLOB_CHARS.search(inner):
            return inner
    return None


# --------------------------------------------------------------------------- megatron-core


def to_megatron(spec: RecipeSpec | BF16Rules, model: ModelDescription | None = None) -> HostKeys:
    """megatron-core's spelling of the training-side rules.

    Keys (only those needed): ``first_last_layers_bf16``, ``num_layers_at_start_in_bf16``,
    ``num_layers_at_end_in_bf16`` (both written: megatron-core defaults each to 1), and
    ``quant_recipe`` (a ``RecipeConfig`` dict: one ``bf16`` config and ordered glob matchers
    over Megatron module names; needs Transformer Engine modules to take effect).
    """
    rules, training_on, _ = _rules_of(spec)
    keys: dict[str, Any] = {}
    warnings: list[str] = []
    if not training_on or not rules.acts_on("training") or rules.empty:
        return HostKeys(keys)
    if rules.first or rules.last:
        keys.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=rules.first,
                    num_layers_at_end_in_bf16=rules.last)
    if rules.modules:
        if model is not None:
            patterns, warns = _megatron_patterns(spec, model)
        else:
            patterns, warns = _megatron_patterns_generic(rules)
        warnings += warns
        if patterns:
            keys["quant_recipe"] = {
                "configs": {"bf16": dict(BF16_QUANT_CONFIG, training_recipe={})},
                "matchers": {f"bf16_{i}": {"config": "bf16", "type": "glob", "pattern": p,
                                           "enabled": True}
                             for i, p in enumerate(patterns)},
            }
    return HostKeys(keys, warnings)


def _experts_glob(name: str) -> str:
    """Cover TE's grouped experts (``experts.linear_fc1``) and the sequential form
    (``experts.local_experts.<e>.linear_fc1``) with one glob."""
    return re.sub(r"\.mlp\.experts\.(linear_fc[12])$", r".mlp.experts.*\1", name)


def _megatron_patterns(spec, model: ModelDescription) -> tuple[list[str], list[str]]:
    res = resolve(spec, model, "training")
    bf16 = {d.module for d in res.decisions if d.precision == "bf16"}
    # Routers and the output layer are not TE modules: megatron-core never runs them in FP8.
    by_rules = [d.module for d in res.decisions
                if is_module_rule(d.rule) and not builtin_high_precision(d.module)]
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
    warnings = []
    if layer_specific:
        labels = sorted({d.rule for d in res.decisions if is_module_rule(d.rule)
                         and template(d.module) in done
                         and not all(m in bf16 for m in by_template[template(d.module)])})
        warnings.append(f"{', '.join(labels)} (host megatron): {_PP_WARNING}")
    return patterns, warnings


# Layer indices the name-only translation probes: a pattern that matches the same leaf at
# all of them does not depend on the layer.
_PROBE_LAYERS = (0, 1, 2, 7, 10, 31, 99, 125)


def _megatron_patterns_generic(rules: BF16Rules) -> tuple[list[str], list[str]]:
    """Translate globs by module leaf when no model description is at hand."""
    patterns: list[str] = []
    warnings: list[str] = []
    mg_leaves = [mg for mg, _ in MEGATRON_TO_HF_LEAVES]
    for r in _module_rules(rules):
        found = False
        if r.match("output_layer") or any(r.match(f"decoder.layers.{k}.{lf}")
                                          for lf in mg_leaves for k in _PROBE_LAYERS):
            patterns.append(r.pattern)  # already a Megatron-name glob: used verbatim
            found = True
        if r.match("lm_head"):
            found = True  # the output layer never runs in FP8: nothing to spell
        for mg_leaf, hf_leaves in MEGATRON_TO_HF_LEAVES:
            coverage = set()
            for hf in hf_leaves:
                hits = [bool(r.match(f"model.layers.{k}.{hf.replace('*', '0')}"))
                        for k in _PROBE_LAYERS]
                coverage.add("all" if all(hits) else "some" if any(hits) else "none")
            if "some" in coverage:
                warnings.append(f"{r.label} (host megatron): names particular layers in Hugging "
                                f"Face names; without a model description it cannot be translated "
                                f"to megatron-core names (pass --model or --model-config)")
                found = True
            elif "all" in coverage:
                patterns.append(_experts_glob(f"decoder.layers.*.{mg_leaf}"))
                found = True
        if not found:
            warnings.append(f"{r.label} (host megatron): matches no known megatron-core or Hugging "
                            f"Face module name; without a model description it is passed as is")
            patterns.append(r.pattern)
    return list(dict.fromkeys(patterns)), list(dict.fromkeys(warnings))


# --------------------------------------------------------------------------- NeMo RL


def _training_side_warnings(spec, rules: BF16Rules, model: ModelDescription | None, host: str,
                            where: str) -> list[str]:
    out = []
    harmless: set[str] = set()
    if model is not None:  # rules that only name routers / the output layer lose nothing
        decided: dict[str, list[str]] = {}
        for d in resolve(spec, model, "training").decisions:
            if is_module_rule(d.rule):
                decided.setdefault(d.rule, []).append(d.module)
        harmless = {label for label, mods in decided.items()
                    if all(builtin_high_precision(m) for m in mods)}
    if rules.first:
        out.append(f"bf16_layers.first={rules.first} (host {host}): {where} has no key for BF16 "
                   f"leading layers; training runs them in FP8")
    if rules.last:
        out.append(f"bf16_layers.last={rules.last} (host {host}): {where} has no key for BF16 "
                   f"trailing layers; training runs them in FP8")
    for i, p in enumerate(rules.modules):
        if rule_label(i, p) not in harmless:
            out.append(f"{rule_label(i, p)} (host {host}): {where} has no per-module keys; "
                       f"training runs the modules it matches in FP8")
    return out


def to_nemo_rl(spec: RecipeSpec | BF16Rules, model: ModelDescription | None = None) -> HostKeys:
    """NeMo RL's spelling: the vLLM generation keys under ``policy.generation.vllm_cfg``,
    and a warning for every rule its Megatron training side cannot express."""
    rules, training_on, generation_on = _rules_of(spec)
    warnings: list[str] = []
    vllm_cfg: dict[str, Any] = {}
    if training_on and rules.acts_on("training"):
        warnings += _training_side_warnings(spec, rules, model, "nemo-rl",
                                            "NeMo RL's training side (policy.megatron_cfg.fp8_cfg)")
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
    keys = {"policy": {"generation": {"vllm_cfg": vllm_cfg}}} if vllm_cfg else {}
    return HostKeys(keys, warnings)


def _nemo_rl_keywords(spec, rules: BF16Rules, model: ModelDescription | None):
    """Substring keywords for ``quantization_ignored_layer_kws``.

    NeMo RL keeps every Hugging Face parameter whose ``model.``-prefixed name contains a
    keyword out of FP8 (``nemo_rl/models/generation/fp8.py``). A glob ``*word*`` is that
    keyword exactly. With a model description, other globs are expanded, modules vLLM fuses
    with a matched one are added (vLLM refuses a fused module whose parts disagree), and a
    keyword that would catch modules the rules keep in FP8 is reported.
    """
    warnings: list[str] = []
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
            warnings.append(f"{label} (host nemo-rl): quantization_ignored_layer_kws takes substrings, "
                            f"not globs; without a model description (--model or --model-config) "
                            f"this pattern cannot be expanded")
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
        if (d.precision == "bf16" or d.layer in fl_layers or builtin == "output_head"
                or (builtin == "router" and not model.vllm_quantizes_router)):
            allowed.update(model.vllm_members(d.module))

    position = {n: i for i, n in enumerate(names)}

    def caught(kw: str) -> set[str]:
        return {n for n in names if kw in n}

    covered: set[str] = set()
    for kw in keywords:
        got = caught(kw)
        extra = sorted(got - allowed, key=position.__getitem__)
        if extra:
            warnings.append(f"{source[kw]} (host nemo-rl): keyword {kw!r} also matches "
                            f"{len(extra)} module(s) the rules keep in FP8 (e.g. {extra[0]}); NeMo RL "
                            f"matches keywords as substrings of parameter names")
        covered |= got
    missing = [n for n in names if n in required and n not in covered]
    added: list[str] = []
    while missing:
        kw = _pick_keyword(missing[0], model, caught, allowed)
        added.append(kw)
        covered |= caught(kw)
        missing = [n for n in missing if n not in covered]
    return keywords + added, warnings


def _pick_keyword(name: str, model: ModelDescription, caught, allowed: set[str]) -> str:
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


# --------------------------------------------------------------------------- vLLM


def to_vllm(spec: RecipeSpec | BF16Rules, model: ModelDescription | None = None) -> HostKeys:
    """vLLM's spelling: ``ignored_layers`` for its FP8 quantization config.

    vLLM compares these exactly against its module prefixes, splitting fused modules into
    their Hugging Face parts (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``; every part
    must agree) and matching a fused-MoE module by prefix (``model.layers.3.mlp.experts``).
    vLLM has no first/last-layer keys, so every rule needs the model description to be
    spelled; without one each rule gets a warning.
    """
    rules, _, generation_on = _rules_of(spec)
    if not generation_on:
        return HostKeys({})
    acts = rules.acts_on("generation") and not rules.empty
    if model is None:
        if not acts:
            return HostKeys({})
        warnings = []
        exact = []
        if rules.first:
            warnings.append(f"bf16_layers.first={rules.first} (host vllm): vLLM has no layer-count "
                            f"key; ignored_layers needs the model description (--model or --model-config)")
        if rules.last:
            warnings.append(f"bf16_layers.last={rules.last} (host vllm): vLLM has no layer-count "
                            f"key; ignored_layers needs the model description (--model or --model-config)")
        for i, p in enumerate(rules.modules):
            if _GLOB_CHARS.search(p):
                warnings.append(f"{rule_label(i, p)} (host vllm): ignored_layers takes exact module "
                                f"names; expanding this glob needs the model description "
                                f"(--model or --model-config)")
            else:
                exact.append(p)
        return HostKeys({"ignored_layers": exact} if exact else {}, warnings)
    if not acts and not model.vllm_quantizes_router:
        return HostKeys({})
    res = resolve(spec, model, "generation")
    ignored: list[str] = []
    for d in res.decisions:
        if d.precision != "bf16" or d.rule == "builtin:output_head":
            continue
        if d.rule == "builtin:router" and not model.vllm_quantizes_router:
            continue
        if d.module.endswith(".mlp.experts"):
            ignored.append(d.module)
        else:
            ignored.extend(model.vllm_members(d.module))
    return HostKeys({"ignored_layers": ignored} if ignored else {})
