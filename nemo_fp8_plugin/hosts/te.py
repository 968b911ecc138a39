"""Transformer Engine: a recipe spec as a TE recipe object, and the fp32-scale trap
(docs/hosts/te.md).

TE has one recipe class per scaling kind (:mod:`nemo_fp8_plugin.kinds` answers its fields).
Building them by hand is unsafe for two reasons: TE's recipe dataclasses accept unknown
keyword arguments silently (so :func:`build_te_recipe` reads every field back), and the
quantizer parameters of current and block scaling are *class* attributes fixed at TE import
from ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` / ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` (and
NVFP4's from ``NVTE_NVFP4_*``; TE >= 2.15 also reads ``NVTE_BACKWARD_OVERRIDE``). Objects
built here carry per-instance quantizer parameters; for objects a host builds itself
(megatron-core, hence NeMo 2 and Bridge) the variable must be in the training process's
environment before TE is imported: :func:`required_env` names it and
:func:`verify_installed_te` checks the TE of the calling process (the callbacks, Bridge's
registered recipes and :func:`~nemo_fp8_plugin.hosts.megatron.build_transformer_config` call
it). Nothing here imports TE at module level.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..capabilities import (
    CAPABILITIES,
    ENV_BACKWARD_OVERRIDE,
    ENV_BLOCK_FP32_SCALES,
    ENV_CURRENT_POW2_SCALES,
    ENV_NVFP4,
    capability,
    nvfp4_te_fields,
    te_env,
    te_env_read_by,
)
from ..errors import FP8ConfigError, HostUnavailableError
from ..kinds import kind
from ..spec import RecipeSpec
from ..stacks import fact as _host_fact
from ..stacks import installed_version
from . import ApplyResult, HostAdapter, HostContext, Message, Spelling

if TYPE_CHECKING:
    from ..stacks import HostFact

__all__ = [
    "TE_RECIPE_CLASS",
    "ENV_BLOCK_FP32_SCALES",
    "ENV_CURRENT_POW2_SCALES",
    "QUANTIZER_ROLES",
    "te_recipe_description",
    "required_env",
    "import_te_recipe_module",
    "build_te_recipe",
    "recipe_mismatches",
    "host_built_recipe",
    "verify_host_recipe",
    "verify_installed_te",
    "FP8_WGRAD_IGNORED",
    "ENV_BACKWARD_OVERRIDE",
    "TEAdapter",
    "ADAPTER",
]

TE_RECIPE_CLASS = {kind: row.te_class for kind, row in CAPABILITIES.items()}
"""Spec ``scaling`` -> name of the TE recipe class in ``transformer_engine.common.recipe``."""


QUANTIZER_ROLES = {
    "fp8_quant_fwd_inp": "input",
    "fp8_quant_fwd_weight": "weight",
    "fp8_quant_bwd_grad": "grad_output",
}
"""TE quantizer-parameter attribute -> the GEMM operand role it quantizes."""

NVFP4_QUANTIZERS = ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")
"""``NVFP4BlockScaling``'s per-role quantizer parameters (derived from its fields)."""


def te_recipe_description(spec: RecipeSpec) -> dict[str, Any]:
    """The TE recipe a spec means, as plain data (no TE import).

    Returns ``{"class": name, "fields": {...}, "quantizers": {attr: {"power_2_scale": b,
    "amax_epsilon": x}}}``; ``fp8_format`` is the ``Format`` member name. ``quantizers`` is
    empty for recipes without per-role quantizer parameters (delayed, MXFP8).
    """
    the = kind(spec.scaling)
    fields = the.te_fields(spec)
    # TE >= 2.15 defaults every recipe's backward_override from NVTE_BACKWARD_OVERRIDE at
    # import; the spec's backward is FP8, so the object to build pins it off (TE < 2.15 has no
    # such field and ignores the argument: its backward is the recipe's own).
    fields["backward_override"] = None
    return {"class": the.row.te_class, "fields": fields, "quantizers": the.te_quantizers(spec)}


def required_env(spec: RecipeSpec) -> dict[str, str]:
    """Environment variables the training process needs *before* TE is imported so that a
    recipe object built by the host (megatron-core) quantizes as the spec says: the
    capability table's :func:`nemo_fp8_plugin.capabilities.te_env` (block ->
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``, tensorwise ->
    ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``, always pinned to one value)."""
    return te_env(spec)


def _unsupported(spec: RecipeSpec) -> list[tuple[str, str]]:
    """(spec key, reason) for settings TE's recipe for this scaling kind has no field for."""
    out = []
    row = capability(spec.scaling)
    if not row.te_amax_epsilon and spec.amax_epsilon:
        out.append(("amax_epsilon", f"TE's {row.te_class} has no amax epsilon"))
    if row.history and spec.pow2_scales:  # an amax history's scales are never rounded
        out.append(("pow2_scales", f"TE's {row.te_class} has no power-of-2 scale option"))
    # The spec refuses it already (row.fp8_attention: Float8BlockScaling asserts not fp8_dpa;
    # NVFP4BlockScaling takes it); kept for a spec built without its checks.
    if not row.fp8_attention and spec.fp8_dot_product_attention:
        out.append(("fp8_dot_product_attention", f"TE's {row.te_class} has no FP8 attention"))
    if not spec.fp8_wgrad:
        out.append(("fp8_wgrad", FP8_WGRAD_IGNORED))
    return out


FP8_WGRAD_IGNORED = (
    "Transformer Engine 2.x cannot run only the weight-gradient GEMM in high precision: "
    "DelayedScaling lost its override_linear_precision field (TE 2.20 accepts the argument "
    "megatron-core still passes and ignores it), and the nearest TE setting, "
    "NVTE_BACKWARD_OVERRIDE=high_precision (TE >= 2.15, refused by DelayedScaling), switches "
    "the whole backward (data and weight gradients) to high precision, a different recipe; "
    "keep fp8_wgrad: true, or set that variable yourself knowing it changes every backward GEMM"
)
"""Why ``fp8_wgrad: false`` cannot be honoured by TE (hence by every megatron-core host)."""


# --------------------------------------------------------------------------- with TE


def import_te_recipe_module() -> ModuleType:
    """``transformer_engine.common.recipe``, or :class:`HostUnavailableError`."""
    try:
        from transformer_engine.common import recipe  # lazy host import
    except ImportError as exc:
        raise HostUnavailableError(
            f"Transformer Engine is not importable here ({exc})",
            hint="install transformer-engine (GPU machines; stock NeMo containers ship it)",
        ) from None
    return recipe


def build_te_recipe(
    spec: RecipeSpec, te_recipe: ModuleType | None = None, *, te_version: str | None = None
) -> Any:
    """A TE recipe object for ``spec``, every field and quantizer parameter read back.

    ``te_recipe`` is TE's ``transformer_engine.common.recipe`` module (imported when None);
    ``te_version`` its release, for messages (read from the installed package when None).
    A field this TE's class does not declare is left out when the spec's value for it means
    "feature off" (:data:`nemo_fp8_plugin.stacks.FACTS`: an older TE behaves exactly so), and
    refused naming the version and the first release that has it otherwise.
    The quantizer parameters are set on the instance, overriding the class attributes TE
    fixed from the environment at import, so fp32 block scales take effect even when
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` was unset. Raises :class:`FP8ConfigError` when
    the spec asks for something TE cannot express, or when the built object differs from
    the spec in any field (an installed TE that ignores or renames a field).
    """
    if spec.training != "fp8":
        raise FP8ConfigError(
            "this recipe trains in BF16 (training: bf16); there is no TE training recipe to build",
            key="training",
            value=spec.training,
        )
    for key, reason in _unsupported(spec):
        raise FP8ConfigError(reason, key=key, value=getattr(spec, key))
    te_recipe = te_recipe or import_te_recipe_module()
    desc = te_recipe_description(spec)
    cls = _recipe_class(spec, te_recipe, te_version)
    absent = _absent_off_fields(spec, cls, desc["fields"], te_version)
    kwargs = {k: v for k, v in desc["fields"].items() if k not in absent}
    for name in ("fp8_format", "fp4_format"):
        if name in kwargs:
            kwargs[name] = te_recipe.Format[kwargs[name]]
    try:
        obj = cls(**kwargs)
    except (AssertionError, TypeError, ValueError) as exc:
        raise FP8ConfigError(
            f"Transformer Engine refuses {desc['class']}({_kw(desc['fields'])}): {exc}",
            key="scaling",
            value=spec.scaling,
        ) from None
    for attr, params in desc["quantizers"].items():
        if attr in NVFP4_QUANTIZERS:
            continue  # derived by NVFP4BlockScaling.__post_init__: read back below, not set
        # Recipe.__setattr__ is a plain setattr; TE's recipe states read these per instance.
        setattr(obj, attr, te_recipe.QParams(**params))
    problems = recipe_mismatches(obj, spec)
    if problems:
        raise FP8ConfigError(
            f"the Transformer Engine recipe object differs from the spec: {_render(problems)}",
            key=problems[0][0],
            hint="this TE version ignores or renames a recipe field",
        )
    return obj


def _te_label(te_version: str | None) -> str:
    version = te_version or installed_version("transformer-engine")
    return f"Transformer Engine {version}" if version else "this Transformer Engine"


def _recipe_class(spec: RecipeSpec, te_recipe: ModuleType, te_version: str | None) -> Any:
    """The TE class for ``spec``, or :class:`HostUnavailableError` naming the first release
    that has it."""
    name = capability(spec.scaling).te_class
    cls = getattr(te_recipe, name, None)
    if cls is None:
        known = _host_fact("transformer-engine", name)
        since = f" (it exists from {known.minimum})" if known is not None else ""
        raise HostUnavailableError(
            f"{_te_label(te_version)} has no recipe class {name}{since}",
            key="scaling",
            value=spec.scaling,
            hint=f"use transformer-engine >= {known.minimum}" if known else "upgrade it",
        )
    return cls


def _declares(cls: Any, name: str) -> bool:
    return name in getattr(cls, "__dataclass_fields__", {}) or hasattr(cls, name)


def _version_fact(class_name: str, name: str) -> HostFact | None:
    """The stacks table's entry for a recipe field that exists only in some TE releases."""
    return _host_fact("transformer-engine", f"{class_name}.{name}") or _host_fact(
        "transformer-engine", f"Recipe.{name}"
    )


_SPEC_KEY = {"enable_2d_quantization": "weight_block"}
"""TE field -> the spec key that sets it (for the refusal), where the names differ."""


def _absent_means_off(class_name: str, name: str, want: Any) -> bool:
    """A field the TE class lacks, whose wanted value is what its absence means."""
    known = _version_fact(class_name, name)
    return known is not None and known.off == want


def _absent_off_fields(
    spec: RecipeSpec, cls: Any, fields: Mapping[str, Any], te_version: str | None
) -> set[str]:
    """Fields of ``fields`` that ``cls`` does not declare and whose value means "off" there
    (left out of the constructor); raises :class:`FP8ConfigError` for one the spec turns on,
    naming this TE's version and the first release that has the field."""
    out = set()
    for name, want in fields.items():
        if _declares(cls, name):
            continue
        if _absent_means_off(cls.__name__, name, want):
            out.add(name)
            continue
        known = _version_fact(cls.__name__, name)
        if known is None:
            continue  # not version-dependent as far as the table knows: the read-back decides
        key = _SPEC_KEY.get(name, name)
        raise FP8ConfigError(
            f"{_te_label(te_version)} has no {cls.__name__}.{name} (it exists from "
            f"Transformer Engine {known.minimum}: {known.doc}), and recipe {spec.name!r} needs "
            f"{name}={want!r}",
            key=key,
            value=getattr(spec, key, want),
            hint=f"use transformer-engine >= {known.minimum}, or the recipe's default for {key}",
        )
    return out


def _kw(fields: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())


def _render(problems: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{attr} is {have!r}, spec needs {want!r}" for attr, have, want in problems)


_MISSING = "<missing>"
_NUMERIC_FIELDS = (
    "fp8_format",
    "use_power_2_scales",
    "x_block_scaling_dim",
    "w_block_scaling_dim",
    "grad_block_scaling_dim",
    "backward_override",
    "fp4_format",
    *ENV_NVFP4,
)


def recipe_mismatches(
    obj: Any, spec: RecipeSpec, *, check_fields: bool = True
) -> list[tuple[str, Any, Any]]:
    """Attributes of TE recipe object ``obj`` that differ from ``spec``, as
    ``(attribute, value on obj, value the spec needs)``; empty when they agree.

    Quantizer parameters are reported as ``fp8_quant_fwd_inp.power_2_scale`` and so on.
    ``check_fields=False`` compares only what decides the numerics of a host-built object
    (class, format, scale rounding, epsilon, block dims), not switches a host sets itself.
    ``use_f32_scales`` is not compared: on TE 2.x it is informational, the quantizer
    parameters decide the scales.
    """
    desc = te_recipe_description(spec)
    if not any(c.__name__ == desc["class"] for c in type(obj).__mro__):
        return [("class", type(obj).__name__, desc["class"])]
    out: list[tuple[str, Any, Any]] = []
    for name, want in desc["fields"].items():
        if name == "use_f32_scales" or (not check_fields and name not in _NUMERIC_FIELDS):
            continue
        have = getattr(obj, name, _MISSING)
        if name in ("fp8_format", "fp4_format"):
            have = getattr(have, "name", have)
        if have is _MISSING and _absent_means_off(desc["class"], name, want):
            # an older TE without the field behaves as the spec asks (backward_override
            # before 2.15, NVFP4's row scaling and "4over6" before 2.16/2.17, ...)
            continue
        if have != want:
            out.append((name, have, want))
    for attr, params in desc["quantizers"].items():
        qp = getattr(obj, attr, None)
        for pname, want in params.items():
            have = getattr(qp, pname, _MISSING) if qp is not None else _MISSING
            if have != want:
                out.append((f"{attr}.{pname}", have, want))
    return out


def host_built_recipe(spec: RecipeSpec, te_recipe: ModuleType | None = None) -> Any:
    """The recipe object megatron-core 0.16 builds for this spec (``fp8_utils.get_fp8_recipe``):
    the TE class constructed with ``fp8_format`` (and ``fp8_dpa`` for current scaling) only, so
    every other parameter comes from TE's defaults, i.e. from the environment at TE import."""
    te_recipe = te_recipe or import_te_recipe_module()
    cls = getattr(te_recipe, capability(spec.scaling).te_class)
    args = kind(spec.scaling).te_host_args(spec)
    if "fp8_format" in args:
        args["fp8_format"] = te_recipe.Format[args["fp8_format"]]
    return cls(**args)


_BACKWARD_MODES = {
    "high_precision": "in high precision (the original BF16 operands) instead of FP8",
    "dequantized": "on dequantized operands in high precision instead of FP8",
}


def backward_override_default(cls: Any) -> Any:
    """The ``backward_override`` a TE recipe class defaults to (TE >= 2.15 reads it from
    ``NVTE_BACKWARD_OVERRIDE`` when TE is imported), or None (unset, or an older TE)."""
    field = getattr(cls, "__dataclass_fields__", {}).get("backward_override")
    if field is not None:
        return field.default
    return getattr(cls, "backward_override", None)


def _refuse_backward_override(spec: RecipeSpec, te_recipe: ModuleType, where: str) -> None:
    cls = getattr(te_recipe, capability(spec.scaling).te_class, None)
    value = backward_override_default(cls)
    if value is None:
        return
    name = capability(spec.scaling).te_class
    if value not in _BACKWARD_MODES:
        effect = "which Transformer Engine rejects when the recipe is built"
    elif capability(spec.scaling).history:
        effect = "which DelayedScaling refuses (TE raises when megatron-core builds the recipe)"
    else:
        effect = (
            f"so every {name} a host builds (megatron-core passes no backward_override) "
            f"would run the whole backward {_BACKWARD_MODES[value]}"
        )
    raise FP8ConfigError(
        f"Transformer Engine in {where} was imported with {ENV_BACKWARD_OVERRIDE}={value}, "
        f"{effect}; recipe {spec.name!r} trains the backward in FP8",
        key=ENV_BACKWARD_OVERRIDE,
        value=value,
        hint=f"unset {ENV_BACKWARD_OVERRIDE} in the training process's environment before it "
        f"starts (no nemo-fp8-plugin recipe uses it)",
    )


def _refuse_nvfp4_defaults(
    spec: RecipeSpec, te_recipe: ModuleType, where: str, te_version: str | None = None
) -> None:
    """The ``NVFP4BlockScaling`` class defaults TE fixed from ``NVTE_NVFP4_*`` at import,
    against the fields the spec means (read from the class, not an instance: a bad value makes
    the constructor assert, and the variable is what to name)."""
    cls = _recipe_class(spec, te_recipe, te_version)
    declared = getattr(cls, "__dataclass_fields__", {})
    want_env = required_env(spec)
    fields = nvfp4_te_fields(spec)
    absent = _absent_off_fields(spec, cls, fields, te_version)  # no variable to set there
    for field, want in fields.items():
        if field in absent:
            continue
        have = declared[field].default if field in declared else getattr(cls, field, _MISSING)
        if have == want:
            continue
        var = ENV_NVFP4[field]
        raise FP8ConfigError(
            f"Transformer Engine in {where} would build NVFP4BlockScaling with {field}={have!r} "
            f"(fixed from {var} when TE was imported; {var}={os.environ.get(var)!r} in this "
            f"process now), but recipe {spec.name!r} needs {field}={want!r}",
            key=var,
            value=os.environ.get(var),
            hint=f"set {var}={want_env[var]} in the training process's environment before it "
            f"starts (NeMo RL: policy.megatron_cfg.env_vars; NeMo-Run: executor env_vars; "
            f"Megatron-Bridge / torchrun: the launch script)",
        )


def verify_host_recipe(
    spec: RecipeSpec,
    te_recipe: ModuleType | None = None,
    *,
    where: str = "the training process",
    te_version: str | None = None,
) -> None:
    """Fail fast when TE, as imported in this process, would build a host-built recipe that
    differs from ``spec``: an ``NVTE_BACKWARD_OVERRIDE`` read at import (TE >= 2.15, every
    recipe), the wrong scale rounding (the fp32-scale trap, block and current scaling), or
    ``NVFP4BlockScaling`` class defaults fixed from another ``NVTE_NVFP4_*`` value (nvfp4).
    Call it inside the training process before the first step; raises
    :class:`FP8ConfigError` naming the variable and the fix. A field this TE lacks whose spec
    value means "off" passes (an older TE behaves so); one the spec turns on is refused naming
    ``te_version`` (the installed release when None) and the first release that has it."""
    if spec.training != "fp8":
        return
    te_recipe = te_recipe or import_te_recipe_module()
    _refuse_backward_override(spec, te_recipe, where)
    check = kind(spec.scaling).te_check
    if check == "nvfp4":
        _refuse_nvfp4_defaults(spec, te_recipe, where, te_version)
        return
    if check == "tiles":
        # megatron-core builds the recipe with the format only: the TE must at least be able
        # to express the spec's tiles.
        _absent_off_fields(spec, _recipe_class(spec, te_recipe, te_version), _mx(spec), te_version)
    if check != "scales":
        return
    obj = host_built_recipe(spec, te_recipe)
    problems = recipe_mismatches(obj, spec, check_fields=False)
    scale = [p for p in problems if p[0].endswith(("power_2_scale", "use_power_2_scales"))]
    if scale:
        var, value = next(iter(required_env(spec).items()))
        now = os.environ.get(var)
        want = "power-of-2" if spec.pow2_scales else "fp32"
        raise FP8ConfigError(
            f"Transformer Engine in {where} would quantize {capability(spec.scaling).te_class} with "
            f"the wrong scales ({_render(scale)}): recipe {spec.name!r} needs {want} scales, and "
            f"TE fixed its quantizer parameters from {var} when it was imported ({var}={now!r} "
            f"in this process now)",
            key="pow2_scales",
            value=spec.pow2_scales,
            hint=f"set {var}={value} in the training process's environment before it starts "
            f"(NeMo-Run: executor env_vars; NeMo RL: policy.megatron_cfg.env_vars; "
            f"Megatron-Bridge / torchrun: export it in the launch script)",
        )
    if problems:
        attr = problems[0][0]
        raise FP8ConfigError(
            f"megatron-core builds {capability(spec.scaling).te_class} with TE's defaults, which "
            f"differ from the spec ({_render(problems)})",
            key="amax_epsilon"
            if "amax_epsilon" in attr
            else "fp8_format"
            if attr == "fp8_format"
            else "activation_block",
            hint="use the preset's values for these fields with megatron-core based hosts",
        )


def _mx(spec: RecipeSpec) -> dict[str, Any]:
    fields: dict[str, Any] = te_recipe_description(spec)["fields"]
    return {"enable_2d_quantization": fields["enable_2d_quantization"]}


def verify_installed_te(
    spec: RecipeSpec | str | Mapping[str, Any], *, where: str = "the training process"
) -> bool:
    """:func:`verify_host_recipe` against the Transformer Engine of *this* process; call it
    in the training process before the model is built. Returns False, checking nothing,
    when TE is not importable (emulation, CPU: no TE recipe will be built) or the recipe
    does not train in FP8; True when the check passed; raises :class:`FP8ConfigError`
    naming the environment variable otherwise. Every FP8 recipe is checked: TE >= 2.15 fixes
    each recipe class's ``backward_override`` at import. ``spec`` may be a recipe name, a
    ``{"recipe": name, ...overrides}`` mapping or a full spec mapping (as the callbacks take)."""
    from ..registry import get_recipe

    spec = get_recipe(spec)
    if spec.training != "fp8":
        return False
    try:
        from transformer_engine.common import recipe as te_recipe
    except ImportError:
        return False
    verify_host_recipe(spec, te_recipe, where=where)
    return True


# --------------------------------------------------------------------------- adapter contract


class TEAdapter(HostAdapter):
    """Transformer Engine itself, for scripts that build their own recipe object: the output
    is a new document describing the recipe (class, fields, quantizer parameters, env), not
    an edit of the input config (``apply --host te`` on any config: its keys stay as they
    are, so a config of any host may be described)."""

    name = "te"
    label = "Transformer Engine"
    runtime = (
        "your script constructs Transformer Engine's recipe from this description; "
        "nemo_fp8_plugin.hosts.te.build_te_recipe builds it and reads every field back"
    )
    follows_defaults = True  # the output is a description, so a parent's request is fine
    edits_config = False

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        # Nothing: what TE has no field for is a warning of the description (its script
        # builds the object, and build_te_recipe refuses a mismatch there).
        return None

    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> Spelling:
        """The recipe class, its constructor fields and quantizer parameters, and the
        environment TE must see at import."""
        if spec.training != "fp8":
            out = Spelling(warnings=[Message("training: bf16, no TE recipe", _LABEL)])
            out.set("transformer_engine", {})
            return out
        te = ctx.assumed_version("transformer-engine") if ctx is not None else None
        out = Spelling(env=te_env_read_by(required_env(spec), te))  # what the stack's TE reads
        out.warnings = [Message(f"{k}: {why}; ignored", _LABEL) for k, why in _unsupported(spec)]
        out.set("transformer_engine", {**te_recipe_description(spec), **_env(out.env)})
        return out

    def passthrough(self, ctx: HostContext) -> None:
        raise FP8ConfigError(
            f"{ctx.path or 'the config'} asks for no FP8 recipe",
            key="precision",
            hint="add `precision: <recipe>` or an `fp8:` block",
        )

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        """Build the recipe with TE's own recipe module and read every field back."""
        try:
            te_recipe = import_te_recipe_module()
        except HostUnavailableError as exc:
            return [f"te: not checked ({exc})"]
        build_te_recipe(ctx.spec, te_recipe)
        return [f"te: {TE_RECIPE_CLASS[ctx.spec.scaling]} built and read back"]


_LABEL = "transformer-engine"


def _env(env: dict[str, str]) -> dict[str, Any]:
    return {"env": env} if env else {}


ADAPTER = TEAdapter()
"""The Transformer Engine adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
