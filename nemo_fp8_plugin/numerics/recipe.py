"""What the numerics read from a recipe, as a structural type.

The numerics layer imports torch and :mod:`nemo_fp8_plugin.errors` only: no recipe spec
module, no registry, no YAML. It takes any object with the fields below, which a
:class:`nemo_fp8_plugin.RecipeSpec` has; turning a recipe name, mapping or JSON text into
one is :func:`nemo_fp8_plugin.get_recipe`'s job, done by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from ..errors import FP8ConfigError, format_value

if TYPE_CHECKING:  # for readers and type checkers only: RecipeSpec satisfies RecipeLike
    from ..spec import RecipeSpec  # noqa: F401

__all__ = ["RecipeLike", "RecipeTypeError", "check_recipe", "SCALING_KINDS"]

SCALING_KINDS = ("delayed", "tensorwise", "block", "mx", "nvfp4")
"""The scaling kinds the quantizers implement (``RecipeSpec.scaling``)."""

_FIELDS = (
    "name",
    "scaling",
    "pow2_scales",
    "amax_epsilon",
    "amax_history_len",
    "amax_compute_algo",
    "margin",
    "reduce_amax",
    "fp8_wgrad",
    "format_for",
    "block_for",
)


@runtime_checkable
class RecipeLike(Protocol):
    """The recipe fields the FP8 emulation reads (all of them are
    :class:`~nemo_fp8_plugin.spec.RecipeSpec` fields; read-only here)."""

    @property
    def name(self) -> str: ...

    @property
    def scaling(self) -> str:
        """One of :data:`SCALING_KINDS`."""

    @property
    def pow2_scales(self) -> bool: ...

    @property
    def amax_epsilon(self) -> float: ...

    @property
    def amax_history_len(self) -> int: ...

    @property
    def amax_compute_algo(self) -> str: ...

    @property
    def margin(self) -> int: ...

    @property
    def reduce_amax(self) -> bool: ...

    @property
    def fp8_wgrad(self) -> bool: ...

    def format_for(self, role: str) -> str:
        """Element format (``e4m3`` / ``e5m2``) of ``input``, ``weight`` or ``grad_output``."""

    def block_for(self, role: str) -> tuple[int, int] | None:
        """Scale tile of a role, None per tensor."""


class RecipeTypeError(FP8ConfigError, TypeError):
    """Something other than a recipe spec was passed where the numerics need one (a recipe
    name, for instance). Both an :class:`FP8ConfigError` and a :class:`TypeError`."""


def check_recipe(recipe: object, key: str = "recipe") -> RecipeLike:
    """``recipe`` itself when it has every field of :class:`RecipeLike` and a known scaling
    kind; otherwise :class:`RecipeTypeError` (a name, a mapping or another object) or
    :class:`FP8ConfigError` (an unknown scaling kind), keyed ``key``."""
    if isinstance(recipe, (str, bytes, Mapping)):
        raise RecipeTypeError(
            f"the numerics take a recipe spec, not a {type(recipe).__name__} "
            f"({format_value(recipe)})",
            key=key,
            value=recipe,
            hint="pass nemo_fp8_plugin.get_recipe(name), which resolves names, mappings and "
            "JSON into a RecipeSpec",
        )
    missing = [f for f in _FIELDS if not hasattr(recipe, f)]
    if missing:
        raise RecipeTypeError(
            f"expected a recipe spec (nemo_fp8_plugin.RecipeSpec), got "
            f"{type(recipe).__name__} {format_value(recipe)} without {', '.join(missing)}",
            key=key,
            value=recipe,
            hint="build one with nemo_fp8_plugin.get_recipe(name)",
        )
    checked = cast(RecipeLike, recipe)  # every field checked above
    scaling = checked.scaling
    if scaling not in SCALING_KINDS:
        raise FP8ConfigError(
            f"unknown scaling kind {format_value(scaling)}; the numerics "
            f"implement {', '.join(SCALING_KINDS)}",
            key=f"{key}.scaling",
            value=scaling,
        )
    return checked
