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
from .. import Message, Spelling

__all__ = ["to_vllm"]


def to_vllm(spec: RecipeSpec | BF16Rules, model: ModelDescription | None = None) -> Spelling:
    """vLLM's spelling: ``ignored_layers`` for its FP8 quantization config.

    vLLM compares these exactly against its module prefixes, splitting fused modules into
    their Hugging Face parts (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``; every part
    must agree) and matching a fused-MoE module by prefix (``model.layers.3.mlp.experts``).
    vLLM has no first/last-layer keys, so every rule needs the model description to be
    spelled; without one each rule gets a warning.
    """
    rules, _, generation_on = side_rules(spec)
    if not generation_on:
        return Spelling()
    acts = rules.acts_on("generation") and not rules.empty
    if model is None:
        if not acts:
            return Spelling()
        out = Spelling()
        exact = []
        no_count = (
            "vLLM has no layer-count key; ignored_layers needs the model description (--model "
            "or --model-config)"
        )
        for side in ("first", "last"):
            if getattr(rules, side):
                out.warnings.append(
                    Message(no_count, "vllm", f"bf16_layers.{side}={getattr(rules, side)}")
                )
        for i, p in enumerate(rules.modules):
            if GLOB_CHARS.search(p):
                text = (
                    "ignored_layers takes exact module names; expanding this glob needs the "
                    "model description (--model or --model-config)"
                )
                out.warnings.append(Message(text, "vllm", rule_label(i, p)))
            else:
                exact.append(p)
        if exact:
            out.set("ignored_layers", exact)
        return out
    if not acts and not model.vllm_quantizes_router:
        return Spelling()
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
    out = Spelling()
    if ignored:
        out.set("ignored_layers", ignored)
    return out
