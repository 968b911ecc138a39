"""What megatron-core's ``get_fp8_recipe`` honours, per version, from the stacks table.

megatron-core builds the Transformer Engine recipe object itself
(``megatron/core/fp8_utils.py``, ``get_fp8_recipe(config)``), and each recipe branch reads a
different set of ``TransformerConfig`` fields: in 0.16.1 ``fp8_dot_product_attention`` reaches
TE only for ``delayed`` and ``tensorwise`` and ``fp8_multi_head_attention`` only for
``delayed``; 0.18 passes ``fp8_dpa`` to MXFP8 as well. A field a branch never reads is dropped
without a word. Which branch reads which field is a row of
:data:`nemo_fp8_plugin.stacks.FACTS` (``get_fp8_recipe.<recipe>.<field>``), read from each
release's source by the tests (``tests/megatron_source.py``); nothing is parsed here. The
version asked about is the installed megatron-core's (package metadata), or, where none is
installed, the oldest tested release, and the messages say so.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HonouredFields", "RECIPES", "fact_name", "honoured_fp8_fields"]

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "custom")
"""megatron-core's ``Fp8Recipe`` branches of ``get_fp8_recipe``."""


def fact_name(recipe: str, field: str) -> str:
    """The stacks fact saying ``recipe``'s branch reads ``field`` (MXFP8's attention field is
    named after the TE argument it becomes, ``fp8_dpa``)."""
    if (recipe, field) == ("mxfp8", "fp8_dot_product_attention"):
        return "get_fp8_recipe.mxfp8.fp8_dpa"
    return f"get_fp8_recipe.{recipe}.{field}"


def _fields_of_facts() -> dict[str, tuple[str, ...]]:
    """recipe -> every field some release's branch reads (the table's rows)."""
    from ...stacks import FACTS

    out: dict[str, list[str]] = {r: [] for r in RECIPES}
    for f in FACTS:
        parts = f.name.split(".")
        if f.host == "megatron-core" and len(parts) == 3 and parts[0] == "get_fp8_recipe":
            field = "fp8_dot_product_attention" if parts[2] == "fp8_dpa" else parts[2]
            if parts[1] in out:
                out[parts[1]].append(field)
    return {r: tuple(fs) for r, fs in out.items()}


@dataclass(frozen=True)
class HonouredFields:
    """The answer for one megatron-core.

    Attributes:
        fields: ``fp8_recipe`` value -> the ``fp8*`` ``TransformerConfig`` fields its branch of
            ``get_fp8_recipe`` reads (directly or in the megatron-core code it calls).
        version: the megatron-core version they are for.
        source: ``"installed"`` (the installed version's rows) or ``"fallback"`` (megatron-core
            is not installed: the oldest tested release's rows).
    """

    fields: dict[str, frozenset[str]]
    version: str
    source: str

    @property
    def label(self) -> str:
        """``megatron-core 0.16.1``, with a note when it is not the installed one."""
        if self.source == "installed":
            return f"megatron-core {self.version}"
        return f"megatron-core {self.version} (not installed here; the oldest version read)"

    def honours(self, recipe: str, field: str) -> bool:
        return field in self.fields.get(recipe, frozenset())

    def recipes_reading(self, field: str) -> list[str]:
        return [r for r, fs in self.fields.items() if field in fs and r != "custom"]


def honoured_fp8_fields(version: str | None = None) -> HonouredFields:
    """:class:`HonouredFields` of megatron-core ``version``; None: the installed one, else the
    oldest tested release (``stacks.TESTED``)."""
    from ...stacks import TESTED, installed_version, lookup

    source = "given"
    if version is None:
        version = installed_version("megatron-core")
        source = "installed"
    if version is None:
        version, source = TESTED["megatron-core"][0], "fallback"
    fields = {
        recipe: frozenset(
            f for f in candidates if lookup("megatron-core", fact_name(recipe, f), version).present
        )
        for recipe, candidates in _fields_of_facts().items()
    }
    return HonouredFields(fields, version, "fallback" if source == "fallback" else "installed")
