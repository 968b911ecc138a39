"""The report as text (``nemo-fp8 analyze``'s default output) and as a PNG heat map."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._io import shown_path
from .metrics import KINDS, OUTPUT_MARGIN_DB, judged
from .suggest import suggestion_yaml

__all__ = ["render_text", "write_heatmap"]

_KIND_WORDS = {"weights": "weight", "activations": "input", "outputs": "output"}


def _fmt_db(v: float | None) -> str:
    return "  -   " if v is None else f"{v:6.1f}"


def _thresholds(report: dict[str, Any]) -> str:
    """``25.0 dB`` when one threshold holds for every recipe, else each with its recipes."""
    by_db: dict[float, list[str]] = {}
    for n in report["recipes"]:
        by_db.setdefault(report["threshold_db"][n], []).append(n)
    if len(by_db) == 1:
        return f"{next(iter(by_db))} dB"
    return ", ".join(f"{db} dB ({', '.join(names)})" for db, names in by_db.items())


def render_text(report: dict[str, Any], *, max_rows: int = 40) -> str:
    recipes = report["recipes"]
    rows = report["modules"]
    lines = [
        f"checkpoint: {shown_path(report['checkpoint'])} ({len(report['files'])} file(s), "
        f"{len(rows)} linear weights, {len(report['skipped'])} tensors skipped)",
        f"threshold: {_thresholds(report)} (flag a module below it under a recipe)",
    ]
    has_act = any("activations" in r for r in rows)
    if report.get("activations"):
        a = report["activations"]
        lines.append(f"activations: {a['samples']} samples, {a['tokens']} tokens")
    # names as printed: a tensor or folder name's control characters (ESC) escaped
    width = max([len(shown_path(r["module"])) for r in rows] + [6])

    def worst(r: dict[str, Any]) -> float:
        judgeds = [judged(r[kind][n], kind) for kind in KINDS if kind in r for n in recipes]
        vals = [v for v in judgeds if v is not None]
        return min(vals) if vals else math.inf

    shown = rows if len(rows) <= max_rows else sorted(rows, key=worst)[:max_rows]
    if len(shown) < len(rows):
        lines.append(
            f"the {len(shown)} modules with the lowest SQNR (all {len(rows)} with --json):"
        )
    # Full recipe names as headers: a column is as wide as its name or its cells.
    cw = max([16 if has_act else 8] + [len(n) for n in recipes])
    head = f"  {'module':<{width}}  " + "  ".join(f"{n:>{cw}}" for n in recipes)
    lines.append(head)
    lines.append(
        "  legend: each cell is a module's SQNR in dB under that recipe, the lower of the "
        "whole tensor's and its worst row's"
        + (
            "; cells read weight/input/GEMM output, the output judged at the threshold - "
            f"{OUTPUT_MARGIN_DB:g} dB"
            if has_act
            else ""
        )
        + "; - = quantized exactly (no error to measure); * = flagged"
    )
    for r in shown:
        cells = []
        for n in recipes:
            cell = "/".join(
                _fmt_db(judged(r[kind][n], kind)).strip() for kind in KINDS if kind in r
            )
            cells.append(f"{cell + ('*' if n in r.get('flagged', []) else ' '):>{cw + 1}}")
        lines.append(f"  {shown_path(r['module']):<{width}} " + " ".join(cells))
    if report["skipped"]:
        reasons: dict[str, list[str]] = {}
        for s in report["skipped"]:
            reasons.setdefault(s["reason"], []).append(shown_path(s["name"]))
        for why, names in reasons.items():
            # a NaN weight must be visible by name; long lists of norms and biases need not be
            shown_names = ", ".join(names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else ""
            )
            lines.append(f"skipped ({why}): {shown_names}")
    for n in recipes:
        s = report["summary"][n]
        text = f"{n}: {s['flagged']} of {len(rows)} modules flagged"
        for word in ("weight", "input", "output"):
            if f"min_{word}_sqnr_db" in s:
                lowest = "tensor" if word == "output" else "tensor or row"
                text += (
                    f"; {word}: median over modules of the tensor SQNR "
                    f"{_fmt_db(s[f'median_{word}_sqnr_db']).strip()} dB, lowest {lowest} "
                    f"SQNR {_fmt_db(s[f'min_{word}_sqnr_db']).strip()} dB "
                    f"({shown_path(s[f'worst_{word}_module'])})"
                )
        lines.append(text)
        if report["suggestions"][n] is None:
            lines.append(
                "  every layer is below the threshold: no bf16_layers leaves this recipe "
                "anything to run in FP8; keep the model in BF16 or try another recipe"
            )
        elif report["suggestions"][n]:
            lines.append("  suggested config:")
            lines += ["    " + ln for ln in suggestion_yaml(report, n).splitlines()]
        else:
            lines.append("  no module below the threshold: no bf16_layers needed")
    return "\n".join(lines) + "\n"


def write_heatmap(report: dict[str, Any], path: str | Path, *, max_rows: int = 400) -> Path:
    """A PNG heat map, module x recipe (the lower of tensor and worst-row SQNR, for weights;
    input and GEMM-output columns too with activations), written atomically. Expert projections are shown per layer at their worst; beyond
    ``max_rows`` modules of the same kind are merged across layers at their worst."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import io

    import matplotlib.pyplot as plt
    import numpy as np

    from .._io import atomic_write_bytes
    from ..rules.resolve import template

    recipes = report["recipes"]
    has_act = any("activations" in r for r in report["modules"])
    kinds = KINDS if has_act else ("weights",)
    columns = [(n, kind) for kind in kinds for n in recipes]
    labels = [f"{n}\n({_KIND_WORDS[kind]})" for n, kind in columns]

    def rows_by(key: Callable[[str], str]) -> dict[str, list[float]]:
        merged: dict[str, list[float]] = {}
        for r in report["modules"]:
            vals = []
            for n, kind in columns:
                v = judged(r[kind][n], kind) if kind in r else None
                vals.append(np.nan if v is None else v)
            k = key(r["module"])
            merged[k] = vals if k not in merged else list(np.fmin(merged[k], vals))
        return merged

    merged = rows_by(lambda m: re.sub(r"\.experts\.\d+\.", ".experts.*.", m))
    if len(merged) > max_rows:
        merged = rows_by(lambda m: template(re.sub(r"\.experts\.\d+\.", ".experts.*.", m)))
    names = list(merged)
    data = np.array([merged[n] for n in names], dtype=float).reshape(len(names), len(columns))
    height = min(max(3.0, 0.18 * len(names) + 1.5), 200.0)
    width = max(6.0, 1.6 * len(columns) + 0.07 * max([len(n) for n in names] + [10]))
    fig, ax = plt.subplots(figsize=(width, height))
    try:
        shown = np.clip(data, 0.0, 45.0)
        im = ax.imshow(
            np.ma.masked_invalid(shown),
            aspect="auto",
            cmap="viridis",
            vmin=0,
            vmax=45,
            interpolation="nearest",
        )
        thr = report["threshold_db"]  # per recipe
        limits = np.array(
            [thr[n] - OUTPUT_MARGIN_DB if kind == "outputs" else thr[n] for n, kind in columns]
        )
        below = np.argwhere(np.nan_to_num(data, nan=np.inf) < limits[None, :])
        if len(below):
            ax.scatter(
                below[:, 1],
                below[:, 0],
                marker="x",
                color="red",
                s=18,
                label=f"flagged (< {thr:g} dB; outputs < {thr - OUTPUT_MARGIN_DB:g} dB)",
            )
            ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
        ax.set_xticks(range(len(columns)), labels, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.set_title(f"FP8 quantization SQNR (dB) -- {Path(report['checkpoint']).name}", fontsize=9)
        fig.colorbar(im, ax=ax, label="SQNR (dB)", shrink=0.6)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
    finally:
        plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
