"""Reading user configs: where the FP8 request lives and what it resolves to.

One line turns FP8 on, in the key each host already has:

* ``precision: fp8_blockwise`` at the root (NeMo 2, megatron-core and NeMo RL YAML);
* ``policy.precision: fp8_blockwise`` (NeMo RL's own key);
* ``mixed_precision: fp8_blockwise`` (Megatron-Bridge, once our names are registered);
* an ``fp8:`` block, a name or a mapping that starts from a name and overrides fields:
  ``fp8: {recipe: fp8_blockwise, pow2_scales: true, bf16_layers: {first: 1}}``.

A precision that is not one of our recipes but a standard one (``bfloat16``,
``bf16-mixed``, ...) passes through untouched; anything else is refused with the valid
names. When several of these keys are present they must name the same recipe.

YAML is parsed with a safe loader only. NeMo RL's ``defaults:`` chain (a parent file path,
or a list of them, relative to the file) is followed parent-first like NeMo RL does.

Over 600 lines on purpose: every way a user's file asks for FP8 (the precision keys, the
``fp8:`` block, ``defaults:`` chains) resolves here, in one order, with one set of refusals.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dotted import get_path
from .errors import LIMITS, FP8ConfigError, check_limit, format_value, suggest
from .registry import RecipeRegistry, default_registry, load_yaml_file
from .spec import RecipeSpec, normalize_hardware

__all__ = [
    "STANDARD_PRECISIONS",
    "FP8Request",
    "load_config",
    "deep_merge",
    "find_fp8_request",
    "resolve_config",
    "get_path",
    "FP8_BLOCK_EXTRA_KEYS",
    "load_config_chain",
    "load_config_files",
    "HOST_SECTIONS",
    "check_sections",
]

STANDARD_PRECISIONS = frozenset(
    {
        # torch dtypes as NeMo RL / Megatron write them
        "bfloat16",
        "bf16",
        "float16",
        "fp16",
        "half",
        "float32",
        "fp32",
        "float",
        "float64",
        "fp64",
        "double",
        "16",
        "32",
        "64",
        # Lightning precision strings (NeMo 2)
        "bf16-mixed",
        "16-mixed",
        "32-true",
        "bf16-true",
        "16-true",
        "64-true",
        "transformer-engine",
        "transformer-engine-float16",
    }
)
"""Precision values that are not FP8 recipes and pass through untouched."""

FP8_BLOCK_EXTRA_KEYS = ("recipe", "model")
"""Keys of the ``fp8:`` block besides the spec fields. ``recipe``: the registered name the
block starts from. ``model``: the model the per-layer rules resolve against (a name from
the built-in architecture table or a path to a Hugging Face ``config.json``)."""

_PRECISION_KEYS = (("precision",), ("policy", "precision"))
_BRIDGE_KEY = ("mixed_precision",)


@dataclass(frozen=True)
class FP8Request:
    """What a config asks for.

    Attributes:
        spec: the resolved, validated recipe.
        keys: dotted keys that carried the request, e.g. ``("policy.precision",)`` or
            ``("precision", "fp8")``; host adapters consume exactly these.
        model: the model the config names for per-layer resolution, or None.
        hardware: the target architecture stated by ``--hardware`` or ``fp8.hardware``
            (normalized: ``hopper``, ``blackwell``, ...), or None.
        hardware_key: where it was stated (``--hardware`` or ``fp8.hardware``), or None.
    """

    spec: RecipeSpec
    keys: tuple[str, ...]
    model: str | None = None
    hardware: str | None = None
    hardware_key: str | None = None


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Parent-first merge as OmegaConf does it: mappings merge, everything else replaces."""
    out = {k: copy.deepcopy(v) for k, v in base.items()}
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _defaults_paths(value: Any, here: Path) -> list[Path] | None:
    """Parent files named by ``defaults:``, or None when it is not a NeMo RL file chain
    (Hydra-style ``defaults:`` lists of groups are left alone)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        return None
    files = [isinstance(i, str) and _is_config_file_name(i) for i in items]
    if not any(files):
        return None  # Hydra groups (``- model: gpt``, ``_self_``): not files
    for i, item in enumerate(items):
        if not files[i]:
            # NeMo RL's loader opens every entry as a file (``str(entry)``): one that is
            # not a config file name would fail there, and must not pass unchecked here.
            raise FP8ConfigError(
                f"entry {format_value(item)} is not a config file name, but the list names "
                f"files (NeMo RL opens every entry as one)",
                key=f"defaults[{i}]" if isinstance(value, list) else "defaults",
                value=item,
                hint="write each parent as a .yaml, .yml or .json file name",
            )
    return [(here.parent / i) if not Path(i).is_absolute() else Path(i) for i in items]


_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
"""File names ``defaults:`` follows, in any letter case (NeMo RL's loader, OmegaConf, reads
any of them: JSON is YAML)."""


def _is_config_file_name(name: str) -> bool:
    return name.lower().endswith(_CONFIG_SUFFIXES)


def _read_mapping(path: Path) -> dict[str, Any]:
    """One YAML file, parsed safely; every problem an :class:`FP8ConfigError` naming it."""
    if path.is_dir():
        raise FP8ConfigError(f"{path} is a directory; name a YAML config file", value=str(path))
    if not path.exists():
        raise FP8ConfigError(f"config file not found: {path}", key=None, value=str(path))
    try:
        data = load_yaml_file(path)  # a FIFO or device is refused there, before any read
    except FP8ConfigError:
        raise
    except UnicodeDecodeError:
        raise FP8ConfigError(f"{path} is not a UTF-8 text file") from None
    except OSError:
        raise  # unreadable (permissions, I/O): the CLI names the path
    except Exception as exc:  # yaml.YAMLError and friends; the file is the user's
        msg = str(exc).replace("\n", " ")
        raise FP8ConfigError(f"{path} is not valid YAML: {msg}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise FP8ConfigError(
            f"{path} must hold a mapping at the top level, got {type(data).__name__}"
        )
    return data


class _Chain:
    """One command's walk of a ``defaults:`` chain: each file parsed once (a parent two
    children share is not read twice), and the walk bounded (``LIMITS.defaults_*``)."""

    def __init__(self) -> None:
        self.parsed: dict[Path, dict[str, Any]] = {}
        self.files: list[Path] = [Path()]  # the config's own place, then each parent read
        self.references = 0

    def read(self, path: Path) -> dict[str, Any]:
        key = path.resolve()
        if key not in self.parsed:
            self.parsed[key] = _read_mapping(path)
            self.files.append(path)
        return self.parsed[key]


def _merge_chain(
    data: dict[str, Any], path: Path, chain: tuple[Path, ...], state: _Chain | None = None
) -> dict[str, Any]:
    """``data`` (the parsed ``path``) with its ``defaults:`` parents merged in, parent-first."""
    if "defaults" not in data:
        return data
    parents = _defaults_paths(data["defaults"], path)
    if parents is None:
        return data
    state = state or _Chain()
    resolved = path.resolve()
    if resolved in chain:
        raise FP8ConfigError(f"defaults chain loops back to {path}", key="defaults")
    check_limit(
        len(chain) + 1,
        LIMITS.defaults_depth,
        f"defaults chain of {path} is too long: files deep",
        key="defaults",
    )
    merged: dict[str, Any] = {}
    for parent in parents:
        state.references += 1
        check_limit(
            state.references,
            LIMITS.defaults_files,
            f"defaults chain of {path} names too many parent files",
            key="defaults",
        )
        if not parent.exists():
            raise FP8ConfigError(
                f"parent config {format_value(data['defaults'])} not found (looked for {parent})",
                key="defaults",
                value=data["defaults"],
            )
        parsed = copy.deepcopy(state.read(parent))
        merged = deep_merge(merged, _merge_chain(parsed, parent, chain + (resolved,), state))
    child = {k: v for k, v in data.items() if k != "defaults"}
    return deep_merge(merged, child)


def load_config(
    path: str | Path, *, follow_defaults: bool = True, _chain: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """Read a YAML config file safely, merging its NeMo RL ``defaults:`` chain parent-first."""
    path = Path(path)
    data = _read_mapping(path)
    return _merge_chain(data, path, _chain) if follow_defaults else data


def load_config_chain(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(as written, with its defaults: chain merged)``, each file of the chain parsed once;
    the second is the first itself when there is no chain (callers must not mutate either)."""
    raw, resolved, _ = load_config_files(path)
    return raw, resolved


def load_config_files(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], list[Path]]:
    """:func:`load_config_chain` and every file it read, the config first."""
    path = Path(path)
    raw = _read_mapping(path)
    state = _Chain()
    state.parsed[path.resolve()] = raw
    resolved = _merge_chain(copy.deepcopy(raw), path, (), state)
    return raw, resolved, [path, *state.files[1:]]


_NUMERIC_PRECISIONS = (16, 32, 64)
"""Lightning's integer precisions (``precision: 16``), which pass through like their names."""


def _unknown_recipe(reg: RecipeRegistry, value: Any, key: str) -> FP8ConfigError:
    """The error for a value that names no recipe. Bare ``fp8`` gets what to write instead of
    the nearest name by spelling (``mxfp8``, another format altogether): it is NeMo RL's vLLM
    spelling (``policy.generation.vllm_cfg.precision: fp8``), which runs block FP8."""
    err = reg.unknown(value, key=key)
    if isinstance(value, str) and value.strip().lower().replace("-", "_") in ("fp8", "fp8_mixed"):
        err = FP8ConfigError(
            err.bare_message,
            key=key,
            value=value,
            hint=(
                "`fp8` alone is NeMo RL's vLLM spelling, not one recipe; write fp8_blockwise for "
                "the block FP8 NeMo RL generation runs, or one of: " + ", ".join(reg.names())
            ),
        )
    return err


def _precision_recipe(value: Any, key: str) -> str | None:
    """The recipe a precision value names; None for nothing or a standard (non-FP8)
    precision. Anything else is refused: a value that is neither must not read as "no FP8
    requested"."""
    reg = default_registry()
    if value is None or (type(value) is int and value in _NUMERIC_PRECISIONS):
        return None
    if not isinstance(value, str):
        raise FP8ConfigError(
            f"expected a precision name or a recipe, got {format_value(value)}",
            key=key,
            value=value,
            hint=f"a recipe ({', '.join(reg.names())}), a precision such as "
            f"bf16 or bf16-mixed, or nothing",
        )
    if value in reg:
        return value
    if value.strip().lower() in STANDARD_PRECISIONS or value.startswith("${"):
        return None
    raise _unknown_recipe(reg, value, key)


_RECIPE_ONLY_FIELDS = (
    "pow2_scales",
    "bf16_layers",
    "fp8_format",
    "activation_block",
    "weight_block",
    "gradient_block",
    "amax_epsilon",
    "amax_history_len",
    "amax_compute_algo",
    "importance_sampling",
)
"""Recipe fields no host spells the same way at a config's top level (megatron-core's own
``fp8_margin``, ``fp8_amax_history_len`` ... live under ``model:``), so finding one there next
to ``precision:`` means it was meant for the ``fp8:`` block."""

_NATIVE_FP8_VALUES = ("hybrid", "e4m3", "e5m2")
"""Values of megatron-core's / NeMo's own ``fp8`` key (the element format switch)."""


def _bridge_recipe(value: str, reg: RecipeRegistry) -> str | None:
    """The recipe a Megatron-Bridge ``mixed_precision:`` value names, None for Bridge's own.

    Bridge's registry answers to ``fp8_blockwise`` and to its hyphenated alias
    ``fp8-blockwise`` (its ``register`` adds both). Bridge's own presets all start with
    ``bf16``/``fp16`` or a model family; a value that starts like ours (``fp8...``,
    ``mxfp8...``) and is close to one of our names is a typo that Bridge would only report
    when the run starts, so it is reported now.
    """
    for name in (value, value.replace("-", "_")):
        if name in reg:
            return name
    squashed = value.replace("-", "_").lower()
    if squashed.startswith(("fp8", "mxfp8")) and suggest(squashed, reg.names()) is not None:
        raise _unknown_recipe(reg, value, "mixed_precision")
    return None


_MAP, _LIST, _STR = "a mapping", "a list of mappings", "a string"

HOST_SECTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "nemo2": {
        "trainer": (_MAP,),
        "trainer.plugins": (_MAP, _LIST),
        "model": (_MAP,),
        "model.config": (_MAP,),
    },
    "bridge": {"model": (_MAP,), "model.transformer": (_MAP,)},
    "megatron": {"model": (_MAP,), "language_model": (_MAP,), "ddp": (_MAP,)},
    "nemo-rl": {
        "policy": (_MAP,),
        "policy.megatron_cfg": (_MAP,),
        "policy.megatron_cfg.fp8_cfg": (_MAP,),
        "policy.megatron_cfg.env_vars": (_MAP,),
        "policy.megatron_cfg.model_overrides": (_MAP,),
        "policy.megatron_cfg.optimizer": (_MAP,),
        "policy.dtensor_cfg": (_MAP,),
        "policy.generation": (_MAP,),
        "policy.generation.vllm_cfg": (_MAP,),
        "loss_fn": (_MAP,),
    },
    "vllm": {
        "model": (_STR,),
        "hf_overrides": (_MAP,),
        "hf-overrides": (_MAP,),
        "hf_overrides.quantization_config": (_MAP,),
        "hf-overrides.quantization_config": (_MAP,),
    },
    "te": {},
}
"""Per host, the sections its adapter reads or writes and what each must be when present
(null is always accepted, as is a ``${...}`` interpolation): checked before anything is
merged, so that a list where a mapping belongs is refused naming the key instead of being
overwritten or passed over."""


def check_sections(host: str, config: Mapping[str, Any]) -> None:
    """Refuse a section of ``config`` whose type is not what ``host`` reads there
    (:data:`HOST_SECTIONS`), naming the dotted key."""
    for path, kinds in HOST_SECTIONS.get(host, {}).items():
        value = get_path(config, path)
        if value is None or (isinstance(value, str) and value.startswith("${")):
            continue
        ok = (
            (_MAP in kinds and isinstance(value, Mapping))
            or (_STR in kinds and isinstance(value, str))
            or (
                _LIST in kinds
                and isinstance(value, list)
                and all(isinstance(v, Mapping) for v in value)
            )
        )
        if not ok:
            raise FP8ConfigError(
                f"expected {' or '.join(kinds)}, got {format_value(value)}",
                key=path,
                value=value,
                hint=f"{host} reads this section",
            )


def find_fp8_request(
    config: Mapping[str, Any], *, hardware: str | None = None, check_hardware: bool = True
) -> FP8Request | None:
    """The FP8 recipe a config asks for, or None when it asks for none.

    ``hardware`` (a GPU name or architecture) overrides ``fp8.hardware`` for validation.
    ``check_hardware=False`` (``explain``, ``doctor``: they report what cannot run rather than
    refuse) leaves the target out of the spec and only in :attr:`FP8Request.hardware`; the
    spelling of the target is still checked. Raises :class:`FP8ConfigError` naming the key
    for every mistake.

    Steps: the recipe names the request keys carry (:func:`_named_recipes`, the ``fp8:``
    block's in :func:`_read_fp8_block`), no recipe field at the top level, one recipe, the
    hardware target (:func:`_hardware_target`), the block's overrides applied
    (:func:`_with_overrides`).
    """
    if not isinstance(config, Mapping):
        raise FP8ConfigError(f"a config must be a mapping, got {format_value(config)}")
    reg = default_registry()
    named = _named_recipes(config, reg)
    block = config.get("fp8")
    overrides, model = _read_fp8_block(block, reg, named)
    if not named:
        return None
    _refuse_top_level_fields(config, named[0][1])
    spec = reg.get(_one_recipe(named))
    target, target_key = _hardware_target(block, hardware)
    if hardware is not None:
        overrides["hardware"] = target
    if not check_hardware:
        overrides.pop("hardware", None)
    if overrides:
        spec = _with_overrides(spec, overrides, block, hardware)
    keys = tuple(dict.fromkeys(k.split(".recipe")[0] for k, _ in named))
    if block is not None and "fp8" not in keys:
        keys = keys + ("fp8",)
    if model is None:
        model = _model_named_by_host(config)
    return FP8Request(spec=spec, keys=keys, model=model, hardware=target, hardware_key=target_key)


def _named_recipes(config: Mapping[str, Any], reg: RecipeRegistry) -> list[tuple[str, str]]:
    """``(key, recipe name)`` for every ``precision:`` / ``policy.precision:`` naming one of
    our recipes, and a Bridge ``mixed_precision:`` naming one."""
    named: list[tuple[str, str]] = []
    for path in _PRECISION_KEYS:
        name = _precision_recipe(get_path(config, path), ".".join(path))
        if name is not None:
            named.append((".".join(path), name))
    bridge_value = get_path(config, _BRIDGE_KEY)
    if isinstance(bridge_value, str):
        bridge_name = _bridge_recipe(bridge_value, reg)
        if bridge_name is not None:
            named.append(("mixed_precision", bridge_name))
    elif bridge_value is not None and not isinstance(bridge_value, Mapping):
        # Bridge's field holds a recipe name or a MixedPrecisionConfig block, nothing else.
        raise FP8ConfigError(
            f"expected a recipe name or a mapping, got {format_value(bridge_value)}",
            key="mixed_precision",
            value=bridge_value,
            hint=f"a recipe ({', '.join(reg.names())}), "
            f"a Megatron-Bridge recipe such as bf16_mixed, or its block",
        )
    return named


def _read_fp8_block(
    block: Any, reg: RecipeRegistry, named: list[tuple[str, str]]
) -> tuple[dict[str, Any], str | None]:
    """The ``fp8:`` block's overrides and model; its recipe is appended to ``named``."""
    if block is None:
        return {}, None
    if isinstance(block, str):
        if block not in reg:
            raise _unknown_fp8_name(reg, block)
        named.append(("fp8", block))
        return {}, None
    if not isinstance(block, Mapping):
        raise FP8ConfigError(
            f"expected a recipe name or a mapping, got {format_value(block)}",
            key="fp8",
            value=block,
        )
    allowed = set(RecipeSpec.OVERRIDABLE) | set(FP8_BLOCK_EXTRA_KEYS)
    for k in block:
        if not isinstance(k, str) or k not in allowed:
            near = suggest(k, sorted(allowed))
            raise FP8ConfigError(
                "unknown key",
                key=f"fp8.{k}",
                hint=f"did you mean {near!r}?"
                if near
                else f"valid keys: {', '.join(sorted(allowed))}",
            )
    overrides = {k: v for k, v in block.items() if k not in FP8_BLOCK_EXTRA_KEYS}
    model = block.get("model")
    if model is not None and not isinstance(model, str):
        raise FP8ConfigError(
            f"expected a model name or config.json path, got {format_value(model)}",
            key="fp8.model",
            value=model,
        )
    if "recipe" in block:
        if not isinstance(block["recipe"], str):
            raise FP8ConfigError(
                f"expected a recipe name, got {format_value(block['recipe'])}",
                key="fp8.recipe",
                value=block["recipe"],
            )
        if block["recipe"] not in reg:
            raise _unknown_recipe(reg, block["recipe"], "fp8.recipe")
        named.append(("fp8.recipe", block["recipe"]))
    elif not named:
        raise FP8ConfigError(
            "is required: the fp8 block must start from a registered recipe",
            key="fp8.recipe",
            hint=f"valid recipes: {', '.join(reg.names())}",
        )
    return overrides, model


def _unknown_fp8_name(reg: RecipeRegistry, block: str) -> FP8ConfigError:
    err = _unknown_recipe(reg, block, "fp8")
    if block.strip().lower() not in _NATIVE_FP8_VALUES:
        return err
    # megatron-core's and NeMo's own `fp8: hybrid|e4m3` switch, at the root
    return FP8ConfigError(
        err.bare_message,
        key="fp8",
        value=block,
        hint=(
            f"{block!r} is megatron-core's own fp8 format switch: it belongs under "
            "model: (or language_model:); at the root, fp8 names one of our "
            f"recipes: {', '.join(reg.names())}"
        ),
    )


def _refuse_top_level_fields(config: Mapping[str, Any], recipe: str) -> None:
    for key in _RECIPE_ONLY_FIELDS:
        if key in config:  # read by no host at the top level: the recipe would silently lack it
            raise FP8ConfigError(
                "a recipe field at the top level is read by nothing",
                key=key,
                value=config[key],
                hint=f"put it in the fp8 block: fp8: {{recipe: {recipe}, {key}: ...}}",
            )


def _one_recipe(named: list[tuple[str, str]]) -> str:
    distinct = sorted({name for _, name in named})
    if len(distinct) > 1:
        where = ", ".join(f"{k}={n!r}" for k, n in named)
        raise FP8ConfigError(
            f"conflicting recipes: {where}",
            key=named[1][0],
            value=named[1][1],
            hint="name one recipe, or make every key name the same one",
        )
    return distinct[0]


def _hardware_target(block: Any, hardware: str | None) -> tuple[str | None, str | None]:
    """``(architecture, the key that stated it)``: ``--hardware``, else ``fp8.hardware``."""
    if hardware is not None:
        return normalize_hardware(hardware, key="--hardware"), "--hardware"
    if isinstance(block, Mapping) and block.get("hardware") is not None:
        return normalize_hardware(block["hardware"], key="fp8.hardware"), "fp8.hardware"
    return None, None


def _with_overrides(
    spec: RecipeSpec, overrides: dict[str, Any], block: Any, hardware: str | None
) -> RecipeSpec:
    try:
        return spec.with_overrides(overrides, prefix="fp8")
    except FP8ConfigError as err:
        # A hardware finding comes from the command line unless the fp8 block said it.
        from_flag = (
            hardware is not None
            and (err.key or "").endswith("hardware")
            and not (
                isinstance(block, Mapping) and "hardware" in block and block["hardware"] == hardware
            )
        )
        if not from_flag:
            raise
        raise FP8ConfigError(
            err.bare_message, key="--hardware", value=hardware, hint=err.hint
        ) from None


def _model_named_by_host(config: Mapping[str, Any]) -> str | None:
    """The model name a host config carries in its own keys, if any."""
    for path in (
        ("policy", "model_name"),
        ("model", "name"),
        ("model_name",),
        ("model", "pretrained_model_name_or_path"),
        ("hf_model_id",),
    ):
        value = get_path(config, path)
        if isinstance(value, str) and value and not value.startswith("${"):
            return value
    return None


def resolve_config(
    path: str | Path, *, hardware: str | None = None
) -> tuple[dict[str, Any], FP8Request | None]:
    """Load ``path`` (following ``defaults:``) and find its FP8 request."""
    config = load_config(path)
    return config, find_fp8_request(config, hardware=hardware)
