"""NeMo 2 (nemo-toolkit 2.x, NeMo-Run): a recipe spec as a ``MegatronMixedPrecision`` plugin.

In NeMo 2 precision lives on the trainer's precision plugin,
``nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision``:
``MegatronStrategy`` copies the plugin's ``DtypeConfig`` onto ``model.config``, the
optimizer config and the DDP config when it connects, overwriting whatever was set there.
So FP8 set on ``model.config`` is silently lost; this adapter only ever writes the plugin
(``trainer.plugins``).

===========================================  ================================================
``MegatronMixedPrecision`` argument           from the spec
===========================================  ================================================
``fp8``, ``fp8_recipe``, ``fp8_margin``,      as megatron-core's ``TransformerConfig`` fields
``fp8_amax_history_len``,                     (:mod:`nemo_fp8_plugin.hosts.megatron`)
``fp8_amax_compute_algo``, ``fp8_wgrad``,
``fp8_dot_product_attention``,
``fp8_multi_head_attention``,
``first_last_layers_bf16``,
``num_layers_at_start_in_bf16``,
``num_layers_at_end_in_bf16``
``fp8_param_gather``                          ``fp8_param`` (NeMo's name; it sets ``fp8_param`` too)
``reuse_grad_buf_for_mxfp8_param_ag``         true for MXFP8 with FP8 parameters (as NeMo's
                                              ``bf16_with_mxfp8_mixed``)
``fp4``, ``fp4_recipe``                       nvfp4: ``e2m1``, ``nvfp4`` (NeMo 2.7.3's plugin has
                                              them; ``fp8`` is null and ``fp8_recipe`` null)
``precision``, ``params_dtype``,              kept from the recipe's plugin; a new plugin gets
``pipeline_dtype``, ``autocast_enabled``,     NeMo's ``bf16_mixed`` values
``grad_reduce_in_fp32``
===========================================  ================================================

Per-module BF16 rules (``bf16_layers.modules``) have no plugin argument; they go on
``model.config.quant_recipe``, which the strategy does not overwrite. Likewise FP4 parameters
(nvfp4's ``fp8_param``): NeMo 2.7.3's ``MegatronMixedPrecision`` has ``fp4`` and
``fp4_recipe`` but no ``fp4_param``, and the strategy copies only its ``DtypeConfig`` fields,
so ``model.config.fp4_param`` (a megatron-core ``TransformerConfig`` field) is kept.

The environment variable of :func:`nemo_fp8_plugin.hosts.te.required_env` belongs in the
executor (``executor.env_vars`` in NeMo-Run, or the shell for ``--direct`` runs); nothing here
writes it. The scale-refresh callback verifies it inside the training process before the
first step; :func:`add_fp8_to_recipe` (the ``<recipe>_<fp8 recipe>`` factories) adds it to
``trainer.callbacks``. The plugin alone (:func:`plugin_config`, the plugin-only factories, the
``apply`` block) is NeMo's own ``MegatronMixedPrecision``, built in the training process
without any code of this package, so it checks nothing: :func:`plugin_only_warning` says so.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ...capabilities import capability
from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from ...spec import RecipeSpec
from .. import ApplyResult, HostAdapter, HostContext, HostKeys, NativeRecipe, recipe_keys
from ..megatron import (
    check_layer_counts,
    merge_native,
    precision_config_fields,
    refuse_dropped,
    remove_request_keys,
    stack_core,
)

__all__ = [
    "PLUGIN_TARGET",
    "CALLBACK_TARGET",
    "plugin_fields",
    "native_keys",
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

MODEL_CONFIG_FIELDS = ("quant_recipe", "fp4_param")
"""Keys of :func:`plugin_fields` that go on ``model.config``, not on the plugin."""


def plugin_fields(spec: RecipeSpec, model=None, megatron_core: str | None = None) -> HostKeys:
    """``MegatronMixedPrecision`` FP8 arguments for ``spec`` (plain data), plus the
    ``model.config`` fields of :data:`MODEL_CONFIG_FIELDS` (``quant_recipe`` when per-module
    rules need one, ``fp4_param`` for nvfp4)."""
    hk = precision_config_fields(spec, model, host="nemo2", megatron_core=megatron_core)
    if spec.training == "fp8" and capability(spec.scaling).is_nvfp4:
        hk.keys["fp4_param"] = spec.fp8_param
    return hk


def native_keys(spec: RecipeSpec, model=None) -> HostKeys:
    """NeMo 2's spelling: the ``trainer.plugins`` block (and ``model.config.quant_recipe``),
    complete as ``apply`` writes it into a config without a plugin (``MegatronMixedPrecision``
    requires ``precision``), so it can be copied as it stands."""
    return _spell(spec, model, existing_plugin=False)


def _spell(
    spec: RecipeSpec, model, *, existing_plugin: bool, megatron_core: str | None = None
) -> HostKeys:
    """The plugin block (only the FP8 fields when the config has a plugin already, whose
    precision and dtypes are kept) and the ``model.config`` fields."""
    hk = plugin_fields(spec, model, megatron_core)
    if not hk.keys:
        return hk
    fields = dict(hk.keys)
    quant = fields.pop("quant_recipe", None)
    fp4_param = fields.pop("fp4_param", None)
    plugin = (
        fields
        if existing_plugin
        else {"_target_": PLUGIN_TARGET, **copy.deepcopy(BF16_MIXED), **fields}
    )
    keys: dict[str, Any] = {"trainer": {"plugins": plugin}}
    if quant is not None:
        keys["model"] = {"config": {"quant_recipe": quant_recipe_yaml(quant)}}
    if fp4_param is not None:
        keys.setdefault("model", {}).setdefault("config", {})["fp4_param"] = fp4_param
    return HostKeys(keys=keys, warnings=hk.warnings, env=hk.env)


def _fields_of(keys: HostKeys) -> dict[str, Any]:
    """The ``MegatronMixedPrecision`` FP8 arguments of a spelling (no target, no base)."""
    plugin = keys.keys.get("trainer", {}).get("plugins", {})
    return {k: v for k, v in plugin.items() if k != "_target_" and k not in BF16_MIXED}


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


def _dtype(value):
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


def plugin_config(spec: RecipeSpec, model=None, base: Mapping[str, Any] | None = None):
    """``run.Config(MegatronMixedPrecision, ...)`` for ``spec`` on top of ``base`` arguments
    (default: NeMo's ``bf16_mixed``). Imports NeMo-Run and NeMo."""
    # Refused first, as apply refuses it (the plugin-only factory runs here too).
    fields = _fields_of(recipe_keys(ADAPTER, spec, model=model))
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


def callback_config(spec: RecipeSpec, **kwargs):
    """``run.Config`` of :class:`nemo_fp8_plugin.hosts.nemo2.callback.FP8ScaleRefreshCallback` for ``spec``."""
    import nemo_run as run

    from .callback import FP8ScaleRefreshCallback

    return run.Config(FP8ScaleRefreshCallback, recipe=_spec_arg(spec), **kwargs)


def add_fp8_to_recipe(recipe, spec: RecipeSpec, model=None, *, callback: bool = True):
    """Turn a NeMo 2 recipe (``run.Partial`` of ``llm.pretrain`` / ``llm.finetune``) into its
    FP8 variant, in place: the FP8 arguments go onto the recipe's own precision plugin
    (keeping its precision, dtypes and ``grad_reduce_in_fp32``), per-module rules onto
    ``model.config.quant_recipe``, and the scale-refresh callback into ``trainer.callbacks``.
    """
    import nemo_run as run

    keys = recipe_keys(ADAPTER, spec, model=model)
    model_config = keys.keys.get("model", {}).get("config", {})
    trainer = getattr(recipe, "trainer", None)
    if trainer is None:
        raise FP8ConfigError(
            "this recipe has no trainer to carry a precision plugin", key="trainer"
        )
    plugins = getattr(trainer, "plugins", None)
    plugin = _find_plugin(plugins)
    fields = _fields_of(keys)
    if plugin is None:
        new = plugin_config(spec, model)
        if isinstance(plugins, list):
            plugins.append(new)
        else:
            trainer.plugins = new
    else:
        if getattr(plugin, "fp4", None) and "fp4" not in fields:  # FP4, FP8: exclusive
            raise ConflictingKeyError(
                f"the recipe's precision plugin already sets fp4={plugin.fp4!r}",
                key="trainer.plugins.fp4",
            )
        for key, value in fields.items():
            setattr(plugin, key, value)
    if "quant_recipe" in model_config:
        from ..megatron import bf16_quant_recipe

        recipe.model.config.quant_recipe = run.Config(
            bf16_quant_recipe, patterns=model_config["quant_recipe"]["patterns"]
        )
    if "fp4_param" in model_config:
        recipe.model.config.fp4_param = model_config["fp4_param"]
    if callback:
        callbacks = list(getattr(trainer, "callbacks", None) or [])
        callbacks.append(callback_config(spec))
        trainer.callbacks = callbacks
    return recipe


def _find_plugin(plugins):
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


def _is_plugin_mapping(node: Any) -> bool:
    """Whether ``node`` is NeMo's ``MegatronMixedPrecision`` block, by the exact import path
    of its ``_target_``. FP8 fields go into NeMo's own plugin only: a ``_target_`` that merely
    ends like it (``evil.MegatronMixedPrecision``) names another callable, and is refused
    rather than taken for it or passed over."""
    if not isinstance(node, Mapping):
        return False
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
    if _is_plugin_mapping(plugins):
        return "trainer.plugins.", None
    raise FP8ConfigError(
        f"is not a MegatronMixedPrecision plugin: {format_value(plugins)}",
        key="trainer.plugins",
        value=plugins,
        hint=f"NeMo 2 FP8 needs _target_: {PLUGIN_TARGET}",
    )


def _merge(ctx: HostContext, keys: HostKeys) -> ApplyResult:
    """Write the spelling: the FP8 fields into the config's plugin (a new one, NeMo's
    ``bf16_mixed`` values, when it has none), the ``model.config`` fields beside it.

    The scale-refresh callback is not written into ``trainer.callbacks``: NeMo-Run's YAML
    loader cannot build a list of ``_target_`` mappings (it cannot load the callback list its
    own ``--to-yaml`` writes either). A note gives the command-line form instead."""
    spec = ctx.spec
    fields = _fields_of(keys)
    out = remove_request_keys(ctx.raw, ctx.request.keys)
    trainer = out.setdefault("trainer", {})
    if not isinstance(trainer, dict):
        raise FP8ConfigError(
            f"expected a mapping, got {format_value(trainer)}", key="trainer", value=trainer
        )
    found = _plugin_node(out)
    block = keys.keys.get("trainer", {}).get("plugins", {})
    if found is None:
        new = {"_target_": PLUGIN_TARGET, **copy.deepcopy(BF16_MIXED), **copy.deepcopy(block)}
        if isinstance(trainer.get("plugins"), list):
            trainer["plugins"].append(new)
            where = f"trainer.plugins[{len(trainer['plugins']) - 1}]."
        else:
            trainer["plugins"] = new
            where = "trainer.plugins."
        plugin = new
    else:
        where, index = found
        plugin = trainer["plugins"] if index is None else trainer["plugins"][index]
    # NeMo's deprecated alias; a different value would contradict fp8_param_gather.
    if "fp8_params" in plugin and plugin["fp8_params"] not in (
        None,
        fields.get("fp8_param_gather", spec.fp8_param),
    ):
        raise ConflictingKeyError(
            f"already set to {format_value(plugin['fp8_params'])}",
            key=f"{where}fp8_params",
            value=plugin["fp8_params"],
        )
    merge_native(plugin, fields, where=where, conflicting=() if "fp4" in fields else ("fp4",))
    model_fields = keys.keys.get("model", {}).get("config", {})
    if model_fields:
        model = out.setdefault("model", {})
        cfg = model.setdefault("config", {}) if isinstance(model, dict) else None
        if not isinstance(cfg, dict):
            raise FP8ConfigError(
                "cannot place per-module rules or fp4_param: model.config is not a mapping",
                key="model.config",
            )
        merge_native(cfg, model_fields, where="model.config.")
    notes = [
        f"nemo2: set {var}={value} in the executor's env_vars (or the shell, for "
        f"--direct runs), and add the start-of-training check: "
        f"trainer.callbacks=[{CALLBACK_FACTORY}.{_callback_factory_name(spec)}]"
        for var, value in keys.env.items()
    ]
    return ApplyResult(data=out, warnings=list(keys.warnings), notes=notes, env=dict(keys.env))


def _validate(result: ApplyResult, ctx) -> list[str]:
    """Build NeMo's own ``MegatronMixedPrecision`` from the written plugin block (its
    constructor builds the ``DtypeConfig`` megatron-core receives), when NeMo is importable."""
    try:
        from nemo.lightning.pytorch.plugins.mixed_precision import MegatronMixedPrecision
    except Exception as exc:  # NeMo's import fails in many ways off its container
        return [f"nemo2: not checked (NeMo is not importable here: {type(exc).__name__})"]
    plugins = (result.data.get("trainer") or {}).get("plugins")
    items = plugins if isinstance(plugins, list) else [plugins]
    plugin = next((p for p in items if _is_plugin_mapping(p)), None)
    if plugin is None:
        return ["nemo2: not checked (no MegatronMixedPrecision block in the output)"]
    kwargs = {k: _dtype(v) for k, v in plugin.items() if k != "_target_"}
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
    runtime = (
        "NeMo's own MegatronMixedPrecision plugin copies these fields onto the model, "
        "optimizer and DDP configs; this package runs in training only through the "
        "<recipe>_callback factories (TE check, scale refresh)"
    )

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

    def spell(self, spec: RecipeSpec, ctx: HostContext | None = None, *, model=None) -> HostKeys:
        if ctx is None:
            return _spell(spec, model, existing_plugin=False)
        return _spell(
            spec,
            ctx.model,
            existing_plugin=_plugin_node(ctx.raw) is not None,
            megatron_core=stack_core(ctx),
        )

    def merge(self, ctx: HostContext, keys: HostKeys) -> ApplyResult:
        return _merge(ctx, keys)

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
