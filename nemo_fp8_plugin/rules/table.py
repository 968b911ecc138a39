"""The per-layer table of ``nemo-fp8 explain``, readable for an 80-layer model: consecutive
layers whose modules are decided identically share one block of rows."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["render_layer_table"]

_SIDE_TITLES = {
    "training": "training (megatron-core module names)",
    "generation": "generation (vLLM module names)",
}
_LAYER_PREFIX = re.compile(r"^(?:.*?\.)?(?:layers|layer|h|blocks)\.\d+\.")


def _layers_text(start: int, end: int) -> str:
    return str(start) if start == end else f"{start}-{end}"


def render_layer_table(decisions: Iterable[dict[str, Any]], indent: str = "  ") -> list[str]:
    """Text lines for decision dicts (``side``, ``layer``, ``module``, ``precision``,
    ``recipe``, ``rule``), one block per side."""
    decisions = list(decisions)
    lines: list[str] = []
    for side in ("training", "generation"):
        rows = [d for d in decisions if d.get("side", "training") == side]
        if not rows:
            continue
        per_layer: dict[int, list[tuple]] = {}
        outside: list[tuple] = []
        for d in rows:
            entry = (
                _LAYER_PREFIX.sub("", d["module"]),
                d["precision"],
                d["recipe"] or "-",
                d["rule"] or "-",
            )
            if d["layer"] is None:
                outside.append(entry)
            else:
                per_layer.setdefault(d["layer"], []).append(entry)
        runs: list[list[int]] = []  # [first, last] of consecutive layers decided alike
        for layer in sorted(per_layer):
            if runs and layer == runs[-1][1] + 1 and per_layer[layer] == per_layer[runs[-1][0]]:
                runs[-1][1] = layer
            else:
                runs.append([layer, layer])
        groups = [(_layers_text(first, last), per_layer[first]) for first, last in runs]
        if outside:
            groups.append(("-", outside))
        body = [(label, *entry) for label, entries in groups for entry in entries]
        header = ("layers", "module", "precision", "recipe", "rule")
        widths = [max(len(str(r[i])) for r in body + [header]) for i in range(4)]
        fp8 = sum(1 for d in rows if d["precision"] == "fp8")
        lines.append(f"{_SIDE_TITLES[side]}: {fp8} FP8, {len(rows) - fp8} BF16")
        fmt = indent + "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
        lines.append(fmt.format(*header).rstrip())
        last_label = None
        for row in body:
            label = row[0] if row[0] != last_label else ""
            last_label = row[0]
            lines.append(fmt.format(label, *row[1:]).rstrip())
    return lines
