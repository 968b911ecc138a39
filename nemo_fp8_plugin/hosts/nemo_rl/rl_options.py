"""The RL options of a NeMo RL config: router replay (``policy.router_replay.enabled``),
sequence masking on the log-prob error (``grpo.seq_logprob_error_threshold``), and first/last
BF16 generation layers where a release's layer counts never reach vLLM."""

from __future__ import annotations

from collections.abc import Mapping

from ...dotted import get_path, set_path
from ...errors import FP8ConfigError
from ...spec import RecipeSpec
from .. import HostContext
from .checks import _has_generation, _moe_fallback
from .releases import request_key
from .spelling import _VLLM, ROUTER_REPLAY, SEQUENCE_ERROR, _generation_fp8, _is_moe

__all__ = ["refuse_rl_only", "router_replay_advice", "edge_layers_as_keywords", "is_grpo"]


def refuse_rl_only(spec: RecipeSpec, ctx: HostContext) -> None:
    """Router replay and sequence masking act on rollouts: refused for a config without
    generation (SFT, DPO), sequence masking for one that is not GRPO, router replay for a model
    without experts."""
    resolved = ctx.resolved
    error = spec.importance_sampling.max_sequence_error
    if spec.router_replay and not _has_generation(resolved):
        raise FP8ConfigError(
            "router replay trains on the experts the rollout engine routed each token to, and "
            "this config has no policy.generation (not an RL config)",
            key=request_key(ctx, "router_replay"),
            value=True,
            hint="remove router_replay",
        )
    if spec.router_replay and _is_moe(ctx.model) is False:
        assert ctx.model is not None
        raise FP8ConfigError(
            f"router replay replays the experts each token was routed to, and "
            f"{ctx.model.name} has no experts",
            key=request_key(ctx, "router_replay"),
            value=True,
            hint="remove router_replay: it is for mixture-of-experts models",
        )
    if error is not None and _has_generation(resolved) and not is_grpo(resolved):
        raise FP8ConfigError(
            f"NeMo RL masks sequences by their log-prob error in GRPO only "
            f"({SEQUENCE_ERROR}), and this config has no grpo section",
            key=request_key(ctx, "importance_sampling.max_sequence_error"),
            value=error,
            hint="remove max_sequence_error, or use a GRPO config",
        )


def router_replay_advice(spec: RecipeSpec, ctx: HostContext) -> tuple[list[str], list[str]]:
    """``(warnings, notes)``: router replay suggested for a mixture of experts generating in FP8
    that does not replay yet; a warning when it is asked for and the model is unknown."""
    from ...stacks import lookup, release_label

    resolved = ctx.resolved
    moe = _is_moe(ctx.model)
    if moe is None and _moe_fallback(resolved):
        moe = True
    if spec.router_replay:
        if moe is None:
            return [
                "router replay needs a mixture-of-experts model, and the model is not known "
                "here (--model or --model-config): for a dense model NeMo RL's vLLM worker "
                "stops, as vLLM returns no routed experts"
            ], []
        return [], []
    if not (moe and _generation_fp8(spec) and _has_generation(resolved)):
        return [], []
    from .values import resolved_value

    if resolved_value(resolved, ROUTER_REPLAY) is True:
        return [], []
    release = ctx.assumed_version("nemo-rl")
    has = lookup("nemo-rl", ROUTER_REPLAY, release).present is not False
    where = "" if has else f" (NeMo RL v0.7.0 on; {release_label(release)} has none)"
    return [], [
        f"nemo-rl: a mixture of experts generating in FP8: router replay{where} trains each "
        f"token through the experts vLLM routed it to, so an FP8 rounding that flips a routing "
        f"decision is not trained on; add router_replay: true to the fp8: block "
        f"({ROUTER_REPLAY}; maintainers advise it with importance sampling for MoE FP8 "
        f"rollouts, NVIDIA/Megatron-LM#4168)"
    ]


def edge_layers_as_keywords(spec: RecipeSpec, ctx: HostContext, keys: dict) -> list[str]:
    """First/last BF16 generation layers as ``quantization_ignored_layer_kws`` for a release
    whose ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16`` never reach vLLM
    (:mod:`.ignored_layers`); the note that says so. The last layers need the layer count."""
    from ...stacks import release_label
    from .ignored_layers import counts_reach_vllm, edge_layer_keywords

    rules, release = spec.bf16_layers, ctx.assumed_version("nemo-rl")
    if not (
        _generation_fp8(spec) and _has_generation(ctx.resolved) and rules.acts_on("generation")
    ):
        return []
    if not (rules.first or rules.last) or counts_reach_vllm(release):
        return []
    label = release_label(release)
    why = (
        f"{label}'s num_first_layers_in_bf16 / num_last_layers_in_bf16 never reach vLLM (its "
        f"init_fp8 appends the layers' names as one nested list, which vLLM never matches: "
        f"nemo_rl/models/generation/vllm/quantization/fp8.py ~214)"
    )
    if rules.last and ctx.model is None:
        raise FP8ConfigError(
            f"cannot be written for {label} without the model's layer count: {why}, so the "
            f"layers go in quantization_ignored_layer_kws by index",
            key=request_key(ctx, "bf16_layers.last"),
            value=rules.last,
            hint="pass --model or --model-config, or choose a release whose counts reach vLLM "
            "(--stack nemo-rl-main-2026-08-22)",
        )
    num_layers = ctx.model.num_layers if ctx.model is not None else rules.first
    added = edge_layer_keywords(rules.first, rules.last, num_layers)
    have = list(get_path(keys, f"{_VLLM}.quantization_ignored_layer_kws", None) or [])
    set_path(
        keys, f"{_VLLM}.quantization_ignored_layer_kws", have + [k for k in added if k not in have]
    )
    set_path(keys, f"{_VLLM}.num_first_layers_in_bf16", 0)
    set_path(keys, f"{_VLLM}.num_last_layers_in_bf16", 0)
    return [
        f"nemo-rl: BF16 generation layers written as quantization_ignored_layer_kws {added}: {why}"
    ]


def is_grpo(resolved: Mapping) -> bool:
    return isinstance(resolved.get("grpo"), Mapping)
