"""Megatron-Bridge: the recipes in Bridge's mixed-precision registry, and its YAML block
(docs/hosts/bridge.md has the table of fields).

Bridge resolves ``mixed_precision: <name>`` through ``MIXED_PRECISION_RECIPES`` when the
config is finalized; ``MixedPrecisionConfig.setup`` then pushes the fields onto the model,
optimizer and DDP configs, so precision belongs in ``mixed_precision`` only. Bridge has no
plugin discovery: the training script calls :func:`register` (``import
nemo_fp8_plugin.hosts.bridge as fp8; fp8.register()``), which adds every recipe with Bridge's
own ``register`` decorator and allows exactly the ``_target_`` callables of
:mod:`nemo_fp8_plugin.hosts.targets`. Bridge's own named recipes with the fields of one of ours
(``bf16_with_mxfp8_mixed`` is ``mxfp8``: :mod:`.recipes` reads them from Bridge's source) are
that recipe; ``apply`` writes the ``MixedPrecisionConfig`` block for every recipe, the one
form stock Bridge builds for all of them. Per-module BF16 rules go to ``quant_recipe`` of the model's
TransformerConfig (``model`` for a provider, ``model.transformer`` for a
``GPTModelConfig``). The TE environment variable must be exported by the launch script;
the recipes :func:`register` adds and
:class:`~nemo_fp8_plugin.hosts.bridge.callback.FP8ScaleRefreshBridgeCallback` check it in the
training process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ...capabilities import capability, te_env_read_by
from ...dotted import child_mapping
from ...errors import ConflictingKeyError, FP8ConfigError, RecipeRegistryError, format_value
from ...spec import RecipeSpec
from .. import (
    ApplyResult,
    HostAdapter,
    HostContext,
    Message,
    NativeRecipe,
    Spelling,
    refuse_recipe,
)
from ..megatron import (
    check_layer_counts,
    precision_fields,
    refuse_dropped,
    stack_core,
    stack_te,
)

__all__ = [
    "MIXED_PRECISION_TARGET",
    "MIXED_PRECISION_TARGETS",
    "TARGET_PREFIX",
    "ALLOWED_TARGETS",
    "QUANT_RECIPE_TARGET",
    "mixed_precision_fields",
    "mixed_precision_config",
    "register",
    "transformer_config_of",
    "transformer_config_path",
    "transformer_section",
]

MIXED_PRECISION_TARGET = "megatron.bridge.training.mixed_precision.MixedPrecisionConfig"
"""Import path of Bridge's ``MixedPrecisionConfig`` (the ``_target_`` of the YAML block)."""

MIXED_PRECISION_TARGETS = frozenset(
    {MIXED_PRECISION_TARGET, "megatron.bridge.training.config.MixedPrecisionConfig"}
)
"""Every import path of that class (Bridge's ``training.config`` re-exports it): the only
``_target_`` a ``mixed_precision`` block the FP8 fields are merged into may name."""

TARGET_PREFIX = "nemo_fp8_plugin.hosts.targets"
"""The module :func:`register` allows as a ``_target_`` prefix on a Bridge without an exact
allow-list (:mod:`nemo_fp8_plugin.hosts.targets` imports nothing, so nothing but its own
callables lies under it)."""

QUANT_RECIPE_TARGET = f"{TARGET_PREFIX}.bf16_quant_recipe"
"""The ``_target_`` of the ``quant_recipe`` the YAML carries per-module BF16 rules in."""

ALLOWED_TARGETS = (QUANT_RECIPE_TARGET, f"{TARGET_PREFIX}.mixed_precision_config")
"""The exact ``_target_`` values :func:`register` adds to Bridge's allow-list: the callables of
:mod:`nemo_fp8_plugin.hosts.targets` (``tests/test_targets.py`` checks they match)."""


def _dtype(name: str) -> dict[str, Any]:
    return {"_target_": f"torch.{name}", "_call_": False}


def base_fields(base: str = "bf16") -> dict[str, Any]:
    """Bridge's ``bf16_mixed`` / ``fp16_mixed`` fields as Bridge YAML (a dtype as
    ``{_target_: torch.bfloat16, _call_: false}``, Bridge's own YAML spelling); a new dict
    on every call so no two YAML nodes share an object (PyYAML would emit anchors)."""
    if base == "fp16":
        return {
            "bf16": False,
            "fp16": True,
            "params_dtype": _dtype("float16"),
            "pipeline_dtype": _dtype("float16"),
            "autocast_enabled": False,
            "grad_reduce_in_fp32": False,
        }
    return {
        "bf16": True,
        "fp16": False,
        "params_dtype": _dtype("bfloat16"),
        "pipeline_dtype": _dtype("bfloat16"),
        "autocast_enabled": False,
        "grad_reduce_in_fp32": True,
    }


_BASE_NAMES = {
    "bf16_mixed": "bf16",
    "bf16-mixed": "bf16",
    "fp16_mixed": "fp16",
    "fp16-mixed": "fp16",
}

BRIDGE_RECIPES = {"nvfp4": "bf16_with_nvfp4_mixed"}
"""Plugin recipe -> the Megatron-Bridge recipe (0.6.2 and HEAD) :func:`register` starts from
and does not register a duplicate of (``tests/hosts/bridge/test_bridge_names.py`` checks the
two are the same recipe)."""


def mixed_precision_fields(
    spec: RecipeSpec, model: Any = None, megatron_core: str | None = None
) -> Spelling:
    """Bridge ``MixedPrecisionConfig`` FP8 fields for ``spec`` as writes keyed by field name,
    plus ``quant_recipe`` (for the model's TransformerConfig) when module rules need one; for
    FP4 also ``fp4_param_gather`` (Bridge's name for FP4 parameters, kept in sync with
    ``fp4_param``)."""
    hk = precision_fields(spec, model, host="bridge", megatron_core=megatron_core)
    if spec.training == "fp8" and capability(spec.scaling).megatron_field == "fp4_recipe":
        hk.set("fp4_param_gather", spec.fp8_param)
    return hk


def _own_recipe_key(spec: RecipeSpec) -> str:
    """The key of :data:`BRIDGE_RECIPES` a spec is looked up by: its scaling kind for nvfp4
    (any nvfp4 spec may be Bridge's recipe), else its name."""
    return "nvfp4" if capability(spec.scaling).megatron_field == "fp4_recipe" else spec.name


def _base_name(current: Any) -> str | None:
    """The base (``"bf16"``, ``"fp16"``) of a ``mixed_precision:`` naming Bridge's base recipe
    or one of Bridge's recipes (:func:`_refuse_block` has made sure it is the request's)."""
    if not isinstance(current, str):
        return None
    from .recipes import base_of, recipe_fields

    theirs = recipe_fields(current)
    return _BASE_NAMES.get(current) or (base_of(theirs) if theirs is not None else None)


def _spell(spec: RecipeSpec, ctx: HostContext | None, model: Any, core: str | None) -> Spelling:
    """``mixed_precision`` for the config (a new block on the config's base recipe, or only
    the FP8 fields into the config's own block) and ``quant_recipe`` into the model's
    TransformerConfig section. Every recipe gets the block: Bridge registers names for some
    (never ``fp8_blockwise``, nor a recipe with BF16 layers or module rules), and a stock
    Bridge builds the block for all of them."""
    fields = mixed_precision_fields(spec, model, core)
    fields.env = te_env_read_by(fields.env, stack_te(ctx))  # what the stack's TE reads
    out = Spelling(warnings=fields.warnings, env=fields.env)
    if not fields.writes:
        return out
    current = _current_block(ctx) if ctx is not None else None
    args = {w.key: w.value for w in fields.writes if w.key != "quant_recipe"}
    base_name = _base_name(current)
    if isinstance(current, Mapping):
        for key, value in args.items():
            out.set(f"mixed_precision.{key}", value)
        if "fp4" not in args:  # FP4 and FP8 exclude each other
            out.guard("mixed_precision.fp4", False)
        out.guard("mixed_precision.fp8_param", spec.fp8_param)
    else:
        if base_name is not None:  # a recipe's name: its block takes its place
            out.set("mixed_precision", {}, checked=False)
        block = {"_target_": MIXED_PRECISION_TARGET, **base_fields(base_name or "bf16"), **args}
        for key, value in block.items():
            out.set(f"mixed_precision.{key}", value)
    quant = fields.get("quant_recipe")
    if quant is not None:
        model_yaml = ctx.raw.get("model") if ctx is not None else None
        on_config = isinstance(model_yaml, Mapping) and _is_model_config_yaml(model_yaml)
        where = "model.transformer" if on_config else "model"
        out.set(f"{where}.quant_recipe", _quant_recipe_yaml(quant))
    out.notes += [
        Message(
            f"export {var}={value} in the launch script (Bridge's env_vars are applied after "
            f"Transformer Engine is imported); stock Bridge builds this block without checking "
            f"it: pass nemo_fp8_plugin.hosts.bridge.callback.FP8ScaleRefreshBridgeCallback to "
            f"pretrain/finetune to verify it at start",
            "bridge",
        )
        for var, value in fields.env.items()
    ]
    return out


def _current_block(ctx: HostContext) -> Any:
    """The config's ``mixed_precision`` the FP8 fields go into (None when the request itself
    was a ``mixed_precision:`` naming one of our recipes: it is replaced)."""
    if ctx.request is None or "mixed_precision" in ctx.request.keys:
        return None
    return ctx.raw.get("mixed_precision")


def _quant_recipe_yaml(mapping: Mapping[str, Any]) -> dict[str, Any]:
    from ..megatron import bf16_patterns

    return {"_target_": QUANT_RECIPE_TARGET, "patterns": bf16_patterns(mapping)}


# --------------------------------------------------------------------------- with Bridge


def _mp_module(mp_module: ModuleType | None) -> ModuleType:
    if mp_module is not None:
        return mp_module
    try:
        from megatron.bridge.training import mixed_precision
    except ImportError as exc:
        from ...errors import HostUnavailableError

        raise HostUnavailableError(
            f"Megatron-Bridge is not importable here ({exc})",
            hint="pip install megatron-bridge (needs Transformer Engine)",
        ) from None
    return mixed_precision


def mixed_precision_config(
    spec: RecipeSpec | str | Mapping, model: Any = None, *, mp_module: ModuleType | None = None
) -> Any:
    """Bridge's own ``MixedPrecisionConfig`` for ``spec``: Bridge's ``bf16_mixed()`` with the
    recipe's FP8 fields set on it. ``mp_module`` is Bridge's ``mixed_precision`` module
    (imported when None). Also usable as a YAML ``_target_`` with ``spec: <name or mapping>``.

    Bridge calls this in the training process (config finalize), so when Transformer Engine
    is importable here its import-time scale defaults are checked against the recipe
    (:func:`nemo_fp8_plugin.hosts.te.verify_installed_te`): a missing
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` raises :class:`FP8ConfigError` before training."""
    from ...registry import get_recipe
    from ..te import verify_installed_te

    spec = get_recipe(spec)
    refuse_recipe(ADAPTER, spec)  # the refusals apply makes
    verify_installed_te(spec, where="the Megatron-Bridge training process")
    mp = _mp_module(mp_module)
    own = BRIDGE_RECIPES.get(_own_recipe_key(spec))
    # Start from Bridge's own recipe where it has one (nvfp4: bf16_with_nvfp4_mixed).
    cfg = getattr(mp, own)() if own and hasattr(mp, own) else mp.bf16_mixed()
    for w in mixed_precision_fields(spec, model).writes:
        if w.key != "quant_recipe":  # a model field, not a mixed-precision one
            setattr(cfg, w.key, w.value)
    return cfg


def register(
    mp_module: ModuleType | None = None,
    *,
    names: list[str] | None = None,
    instantiate_module: ModuleType | None = None,
) -> list[str]:
    """Register recipes (default: every recipe of the plugin's registry) into Bridge's
    ``MIXED_PRECISION_RECIPES`` with Bridge's ``register`` decorator, and allow the
    :data:`ALLOWED_TARGETS` ``_target_`` values. Idempotent; a name another package already
    registered is refused with :class:`RecipeRegistryError` naming both. Returns the names
    added (aliases included).

    ``mp_module`` / ``instantiate_module``: Bridge's ``training.mixed_precision`` and
    ``utils.instantiate_utils`` modules (imported when None).
    """
    from ...registry import list_recipes

    mp = _mp_module(mp_module)
    table = mp.MIXED_PRECISION_RECIPES
    # A recipe Bridge already registers under its own name (nvfp4: bf16_with_nvfp4_mixed) is
    # not registered twice.
    wanted = (
        names
        if names is not None
        else [s.name for s in list_recipes() if BRIDGE_RECIPES.get(_own_recipe_key(s)) is None]
    )
    added: list[str] = []
    for name in wanted:
        factory = _bridge_factory(name, mp)
        aliases = {name, name.replace("_", "-")}
        for alias in sorted(aliases):
            other = table.get(alias)
            if other is not None and not getattr(other, "_nemo_fp8_recipe", None) == name:
                where = (
                    f"{getattr(other, '__module__', '?')}.{getattr(other, '__qualname__', other)}"
                )
                raise RecipeRegistryError(
                    f"Megatron-Bridge mixed-precision recipe {alias!r} is defined twice: by {where} "
                    f"and by nemo-fp8-plugin",
                    key=alias,
                    hint="rename one of the recipes",
                )
        before = set(table)
        mp.register(factory)
        added += sorted(set(table) - before)
    _allow_target_prefix(instantiate_module)
    return added


def _bridge_factory(name: str, mp: ModuleType) -> Callable[[], Any]:
    def factory() -> Any:
        from ...registry import get_recipe

        return mixed_precision_config(get_recipe(name), mp_module=mp)

    # Bridge's register() keys the table by __name__ (plus the hyphenated alias).
    factory.__name__ = factory.__qualname__ = name
    factory.__module__ = __name__
    factory.__doc__ = f"nemo-fp8-plugin recipe {name!r} as a Megatron-Bridge MixedPrecisionConfig."
    factory._nemo_fp8_recipe = name  # type: ignore[attr-defined]  # a marker on the function
    return factory


def _allow_target_prefix(instantiate_module: ModuleType | None) -> None:
    if instantiate_module is None:
        try:
            from megatron.bridge.utils import instantiate_utils

            instantiate_module = instantiate_utils
        except ImportError as exc:
            from ...errors import HostUnavailableError

            raise HostUnavailableError(
                f"Megatron-Bridge's instantiate_utils is not importable ({exc})"
            ) from None
    # Exact callables where Bridge has the exact list (0.6.2: megatron-core's
    # target_allowlist.add_exact); else the one module holding only them. Never the package
    # prefix: it would allow nemo_fp8_plugin.<module>.os.system.
    allowlist = getattr(instantiate_module, "target_allowlist", None)
    if allowlist is not None and callable(getattr(allowlist, "add_exact", None)):
        for target in ALLOWED_TARGETS:
            allowlist.add_exact(target)
    else:
        instantiate_module.register_allowed_target_prefix(TARGET_PREFIX)


# --------------------------------------------------------------------------- ConfigContainer.model


def _has_transformer_field(model_cfg: Any) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(model_cfg) and any(
        f.name == "transformer" for f in dataclasses.fields(model_cfg)
    )


def transformer_config_of(model_cfg: Any) -> Any:
    """The megatron-core ``TransformerConfig`` of a Bridge ``ConfigContainer.model``: the
    object itself for a model provider (``GPTModelProvider`` subclasses ``TransformerConfig``),
    its ``.transformer`` for a ``GPTModelConfig`` / ``HybridModelConfig`` (Megatron-LM's
    ``megatron.training.models``, which Bridge 0.6.2 accepts too). Reads the dataclass field,
    not the attribute proxy, so the answer never depends on which names happen to proxy."""
    if _has_transformer_field(model_cfg):
        return object.__getattribute__(model_cfg, "transformer")
    return model_cfg


def transformer_config_path(model_cfg: Any) -> str:
    """``"model.transformer"`` or ``"model"``: where :func:`transformer_config_of` found it,
    as a config path for messages."""
    return "model.transformer" if _has_transformer_field(model_cfg) else "model"


def _is_model_config_yaml(model: Mapping[str, Any]) -> bool:
    target = model.get("_target_")
    return "transformer" in model or (
        isinstance(target, str) and target.rsplit(".", 1)[-1].endswith("ModelConfig")
    )


def transformer_section(config: dict) -> tuple[dict, str]:
    """``(mapping, dotted prefix)`` of the TransformerConfig fields in a Bridge YAML mapping
    (created when absent): ``model.transformer`` when ``model`` is a GPTModelConfig /
    HybridModelConfig (a ``transformer:`` mapping, or a ``_target_`` naming a ``*ModelConfig``),
    else ``model`` (a provider, itself a TransformerConfig). Per-module rules
    (``quant_recipe``) go there."""
    if config.get("model") is None:
        config["model"] = {}
    model = config["model"]
    if not isinstance(model, dict):
        raise FP8ConfigError(
            f"expected a mapping of model fields, got {format_value(model)}",
            key="model",
            value=model,
        )
    if not _is_model_config_yaml(model):
        return model, "model."
    fields = child_mapping(
        model, "transformer", what="TransformerConfig fields", where="model.transformer"
    )
    return fields, "model.transformer."


# --------------------------------------------------------------------------- YAML


def _refuse_block(spec: RecipeSpec, current: Any, model: Any = None) -> None:
    """A ``mixed_precision`` the FP8 fields cannot go into: another Bridge recipe's name, a
    block whose ``_target_`` is not Bridge's class, or anything else."""
    if isinstance(current, str):
        from .recipes import difference

        differs = None if current in _BASE_NAMES else difference(current, spec, model)
        if differs:
            said = ", ".join(f"{k}: {a!r} (the recipe: {b!r})" for k, (a, b) in differs.items())
            raise ConflictingKeyError(
                f"names Megatron-Bridge's recipe {current!r}, which is not FP8 recipe "
                f"{spec.name!r}: it sets {said}",
                key="mixed_precision",
                value=current,
                hint="state the recipe once",
            )
        if differs is None and current not in _BASE_NAMES:
            raise ConflictingKeyError(
                f"already names {current!r}, not a Megatron-Bridge recipe "
                f"(nor FP8 recipe {spec.name!r})",
                key="mixed_precision",
                value=current,
                hint="state the recipe once",
            )
    elif isinstance(current, Mapping):
        target = current.get("_target_")
        if target is not None and (
            not isinstance(target, str) or target not in MIXED_PRECISION_TARGETS
        ):
            # The fields would become keyword arguments of whatever the path names.
            raise FP8ConfigError(
                f"names {format_value(target)}, not Megatron-Bridge's MixedPrecisionConfig",
                key="mixed_precision._target_",
                value=target,
                hint=f"the FP8 fields go into Bridge's own "
                f"class: _target_: {MIXED_PRECISION_TARGET}, or no _target_",
            )
    elif current is not None:
        raise FP8ConfigError(
            f"expected a recipe name or a mapping, got {format_value(current)}",
            key="mixed_precision",
            value=current,
        )


class BridgeAdapter(HostAdapter):
    """Megatron-Bridge (a ``mixed_precision`` block of ``MixedPrecisionConfig`` fields)."""

    name = "bridge"
    label = "Megatron-Bridge"
    runtime = (
        "Megatron-Bridge's own MixedPrecisionConfig applies these fields at setup; this "
        "package runs in training only through FP8ScaleRefreshBridgeCallback, or when "
        "the script calls nemo_fp8_plugin.hosts.bridge.register()"
    )

    detect_order = 30
    serves_shapes = ("megatron",)

    def detects(self, config: Mapping[str, Any]) -> bool:
        return "mixed_precision" in config

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        prefix = ctx.prefix if ctx is not None else ""
        refuse_dropped(
            spec,
            prefix,
            host="Megatron-Bridge (megatron-core)",
            training_host="Megatron-Bridge",
            megatron_core=stack_core(ctx),
        )
        if ctx is not None:
            check_layer_counts(ctx)
            _refuse_block(spec, _current_block(ctx), ctx.model)

    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> Spelling:
        return _spell(spec, ctx, ctx.model if ctx else model, stack_core(ctx))

    def finish(self, ctx: HostContext, result: ApplyResult) -> ApplyResult:
        """``mixed_precision`` in the place of the request (or of the config's own
        ``mixed_precision``), whichever comes first in the file."""
        assert ctx.request is not None
        roots = {k for k in ctx.request.keys if k in ("precision", "fp8")} | {"mixed_precision"}
        first = next((k for k in ctx.raw if k in roots), None)
        if first is None or "mixed_precision" not in result.data:
            return result
        order = []
        for key in ctx.raw:
            if key == first:
                order.append("mixed_precision")
            if key in result.data and key != "mixed_precision":
                order.append(key)
        order += [k for k in result.data if k not in order]
        result.data = {k: result.data[k] for k in order}
        return result

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        # Bridge needs Python >= 3.12 and Transformer Engine at import: where it imports, its
        # own MixedPrecisionConfig checks the block; elsewhere say so.
        try:
            from megatron.bridge.training.mixed_precision import MixedPrecisionConfig
        except Exception as exc:  # Bridge's import needs TE and a GPU build
            return [
                f"bridge: not checked (Megatron-Bridge is not importable here: "
                f"{type(exc).__name__})"
            ]
        named = result.data.get("mixed_precision")
        block = {
            k: v for k, v in (named or {}).items() if k != "_target_" and not isinstance(v, Mapping)
        }
        try:
            MixedPrecisionConfig(**block)
        except (TypeError, ValueError, AssertionError) as exc:
            raise FP8ConfigError(
                f"Megatron-Bridge's MixedPrecisionConfig refuses the output: {exc}",
                key="mixed_precision",
            ) from None
        return [f"bridge: MixedPrecisionConfig accepted {len(block)} fields"]

    def default(self, key: str, data: Mapping[str, Any]) -> Any:
        from .native import field_default

        return field_default(key, data)

    def read_native(self, ctx: HostContext) -> NativeRecipe | None:
        from .native import read_native

        return read_native(ctx)


ADAPTER = BridgeAdapter()
"""The Megatron-Bridge adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
