"""vLLM's spelling of the BF16 rules: ``ignored_layers`` (vLLM's FP8 ``quantization_config``),
exact module names as vLLM's ``is_layer_skipped`` compares them."""

from __future__ import annotations

from ...rules import ModelDescription
from ...rules.resolve import (
    GLOB_CHARS,
    resolve,
    rule_label,
    side_rules,
)
from ...spec import BF16Rules, RecipeSpec
from .. import HostKeys

__all__ = ["to_vllm"]


def to_vllm(spec: RecipeSpec | BF16Rules, model: ModelDescription | None = None) -> HostKeys:
    """vLLM's spelling: ``ignored_layers`` for its FP8 quantization config.

    vLLM compares these exactly against its module prefixes, splitting fused modules into
    their Hugging Face parts (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``; every part
    must agree) and matching a fused-MoE module by prefix (``model.layers.3.mlp.experts``).
    vLLM has no first/last-layer keys, so every rule needs the model description to be
    spelled; without one each rule gets a warning.
    """
    rules, _, generation_on = side_rules(spec)
    if not generation_on:
        return HostKeys({})
    acts = rules.acts_on("generation") and not rules.empty
    if model is None:
        if not acts:
            return HostKeys({})
        warnings = []
        exact = []
        if rules.first:
            warnings.append(
                f"bf16_layers.first={rules.first} (host vllm): vLLM has no layer-count "
                f"key; ignored_layers needs the model description (--model or --model-config)"
            )
        if rules.last:
            warnings.append(
                f"bf16_layers.last={rules.last} (host vllm): vLLM has no layer-count "
                f"key; ignored_layers needs the model description (--model or --model-config)"
            )
        for i, p in enumerate(rules.modules):
            if GLOB_CHARS.search(p):
                warnings.append(
                    f"{rule_label(i, p)} (host vllm): ignored_layers takes exact module "
                    f"names; expanding this glob needs the model description "
                    f"(--model or --model-config)"
                )
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
