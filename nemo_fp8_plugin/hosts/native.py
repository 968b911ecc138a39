"""Reading native FP8 keys back into the recipe they mean: the part every host's
:meth:`~nemo_fp8_plugin.hosts.HostAdapter.read_native` shares.

A host's reader turns its own keys into a scaling kind (through the capability rows, never a
spelling compare) and the spec fields its keys state (``fp8_format``, ``fp8_param``,
``bf16_layers``, ``kv_cache``, ...). :func:`match_recipe` then picks the registered recipe of
that kind the fields change least, so the reading names a recipe of ours and says what
differs from it, and which other recipes the host's keys cannot tell apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..capabilities import CAPABILITIES
from ..errors import FP8ConfigError
from . import NativeRecipe

__all__ = [
    "match_recipe",
    "scaling_for_megatron_recipe",
    "megatron_fields",
    "layer_count",
    "FP8_FIELD_DEFAULTS",
]

FP8_FIELD_DEFAULTS: dict[str, Any] = {
    "fp8": None,
    "first_last_layers_bf16": False,
    "fp8_margin": 0,
    "fp8_amax_history_len": 1,
    "fp8_amax_compute_algo": "most_recent",
    "fp8_wgrad": True,
    "fp8_dot_product_attention": False,
    "fp8_multi_head_attention": False,
    "fp4": None,
}
"""The defaults megatron-core's ``TransformerConfig``, NeMo 2's ``MegatronMixedPrecision`` and
Bridge's ``MixedPrecisionConfig`` agree on for the FP8 fields they share by name (each host's
table adds its own; each is compared with its host's source)."""


def scaling_for_megatron_recipe(value: Any) -> str | None:
    """The scaling kind whose megatron-core recipe name (``fp8_recipe`` / ``fp4_recipe``) is
    ``value`` (``blockwise`` -> ``block``), or None."""
    for kind, row in CAPABILITIES.items():
        if row.megatron_recipe == value:
            return kind
    return None


def match_recipe(
    host: str,
    scaling: str,
    fields: Mapping[str, Any],
    *,
    read: list[tuple[str, Any]],
    unmatched: list[str],
    env_note: str = "",
) -> NativeRecipe:
    """The registered recipe of kind ``scaling`` with ``fields`` (spec overrides the native
    keys state) applied, choosing the preset they change least (ties: registry order).

    ``alike``: the other presets of that kind that, with the same fields, are the same spec
    but for what the host's keys do not carry (``env_note`` says what tells them apart)."""
    from ..registry import list_recipes

    candidates = []
    for preset in list_recipes():
        if preset.scaling != scaling:
            continue
        try:
            spec = preset.with_overrides(dict(fields))
        except FP8ConfigError:
            continue  # the keys state something this preset cannot be
        base, mine = preset.to_dict(), spec.to_dict()
        differs = tuple((k, mine[k]) for k in mine if k != "name" and mine[k] != base[k])
        candidates.append((len(differs), preset.name, spec, differs))
    if not candidates:
        kinds = f"{scaling} scaling"
        return NativeRecipe(
            host,
            None,
            tuple(read),
            unmatched=tuple(unmatched + [f"{kinds}: no registered recipe of that kind fits them"]),
        )
    candidates.sort(key=lambda c: c[0])
    _, _, spec, differs = candidates[0]
    alike = tuple(
        f"{name}{' (' + env_note + ')' if env_note else ''}"
        for count, name, _, _ in candidates[1:]
        if count == candidates[0][0]
    )
    return NativeRecipe(host, spec, tuple(read), differs, alike, tuple(unmatched))


def megatron_fields(
    section: Mapping[str, Any], where: str, defaults: Mapping[str, Any]
) -> tuple[str | None, dict[str, Any], list[tuple[str, Any]], list[str]]:
    """megatron-core's FP8 fields in ``section`` (a ``TransformerConfig`` mapping, NeMo 2's
    ``MegatronMixedPrecision`` or Bridge's ``MixedPrecisionConfig``, all under the same field
    names) as ``(scaling, spec fields, read, unmatched)``; ``scaling`` None: no FP8 there.
    ``defaults``: what an absent field means to that host (its own defaults)."""

    def value(name: str) -> Any:
        return section.get(name, defaults.get(name))

    read: list[tuple[str, Any]] = []
    unmatched: list[str] = []
    fields: dict[str, Any] = {}
    fp4_recipe = value("fp4_recipe") if value("fp4") else None
    if fp4_recipe is not None:
        scaling = scaling_for_megatron_recipe(fp4_recipe)
        read += [(f"{where}fp4", value("fp4")), (f"{where}fp4_recipe", fp4_recipe)]
        if "fp4_param" in section:
            fields["fp8_param"] = bool(section["fp4_param"])
            read.append((f"{where}fp4_param", section["fp4_param"]))
    elif value("fp8"):
        recipe = value("fp8_recipe")
        scaling = scaling_for_megatron_recipe(recipe)
        read += [(f"{where}fp8", value("fp8")), (f"{where}fp8_recipe", recipe)]
        fields["fp8_format"] = value("fp8")
        if scaling is not None and CAPABILITIES[scaling].is_delayed:
            for ours, theirs in (
                ("margin", "fp8_margin"),
                ("amax_history_len", "fp8_amax_history_len"),
                ("amax_compute_algo", "fp8_amax_compute_algo"),
            ):
                if value(theirs) is not None:
                    fields[ours] = value(theirs)
        for name in ("fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention"):
            if value(name) is not None:
                fields[name] = bool(value(name))
        for name in ("fp8_param", "fp8_params"):  # NeMo 2's plugin spells it fp8_params
            if section.get(name) is not None:
                fields["fp8_param"] = bool(section[name])
                read.append((f"{where}{name}", section[name]))
        if scaling is None:
            unmatched.append(
                f"{where}fp8_recipe: {recipe!r}: a megatron-core recipe no recipe of ours "
                f"spells (custom: a quantizer factory of the training script's own)"
            )
    else:
        return None, {}, [], []
    # The counts are read by megatron-core only under first_last_layers_bf16.
    on = bool(value("first_last_layers_bf16"))
    fields["bf16_layers"] = {
        side: layer_count(value(name) or 0, f"{where}{name}") if on else 0
        for side, name in (
            ("first", "num_layers_at_start_in_bf16"),
            ("last", "num_layers_at_end_in_bf16"),
        )
    }
    if on:
        read.append((f"{where}first_last_layers_bf16", True))
    return scaling, fields, read, unmatched


def layer_count(value: Any, key: str) -> int:
    """A native layer count read back (``num_layers_at_start_in_bf16: 2``): a whole number
    of layers, 0 or more (a quoted digit string or an integral float read as one); anything
    else (``abc``, ``.inf``, ``[1]``, ``-1``, ``true``) refused naming ``key``."""
    from ..errors import LIMITS, check_limit, format_value

    count: Any = value
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 18:
        count = int(value.strip())
    elif isinstance(value, float) and value.is_integer():
        count = int(value)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise FP8ConfigError(
            f"expected a number of layers (a whole number, 0 or more), got {format_value(value)}",
            key=key,
            value=value,
        )
    check_limit(count, LIMITS.layers, "layers", key=key)
    return count
