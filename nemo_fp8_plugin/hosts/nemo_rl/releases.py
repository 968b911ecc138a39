"""What each NeMo RL release reads: a key is written only for a release that reads it.

NeMo RL does not refuse a configuration key it does not know: written for a release that lacks
it, the key changes nothing, and the run trains or generates in BF16 without a word (v0.7.0
has no ``policy.generation.vllm_cfg.is_mx``, so MXFP8 rollouts there are block FP8; no
``policy.megatron_cfg.model_overrides``, so NVFP4 training and BF16 training layers vanish).
Which release has which key is :data:`nemo_fp8_plugin.stacks.FACTS` (one row per key, read in
each release's own source); this module asks it for every key the adapter spells
(:func:`refuse_unread`) and refuses, in one line naming the release, the key and what to do,
whatever the release cannot express. Adding a key is one fact row plus its spelling; a
feature whose refusal deserves its own words is one :data:`FEATURES` row.

The loss's truncation switch also moved between releases (:func:`truncation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...dotted import flatten
from ...errors import FP8ConfigError
from .. import HostContext

__all__ = [
    "release_choice",
    "assumed_release",
    "Feature",
    "FEATURES",
    "request_key",
    "refuse_unread",
    "TRUNCATION_BY_TYPE",
    "truncation",
    "TRUNCATION_KEYS",
]

_MEGATRON = "policy.megatron_cfg"
_VLLM = "policy.generation.vllm_cfg"
_MAIN_STACK = "--stack nemo-rl-main-2026-08-22"


def release_choice(ctx: HostContext | None) -> Any:
    """The NeMo RL release a command writes for and how it was decided: the stack's
    (``--stack``, or detected from the installed vLLM and Transformer Engine), else, for a
    context built in code, the newest release (:data:`nemo_fp8_plugin.stacks.NEMO_RL_NEWEST`)."""
    from ...stacks import NEMO_RL_NEWEST, ReleaseChoice

    if ctx is not None and ctx.stack is not None:
        return ctx.stack.release
    return ReleaseChoice(NEMO_RL_NEWEST, "assumed, the newest release: no --stack given")


def assumed_release(ctx: HostContext | None) -> str:
    """The name of :func:`release_choice`'s release."""
    return str(release_choice(ctx).release)


@dataclass(frozen=True)
class Feature:
    """What a key the adapter writes carries, for the refusal where a release lacks the key.

    Attributes:
        prefix: the written keys it covers (a dotted key, or a section ending in ``.``).
        what: what the release then cannot do (``"train in NVFP4"``).
        field: the spec field a message names (under ``fp8.`` when the request is an ``fp8:``
            block); ``""``: the request itself (``fp8.recipe`` / the precision key).
        hint: what to do instead.
    """

    prefix: str
    what: str
    field: str
    hint: str


FEATURES: tuple[Feature, ...] = (
    Feature(
        f"{_MEGATRON}.model_overrides.fp4",
        "train in NVFP4 (NeMo RL hands Transformer Engine's FP4 fields to the model only "
        "through policy.megatron_cfg.model_overrides)",
        "",
        f"use a NeMo RL with model_overrides ({_MAIN_STACK}), or fp8: {{recipe: nvfp4, qat: "
        f"w4a16}} (ModelOpt quantization-aware RL, NeMo RL v0.7.0 on)",
    ),
    Feature(
        f"{_MEGATRON}.model_overrides.",
        "keep training layers in BF16 (no policy.megatron_cfg.model_overrides, where "
        "first_last_layers_bf16 / num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 go)",
        "bf16_layers",
        f"upgrade to a build with model_overrides ({_MAIN_STACK}), or keep the layers in BF16 "
        f"for generation only (bf16_layers.applies_to: generation), or drop "
        f"bf16_layers.first/last (for a preset: state bf16_layers: {{first: 0, last: 0}})",
    ),
    Feature(
        "policy.router_replay.",
        "replay MoE routing (no policy.router_replay: training routes each token itself)",
        "router_replay",
        "use NeMo RL v0.7.0 or later (--stack nemo-rl-0.7.0), or remove router_replay",
    ),
    Feature(
        "grpo.seq_logprob_error_threshold",
        "drop sequences by their log-prob error (no grpo.seq_logprob_error_threshold)",
        "importance_sampling.max_sequence_error",
        "use NeMo RL v0.6.0 or later, or remove max_sequence_error",
    ),
    Feature(
        f"{_VLLM}.is_mx",
        "generate in MXFP8 (no policy.generation.vllm_cfg.is_mx: its FP8 rollouts are 128x128 "
        "block FP8 only)",
        "generation",
        f"generate in BF16 (fp8: {{recipe: mxfp8, generation: bf16}}), use fp8_blockwise for "
        f"FP8 rollouts, or a NeMo RL with is_mx ({_MAIN_STACK})",
    ),
)
"""The features whose refusal says more than "does not read the key", first match wins."""


def request_key(ctx: HostContext, field: str) -> str:
    """How a message names spec ``field``: ``fp8.<field>`` when the request is an ``fp8:``
    block, the bare field otherwise; ``""`` names the request itself (``fp8.recipe``, or the
    key that names the recipe)."""
    in_block = isinstance(ctx.resolved.get("fp8"), Mapping)
    if not field:
        assert ctx.request is not None  # a message about the request: there is one
        return "fp8.recipe" if in_block else ctx.request.keys[0]
    return f"fp8.{field}" if in_block else field


def refuse_unread(ctx: HostContext, keys: Mapping[str, Any]) -> None:
    """Refuse, in one line naming the release, the key and what to do, the first key of
    ``keys`` (nested, as spelled) that the assumed NeMo RL release does not read
    (:data:`nemo_fp8_plugin.stacks.FACTS`). A release the table does not know, or a key no
    row covers, is let through (the tests hold every key the adapter writes to a row)."""
    from ...stacks import lookup, nemo_rl_key_fact, release_label

    release = assumed_release(ctx)
    for key, _ in flatten(dict(keys)):
        row = nemo_rl_key_fact(key)
        if row is None or lookup("nemo-rl", row.name, release).present is not False:
            continue
        label = release_label(release)
        feature = next((f for f in FEATURES if key.startswith(f.prefix)), None)
        where = f"it is in: {row.versions.label}"
        if feature is None:
            raise FP8ConfigError(
                f"{label} does not read {key} ({where}), so {ctx.spec.name} cannot be written "
                f"for it: the key would be ignored silently",
                key=request_key(ctx, ""),
                value=ctx.spec.name,
                hint="choose a release that has it with --stack, or another recipe",
            )
        field = _field(ctx, feature)
        raise FP8ConfigError(
            f"{label} cannot {feature.what}; {key} would be ignored silently ({where})",
            key=request_key(ctx, field),
            value=ctx.spec.name if not field else _spec_value(ctx, field),
            hint=feature.hint,
        )


def _field(ctx: HostContext, feature: Feature) -> str:
    if feature.field == "bf16_layers":  # the count that asks for the training layers
        rules = ctx.spec.bf16_layers
        return "bf16_layers.first" if rules.first else "bf16_layers.last"
    return feature.field


def _spec_value(ctx: HostContext, field: str) -> Any:
    value: Any = ctx.spec
    for part in field.split("."):
        value = getattr(value, part, None)
    return value


# --------------------------------------------------------------------------- loss truncation

TRUNCATION_KEYS = (
    "loss_fn.truncated_importance_sampling_type",
    "loss_fn.truncated_importance_sampling_ratio",
    "loss_fn.truncated_importance_sampling_ratio_min",
)
"""NeMo RL's truncated importance-sampling keys: type, upper ratio, lower ratio."""

TRUNCATION_BY_TYPE = "loss_fn.truncated_importance_sampling_type turns truncation on"
"""The :data:`nemo_fp8_plugin.stacks.FACTS` behaviour row: from v0.7.0 the type turns
truncation on (and then needs a positive ratio); at v0.6.0 the ratio does, and a type without
a ratio is ignored (NVIDIA's v0.6.0 ``grpo_math_1B.yaml`` sets ``type: tis`` with ``ratio:
null``: no truncation)."""


def truncation(values: Mapping[str, Any], release: str | None) -> tuple[Any, Any, Any]:
    """``(type, ratio, ratio_min)`` of the truncation ``values`` (dotted key -> value, the
    :data:`TRUNCATION_KEYS`) turn on for NeMo RL ``release``; ``(None, None, None)`` when
    they turn none on (the others are then inert, whatever they say)."""
    from ...stacks import lookup

    kind, ratio, low = (values.get(k) for k in TRUNCATION_KEYS)
    by_type = lookup("nemo-rl", TRUNCATION_BY_TYPE, release).present is not False
    on = kind is not None if by_type else ratio is not None
    return (kind, ratio, low) if on else (None, None, None)


def release_hint(err: FP8ConfigError, choice: Any) -> FP8ConfigError:
    """``err`` with, when it names the NeMo RL release ``choice`` (a
    :class:`~nemo_fp8_plugin.stacks.ReleaseChoice`) that was assumed or detected rather than
    chosen, how it was decided and the ``--stack`` names of the others appended to its hint: a
    refusal is one line, so the commands' first line naming the release is not printed."""
    if choice.how.startswith("chosen") or choice.label not in err.bare_message:
        return err
    said = f"{choice.line.removeprefix(choice.label + ' (').removesuffix(')')}"
    hint = f"{err.hint}; " if err.hint else ""
    return type(err)(
        err.bare_message, key=err.key, value=err.value, hint=f"{hint}{choice.label}: {said}"
    )
