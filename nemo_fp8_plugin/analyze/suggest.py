"""From flagged modules to the fewest ``bf16_layers`` rules that keep exactly them in BF16."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..rules.names import layer_index

__all__ = ["suggest_bf16_layers", "suggestion_yaml"]


def _unit(name: str) -> str:
    """One routed expert cannot stay BF16 alone (hosts run all experts of a layer as one
    grouped GEMM): expert projections collapse to the layer's experts."""
    return re.sub(r"\.experts\.\d+\.[^.]+$", ".experts.*", name)


def suggest_bf16_layers(modules: list[str], flagged: Iterable[str]) -> dict[str, Any] | None:
    """A ``bf16_layers`` mapping that keeps exactly the flagged modules (and the experts
    sharing their grouped GEMM) in BF16, in the fewest rules: whole leading/trailing layers
    as ``first``/``last``, a module kind flagged in every layer as one layer-wildcard glob,
    the rest by name. Empty when nothing is flagged; None when every layer is flagged: the
    rules would leave nothing in FP8, which ``explain`` and every host refuse."""
    flagged = set(flagged)
    if not flagged:
        return {}
    by_layer: dict[int, list[str]] = {}
    for m in modules:
        li = layer_index(m)
        if li is not None:
            by_layer.setdefault(li, []).append(m)
    layers = sorted(by_layer)
    first = 0
    for li in layers:
        if li == first and all(m in flagged for m in by_layer[li]):
            first += 1
        else:
            break
    last = 0
    if layers:
        n = layers[-1] + 1
        for li in reversed(layers):
            if li == n - 1 - last and li >= first and all(m in flagged for m in by_layer[li]):
                last += 1
            else:
                break
    if layers and first + last >= len(layers):
        return None
    if flagged >= set(modules):
        return None
    covered_layers = set(range(first)) | set(
        range(layers[-1] + 1 - last, layers[-1] + 1) if last else ()
    )
    rest_units = [
        u
        for u in dict.fromkeys(_unit(m) for m in modules if m in flagged)
        if layer_index(u) not in covered_layers
    ]
    from ..rules.resolve import template

    all_units = list(dict.fromkeys(_unit(m) for m in modules))
    by_template: dict[str, list[str]] = {}
    for u in all_units:
        if layer_index(u) not in covered_layers:
            by_template.setdefault(template(u), []).append(u)
    # linear in the modules: each template's count of flagged units, taken once
    hits: dict[str, int] = {}
    for u in rest_units:
        hits[template(u)] = hits.get(template(u), 0) + 1
    patterns: list[str] = []
    done: set[str] = set()
    for u in rest_units:
        t = template(u)
        if t in done:
            continue
        group = by_template.get(t, [])
        if layer_index(u) is not None and len(group) > 1 and hits[t] == len(group):
            patterns.append(t)
            done.add(t)
        else:
            patterns.append(u)
    out: dict[str, Any] = {}
    if first:
        out["first"] = first
    if last:
        out["last"] = last
    if patterns:
        out["modules"] = list(dict.fromkeys(patterns))
    return out


def suggestion_yaml(report: dict[str, Any], recipe: str) -> str:
    """The ready-to-paste ``fp8:`` block for one recipe's suggestion."""
    from .._io import dump_yaml

    block: dict[str, Any] = {"recipe": recipe}
    if report["suggestions"].get(recipe):
        block["bf16_layers"] = report["suggestions"][recipe]
    return dump_yaml({"fp8": block})
