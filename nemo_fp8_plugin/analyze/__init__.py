"""``nemo-fp8 analyze``: how much each linear layer of a checkpoint loses under each FP8 recipe,
and which layers to keep in BF16.

Weights are streamed one tensor at a time from ``.safetensors`` files (``safe_open``: the
model is never in memory as a whole), quantized with the reference quantizers of
:mod:`nemo_fp8_plugin.numerics` exactly as the recipe's weight role does it, and compared
with the original:

* ``sqnr_db`` = 10 log10(sum x^2 / sum (x - dq(q(x)))^2), the signal-to-quantization-noise
  ratio over the whole tensor;
* ``max_rel_err`` = the largest per-row ||x - dq(q(x))|| / ||x|| (rows are output channels
  for weights and tokens for activations): the worst single dot product's relative error,
  which an elementwise maximum (always ~1 from values that flush to zero) would not show;
  ``min_row_sqnr_db`` = -20 log10(max_rel_err) is the same in dB. A few huge outliers carry
  most of a tensor's energy, so they lift ``sqnr_db`` while the rows they crush are ruined;
  the worst row shows it.

With ``activations=True`` a ``transformers`` model built from the checkpoint's own
``config.json`` runs a few samples on CPU; forward pre-hooks record every linear layer's
input, quantized with the recipe's activation role (1x128 tiles for block scaling), and the
GEMM's output with both operands quantized (``outputs``): an outlier input channel crushes
its tile's other channels, which the input's own SQNR hides (the outlier dominates it) and
the output shows when, as in real LLMs, the outlier channel meets small weights.

A module is flagged for a recipe when its weight or input SQNR, or its worst row's, is below
the threshold, or its GEMM output's SQNR is below the threshold minus
:data:`OUTPUT_MARGIN_DB`
(default per element format: :data:`DEFAULT_THRESHOLD_DB` for E4M3, :data:`NVFP4_THRESHOLD_DB`; justified in ``docs/analyze.md``); the flagged
modules become a ``bf16_layers`` rule set per recipe.

The package: :mod:`.scan` (which tensors, streamed one at a time), :mod:`.metrics` (the error
statistics and the flagging), :mod:`.activations` (the forward hooks), :mod:`.suggest` (flagged
modules to ``bf16_layers`` rules), :mod:`.report` (text and heat map); this module runs them
(:func:`analyze_checkpoint`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

from ..errors import FP8ConfigError
from ..rules.names import layer_index
from .activations import SAMPLE_TEXTS, activation_stats, join_activation_names, load_samples
from .metrics import (
    DEFAULT_THRESHOLD_DB,
    NVFP4_THRESHOLD_DB,
    OUTPUT_MARGIN_DB,
    ErrorStats,
    default_threshold_db,
    is_flagged,
    resolve_recipes,
    summarize,
    weight_stats,
)
from .report import render_text, write_heatmap
from .scan import checkpoint_files, iter_tensors, natural_key, progress_bar, scan_headers
from .suggest import suggest_bf16_layers, suggestion_yaml

__all__ = [
    "DEFAULT_THRESHOLD_DB",
    "NVFP4_THRESHOLD_DB",
    "default_threshold_db",
    "OUTPUT_MARGIN_DB",
    "SAMPLE_TEXTS",
    "analyze_checkpoint",
    "checkpoint_files",
    "suggest_bf16_layers",
    "suggestion_yaml",
    "render_text",
    "write_heatmap",
    "ErrorStats",
]


def analyze_checkpoint(
    checkpoint: str | Path,
    *,
    recipes: Iterable[Any] | None = None,
    threshold_db: float | None = None,
    activations: bool = False,
    samples: str | Path | None = None,
    max_tokens: int = 128,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Analyze a safetensors checkpoint; returns the report ``--json`` prints.

    Args:
        checkpoint: a ``.safetensors`` file or a checkpoint directory.
        recipes: recipe names or specs (default: every registered recipe).
        threshold_db: flag modules whose weight or input SQNR is below this; None: each
            recipe's own (:func:`default_threshold_db`: 25 dB for E4M3, 13 dB for NVFP4).
        activations: also run the model (built by ``transformers`` from the checkpoint's
            ``config.json``) on ``samples`` and measure each linear layer's inputs.
        samples: a text file (one sample per line) or a JSON file of token-id lists;
            default :data:`SAMPLE_TEXTS`.
        max_tokens: tokens per sample (longer ones are truncated).
        progress: show a progress bar on stderr (None: only on a terminal).
    """
    if threshold_db is not None and (
        not isinstance(threshold_db, (int, float))
        or isinstance(threshold_db, bool)
        or not math.isfinite(threshold_db)
    ):
        raise FP8ConfigError(
            f"expected a number of dB, got {threshold_db!r}", key="--threshold", value=threshold_db
        )
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise FP8ConfigError(
            f"expected a positive integer, got {max_tokens!r}", key="--max-tokens", value=max_tokens
        )
    specs = resolve_recipes(recipes)
    checkpoint = Path(checkpoint).expanduser()
    files = checkpoint_files(checkpoint)
    todo, skipped = scan_headers(files)
    if activations and samples is not None:
        load_samples(samples)  # a bad samples file fails before the long weight pass
    import torch

    rows: list[dict[str, Any]] = []
    weights = iter_tensors(progress_bar(todo, len(todo), "weights", progress))
    with closing(weights):  # closes the open file if a tensor cannot be read
        for _, name, shape, dtype, tensor in weights:
            if not bool(torch.isfinite(tensor).all()):
                skipped.append(
                    {"name": name, "shape": shape, "dtype": dtype, "reason": "non-finite values"}
                )
                continue
            module = name[: -len(".weight")]
            stats = weight_stats(tensor, specs)
            del tensor
            rows.append(
                {
                    "module": module,
                    "layer": layer_index(module),
                    "shape": shape,
                    "dtype": dtype,
                    "weights": {k: v.to_dict() for k, v in stats.items()},
                }
            )

    if not rows:  # a report of nothing would read as "all clear"
        why = "; ".join(f"{s['name']} ({s['reason']})" for s in skipped[:5])
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        raise FP8ConfigError(
            "no linear weight to analyze"
            + (
                f": every 2-D weight was skipped: {why}{more}"
                if skipped
                else ": the checkpoint holds no 2-D floating-point `.weight` tensor"
            ),
            key="CHECKPOINT",
            value=str(checkpoint),
        )
    rows.sort(key=lambda r: natural_key(r["module"]))
    act_info = None
    if activations:
        act, out, act_info = activation_stats(checkpoint, specs, samples, max_tokens, progress)
        joined = join_activation_names([r["module"] for r in rows], act)
        by_module = {r["module"]: r for r in rows}
        for a_name, w_name in joined.items():
            by_module[w_name]["activations"] = {k: v.to_dict() for k, v in act[a_name].items()}
            by_module[w_name]["outputs"] = {k: v.to_dict() for k, v in out[a_name].items()}
        act_info["unmatched_modules"] = sorted(set(act) - set(joined))

    modules = [r["module"] for r in rows]
    suggestions, summary = {}, {}
    thresholds = {
        s.name: default_threshold_db(s) if threshold_db is None else float(threshold_db)
        for s in specs
    }
    for spec in specs:
        flagged = []
        for r in rows:
            if is_flagged(r, spec.name, thresholds[spec.name]):
                flagged.append(r["module"])
                r.setdefault("flagged", []).append(spec.name)
        suggestions[spec.name] = suggest_bf16_layers(modules, flagged)
        summary[spec.name] = {
            "flagged": len(flagged),
            **summarize(rows, spec.name, "weights", "weight"),
        }
        if any("activations" in r for r in rows):
            summary[spec.name].update(summarize(rows, spec.name, "activations", "input"))
            summary[spec.name].update(summarize(rows, spec.name, "outputs", "output"))
    report: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "files": [str(f) for f in files],
        "recipes": [s.name for s in specs],
        "threshold_db": thresholds,
        "modules": rows,
        "skipped": skipped,
        "summary": summary,
        "suggestions": suggestions,
    }
    if act_info is not None:
        report["activations"] = act_info
    return report
