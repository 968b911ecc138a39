"""``nemo-fp8 analyze --attribution RL_CHECK.json``: ``bf16_layers`` from rl-check's mismatch
attribution instead of a checkpoint's SQNR.

``nemo-fp8 rl-check --json`` attributes one step's engine/trainer mismatch to candidates
(``summary.arms.<arm>.attribution``): each layer (``layer.<i>``, its FP8 linears) and each
module kind (``q_proj`` ... ``down_proj`` in every layer) kept in BF16 one at a time, with the
share of the arm's excess ``token_mult_prob_error`` that keeping it in BF16 removes (mean over
seeds; in the end-to-end arms the candidate in BF16 on both sides, ``both_sides_removed``, as a
``bf16_layers`` rule would keep it). Here the best-ranked candidates whose share's 95% interval
lies above 0 (a one-seed run gives no interval: nothing is chosen) become flagged modules, and
:func:`~.suggest.suggest_bf16_layers` turns them into the fewest rules, exactly as for a
checkpoint (a suggestion covering every layer is None).

Reads JSON only: no torch, no host, no rl-check import (analyze sits below tools).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import FP8ConfigError
from .suggest import suggest_bf16_layers, suggestion_yaml

__all__ = ["DEFAULT_ARM", "attribution_report", "report_from_data", "render_attribution"]

DEFAULT_ARM = "fp8-e2e-is"
"""The arm whose ranking is read when none is named: FP8 on both sides with truncated
importance sampling (ratio capped at 2), the end-to-end setup a ``bf16_layers`` rule is written
for. NVIDIA's published end-to-end recipe uses plain importance sampling; rl-check's TIS arm
stands in for it (docs/rl.md)."""

KEY = "--attribution"

_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Hugging Face projections the hosts run as one fused GEMM with their siblings (vLLM's
``qkv_proj`` / ``gate_up_proj``, Megatron's ``linear_qkv`` / ``linear_fc1``)."""


def _fail(where: str, message: str, value: Any = None, hint: str | None = None) -> FP8ConfigError:
    return FP8ConfigError(f"{where}: {message}", key=KEY, value=value, hint=hint)


def _load(path: str | Path) -> dict[str, Any]:
    from .._io import read_user_json

    p = Path(path)
    # a regular file (a FIFO, /dev/zero refused) within LIMITS.config_bytes, nesting bounded
    data = read_user_json(
        p, key=KEY, what="JSON file", hint="pass the file `nemo-fp8 rl-check --json` wrote"
    )
    if not isinstance(data, dict):
        raise _fail("the document", "expected rl-check's JSON object", type(data).__name__)
    return data


def _share(row: dict[str, Any], key: str, where: str) -> dict[str, float]:
    """A ``{mean, ci95, n}`` interval of ``row[key]``, checked."""
    cell = row.get(key)
    if not isinstance(cell, dict) or not isinstance(cell.get("mean"), (int, float)):
        raise _fail(f"{where}.{key}", "expected a {mean, ci95, n} interval", cell)
    if isinstance(cell["mean"], bool) or not math.isfinite(cell["mean"]):
        raise _fail(f"{where}.{key}.mean", "expected a finite number", cell["mean"])
    ci = cell.get("ci95", math.nan)
    return {
        "mean": float(cell["mean"]),
        "ci95": float(ci) if isinstance(ci, (int, float)) else math.nan,
        "n": int(cell.get("n", 0)) if isinstance(cell.get("n", 0), int) else 0,
    }


def _resolved(share: dict[str, float]) -> bool:
    """The share's 95% interval lies above 0 (NaN, one seed: no interval, not resolved)."""
    return math.isfinite(share["ci95"]) and share["mean"] - share["ci95"] > 0


def _rows(arm_row: Any, where: str) -> list[dict[str, Any]]:
    rows = arm_row.get("attribution") if isinstance(arm_row, dict) else None
    if not isinstance(rows, list) or not rows:
        raise _fail(f"{where}.attribution", "no attribution ranking", rows)
    for i, row in enumerate(rows):
        at = f"{where}.attribution[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("bf16"), str):
            raise _fail(f"{at}.bf16", "expected the candidate's name", row)
        mods = row.get("modules")
        if not isinstance(mods, list) or not all(isinstance(m, str) and m for m in mods):
            raise _fail(
                f"{at}.modules",
                "expected the list of module names the candidate keeps in BF16",
                mods,
                hint="rerun rl-check: JSON written before the attribution named its modules "
                "lack it",
            )
    return rows


def attribution_report(path: str | Path, *, arm: str | None = None, top: int = 1) -> dict[str, Any]:
    """The ranking of ``arm`` (default :data:`DEFAULT_ARM`, else the first attributed arm) in
    rl-check's JSON at ``path`` and the ``bf16_layers`` suggestion of its ``top`` best
    candidates that measurably remove a share of the excess mismatch (the 95% interval's lower
    bound above 0: a positive mean whose interval holds 0 is not evidence) and hold linear layers
    (the ``kv_cache`` candidate is the KV cache's dtype, not a ``bf16_layers`` rule).

    The report has analyze's ``recipes`` / ``suggestions`` shape (one recipe: the run's), so
    :func:`~.suggest.suggestion_yaml` prints its block. Every shape error raises
    :class:`FP8ConfigError` under ``--attribution`` naming the JSON key."""
    return report_from_data(_load(path), str(path), arm=arm, top=top)


def report_from_data(
    data: dict[str, Any], source: str, *, arm: str | None = None, top: int = 1
) -> dict[str, Any]:
    """:func:`attribution_report` of an rl-check JSON document already read (``source``:
    where it came from, for the messages)."""
    path = source
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise FP8ConfigError("must be a positive integer", key="--top", value=top)
    summary = data.get("summary")
    arms = summary.get("arms") if isinstance(summary, dict) else None
    if not isinstance(arms, dict) or not arms:
        raise _fail("summary.arms", "missing: not rl-check's JSON", None)
    attributed = [a for a, r in arms.items() if isinstance(r, dict) and r.get("attribution")]
    if not attributed:
        raise _fail(
            "summary.arms.<arm>.attribution",
            "no arm has an attribution ranking",
            hint="run rl-check with its default attribution step and an FP8 arm",
        )
    if arm is None:
        arm = DEFAULT_ARM if DEFAULT_ARM in attributed else attributed[0]
    elif arm not in attributed:
        raise FP8ConfigError(
            f"no attribution ranking for arm {arm!r} in {path}",
            key="--attribution-arm",
            value=arm,
            hint=f"one of {', '.join(attributed)}",
        )
    where = f"summary.arms.{arm}"
    rows = _rows(arms[arm], where)
    both = all("both_sides_removed" in r for r in rows if r["bf16"] != "none")
    key = "both_sides_removed" if both else "removed"
    ranking = []
    for i, row in enumerate(rows):
        if row["bf16"] == "none":
            continue
        at = f"{where}.attribution[{i}]"
        ranking.append(
            {
                "candidate": row["bf16"],
                "modules": list(row["modules"]),
                "removed": _share(row, key, at),
                "token_mult_prob_error": _share(
                    row, "both_sides" if both else "token_mult_prob_error", at
                )["mean"],
            }
        )
    ranking.sort(key=lambda r: -r["removed"]["mean"])
    modules = sorted({m for r in ranking for m in r["modules"]})
    if not modules:
        raise _fail(f"{where}.attribution", "no candidate names a module", None)
    usable = [r for r in ranking if r["modules"] and _resolved(r["removed"])]
    chosen = usable[:top]
    flagged = {m for r in chosen for m in r["modules"]}
    settings = data.get("settings")
    if not isinstance(settings, dict):
        settings = {}  # refused just below: no recipe
    recipe = settings.get("recipe")
    if not isinstance(recipe, str) or not recipe or not recipe.isprintable():
        # a newline would reach the suggested YAML and the terminal as written
        raise _fail("settings.recipe", "expected the run's recipe name (one line)", recipe)
    step = settings.get("attribution_step")
    steps = settings.get("steps")
    if isinstance(step, int) and step < 0 and isinstance(steps, int):
        step += steps  # rl-check counts a negative step from the end
    return {
        "attribution": source,
        "arm": arm,
        "attribution_step": step,
        "ranked_by": key,
        "ranking": ranking,
        "chosen": [r["candidate"] for r in chosen],
        "modules": modules,
        "recipes": [recipe],
        "suggestions": {recipe: suggest_bf16_layers(modules, flagged)},
    }


def _widened(report: dict[str, Any]) -> list[str]:
    """Chosen projections whose fused siblings were not chosen with them: the hosts keep the
    fused GEMM in BF16, so the rule reaches further than the attribution measured."""
    chosen = {
        m for r in report["ranking"] if r["candidate"] in report["chosen"] for m in r["modules"]
    }
    out = set()
    for m in chosen:
        parent, _, leaf = m.rpartition(".")
        for group in _FUSED:
            if leaf in group and any(f"{parent}.{sib}" not in chosen for sib in group):
                out.add(leaf)
    return sorted(out)


def render_attribution(report: dict[str, Any]) -> str:
    """The ranking and the ready-to-paste ``fp8:`` block, as text."""
    recipe = report["recipes"][0]
    side = "on both sides" if report["ranked_by"] == "both_sides_removed" else "in the engine"
    lines = [
        f"attribution: {report['attribution']} (arm {report['arm']}, step "
        f"{report['attribution_step']}, recipe {recipe})",
        f"  share of the arm's excess token_mult_prob_error removed by keeping each candidate "
        f"in BF16 {side} (mean over seeds ± 95% interval):",
    ]
    width = max(len(r["candidate"]) for r in report["ranking"])
    for r in report["ranking"]:
        share = r["removed"]
        ci = "" if math.isnan(share["ci95"]) else f" ± {share['ci95']:.0%}"
        if r["candidate"] in report["chosen"]:
            mark = " *"
        elif share["mean"] > 0 and r["modules"] and not _resolved(share):
            # a positive mean that is not evidence: say why it was passed over
            mark = " (no interval)" if math.isnan(share["ci95"]) else " (interval includes 0)"
        else:
            mark = ""
        lines.append(
            f"  {r['candidate']:<{width}}  {share['mean']:+6.0%}{ci:<7}  "
            f"token_mult_prob_error {r['token_mult_prob_error']:.5f}{mark}"
        )
    suggestion = report["suggestions"][recipe]
    if not report["chosen"]:
        lines.append(
            "  no candidate measurably lowers the mismatch (no 95% interval above 0): "
            "no bf16_layers needed"
        )
    elif suggestion is None:
        lines.append(
            "  the chosen candidates cover every layer: no bf16_layers leaves anything to run "
            "in FP8; choose fewer (--top)"
        )
    else:
        widened = _widened(report)
        if widened:
            lines.append(
                f"  note: {', '.join(widened)} run fused with their siblings in vLLM and "
                "Megatron (q/k/v, gate/up): the rule keeps the whole fused GEMM in BF16"
            )
        lines.append("  * chosen; suggested config:")
        lines += ["    " + ln for ln in suggestion_yaml(report, recipe).splitlines()]
    return "\n".join(lines) + "\n"
