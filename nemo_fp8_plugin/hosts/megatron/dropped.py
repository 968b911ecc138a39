"""What megatron-core would drop of a recipe without a word: it builds Transformer Engine's
recipe object itself (``fp8_utils.get_fp8_recipe``) and passes TE only the format (and delayed
scaling's history settings), so a spec setting it has no field for is lost. Which branch of
``get_fp8_recipe`` reads which field is a row of the version table (:mod:`.honoured`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...capabilities import capability
from ...errors import FP8ConfigError
from ...kinds import kind
from ...spec import RecipeSpec

if TYPE_CHECKING:
    from .honoured import HonouredFields

__all__ = ["dropped_settings", "refuse_dropped"]


def dropped_settings(spec: RecipeSpec, megatron_core: str | None = None) -> list[tuple[str, str]]:
    """(spec key, reason) for each setting megatron-core would silently drop.

    ``megatron_core``: the version the command assumes (``--stack``, else the installed one,
    :func:`stack_core`); None: the installed source's version. Version-table facts (FP8
    attention under nvfp4) are decided for it; the per-branch fields are the stacks table's
    rows for the installed version (:mod:`.honoured`)."""
    if spec.training != "fp8":
        return []
    out: list[tuple[str, str]] = []
    kind = spec.scaling
    row = capability(kind)
    if spec.amax_epsilon:
        out.append(
            (
                "amax_epsilon",
                "megatron-core builds Transformer Engine recipes with TE's "
                "default amax epsilon (0)",
            )
        )
    if not spec.reduce_amax and row.history:
        out.append(
            (
                "reduce_amax",
                "megatron-core always all-reduces delayed-scaling amaxes "
                "(only tp_only_amax_red narrows the group)",
            )
        )
    out += _unread_fields(spec, megatron_core)
    if row.history and spec.pow2_scales:
        out.append(("pow2_scales", "delayed scaling has no power-of-2 scale option"))
    if not spec.fp8_wgrad:
        # megatron-core 0.16 reads fp8_wgrad only to build DelayedScaling's
        # override_linear_precision; the other recipes never see it.
        from .honoured import honoured_fp8_fields

        out.append(
            (
                "fp8_wgrad",
                f"{honoured_fp8_fields().label} passes fp8_wgrad to Transformer "
                "Engine only as "
                "DelayedScaling's override_linear_precision, which TE 2.x "
                "ignores, so the weight gradient would run in FP8 anyway; TE "
                "has no weight-gradient-only switch, the nearest setting, "
                "NVTE_BACKWARD_OVERRIDE=high_precision (TE >= 2.15, not for "
                "delayed scaling), moves the whole backward to high precision; "
                "use fp8_wgrad: true",
            )
        )
    if row.argless_tiles is not None:  # megatron-core passes no tile shape for these
        act, wgt, grad = row.argless_tiles
        for key, want in (
            ("activation_block", act),
            ("weight_block", wgt),
            ("gradient_block", grad),
        ):
            if getattr(spec, key) != want:
                out.append(
                    (
                        key,
                        f"megatron-core builds the {row.megatron_recipe} recipe with "
                        f"Transformer Engine's default tiles ({None if want is None else list(want)})",
                    )
                )
    return out


# Spec key -> (TransformerConfig field, the spec value that asks nothing of that field). A
# value other than the neutral one is dropped when the recipe's branch of megatron-core's
# get_fp8_recipe never reads the field (honoured.honoured_fp8_fields, per installed version).
_RECIPE_FIELDS = (
    ("margin", "fp8_margin", 0),
    ("amax_history_len", "fp8_amax_history_len", 1),
    ("amax_compute_algo", "fp8_amax_compute_algo", "most_recent"),
    ("fp8_dot_product_attention", "fp8_dot_product_attention", False),
    ("fp8_multi_head_attention", "fp8_multi_head_attention", False),
)


def _unread_fields(spec: RecipeSpec, megatron_core: str | None = None) -> list[tuple[str, str]]:
    from .honoured import honoured_fp8_fields

    honoured = honoured_fp8_fields()
    recipe = capability(spec.scaling).megatron_recipe
    fact = kind(spec.scaling).megatron_attention_fact
    # A stack naming another release than the installed source, or a recipe the source's
    # get_fp8_recipe does not build (FP4): the version table decides FP8 attention.
    by_table = fact is not None and (
        (megatron_core is not None and megatron_core != honoured.version)
        or recipe not in honoured.fields
    )
    out = []
    for key, field, neutral in _RECIPE_FIELDS:
        if getattr(spec, key) == neutral:
            continue
        if by_table and key == "fp8_dot_product_attention":
            assert fact is not None
            out += _attention_by_table(spec, fact, megatron_core or honoured.version, honoured)
            continue
        if honoured.honours(recipe, field):
            continue
        readers = honoured.recipes_reading(field)
        instead = _presets_for(readers)
        where = f"only for fp8_recipe {' and '.join(readers)}" if readers else "for no fp8_recipe"
        out.append(
            (
                key,
                f"{honoured.label}'s get_fp8_recipe passes {field} to Transformer "
                f"Engine {where}, not for {recipe}; "
                + (f"use {' or '.join(instead)} for it, or " if instead else "")
                + f"remove {key} (the neutral value is "
                + (str(neutral).lower() if isinstance(neutral, bool) else repr(neutral))
                + ")",
            )
        )
    return out


def _attention_by_table(
    spec: RecipeSpec, fact: str, version: str, honoured: HonouredFields
) -> list[tuple[str, str]]:
    """FP8 attention under a kind whose megatron-core recipe builder passes ``fp8_dpa`` from
    some release on (the stacks-table ``fact``), for the assumed version."""
    from ...stacks import lookup

    answer = lookup("megatron-core", fact, version)
    if answer.present:
        return []
    minimum = answer.fact.minimum if answer.fact is not None else "?"
    label = honoured.label if version == honoured.version else f"megatron-core {version}"
    builder = fact.split(".")[0]
    built = kind(spec.scaling).megatron_attention_builds
    return [
        (
            "fp8_dot_product_attention",
            f"{label}'s {builder} builds {built} without fp8_dpa (megatron-core passes it from "
            f"{minimum}), so attention would run in BF16; use megatron-core >= {minimum}, or "
            f"remove fp8_dot_product_attention",
        )
    ]


def _presets_for(megatron_recipes: list[str]) -> list[str]:
    """Registered presets whose megatron-core ``fp8_recipe`` is one of ``megatron_recipes``."""
    from ...registry import list_recipes

    return [
        s.name
        for s in list_recipes()
        if s.training == "fp8" and capability(s.scaling).megatron_recipe in megatron_recipes
    ]


def refuse_dropped(
    spec: RecipeSpec,
    prefix: str = "fp8",
    *,
    host: str = "megatron-core",
    training_host: str | None = None,
    megatron_core: str | None = None,
) -> None:
    """Refuse a recipe setting megatron-core would silently drop (:func:`dropped_settings`),
    naming ``prefix.key``; with ``training_host`` (NeMo 2, Bridge: hosts that only train)
    also a recipe that trains in BF16, which gives such a host nothing."""
    dropped = dropped_settings(spec, megatron_core)
    if dropped:
        key, reason = dropped[0]
        raise FP8ConfigError(
            f"{host} would silently drop this setting: {reason}",
            key=f"{prefix}.{key}" if prefix else key,
            value=getattr(spec, key),
            hint="remove it, or use the recipe's preset value",
        )
    if training_host is not None and spec.training != "fp8":
        raise FP8ConfigError(
            f"this recipe trains in BF16; {training_host} training gets nothing from it",
            key=f"{prefix}.training" if prefix else "training",
            value=spec.training,
        )
