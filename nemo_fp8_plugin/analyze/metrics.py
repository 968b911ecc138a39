"""What ``nemo-fp8 analyze`` measures and how it judges it.

:class:`ErrorStats` accumulates the quantization error of a tensor (or of a layer's inputs
over batches): ``sqnr_db`` over the whole tensor, and ``max_rel_err`` / ``min_row_sqnr_db``
of its worst row (see the package docstring for why both). Recipes that quantize a role the
same way share one quantize-dequantize pass (:func:`quantizer_key`). A module is flagged
when a weight or input is below the threshold (tensor or worst row), or its GEMM output's
tensor SQNR is below the threshold minus :data:`OUTPUT_MARGIN_DB` (:func:`is_flagged`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..capabilities import capability
from ..errors import FP8ConfigError

if TYPE_CHECKING:
    import torch

    from ..numerics import QTensor
    from ..numerics.nvfp4 import NVFP4Tensor
    from ..spec import RecipeSpec

__all__ = [
    "DEFAULT_THRESHOLD_DB",
    "NVFP4_THRESHOLD_DB",
    "default_threshold_db",
    "OUTPUT_MARGIN_DB",
    "KINDS",
    "ErrorStats",
    "quantizer_key",
    "quantize_dequantize",
    "stats_for",
    "weight_stats",
    "resolve_recipes",
    "is_flagged",
    "judged",
    "summarize",
]

DEFAULT_THRESHOLD_DB = 25.0
"""Flag a module whose SQNR under a recipe is below this (dB). E4M3's 3 mantissa bits give
~31 dB on well-scaled data; 25 dB (torchao's floor for FP8 casts) is 4x that noise power.
The default for every E4M3 recipe (per-tensor, block, MX)."""

NVFP4_THRESHOLD_DB = 13.0
"""NVFP4's default: E2M1 elements (1 mantissa bit) under E4M3 scales of 16 values give ~19 dB
on Gaussian data (measured: 19.06 per tensor, 18.40 worst row of a 512x1024 randn weight), so
25 dB would flag every healthy module. The same rule as E4M3's: 4x the floor's noise (-6 dB)."""


def default_threshold_db(spec: RecipeSpec) -> float:
    """The flagging threshold for ``spec`` when ``--threshold`` is not given: by its element
    format (NVFP4's floor is ~12 dB below E4M3's)."""
    return NVFP4_THRESHOLD_DB if capability(spec.scaling).is_nvfp4 else DEFAULT_THRESHOLD_DB


OUTPUT_MARGIN_DB = 3.0
"""An FP8 GEMM quantizes two operands, each adding its own noise: the output's ideal SQNR is
~3 dB below one operand's, so outputs are held to ``threshold - OUTPUT_MARGIN_DB``."""

KINDS = ("weights", "activations", "outputs")
"""The measured operands of a module row, in report order: its weight, its inputs, its GEMM's
output (the last two only with activations)."""


@dataclass
class ErrorStats:
    """Running quantization error of one tensor (or of one layer's inputs over batches)."""

    signal: float = 0.0
    """Sum of x^2 over everything added (fp64)."""
    noise: float = 0.0
    """Sum of (x - dq(q(x)))^2 over everything added (fp64)."""
    max_rel_err: float = 0.0
    """The largest per-row ||x - dq(q(x))|| / ||x|| seen (rows with no signal left out)."""
    rows: int = 0
    """Rows added (output channels of a weight, tokens of an input)."""

    @property
    def sqnr_db(self) -> float:
        """10 log10(signal / noise); inf when nothing was lost, NaN when there was nothing."""
        if self.noise == 0.0:
            return math.inf if self.signal > 0 else math.nan
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)

    def add(
        self, x: torch.Tensor, dq: torch.Tensor, row_signal: torch.Tensor | None = None
    ) -> None:
        """Accumulate ``x`` [rows, cols] against its quantize-dequantize ``dq``.
        ``row_signal`` (sum of x^2 per row) may be passed when several recipes share ``x``."""
        xf = x.float()
        # Per-row sums in fp32 (rows are at most a few ten thousand elements), totals in fp64.
        row_sig = xf.square().sum(dim=-1) if row_signal is None else row_signal
        row_err = (xf - dq.float()).square().sum(dim=-1)
        self.signal += float(row_sig.double().sum())
        self.noise += float(row_err.double().sum())
        nz = row_sig > 0
        if bool(nz.any()):
            self.max_rel_err = max(
                self.max_rel_err, float((row_err[nz] / row_sig[nz]).sqrt().max())
            )
        self.rows += int(xf.shape[0])

    @property
    def min_row_sqnr_db(self) -> float:
        """The worst row's SQNR, ``-20 log10(max_rel_err)``."""
        return -20.0 * math.log10(self.max_rel_err) if self.max_rel_err > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """``sqnr_db`` is None when there is no noise at all (``exact``) or no signal."""
        db, row = self.sqnr_db, self.min_row_sqnr_db
        out: dict[str, Any] = {
            "sqnr_db": round(db, 4) if math.isfinite(db) else None,
            "max_rel_err": self.max_rel_err,
            "min_row_sqnr_db": round(row, 4) if math.isfinite(row) else None,
        }
        if self.noise == 0.0 and self.signal > 0:
            out["exact"] = True
        return out


def quantizer_key(spec: RecipeSpec, role: str) -> tuple:
    """Recipes that quantize a role identically share one key (delayed and current scaling
    quantize a weight alike; see :func:`quantize_dequantize`)."""
    block = spec.weight_block if role == "weight" else spec.activation_block
    row = capability(spec.scaling)
    kind = "tensor" if row.per_tensor else spec.scaling
    return (kind, block, spec.pow2_scales if row.fixed_pow2 is None else row.fixed_pow2)


def quantize_dequantize(x: torch.Tensor, spec: RecipeSpec, role: str) -> torch.Tensor:
    """Quantize-dequantize ``x`` (2-D) as the recipe quantizes a ``role`` operand."""
    from ..numerics import quantize_blockwise, quantize_mxfp8, quantize_per_tensor
    from ..numerics.reference import check_block

    row = capability(spec.scaling)
    q: QTensor | NVFP4Tensor
    if row.per_tensor:
        # Delayed scaling's weight scale comes from the amax history, which for a weight at
        # steady state equals its current amax: current scaling is the faithful stand-in.
        q = quantize_per_tensor(x, "e4m3", pow2_scales=spec.pow2_scales)
        return q.dequantize()
    # a tiled kind's tile (a spec without one is refused, naming ``block``)
    block = check_block(spec.weight_block if role == "weight" else spec.activation_block)
    if row.is_block:
        q = quantize_blockwise(x, block=block, fmt="e4m3", pow2_scales=spec.pow2_scales)
    elif row.is_nvfp4:  # TE's NVFP4, bit-exact (forward operands: no RHT)
        from ..numerics import quantize_nvfp4

        q = quantize_nvfp4(x, block)
    else:
        q = quantize_mxfp8(x, block=block, fmt="e4m3")
    return q.dequantize()


def stats_for(
    mats: Iterable[torch.Tensor],
    specs: Sequence[RecipeSpec],
    role: str,
    into: dict[str, ErrorStats] | None = None,
) -> dict[str, ErrorStats]:
    """Error of ``mats`` (2-D tensors) under each recipe, quantizing once per distinct
    quantizer."""
    out = into if into is not None else {}
    by_key: dict[tuple, list] = {}
    for spec in specs:
        by_key.setdefault(quantizer_key(spec, role), []).append(spec)
    for m in mats:
        row_sig = m.float().square().sum(dim=-1)
        for group in by_key.values():
            dq = quantize_dequantize(m, group[0], role)
            for spec in group:
                out.setdefault(spec.name, ErrorStats()).add(m, dq, row_sig)
    return out


def weight_stats(tensor: torch.Tensor, specs: Sequence[RecipeSpec]) -> dict[str, ErrorStats]:
    import torch

    x = tensor if tensor.dtype in (torch.float32, torch.bfloat16, torch.float16) else tensor.float()
    mats = [x] if x.dim() == 2 else list(x)  # 3-D: a stack of expert matrices, one by one
    return stats_for(mats, specs, "weight")


def resolve_recipes(recipes: Iterable[Any] | None) -> list[RecipeSpec]:
    """The specs to analyze: ``--recipes``' names or specs (duplicates dropped), or every
    registered recipe by name; a bad name is an error naming ``--recipes``."""
    from ..registry import default_registry, get_recipe

    if recipes is None:
        return [s for s in (default_registry().get(n) for n in sorted(default_registry().names()))]
    out: list[RecipeSpec] = []
    for r in recipes:
        try:
            spec = get_recipe(r)
        except FP8ConfigError as err:  # the user typed it in --recipes, so name that
            raise FP8ConfigError(
                err.bare_message, key="--recipes", value=r, hint=err.hint
            ) from None
        if spec.name not in [s.name for s in out]:
            out.append(spec)
    if not out:
        raise FP8ConfigError("no recipe to analyze", key="--recipes")
    return out


def is_flagged(row: dict[str, Any], recipe: str, threshold_db: float) -> bool:
    """Below the threshold: a weight or input (tensor or worst row), or the GEMM output
    (tensor; a single token's output row can be small by cancellation, so it is reported but
    not judged)."""
    for kind in ("weights", "activations"):
        if kind in row and any(
            v is not None and v < threshold_db
            for v in (row[kind][recipe]["sqnr_db"], row[kind][recipe]["min_row_sqnr_db"])
        ):
            return True
    if "outputs" in row:
        v = row["outputs"][recipe]["sqnr_db"]
        if v is not None and v < threshold_db - OUTPUT_MARGIN_DB:
            return True
    return False


def _lowest(stats: dict[str, Any]) -> float | None:
    vals = [v for v in (stats.get("sqnr_db"), stats.get("min_row_sqnr_db")) if v is not None]
    return min(vals) if vals else None


def judged(stats: dict[str, Any], kind: str) -> float | None:
    """The value the flagging judges: the lower of tensor and worst-row SQNR for weights and
    inputs, the tensor SQNR for GEMM outputs."""
    return stats.get("sqnr_db") if kind == "outputs" else _lowest(stats)


def summarize(rows: list[dict[str, Any]], recipe: str, kind: str, word: str) -> dict[str, Any]:
    """Lowest (tensor or row) SQNR with its module, and the median tensor SQNR."""
    lows = [
        (v, r["module"])
        for r in rows
        if kind in r
        for v in (judged(r[kind][recipe], kind),)
        if v is not None
    ]
    med = sorted(
        v for r in rows if kind in r for v in (r[kind][recipe]["sqnr_db"],) if v is not None
    )
    if not lows:
        return {}
    low, module = min(lows)
    return {
        f"min_{word}_sqnr_db": low,
        f"worst_{word}_module": module,
        f"median_{word}_sqnr_db": med[len(med) // 2] if med else None,
    }
