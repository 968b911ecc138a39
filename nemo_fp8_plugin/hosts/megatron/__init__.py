"""megatron-core: a recipe spec as ``TransformerConfig`` fields.

=====================================  ==========================================================
``TransformerConfig`` field             from the spec
=====================================  ==========================================================
``fp8``                                 ``fp8_format`` (``e4m3`` / ``hybrid``); null for nvfp4
``fp8_recipe``                          ``scaling``: delayed, tensorwise, blockwise, mxfp8 (null
                                        for nvfp4)
``fp4``, ``fp4_recipe``, ``fp4_param``  nvfp4 only: ``e2m1``, ``nvfp4``, ``fp8_param``
                                        (megatron-core 0.16.1 has them; FP8 and FP4 exclude
                                        each other, so the FP8 fields are off)
``fp8_margin``, ``fp8_amax_history_len``, ``margin``, ``amax_history_len``, ``amax_compute_algo``
``fp8_amax_compute_algo``               (megatron-core reads them for delayed scaling only)
``fp8_wgrad``                           ``fp8_wgrad`` (always true: false is refused, see below)
``fp8_dot_product_attention``,          ``fp8_dot_product_attention``, ``fp8_multi_head_attention``
``fp8_multi_head_attention``
``fp8_param``                           ``fp8_param``
``first_last_layers_bf16``,             ``bf16_layers.first`` / ``last``, through
``num_layers_at_start_in_bf16``,        :func:`nemo_fp8_plugin.rules.to_megatron`
``num_layers_at_end_in_bf16``
``quant_recipe``                        ``bf16_layers.modules`` (a ``RecipeConfig``; in YAML the
                                        mapping ``RecipeConfig.from_config_dict`` takes)
environment                             ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` (block) /
                                        ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` (tensorwise)
=====================================  ==========================================================

megatron-core builds its TE recipe object itself from these fields (``fp8_utils.get_fp8_recipe``),
passing only the format (and the delayed-scaling history settings), so spec settings it
has no field for are *dropped*: ``amax_epsilon``, ``reduce_amax: false``, a field the
recipe's branch of ``get_fp8_recipe`` never reads (``margin`` and the history outside delayed
scaling; in 0.16.1 ``fp8_dot_product_attention`` outside delayed/tensorwise and
``fp8_multi_head_attention`` outside delayed: read from the installed source by
:mod:`.source`), non-default block tiles, MXFP8 32x32 weight tiles, ``pow2_scales`` under
delayed scaling, and ``fp8_wgrad: false`` (megatron-core 0.16 passes it to TE only for
delayed scaling, as ``override_linear_precision``, which TE 2.x ignores).
:func:`dropped_settings` lists them; ``apply`` refuses a config that asks for one,
naming the key, and ``native_keys`` reports them as warnings. Scale rounding
(``pow2_scales`` for block and current scaling) is carried by the environment variable of
:func:`nemo_fp8_plugin.hosts.te.required_env`: :func:`build_transformer_config` and
:func:`apply_to_transformer_config` verify it against the Transformer Engine of the process
that calls them (:func:`nemo_fp8_plugin.hosts.te.verify_installed_te`); a Megatron-LM run
from YAML calls neither, so its training script must call that check itself.

``bf16_layers.first`` / ``last`` beyond the layer count the config states
(``num_layers`` of the section the fields go to) are refused by ``apply``
(:func:`check_layer_counts`), as ``nemo-fp8 explain`` refuses them, rather than written for
megatron-core to reject at model build time.

YAML layout for ``nemo-fp8 apply --host megatron``: the fields go under ``language_model:``
when the config has that mapping (Megatron-LM's ``--yaml-cfg`` layout), else under
``model:``, created when absent: never at the root, where ``fp8:`` is the plugin's own
request key. ``quant_recipe`` is written as the mapping
``{configs: ..., matchers: ...}``; :func:`build_transformer_config` turns it into the
``RecipeConfig`` megatron-core wants.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, List  # noqa: UP035 - see bf16_quant_recipe

from ...capabilities import CAPABILITIES, capability
from ...dotted import child_mapping, delete_path, get_path
from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from ...spec import RecipeSpec
from .. import ApplyResult, HostAdapter, HostContext, HostKeys, NativeRecipe, refuse_recipe
from ..te import required_env

__all__ = [
    "FP8_RECIPE",
    "refuse_dropped",
    "stack_core",
    "FP8_FIELDS",
    "BF16_FIELDS",
    "PRECISION_CONFIG_FP8_FIELDS",
    "dropped_settings",
    "transformer_config_fields",
    "precision_config_fields",
    "native_keys",
    "build_transformer_config",
    "apply_to_transformer_config",
    "quant_recipe_object",
    "bf16_quant_recipe",
    "bf16_patterns",
    "section_path",
    "check_layer_counts",
    "merge_native",
    "remove_request_keys",
    "DDP_FIELDS",
    "ddp_config_fields",
    "optimizer_config_fields",
    "build_ddp_config",
    "write_distributed_fields",
    "FP4_FIELDS",
]

FP8_RECIPE = {kind: row.megatron_recipe for kind, row in CAPABILITIES.items()}
"""Spec ``scaling`` -> megatron-core ``fp8_recipe`` (for nvfp4: its ``fp4_recipe``, see
:data:`FP4_FIELDS`)."""

FP4_FIELDS = ("fp4", "fp4_recipe", "fp4_param")
"""``TransformerConfig`` FP4 fields, written for nvfp4 (``fp4: e2m1``, ``fp4_recipe: nvfp4``,
``fp4_param`` from the spec's ``fp8_param``)."""

FP8_FIELDS = (
    "fp8",
    "fp8_recipe",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "fp8_param",
)
"""``TransformerConfig`` FP8 fields this adapter always writes (so a stale value cannot linger)."""

BF16_FIELDS = ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
"""``TransformerConfig`` first/last-layer BF16 fields, always written."""

CONFLICTING_FIELDS = ("fp8_quantizer_factory", "fp4", "fp4_recipe", "fp4_param", "quant_recipe")
"""Native keys that, when already set in an input config, contradict the recipe we write
(``quant_recipe`` only when our rules need one of their own)."""


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
    if not spec.reduce_amax and row.is_delayed:
        out.append(
            (
                "reduce_amax",
                "megatron-core always all-reduces delayed-scaling amaxes "
                "(only tp_only_amax_red narrows the group)",
            )
        )
    out += _unread_fields(spec, megatron_core)
    if row.is_delayed and spec.pow2_scales:
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
    if row.is_block or row.is_mx:  # megatron-core passes no tile shape for these
        act, wgt, grad = row.tiles
        for key, want in (
            ("activation_block", act),
            ("weight_block", wgt),
            ("gradient_block", grad),
        ):
            if getattr(spec, key) != want:
                out.append(
                    (
                        key,
                        f"megatron-core builds the {FP8_RECIPE[kind]} recipe with "
                        f"Transformer Engine's default tiles ({list(want)})",
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
    recipe = FP8_RECIPE[spec.scaling]
    out = []
    for key, field, neutral in _RECIPE_FIELDS:
        if getattr(spec, key) == neutral:
            continue
        assumed_other = megatron_core is not None and megatron_core != honoured.version
        if assumed_other and capability(spec.scaling).is_mx and key == MXFP8_DPA_FIELD:
            # A stack naming another release than the installed source: its table row decides.
            out += _mxfp8_attention(megatron_core)
            continue
        if honoured.honours(recipe, field):
            continue
        if capability(spec.scaling).is_nvfp4 and key == "fp8_dot_product_attention":
            out += _fp4_attention(honoured, megatron_core)
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


MXFP8_DPA = "get_fp8_recipe.mxfp8.fp8_dpa"
"""The stacks-table fact: megatron-core >= 0.18's ``get_fp8_recipe`` passes
``fp8_dpa=config.fp8_dot_product_attention`` to ``MXFP8BlockScaling``."""

MXFP8_DPA_FIELD = "fp8_dot_product_attention"


def _mxfp8_attention(megatron_core: str) -> list[tuple[str, str]]:
    """FP8 attention under MXFP8 for an assumed megatron-core version (the stacks table)."""
    from ...stacks import lookup

    answer = lookup("megatron-core", MXFP8_DPA, megatron_core)
    if answer.present:
        return []
    minimum = answer.fact.minimum if answer.fact is not None else "0.18"
    return [
        (
            MXFP8_DPA_FIELD,
            f"megatron-core {megatron_core}'s get_fp8_recipe builds MXFP8BlockScaling without "
            f"fp8_dpa (megatron-core passes it from {minimum}), so attention would run in BF16; "
            f"use megatron-core >= {minimum}, or remove fp8_dot_product_attention",
        )
    ]


FP4_DPA = "get_fp4_recipe.fp8_dpa"
"""The stacks-table fact: megatron-core >= 0.17's ``get_fp4_recipe`` passes
``fp8_dpa=config.fp8_dot_product_attention`` to ``NVFP4BlockScaling``."""


def _fp4_attention(honoured, megatron_core: str | None = None) -> list[tuple[str, str]]:
    """FP8 attention under nvfp4: honoured from megatron-core 0.17, dropped before; decided
    for ``megatron_core`` (the assumed version) when given, else the installed source's."""
    from ...stacks import lookup

    version = megatron_core or honoured.version
    answer = lookup("megatron-core", FP4_DPA, version)
    if answer.present:
        return []
    minimum = answer.fact.minimum if answer.fact is not None else "0.17"
    label = honoured.label if version == honoured.version else f"megatron-core {version}"
    return [
        (
            "fp8_dot_product_attention",
            f"{label}'s get_fp4_recipe builds NVFP4BlockScaling() without fp8_dpa "
            f"(megatron-core passes it from {minimum}), so attention would run in BF16; use "
            f"megatron-core >= {minimum}, or remove fp8_dot_product_attention",
        )
    ]


def _presets_for(megatron_recipes: list[str]) -> list[str]:
    """Registered presets whose megatron-core ``fp8_recipe`` is one of ``megatron_recipes``."""
    from ...registry import list_recipes

    return [
        s.name
        for s in list_recipes()
        if s.training == "fp8" and FP8_RECIPE[s.scaling] in megatron_recipes
    ]


_NO_BF16_LAYERS = {
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0,
}


def _rules_keys(spec: RecipeSpec, model=None) -> HostKeys:
    """First/last BF16 layers and per-module rules, spelt by the rules module; the
    first/last fields are always present so a stale value in a config cannot survive."""
    keys = dict(_NO_BF16_LAYERS)
    if not spec.bf16_layers.acts_on("training") or spec.bf16_layers.empty:
        return HostKeys(keys=keys)
    from .rules import to_megatron  # stdlib only, but not needed by every command

    rules = to_megatron(spec, model)
    keys.update(rules.keys)
    return HostKeys(keys=keys, warnings=list(rules.warnings))


def _stated_layers(ctx: HostContext) -> tuple[int, str] | None:
    """(layer count, what states it) for :func:`check_layer_counts`, or None: ``num_layers``
    of the section the fields go to (NeMo 2 keeps it under ``model.config``, a Bridge
    GPTModelConfig under ``model.transformer``), else the model description of the context
    (read relative to the config's directory)."""
    path = section_path(ctx.raw)
    section = get_path(ctx.raw, path)
    where = ".".join(path)
    for node, label in (
        (section, where),
        (get_path(section, "config"), f"{where}.config"),
        (get_path(section, "transformer"), f"{where}.transformer"),
    ):
        value = node.get("num_layers") if isinstance(node, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value, f"the model ({label}.num_layers)"
    if ctx.model is not None:
        return ctx.model.num_layers, ctx.model.name
    return None


def check_layer_counts(ctx: HostContext) -> None:
    """Refuse ``bf16_layers.first`` / ``last`` that the layer count the config states cannot
    hold, with the error ``nemo-fp8 explain`` gives, instead of writing
    ``num_layers_at_start_in_bf16`` / ``..._end_...`` for megatron-core to reject when it
    builds the model; without a count nothing is checked (megatron-core's own validation
    remains)."""
    spec = ctx.spec
    rules = spec.bf16_layers
    if spec.training != "fp8" or not rules.acts_on("training") or not (rules.first or rules.last):
        return
    stated = _stated_layers(ctx)
    if stated is None:
        return
    # The very check explain reaches through rules.resolve(), so both commands agree.
    from ...rules.resolve import _check_counts

    try:
        _check_counts(rules, *stated)
    except FP8ConfigError as err:
        raise (err.with_prefix(ctx.prefix) if ctx.prefix else err) from None


def transformer_config_fields(
    spec: RecipeSpec, model=None, megatron_core: str | None = None
) -> HostKeys:
    """The ``TransformerConfig`` fields for ``spec`` (plain data; ``quant_recipe`` as a mapping).

    ``warnings`` holds what megatron-core cannot express (see :func:`dropped_settings`) and the
    rules the rules module could not translate; ``env`` the variables TE must see at import.
    """
    if spec.training != "fp8":
        return HostKeys(
            keys={},
            warnings=["megatron: training: bf16 in this recipe, so megatron-core gets no FP8 keys"],
        )
    row = capability(spec.scaling)
    if row.is_nvfp4:
        return _fp4_fields(spec, model, megatron_core)
    keys: dict[str, Any] = {
        "fp8": spec.fp8_format,
        "fp8_recipe": FP8_RECIPE[spec.scaling],
        "fp8_margin": spec.margin if row.is_delayed else 0,
        "fp8_amax_history_len": spec.amax_history_len if row.is_delayed else 1,
        "fp8_amax_compute_algo": spec.amax_compute_algo if row.is_delayed else "most_recent",
        "fp8_wgrad": spec.fp8_wgrad,
        "fp8_dot_product_attention": spec.fp8_dot_product_attention,
        "fp8_multi_head_attention": spec.fp8_multi_head_attention,
        "fp8_param": spec.fp8_param,
    }
    rules = _rules_keys(spec, model)
    keys.update(rules.keys)
    warnings = [
        f"megatron: {key}: {reason}; dropped"
        for key, reason in dropped_settings(spec, megatron_core)
    ]
    warnings += list(rules.warnings)
    return HostKeys(keys=keys, warnings=warnings, env=required_env(spec))


def _fp4_fields(spec: RecipeSpec, model=None, megatron_core: str | None = None) -> HostKeys:
    """nvfp4: megatron-core's FP4 fields with FP8 off (``TransformerConfig.__post_init__``
    refuses both; ``get_fp4_recipe`` builds ``NVFP4BlockScaling()`` from TE's defaults, which
    the environment of :func:`~nemo_fp8_plugin.hosts.te.required_env` pins). The FP8 recipe
    fields are inert without ``fp8`` and left alone, but for ``fp8_recipe`` (null: none)."""
    keys: dict[str, Any] = {
        "fp8": None,
        "fp8_recipe": None,
        "fp8_param": False,
        "fp4": "e2m1",
        "fp4_recipe": capability(spec.scaling).megatron_recipe,
        "fp4_param": spec.fp8_param,
    }
    if spec.fp8_dot_product_attention:  # reached only where honoured (dropped_settings)
        keys["fp8_dot_product_attention"] = True
    rules = _rules_keys(spec, model)
    keys.update(rules.keys)
    warnings = [
        f"megatron: {key}: {reason}; dropped"
        for key, reason in dropped_settings(spec, megatron_core)
    ]
    warnings += list(rules.warnings)
    return HostKeys(keys=keys, warnings=warnings, env=required_env(spec))


PRECISION_CONFIG_FP8_FIELDS = (
    "fp8",
    "fp8_recipe",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
)
"""FP8 fields that NeMo 2's ``MegatronMixedPrecision`` and Megatron-Bridge's
``MixedPrecisionConfig`` both carry under the TransformerConfig's names (both copy them onto
the model config at setup)."""


def precision_config_fields(
    spec: RecipeSpec, model=None, *, host: str, megatron_core: str | None = None
) -> HostKeys:
    """The FP8 fields of a NeMo 2 / Megatron-Bridge precision config for ``spec``, plus
    ``quant_recipe`` when per-module rules need one; warnings are labelled with ``host``;
    ``megatron_core`` as in :func:`dropped_settings`."""
    if spec.training != "fp8":
        return HostKeys(
            keys={},
            warnings=[
                f"{host}: training: bf16 in this recipe, so its precision config gets no FP8 fields"
            ],
        )
    mc = transformer_config_fields(spec, model, megatron_core)
    keys = {k: mc.keys[k] for k in PRECISION_CONFIG_FP8_FIELDS if k in mc.keys}
    if capability(spec.scaling).is_nvfp4:  # NeMo 2.7.3 and Bridge 0.6.2: fp4, fp4_recipe
        keys.update({k: mc.keys[k] for k in ("fp4", "fp4_recipe")})
    keys.update(ddp_config_fields(spec))
    if "quant_recipe" in mc.keys:
        keys["quant_recipe"] = mc.keys["quant_recipe"]
    warnings = [w.replace("megatron:", f"{host}:", 1) for w in mc.warnings]
    return HostKeys(keys=keys, warnings=warnings, env=dict(mc.env))


DDP_FIELDS = ("fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag")
"""megatron-core ``DistributedDataParallelConfig`` fields an FP8 recipe decides."""


def ddp_config_fields(spec: RecipeSpec) -> dict[str, bool]:
    """``DistributedDataParallelConfig`` kwargs for ``spec``: ``fp8_param_gather`` (FP8
    parameters all-gathered in FP8: ``fp8_param``) and ``reuse_grad_buf_for_mxfp8_param_ag``
    (MXFP8 with FP8 parameters; megatron-core asserts ``fp8_param_gather`` for it and its
    optimizer warns for MXFP8 without both). Empty when training is not FP8."""
    if spec.training != "fp8":
        return {}
    row = capability(spec.scaling)
    fp8 = not row.is_nvfp4  # FP4 parameters are TransformerConfig.fp4_param
    return {
        "fp8_param_gather": fp8 and spec.fp8_param,
        "reuse_grad_buf_for_mxfp8_param_ag": row.is_mx and spec.fp8_param,
    }


FP4_PARAM_GATHER = "ddp.fp4_param_gather"
"""The stacks-table fact (:data:`nemo_fp8_plugin.stacks.FACTS`): megatron-core >= 0.18's
``DistributedDataParallelConfig.fp4_param_gather``, without which the distributed optimizer does
not all-gather (requantize) NVFP4 parameters."""


def fp4_ddp_fields(spec: RecipeSpec, megatron_core: str | None) -> dict[str, bool]:
    """``{"fp4_param_gather": fp8_param}`` for nvfp4 training on a megatron-core that has the
    field (``megatron_core``: its version; the stacks table decides), else empty (0.16.1's
    ``DistributedDataParallelConfig`` has no such field and would refuse it)."""
    from ...stacks import lookup

    if spec.training != "fp8" or not capability(spec.scaling).is_nvfp4:
        return {}
    if not lookup("megatron-core", FP4_PARAM_GATHER, megatron_core).present:
        return {}
    return {"fp4_param_gather": spec.fp8_param}


def optimizer_config_fields(spec: RecipeSpec) -> dict[str, Any]:
    """megatron-core ``OptimizerConfig`` kwargs for ``spec``: ``fp8_recipe`` (the distributed
    optimizer handles FP8 parameters per recipe) and ``reuse_grad_buf_for_mxfp8_param_ag``.
    Empty when training is not FP8."""
    if spec.training != "fp8":
        return {}
    return {
        "fp8_recipe": None if capability(spec.scaling).is_nvfp4 else FP8_RECIPE[spec.scaling],
        "reuse_grad_buf_for_mxfp8_param_ag": ddp_config_fields(spec)[
            "reuse_grad_buf_for_mxfp8_param_ag"
        ],
    }


def build_ddp_config(spec: RecipeSpec, *, config_class=None, **base: Any):
    """A real megatron-core ``DistributedDataParallelConfig`` (or ``config_class``) from
    ``base`` plus :func:`ddp_config_fields`; a ``base`` key the recipe decides is refused, and
    megatron-core's own ``__post_init__`` validates the result."""
    if config_class is None:
        from megatron.core.distributed import DistributedDataParallelConfig as config_class
    fields = ddp_config_fields(spec)
    clash = sorted(k for k in set(base) & set(fields) if base[k] != fields[k])
    if clash:
        raise FP8ConfigError(
            f"is set by the caller to {format_value(base[clash[0]])}, but recipe "
            f"{spec.name!r} needs {format_value(fields[clash[0]])}",
            key=clash[0],
            value=base[clash[0]],
        )
    return _construct(config_class, {**base, **fields}, spec)


def write_distributed_fields(
    out: dict, spec: RecipeSpec, *, megatron_core: str | None = None
) -> list[str]:
    """Write :func:`ddp_config_fields` into an ``apply --host megatron`` output; returns the
    keys written.

    Megatron-LM's ``--yaml-cfg`` layout (a ``language_model:`` mapping) reads
    ``DistributedDataParallelConfig`` (and ``OptimizerConfig``) fields from its flattened
    arguments, so they go at the root, beside ``use_distributed_optimizer``; otherwise under
    ``ddp:`` (created when absent: ``DistributedDataParallelConfig(**config["ddp"])``, the
    name Megatron-Bridge uses for the same class). A value already there that differs is
    refused, naming the key. ``megatron_core``: the version written for (nvfp4's
    ``fp4_param_gather`` from 0.18, :func:`fp4_ddp_fields`)."""
    fields = {**ddp_config_fields(spec), **fp4_ddp_fields(spec, megatron_core)}
    if not fields:
        return []
    return _write_ddp(
        out, fields if isinstance(out.get("language_model"), Mapping) else {"ddp": fields}
    )


def native_keys(spec: RecipeSpec, model=None) -> HostKeys:
    """The adapter contract: :func:`transformer_config_fields`."""
    return transformer_config_fields(spec, model)


# --------------------------------------------------------------------------- with megatron-core


def quant_recipe_object(mapping: Mapping[str, Any] | None):
    """megatron-core's ``RecipeConfig`` from the YAML mapping (``configs`` + ``matchers``)."""
    if mapping is None:
        return None
    from megatron.core.quantization.quant_config import RecipeConfig

    if isinstance(mapping, RecipeConfig):
        return mapping
    if not isinstance(mapping, Mapping):
        raise FP8ConfigError(
            f"expected a mapping with configs and matchers, got {format_value(mapping)}",
            key="quant_recipe",
            value=mapping,
        )
    return RecipeConfig.from_config_dict(dict(mapping))


def bf16_patterns(mapping: Mapping[str, Any]) -> list[str]:
    """The ordered glob patterns of a BF16-only ``quant_recipe`` mapping (the rules module's)."""
    return [m["pattern"] for m in mapping.get("matchers", {}).values() if m.get("enabled")]


def bf16_quant_recipe(patterns: list[str]):
    """megatron-core's ``RecipeConfig`` keeping the modules matching ``patterns`` (fnmatch
    globs, first match wins) in BF16: the YAML ``_target_`` NeMo-Run and Bridge configs use,
    since NeMo-Run's YAML loader passes scalars and lists but not nested mappings."""
    from .rules import BF16_QUANT_CONFIG

    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise FP8ConfigError(
            f"expected a list of glob patterns, got {format_value(patterns)}",
            key="quant_recipe.patterns",
            value=patterns,
        )
    return quant_recipe_object(
        {
            "configs": {"bf16": dict(BF16_QUANT_CONFIG, training_recipe={})},
            "matchers": {
                f"bf16_{i}": {"config": "bf16", "type": "glob", "pattern": p, "enabled": True}
                for i, p in enumerate(patterns)
            },
        }
    )


# NeMo-Run parses CLI/YAML values by the annotation object; a postponed (string) annotation
# is "Unsupported type", so this one is set as a real typing object.
bf16_quant_recipe.__annotations__["patterns"] = List[str]  # noqa: UP006 - NeMo-Run parses typing.List


def _objects(fields: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(fields)
    if out.get("quant_recipe") is not None:
        out["quant_recipe"] = quant_recipe_object(out["quant_recipe"])
    return out


def build_transformer_config(spec: RecipeSpec, model=None, *, config_class=None, **base: Any):
    """A real megatron-core ``TransformerConfig`` (or ``config_class``) from ``base`` model
    fields plus the recipe's FP8 fields; megatron-core's own ``__post_init__`` validates it.

    Raises :class:`FP8ConfigError` for settings megatron-core would drop, and re-raises
    megatron-core's own validation errors as :class:`FP8ConfigError` naming the field.
    """
    if config_class is None:
        from megatron.core.transformer import TransformerConfig as config_class
    refuse_recipe(ADAPTER, spec)
    hk = transformer_config_fields(spec, model)
    _verify_te(spec)
    clash = sorted(set(base) & set(hk.keys))
    if clash:
        raise FP8ConfigError(
            f"{clash[0]} is set both by the caller and by recipe {spec.name!r}",
            key=clash[0],
            value=base[clash[0]],
        )
    return _construct(config_class, {**base, **_objects(hk.keys)}, spec)


def apply_to_transformer_config(config, spec: RecipeSpec, model=None):
    """A copy of an existing ``TransformerConfig`` with the recipe's fields, validated again
    by megatron-core (``dataclasses.replace`` runs ``__post_init__`` on the copy)."""
    refuse_recipe(ADAPTER, spec)
    hk = transformer_config_fields(spec, model)
    _verify_te(spec)
    return _construct(lambda **kw: dataclasses.replace(config, **kw), _objects(hk.keys), spec)


def _verify_te(spec: RecipeSpec) -> None:
    # A TransformerConfig is built in the process that trains, and megatron-core builds its
    # TE recipe from it with TE's import-time scale defaults: the one place plain
    # megatron-core gives us to catch the fp32-scale trap.
    from ..te import verify_installed_te

    verify_installed_te(spec, where="this process")


def _construct(factory, kwargs: dict[str, Any], spec: RecipeSpec):
    try:
        return factory(**kwargs)
    except (ValueError, AssertionError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        key = next((k for k in (*BF16_FIELDS, *FP8_FIELDS, *FP4_FIELDS) if k in msg), None)
        raise FP8ConfigError(f"megatron-core refuses recipe {spec.name!r}: {msg}", key=key) from exc


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


# --------------------------------------------------------------------------- YAML


def section_path(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Where TransformerConfig keys live in a config: ``language_model`` when present, else
    ``model`` (never the root, where ``fp8:`` is the plugin's request key)."""
    if isinstance(config.get("language_model"), Mapping):
        return ("language_model",)
    return ("model",)


def remove_request_keys(config: Mapping[str, Any], keys) -> dict:
    """A deep copy of ``config`` without the plugin keys that carried the request
    (``FP8Request.keys``: dotted paths such as ``precision`` or ``policy.precision``)."""
    out = copy.deepcopy(dict(config))
    for dotted in keys:
        delete_path(out, dotted)
    return out


def merge_native(
    section: dict, keys: Mapping[str, Any], *, where: str, conflicting: tuple[str, ...] = ()
) -> list[str]:
    """Write ``keys`` into ``section``; refuse a key already set there to a different value,
    and any of ``conflicting`` set at all. Returns the keys written."""
    for key in conflicting:
        if section.get(key) not in (None, False):
            raise ConflictingKeyError(
                f"already set to {format_value(section[key])}, which conflicts with "
                f"the FP8 recipe being applied",
                key=f"{where}{key}",
                value=section[key],
                hint="remove it, or remove the plugin's precision/fp8 key",
            )
    for key, value in keys.items():
        if key in section and section[key] is not None and section[key] != value:
            raise ConflictingKeyError(
                f"already set to {format_value(section[key])}; the recipe needs "
                f"{format_value(value)}",
                key=f"{where}{key}",
                value=section[key],
                hint="state the recipe once: remove the native key or the "
                "plugin's precision/fp8 key",
            )
    section.update(copy.deepcopy(dict(keys)))
    return list(keys)


def _fp4_gather_notes(spec: RecipeSpec, core: str | None, written: list[str]) -> list[str]:
    """What to do about ``fp4_param_gather`` when it was not written for FP4 parameters."""
    if not (capability(spec.scaling).is_nvfp4 and spec.fp8_param) or "fp4_param_gather" in written:
        return []
    from ...stacks import fact

    since = fact("megatron-core", FP4_PARAM_GATHER)
    minimum = since.minimum if since is not None else "0.18"
    if core is None:
        return [
            f"megatron: NVFP4 parameters: megatron-core >= {minimum} also needs "
            f"ddp.fp4_param_gather: true (the distributed optimizer requantizes them only with "
            f"it); the megatron-core version is unknown here, pass --stack to write it"
        ]
    return [
        f"megatron: megatron-core {core} has no ddp.fp4_param_gather (from {minimum}), which "
        f"the distributed optimizer needs to requantize NVFP4 parameters; keep fp8_param: false "
        f"for nvfp4 there, or use megatron-core >= {minimum}"
    ]


def _merge(ctx: HostContext, keys: HostKeys) -> ApplyResult:
    """Write :meth:`MegatronAdapter.spell`'s keys: the TransformerConfig fields into their
    section, the DistributedDataParallelConfig fields under ``ddp:`` (or at the root of
    Megatron-LM's ``--yaml-cfg`` layout)."""
    spec = ctx.spec
    out = remove_request_keys(ctx.raw, ctx.request.keys)
    name = section_path(out)[0]
    if out.get(name) is None:
        out[name] = {}
    section = out[name]
    if not isinstance(section, dict):
        raise FP8ConfigError(
            f"expected a mapping of model fields, got {format_value(section)}",
            key=name,
            value=section,
        )
    fields = keys.keys.get(name, {})
    # A quant_recipe of our own is compared like any key; someone else's contradicts ours.
    conflicting = tuple(k for k in CONFLICTING_FIELDS if k not in fields)
    merge_native(section, fields, where=f"{name}.", conflicting=conflicting)
    # the DDP side (fp8_param_gather, MXFP8 buffer reuse, NVFP4's fp4_param_gather)
    written = _write_ddp(out, {k: v for k, v in keys.keys.items() if k != name})
    notes = _fp4_gather_notes(spec, stack_core(ctx), written)
    notes += [
        f"megatron: export {var}={value} in the training process's environment "
        f"before Transformer Engine is imported; megatron-core does not check it: "
        f"a script building its config with nemo_fp8_plugin.hosts.megatron."
        f"build_transformer_config is checked there, otherwise call "
        f"nemo_fp8_plugin.hosts.te.verify_installed_te({_recipe_literal(spec)}) "
        f"in the training script before the model is built"
        for var, value in keys.env.items()
    ]
    return ApplyResult(data=out, warnings=list(keys.warnings), notes=notes, env=dict(keys.env))


def stack_core(ctx: HostContext | None) -> str | None:
    """The megatron-core version the context assumes (``--stack``, else the installed one);
    None without a context or a stack (a mapping given in code)."""
    return ctx.assumed_version("megatron-core") if ctx is not None else None


def _spell(
    spec: RecipeSpec, config: Mapping[str, Any] | None, model, megatron_core: str | None = None
) -> HostKeys:
    """The TransformerConfig fields under their section (``language_model`` or ``model``),
    and the DDP fields where :func:`write_distributed_fields` puts them (nvfp4's
    ``fp4_param_gather`` where ``megatron_core`` has it, :func:`fp4_ddp_fields`)."""
    hk = transformer_config_fields(spec, model, megatron_core)
    name = section_path(config or {})[0]
    keys: dict[str, Any] = {name: dict(hk.keys)} if hk.keys else {}
    ddp = {**ddp_config_fields(spec), **fp4_ddp_fields(spec, megatron_core)}
    if ddp:
        keys.update(ddp) if name == "language_model" else keys.update(ddp=ddp)
    return HostKeys(keys=keys, warnings=list(hk.warnings), env=dict(hk.env))


def _write_ddp(out: dict, placed: Mapping[str, Any]) -> list[str]:
    """Merge the DDP part of the spelling (``{"ddp": {...}}`` or root fields) into ``out``."""
    if "ddp" not in placed:
        return merge_native(out, placed, where="") if placed else []
    ddp = child_mapping(out, "ddp", what="DistributedDataParallelConfig fields", where="ddp")
    return merge_native(ddp, placed["ddp"], where="ddp.")


def _recipe_literal(spec: RecipeSpec) -> str:
    """``spec`` as the Python literal ``verify_installed_te`` takes: the registered name, the
    ``{"recipe": name, ...}`` mapping of the fields that differ from that preset, or (a spec
    no preset has) the full mapping."""
    from ...registry import default_registry

    reg = default_registry()
    if spec.name not in reg:
        return repr(spec.to_dict())
    preset, mine = reg.get(spec.name).to_dict(), spec.to_dict()
    diff = {k: v for k, v in mine.items() if k != "name" and preset.get(k) != v}
    return repr({"recipe": spec.name, **diff}) if diff else repr(spec.name)


def _validate(result: ApplyResult, ctx: HostContext) -> list[str]:
    """Build megatron-core's own ``TransformerConfig`` from the written section (its
    ``__post_init__`` validates the FP8 fields), when megatron-core is importable."""
    try:
        from megatron.core.transformer import TransformerConfig
    except ImportError as exc:
        return [f"megatron: not checked (megatron-core is not importable here: {exc})"]
    section = get_path(result.data, section_path(result.data)) or {}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs = {k: v for k, v in section.items() if k in fields}
    # The sizes a config may leave to the launcher: small stand-ins, the FP8 fields are checked.
    for key, value in (("num_layers", 2), ("hidden_size", 128), ("num_attention_heads", 4)):
        kwargs.setdefault(key, value)
    _construct(TransformerConfig, _objects(kwargs), ctx.spec)
    return [
        f"megatron: megatron-core {_megatron_version()} TransformerConfig accepted "
        f"{len(kwargs)} fields"
    ]


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "(unknown version)"


class MegatronAdapter(HostAdapter):
    """megatron-core (``TransformerConfig`` fields in a YAML ``model:`` section)."""

    name = "megatron"
    runtime = (
        "megatron-core builds Transformer Engine's recipe from these TransformerConfig "
        "fields (fp8_utils.get_fp8_recipe); no code of this package runs unless the "
        "training script calls nemo_fp8_plugin.hosts.megatron.build_transformer_config"
    )

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        refuse_dropped(spec, ctx.prefix if ctx is not None else "", megatron_core=stack_core(ctx))
        if ctx is not None:
            check_layer_counts(ctx)

    def spell(self, spec: RecipeSpec, ctx: HostContext | None = None, *, model=None) -> HostKeys:
        if ctx is not None:
            return _spell(spec, ctx.raw, ctx.model, stack_core(ctx))
        return _spell(spec, None, model)

    def merge(self, ctx: HostContext, keys: HostKeys) -> ApplyResult:
        from .precision_file import megatron_lm_precision_file

        # Megatron-LM's --yaml-cfg cannot carry quant_recipe: the rules go to a file instead
        return megatron_lm_precision_file(ctx, _merge(ctx, keys))

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        return _validate(result, ctx)

    def default(self, key: str, data: Mapping[str, Any]) -> Any:
        from .native import field_default

        section = section_path(data)[0]
        ddp = None if isinstance(data.get("language_model"), Mapping) else "ddp"
        return field_default(section, key, data, ddp=ddp)

    def read_native(self, ctx: HostContext) -> NativeRecipe | None:
        from .native import read_native

        return read_native(ctx)


ADAPTER = MegatronAdapter()
"""The megatron-core adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
