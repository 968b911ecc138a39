"""NeMo 2 (nemo-toolkit 2.x, NeMo-Run): a recipe spec as a ``MegatronMixedPrecision`` plugin
(docs/hosts/nemo2.md has the table of arguments).

``MegatronStrategy`` copies the plugin's ``DtypeConfig`` onto ``model.config``, the optimizer
and DDP configs when it connects, overwriting what was set there, so FP8 set on
``model.config`` is lost: this adapter writes the plugin (``trainer.plugins``), and only what the
plugin has no argument for on ``model.config`` (``quant_recipe`` for per-module rules, FP4's
``fp4_param``). The TE environment variable belongs in the executor's ``env_vars``; the
scale-refresh callback checks it in the training process. The plugin alone (the plugin-only
factories, the ``apply`` block) is NeMo's own class and checks nothing
(:func:`plugin_only_warning`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...capabilities import capability, te_env_read_by
from ...dotted import get_path
from ...errors import FP8ConfigError, format_value
from ...spec import RecipeSpec
from .. import ApplyResult, HostAdapter, HostContext, Message, NativeRecipe, Spelling, refuse_recipe
from ..megatron import (
    check_layer_counts,
    precision_fields,
    refuse_dropped,
    stack_core,
    stack_te,
)

__all__ = [
    "PLUGIN_TARGET",
    "CALLBACK_TARGET",
    "plugin_fields",
    "plugin_config",
    "callback_config",
    "add_fp8_to_recipe",
    "plugin_only_warning",
    "BF16_MIXED",
]

PLUGIN_TARGET = "nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision"
"""Import path of NeMo 2's precision plugin class (the ``_target_`` NeMo-Run YAML uses)."""

CALLBACK_TARGET = "nemo_fp8_plugin.hosts.nemo2.callback.FP8ScaleRefreshCallback"
"""Import path of the Lightning callback that verifies TE at start and refreshes scales."""

CALLBACK_FACTORY = "nemo_fp8_plugin.hosts.nemo2.factories"
"""Module holding one zero-argument callback factory per recipe, ``<recipe>_callback``, for
``trainer.callbacks=[...]`` on the NeMo-Run command line."""


def _callback_factory_name(spec: RecipeSpec) -> str:
    return f"{spec.name}_callback"


BF16_MIXED = {
    "precision": "bf16-mixed",
    "params_dtype": "torch.bfloat16",
    "pipeline_dtype": "torch.bfloat16",
    "autocast_enabled": False,
    "grad_reduce_in_fp32": True,
}
"""NeMo's ``bf16_mixed()`` plugin arguments as NeMo-Run YAML, for configs that have no
plugin yet. Dtypes are import paths: NeMo-Run's YAML loader resolves ``torch.bfloat16`` to
the dtype, while the ``{_target_: torch.bfloat16, _call_: false}`` form its ``--to-yaml``
writes cannot be loaded back."""


def plugin_fields(
    spec: RecipeSpec, model: Any = None, megatron_core: str | None = None
) -> Spelling:
    """``MegatronMixedPrecision``'s FP8 arguments for ``spec`` as writes keyed by argument
    name, and the fields that go on ``model.config`` instead (keyed ``model.config.<field>``):
    ``quant_recipe`` when module rules need one (its mapping), ``fp4_param`` for FP4."""
    hk = precision_fields(spec, model, host="nemo2", megatron_core=megatron_core)
    out = Spelling(warnings=hk.warnings, env=hk.env)
    for w in hk.writes:
        out.set(f"model.config.{w.key}" if w.key == "quant_recipe" else w.key, w.value)
    if spec.training == "fp8" and capability(spec.scaling).megatron_field == "fp4_recipe":
        out.set("model.config.fp4_param", spec.fp8_param)
    return out


def _plugin_args(fields: Spelling) -> dict[str, Any]:
    return {w.key: w.value for w in fields.writes if not w.key.startswith("model.")}


QUANT_RECIPE_TARGET = "nemo_fp8_plugin.hosts.targets.bf16_quant_recipe"
"""Module-level function NeMo-Run YAML calls to build megatron-core's ``RecipeConfig`` from
the BF16 glob patterns (NeMo-Run's YAML cannot call a static method such as
``RecipeConfig.from_config_dict`` nor pass it a nested mapping); in
:mod:`nemo_fp8_plugin.hosts.targets`, the one module a ``_target_`` of this package names."""


def quant_recipe_yaml(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``model.config.quant_recipe`` as NeMo-Run YAML: a call building the ``RecipeConfig``."""
    from ..megatron import bf16_patterns

    return {"_target_": QUANT_RECIPE_TARGET, "patterns": bf16_patterns(mapping)}


# --------------------------------------------------------------------------- NeMo-Run objects


def _dtype(value: Any) -> Any:
    import torch

    if isinstance(value, str) and value.startswith("torch."):
        return getattr(torch, value.split(".", 1)[1])
    return value


def _spec_arg(spec: RecipeSpec) -> str:
    """How the callback config names the recipe: the registered name, or, when fields differ
    from that preset, the ``fp8:`` block form as a JSON string (NeMo-Run YAML passes scalars
    and lists to a constructor, not nested mappings)."""
    import json

    from ...registry import default_registry

    reg = default_registry()
    if spec.name not in reg:
        return json.dumps(spec.to_dict())
    preset, mine = reg.get(spec.name).to_dict(), spec.to_dict()
    diff = {k: v for k, v in mine.items() if k != "name" and preset.get(k) != v}
    return json.dumps({"recipe": spec.name, **diff}) if diff else spec.name


def plugin_config(
    spec: RecipeSpec, model: Any = None, base: Mapping[str, Any] | None = None
) -> Any:
    """``run.Config(MegatronMixedPrecision, ...)`` for ``spec`` on top of ``base`` arguments
    (default: NeMo's ``bf16_mixed``). Imports NeMo-Run and NeMo."""
    refuse_recipe(ADAPTER, spec)  # as apply refuses it (the plugin-only factory runs here too)
    fields = _plugin_args(plugin_fields(spec, model))
    import nemo_run as run
    from nemo.lightning.pytorch.plugins.mixed_precision import MegatronMixedPrecision

    args = {k: _dtype(v) for k, v in (base or BF16_MIXED).items()}
    return run.Config(MegatronMixedPrecision, **args, **fields)


def plugin_only_warning(spec: RecipeSpec) -> str | None:
    """What the plugin-only factory (``trainer.plugins=<module>.<recipe>``) leaves unchecked,
    or None when the recipe needs no environment variable. The factory runs in the NeMo-Run
    launcher, whose environment is not the training process's, and the plugin it returns is
    NeMo's own class, so the only in-process check is the callback."""
    from ..te import required_env

    env = required_env(spec)
    if not env:
        return None
    var, value = next(iter(env.items()))
    return (
        f"trainer.plugins={CALLBACK_FACTORY}.{spec.name} sets the precision plugin only, "
        f"and nothing in it checks {var}: set {var}={value} in the executor's env_vars (or "
        f"the shell, for --direct runs) and add trainer.callbacks=[{CALLBACK_FACTORY}."
        f"{_callback_factory_name(spec)}], which stops a run whose Transformer Engine was "
        f"imported without it (the --factory <model>_{spec.name} variants add that callback)"
    )


def callback_config(spec: RecipeSpec, **kwargs: Any) -> Any:
    """``run.Config`` of :class:`nemo_fp8_plugin.hosts.nemo2.callback.FP8ScaleRefreshCallback` for ``spec``."""
    import nemo_run as run

    from .callback import FP8ScaleRefreshCallback

    return run.Config(FP8ScaleRefreshCallback, recipe=_spec_arg(spec), **kwargs)


def add_fp8_to_recipe(
    recipe: Any, spec: RecipeSpec, model: Any = None, *, callback: bool = True
) -> Any:
    """Turn a NeMo 2 recipe (``run.Partial`` of ``llm.pretrain`` / ``llm.finetune``) into its
    FP8 variant, in place: the FP8 arguments go onto the recipe's own precision plugin
    (keeping its precision, dtypes and ``grad_reduce_in_fp32``), per-module rules onto
    ``model.config.quant_recipe``, and the scale-refresh callback into ``trainer.callbacks``.
    """
    import nemo_run as run

    refuse_recipe(ADAPTER, spec)
    spelt = plugin_fields(spec, model)
    fields = _plugin_args(spelt)
    trainer = getattr(recipe, "trainer", None)
    if trainer is None:
        raise FP8ConfigError(
            "this recipe has no trainer to carry a precision plugin", key="trainer"
        )
    plugins = getattr(trainer, "plugins", None)
    plugin = _find_plugin(plugins)
    if plugin is None:
        new = plugin_config(spec, model)
        if isinstance(plugins, list):
            plugins.append(new)
        else:
            trainer.plugins = new
    else:
        if getattr(plugin, "fp4", None) and "fp4" not in fields:  # FP4, FP8: exclusive
            from ...errors import ConflictingKeyError

            raise ConflictingKeyError(
                f"the recipe's precision plugin already sets fp4={plugin.fp4!r}",
                key="trainer.plugins.fp4",
            )
        for key, value in fields.items():
            setattr(plugin, key, value)
    quant = spelt.get("model.config.quant_recipe")
    if quant is not None:
        from ..megatron import bf16_patterns, bf16_quant_recipe

        recipe.model.config.quant_recipe = run.Config(
            bf16_quant_recipe, patterns=bf16_patterns(quant)
        )
    if spelt.get("model.config.fp4_param") is not None:
        recipe.model.config.fp4_param = spelt.get("model.config.fp4_param")
    if callback:
        callbacks = list(getattr(trainer, "callbacks", None) or [])
        callbacks.append(callback_config(spec))
        trainer.callbacks = callbacks
    return recipe


def _find_plugin(plugins: Any) -> Any:
    items = plugins if isinstance(plugins, list) else [plugins]
    for item in items:
        target = getattr(item, "__fn_or_cls__", None)
        if target is not None and getattr(target, "__name__", "") == "MegatronMixedPrecision":
            return item
    return None


# --------------------------------------------------------------------------- YAML


PLUGIN_TARGETS = frozenset(
    {
        PLUGIN_TARGET,
        "nemo.lightning.pytorch.plugins.MegatronMixedPrecision",
        "nemo.lightning.MegatronMixedPrecision",
    }
)
"""Every import path of NeMo's ``MegatronMixedPrecision`` (the class and NeMo's two
re-exports of it); ``tests/hosts/nemo2/test_nemo2_adapter.py`` resolves each to the one class."""


def _is_plugin_mapping(node: Any, *, overlay: bool = False) -> bool:
    """Whether ``node`` is NeMo's ``MegatronMixedPrecision`` block, by the exact import path
    of its ``_target_``. FP8 fields go into NeMo's own plugin only: a ``_target_`` that merely
    ends like it (``evil.MegatronMixedPrecision``) names another callable, and is refused
    rather than taken for it or passed over. ``overlay``: a ``trainer.plugins`` mapping
    without ``_target_`` is also one (the overlay on a ``--factory`` recipe's own plugin)."""
    if not isinstance(node, Mapping):
        return False
    if overlay and "_target_" not in node:
        return True
    target = node.get("_target_")
    if not isinstance(target, str):
        return False
    if target in PLUGIN_TARGETS:
        return True
    if "MegatronMixedPrecision" in target.rsplit(".", 1)[-1]:
        raise FP8ConfigError(
            f"names {format_value(target)}, not NeMo's MegatronMixedPrecision",
            key="trainer.plugins._target_",
            value=target,
            hint=f"the FP8 fields go into NeMo's own plugin: _target_: {PLUGIN_TARGET}",
        )
    return False


def _plugin_node(config: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """Where the config's ``MegatronMixedPrecision`` block is: ``("trainer.plugins.",
    None)``, ``("trainer.plugins[i].", i)`` in a list, or None (a new block goes in). Refuses
    a ``trainer`` or ``trainer.plugins`` that cannot hold the plugin."""
    trainer = config.get("trainer")
    if trainer is None:
        return None
    if not isinstance(trainer, Mapping):
        raise FP8ConfigError(
            f"expected a mapping, got {format_value(trainer)}", key="trainer", value=trainer
        )
    plugins = trainer.get("plugins")
    if isinstance(plugins, list):
        index = next((i for i, p in enumerate(plugins) if _is_plugin_mapping(p)), None)
        return None if index is None else (f"trainer.plugins[{index}].", index)
    if plugins is None:
        return None
    if _is_plugin_mapping(plugins, overlay=True):
        return "trainer.plugins.", None
    raise FP8ConfigError(
        f"is not a MegatronMixedPrecision plugin: {format_value(plugins)}",
        key="trainer.plugins",
        value=plugins,
        hint=f"NeMo 2 FP8 needs _target_: {PLUGIN_TARGET}",
    )


def _spell(spec: RecipeSpec, ctx: HostContext | None, model: Any, core: str | None) -> Spelling:
    """The FP8 arguments into the config's plugin, the ``model.config`` fields beside it.

    A config without a plugin is an overlay for ``nemo llm finetune --factory <recipe> --yaml``:
    NeMo-Run replaces a ``trainer.plugins`` mapping that names a ``_target_`` with a new object
    (the factory plugin's ``autocast_enabled``, ``grad_reduce_in_fp32`` and any other field
    are lost) and merges one without ``_target_`` into the factory's plugin, so the overlay
    gets the FP8 arguments only, every one written (the factory's plugin, not NeMo's class
    defaults, holds the values an omitted argument would keep). A plugin list gets a new
    plugin on NeMo's ``bf16_mixed`` values.

    The scale-refresh callback is not written into ``trainer.callbacks``: NeMo-Run's YAML
    loader cannot build a list of ``_target_`` mappings (it cannot load the callback list its
    own ``--to-yaml`` writes either), and a list replaces the recipe's own. A note names the
    FP8 variant factory, which adds the callback to the stock ones."""
    fields = plugin_fields(spec, model, core)
    fields.env = te_env_read_by(fields.env, stack_te(ctx))  # what the stack's TE reads
    out = Spelling(warnings=fields.warnings, env=fields.env)
    if not fields.writes:
        return out
    found = _plugin_node(ctx.raw) if ctx is not None else None
    if found is None:
        plugins = get_path(ctx.raw, "trainer.plugins") if ctx is not None else None
        if isinstance(plugins, list):
            where = f"trainer.plugins[{len(plugins)}]."
            for key, value in {"_target_": PLUGIN_TARGET, **BF16_MIXED}.items():
                out.set(where + key, value)
        else:
            where = "trainer.plugins."
    else:
        where = found[0]
    for w in fields.writes:
        if w.key == "model.config.quant_recipe":
            out.set(w.key, quant_recipe_yaml(w.value))
        else:
            out.set(w.key if w.key.startswith("model.") else where + w.key, w.value)
    args = _plugin_args(fields)
    if "fp4" not in args:  # FP4 and FP8 exclude each other
        out.guard(f"{where}fp4", False)
    # NeMo's deprecated alias; a different value would contradict fp8_param_gather.
    out.guard(f"{where}fp8_params", args.get("fp8_param_gather", spec.fp8_param))
    out.notes += [
        Message(
            f"set {var}={value} in the executor's env_vars (or the shell, for --direct runs), "
            f"and add the start-of-training check: give the FP8 variant as the factory, "
            f"--factory <stock recipe>_{spec.name} --yaml OUT, which adds it to the stock "
            f"callbacks (trainer.callbacks=[{CALLBACK_FACTORY}."
            f"{_callback_factory_name(spec)}] replaces the whole list: name every callback)",
            "nemo2",
        )
        for var, value in fields.env.items()
    ]
    return out


def _validate(result: ApplyResult, ctx: HostContext | None) -> list[str]:
    """Build NeMo's own ``MegatronMixedPrecision`` from the written plugin block (its
    constructor builds the ``DtypeConfig`` megatron-core receives), when NeMo is importable."""
    try:
        from nemo.lightning.pytorch.plugins.mixed_precision import MegatronMixedPrecision
    except Exception as exc:  # NeMo's import fails in many ways off its container
        return [f"nemo2: not checked (NeMo is not importable here: {type(exc).__name__})"]
    plugins = (result.data.get("trainer") or {}).get("plugins")
    items = plugins if isinstance(plugins, list) else [plugins]
    overlay = isinstance(plugins, Mapping) and "_target_" not in plugins
    plugin = next((p for p in items if _is_plugin_mapping(p, overlay=overlay)), None)
    if plugin is None:
        return ["nemo2: not checked (no MegatronMixedPrecision block in the output)"]
    # An overlay is checked on NeMo's bf16_mixed, the stock recipes' plugin.
    base = BF16_MIXED if overlay else {}
    kwargs = {k: _dtype(v) for k, v in {**base, **plugin}.items() if k != "_target_"}
    try:
        MegatronMixedPrecision(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise FP8ConfigError(
            f"NeMo's MegatronMixedPrecision refuses the output: {exc}", key="trainer.plugins"
        ) from None
    return [f"nemo2: MegatronMixedPrecision accepted {len(kwargs)} arguments"]


class NeMo2Adapter(HostAdapter):
    """NeMo 2 (NeMo-Run YAML; a ``MegatronMixedPrecision`` plugin in ``trainer.plugins``)."""

    name = "nemo2"
    label = "NeMo 2"
    runtime = (
        "NeMo's own MegatronMixedPrecision plugin copies these fields onto the model, "
        "optimizer and DDP configs; this package runs in training only through the "
        "<recipe>_callback factories (TE check, scale refresh)"
    )

    detect_order = 20
    serves_shapes = ("megatron",)

    def detects(self, config: Mapping[str, Any]) -> bool:
        return isinstance(config.get("trainer"), Mapping)

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        prefix = ctx.prefix if ctx is not None else ""
        refuse_dropped(
            spec,
            prefix,
            host="NeMo 2 (megatron-core)",
            training_host="NeMo 2",
            megatron_core=stack_core(ctx),
        )
        if ctx is not None:
            _plugin_node(ctx.raw)
            check_layer_counts(ctx)

    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> Spelling:
        return _spell(spec, ctx, ctx.model if ctx else model, stack_core(ctx))

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        return _validate(result, ctx)

    def default(self, key: str, data: Mapping[str, Any]) -> Any:
        from .native import argument_default

        return argument_default(key, data)

    def read_native(self, ctx: HostContext) -> NativeRecipe | None:
        from .native import read_native

        return read_native(ctx)


ADAPTER = NeMo2Adapter()
"""The NeMo 2 adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
