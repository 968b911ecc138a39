"""megatron-core: a recipe spec as ``TransformerConfig`` fields (docs/hosts/megatron.md has the
table of fields, the YAML layout and the settings megatron-core drops).

megatron-core builds its Transformer Engine recipe object itself (``fp8_utils.get_fp8_recipe``)
from these fields and passes TE only the format (and delayed scaling's history), so a spec
setting it has no field for would be dropped without a word: :func:`dropped_settings` lists
them and ``apply`` refuses them, naming the key. Scale rounding is carried by the environment
variable of :func:`nemo_fp8_plugin.hosts.te.required_env`, checked by
:func:`build_transformer_config` against the Transformer Engine of the calling process.
Fields go under ``language_model:`` (Megatron-LM's ``--yaml-cfg`` layout) or ``model:``,
never at the root, where ``fp8:`` is the plugin's request key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, List  # noqa: UP035 - see bf16_quant_recipe

from ...capabilities import CAPABILITIES, capability, te_env_read_by
from ...dotted import get_path
from ...errors import FP8ConfigError, format_value
from ...kinds import kind
from ...spec import RecipeSpec
from .. import ApplyResult, HostAdapter, HostContext, Message, NativeRecipe, Spelling, refuse_recipe
from ..te import required_env
from .dropped import dropped_settings, refuse_dropped

__all__ = [
    "FP8_RECIPE",
    "refuse_dropped",
    "stack_core",
    "dropped_settings",
    "transformer_config_fields",
    "precision_fields",
    "stack_te",
    "build_transformer_config",
    "apply_to_transformer_config",
    "quant_recipe_object",
    "bf16_quant_recipe",
    "bf16_patterns",
    "section_path",
    "check_layer_counts",
    "ddp_config_fields",
    "fp4_ddp_fields",
    "optimizer_config_fields",
    "build_ddp_config",
    "ADAPTER",
]

FP8_RECIPE = {kind: row.megatron_recipe for kind, row in CAPABILITIES.items()}
"""Spec ``scaling`` -> megatron-core ``fp8_recipe`` (for nvfp4: its ``fp4_recipe``)."""

_FIELDS = (
    "fp8",
    "fp8_recipe",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
    "fp8_param",
    "fp4",
    "fp4_recipe",
    "fp4_param",
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
)
"""``TransformerConfig`` fields the adapter writes, named by a refusal of megatron-core's."""

PRECISION_FIELDS = (*_FIELDS[:8], *_FIELDS[12:], "fp4", "fp4_recipe")
"""The fields NeMo 2's ``MegatronMixedPrecision`` and Megatron-Bridge's ``MixedPrecisionConfig``
carry under the TransformerConfig's names (both copy them onto the model config at setup)."""

CONFLICTING_FIELDS = ("fp8_quantizer_factory", "fp4", "fp4_recipe", "fp4_param", "quant_recipe")
"""Native keys that, set in an input config and not written by the recipe, contradict it."""


_NO_BF16_LAYERS = {
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0,
}


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
    spec: RecipeSpec, model: Any = None, megatron_core: str | None = None
) -> Spelling:
    """The ``TransformerConfig`` fields for ``spec`` as writes keyed by field name (its kind's
    :meth:`~nemo_fp8_plugin.kinds.Kind.megatron_fields`, the first/last BF16 layers, always
    written so a stale value cannot survive, and ``quant_recipe`` for module rules).
    ``warnings``: what megatron-core would drop (:func:`dropped_settings`) and the rules the
    rules spelling could not translate; ``env``: the variables TE must see at import."""
    if spec.training != "fp8":
        text = "training: bf16 in this recipe, so megatron-core gets no FP8 keys"
        return Spelling(warnings=[Message(text, "megatron")])
    out = Spelling(env=required_env(spec))
    for key, value in kind(spec.scaling).megatron_fields(spec).items():
        out.set(key, value)
    for key, value in _NO_BF16_LAYERS.items():
        out.set(key, value)
    out.warnings = [
        Message(f"{key}: {reason}; dropped", "megatron")
        for key, reason in dropped_settings(spec, megatron_core)
    ]
    if spec.bf16_layers.acts_on("training") and not spec.bf16_layers.empty:
        from .rules import to_megatron  # stdlib only, but not needed by every command

        out.extend(to_megatron(spec, model))
    return out


def precision_fields(
    spec: RecipeSpec, model: Any = None, *, host: str, megatron_core: str | None = None
) -> Spelling:
    """The FP8 fields of a NeMo 2 / Megatron-Bridge precision config for ``spec``
    (:data:`PRECISION_FIELDS`, the DDP ones, ``quant_recipe`` when module rules need one), as
    writes keyed by field name; what megatron-core drops is said of ``host``."""
    if spec.training != "fp8":
        text = "training: bf16 in this recipe, so its precision config gets no FP8 fields"
        return Spelling(warnings=[Message(text, host)])
    mc = transformer_config_fields(spec, model, megatron_core)
    out = Spelling(env=mc.env, warnings=[w if w.rules else w.about(host) for w in mc.warnings])
    written = {w.key: w.value for w in mc.writes}
    for key in PRECISION_FIELDS:
        if key in written:
            out.set(key, written[key])
    for key, value in ddp_config_fields(spec).items():
        out.set(key, value)
    if "quant_recipe" in written:
        out.set("quant_recipe", written["quant_recipe"])
    return out


def ddp_config_fields(spec: RecipeSpec) -> dict[str, bool]:
    """``DistributedDataParallelConfig`` kwargs for ``spec`` (its kind's
    :meth:`~nemo_fp8_plugin.kinds.Kind.ddp_fields`: ``fp8_param_gather``,
    ``reuse_grad_buf_for_mxfp8_param_ag``). Empty when training is not FP8."""
    return kind(spec.scaling).ddp_fields(spec) if spec.training == "fp8" else {}


FP4_PARAM_GATHER = "ddp.fp4_param_gather"
"""The stacks-table fact: megatron-core >= 0.18's ``DistributedDataParallelConfig.fp4_param_gather``,
without which the distributed optimizer does not all-gather (requantize) NVFP4 parameters."""


def fp4_ddp_fields(spec: RecipeSpec, megatron_core: str | None) -> dict[str, bool]:
    """``{"fp4_param_gather": fp8_param}`` for FP4 training on a megatron-core that has the
    field (the stacks table decides), else empty (0.16.1 would refuse it)."""
    from ...stacks import lookup

    if spec.training != "fp8" or capability(spec.scaling).megatron_field != "fp4_recipe":
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
    fields = kind(spec.scaling).megatron_fields(spec)
    return {
        "fp8_recipe": fields["fp8_recipe"],
        "reuse_grad_buf_for_mxfp8_param_ag": ddp_config_fields(spec)[
            "reuse_grad_buf_for_mxfp8_param_ag"
        ],
    }


def build_ddp_config(
    spec: RecipeSpec, *, config_class: Callable[..., Any] | None = None, **base: Any
) -> Any:
    """A real megatron-core ``DistributedDataParallelConfig`` (or ``config_class``) from
    ``base`` plus :func:`ddp_config_fields`; a ``base`` key the recipe decides is refused, and
    megatron-core's own ``__post_init__`` validates the result."""
    if config_class is None:
        from megatron.core.distributed import DistributedDataParallelConfig

        config_class = DistributedDataParallelConfig
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


# --------------------------------------------------------------------------- with megatron-core


def quant_recipe_object(mapping: Mapping[str, Any] | None) -> Any:
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


def bf16_quant_recipe(patterns: list[str]) -> Any:
    """megatron-core's ``RecipeConfig`` keeping the modules matching ``patterns`` (fnmatch
    globs, first match wins) in BF16: the YAML ``_target_`` NeMo-Run and Bridge configs use,
    since NeMo-Run's YAML loader passes scalars and lists but not nested mappings."""
    from .rules import quant_recipe_mapping

    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise FP8ConfigError(
            f"expected a list of glob patterns, got {format_value(patterns)}",
            key="quant_recipe.patterns",
            value=patterns,
        )
    return quant_recipe_object(quant_recipe_mapping(list(patterns)))


# NeMo-Run parses CLI/YAML values by the annotation object; a postponed (string) annotation
# is "Unsupported type", so this one is set as a real typing object.
bf16_quant_recipe.__annotations__["patterns"] = List[str]  # noqa: UP006 - NeMo-Run parses typing.List


def _objects(fields: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(fields)
    if out.get("quant_recipe") is not None:
        out["quant_recipe"] = quant_recipe_object(out["quant_recipe"])
    return out


def build_transformer_config(
    spec: RecipeSpec,
    model: Any = None,
    *,
    config_class: Callable[..., Any] | None = None,
    **base: Any,
) -> Any:
    """A real megatron-core ``TransformerConfig`` (or ``config_class``) from ``base`` model
    fields plus the recipe's FP8 fields; megatron-core's own ``__post_init__`` validates it.

    Raises :class:`FP8ConfigError` for settings megatron-core would drop, and re-raises
    megatron-core's own validation errors as :class:`FP8ConfigError` naming the field.
    """
    if config_class is None:
        from megatron.core.transformer import TransformerConfig

        config_class = TransformerConfig
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


def apply_to_transformer_config(config: Any, spec: RecipeSpec, model: Any = None) -> Any:
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


def _construct(factory: Callable[..., Any], kwargs: dict[str, Any], spec: RecipeSpec) -> Any:
    try:
        return factory(**kwargs)
    except (ValueError, AssertionError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        key = next((k for k in _FIELDS if k in msg), None)
        raise FP8ConfigError(f"megatron-core refuses recipe {spec.name!r}: {msg}", key=key) from exc


# --------------------------------------------------------------------------- YAML


def section_path(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Where TransformerConfig keys live in a config: ``language_model`` when present, else
    ``model`` (never the root, where ``fp8:`` is the plugin's request key)."""
    if isinstance(config.get("language_model"), Mapping):
        return ("language_model",)
    return ("model",)


def _fp4_gather_notes(
    spec: RecipeSpec, core: str | None, written: Mapping[str, Any]
) -> list[Message]:
    """What to do about ``fp4_param_gather`` when it was not written for FP4 parameters."""
    fp4 = capability(spec.scaling).megatron_field == "fp4_recipe"
    if not (fp4 and spec.fp8_param and spec.training == "fp8") or "fp4_param_gather" in written:
        return []
    from ...stacks import fact

    since = fact("megatron-core", FP4_PARAM_GATHER)
    minimum = since.minimum if since is not None else "0.18"
    if core is None:
        return [
            Message(
                f"NVFP4 parameters: megatron-core >= {minimum} also needs ddp.fp4_param_gather: "
                f"true (the distributed optimizer requantizes them only with it); the "
                f"megatron-core version is unknown here, pass --stack to write it",
                "megatron",
            )
        ]
    return [
        Message(
            f"megatron-core {core} has no ddp.fp4_param_gather (from {minimum}), which the "
            f"distributed optimizer needs to requantize NVFP4 parameters; keep fp8_param: false "
            f"for nvfp4 there, or use megatron-core >= {minimum}",
            "megatron",
        )
    ]


def stack_core(ctx: HostContext | None) -> str | None:
    """The megatron-core version the context assumes (``--stack``, else the installed one);
    None without a context or a stack (a mapping given in code)."""
    return ctx.assumed_version("megatron-core") if ctx is not None else None


def stack_te(ctx: HostContext | None) -> str | None:
    """The Transformer Engine version the context assumes (``--stack``, else the installed
    one); None without a context or a stack."""
    return ctx.assumed_version("transformer-engine") if ctx is not None else None


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


class MegatronAdapter(HostAdapter):
    """megatron-core (``TransformerConfig`` fields in a YAML ``model:`` section)."""

    name = "megatron"
    label = "megatron-core"
    runtime = (
        "megatron-core builds Transformer Engine's recipe from these TransformerConfig "
        "fields (fp8_utils.get_fp8_recipe); no code of this package runs unless the "
        "training script calls nemo_fp8_plugin.hosts.megatron.build_transformer_config"
    )
    detect_order = 50

    def detects(self, config: Mapping[str, Any]) -> bool:
        return isinstance(config.get("model"), Mapping) or isinstance(
            config.get("language_model"), Mapping
        )

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        refuse_dropped(spec, ctx.prefix if ctx is not None else "", megatron_core=stack_core(ctx))
        if ctx is not None:
            check_layer_counts(ctx)

    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> Spelling:
        """The TransformerConfig fields under their section (``language_model`` or ``model``),
        the DDP fields under ``ddp:`` (at the root of Megatron-LM's ``--yaml-cfg`` layout),
        with nvfp4's ``fp4_param_gather`` where the assumed megatron-core has it."""
        core = stack_core(ctx)
        fields = transformer_config_fields(spec, ctx.model if ctx else model, core)
        fields.env = te_env_read_by(fields.env, stack_te(ctx))  # what the stack's TE reads
        name = section_path(ctx.raw if ctx else {})[0]
        out = Spelling().extend(fields, f"{name}.")
        # A quant_recipe of our own is compared like any key; someone else's contradicts ours.
        for key in CONFLICTING_FIELDS:
            if fields.get(key) is None:
                out.guard(f"{name}.{key}", False)
        ddp = {**ddp_config_fields(spec), **fp4_ddp_fields(spec, core)}
        for key, value in ddp.items():
            out.set(f"{key}" if name == "language_model" else f"ddp.{key}", value)
        out.notes += _fp4_gather_notes(spec, core, ddp)
        out.notes += [
            Message(
                f"export {var}={value} in the training process's environment before "
                f"Transformer Engine is imported; megatron-core does not check it: a script "
                f"building its config with nemo_fp8_plugin.hosts.megatron."
                f"build_transformer_config is checked there, otherwise call "
                f"nemo_fp8_plugin.hosts.te.verify_installed_te({_recipe_literal(spec)}) in "
                f"the training script before the model is built",
                "megatron",
            )
            for var, value in fields.env.items()
        ]
        return out

    def finish(self, ctx: HostContext, result: ApplyResult) -> ApplyResult:
        from .precision_file import megatron_lm_precision_file

        # Megatron-LM's --yaml-cfg cannot carry quant_recipe: the rules go to a file instead
        return megatron_lm_precision_file(ctx, result)

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        """Build megatron-core's own ``TransformerConfig`` from the written section (its
        ``__post_init__`` validates the FP8 fields), when megatron-core is importable."""
        try:
            from megatron.core.transformer import TransformerConfig
        except ImportError as exc:
            return [f"megatron: not checked (megatron-core is not importable here: {exc})"]
        from importlib.metadata import PackageNotFoundError, version

        section = result.data.get(section_path(result.data)[0]) or {}
        fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        kwargs = {k: v for k, v in section.items() if k in fields}
        # The sizes a config may leave to the launcher: small stand-ins, the FP8 fields checked.
        for key, value in (("num_layers", 2), ("hidden_size", 128), ("num_attention_heads", 4)):
            kwargs.setdefault(key, value)
        _construct(TransformerConfig, _objects(kwargs), ctx.spec)
        try:
            core = version("megatron-core")
        except PackageNotFoundError:
            core = "(unknown version)"
        return [f"megatron: megatron-core {core} TransformerConfig accepted {len(kwargs)} fields"]

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
