"""The statistics of ``nemo-fp8 rl-check``: intervals over seeds, power, and the verdicts the
tables and docs/rl.md print, with how firmly each holds.

Pure Python (no torch): docs/rl.md's renderer and the tests use it on a JSON alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

__all__ = [
    "t_quantile_975",
    "t_interval",
    "power_analysis",
    "sd_upper_bound",
    "verdict",
    "FIRM_MARGIN_SE",
]

# two-sided 95% quantiles of Student's t, by degrees of freedom
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
    2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
    2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
    2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile (a table to 30 degrees of freedom, then the Cornish-Fisher
    expansion, within 1e-3 of the exact value)."""
    if df < 1:
        return float("nan")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Iterable[float]) -> dict[str, float]:
    """Mean, standard error and the 95% t-interval half-width over ``values`` (seeds).
    One value: ``se`` and ``ci95`` are NaN (no interval from one seed)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return {"mean": float("nan"), "se": float("nan"), "ci95": float("nan"), "n": 0}
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "se": float("nan"), "ci95": float("nan"), "n": 1}
    se = statistics.stdev(xs) / math.sqrt(n)
    return {"mean": mean, "se": se, "ci95": t_quantile_975(n - 1) * se, "n": n}


_Z_POWER = {0.8: 0.841621, 0.9: 1.281552}  # one-sided normal quantiles of the power


def power_analysis(
    paired_sd: float, gap: float = 0.03, power: float = 0.8, seeds: int | None = None
) -> dict[str, Any]:
    """How many seeds a paired comparison with per-seed SD ``paired_sd`` needs for ``gap``.

    * ``seeds_to_resolve``: the fewest seeds whose 95% t-interval half-width,
      ``t(0.975, n-1) * sd / sqrt(n)``, is at most ``gap`` (a measured difference of ``gap``
      then excludes zero);
    * ``seeds_for_power``: the fewest seeds that detect a true difference of ``gap`` with
      probability ``power`` (two-sided, 5%): ``(t(0.975, n-1) + z(power)) * sd / sqrt(n) <=
      gap``;
    * with ``seeds``: ``half_width`` of that many seeds and ``resolves`` (half-width <= gap).

    ``paired_sd`` NaN (fewer than two seeds): the counts are None."""
    if power not in _Z_POWER:
        raise ValueError(f"power must be one of {sorted(_Z_POWER)}, got {power!r}")
    if not gap > 0:
        raise ValueError(f"gap must be positive, got {gap!r}")
    out: dict[str, Any] = {"paired_sd": paired_sd, "gap": gap, "power": power}

    def fewest(extra: float) -> int | None:
        if not math.isfinite(paired_sd):
            return None
        if paired_sd == 0:
            return 2
        n = 2
        while (t_quantile_975(n - 1) + extra) * paired_sd / math.sqrt(n) > gap:
            n += 1
        return n

    out["seeds_to_resolve"] = fewest(0.0)
    out["seeds_for_power"] = fewest(_Z_POWER[power])
    if seeds is not None:
        half = t_quantile_975(seeds - 1) * paired_sd / math.sqrt(seeds) if seeds > 1 else math.nan
        out["seeds"] = seeds
        out["half_width"] = half
        out["resolves"] = bool(math.isfinite(half) and half <= gap)
    return out


def sd_upper_bound(sd: float, df: int, z: float = 1.281552) -> float:
    """One-sided upper confidence bound of a standard deviation estimated with ``df`` degrees
    of freedom, ``sd * sqrt(df / chi2_lower(df))``; ``z`` is the normal quantile of the level
    (1.281552: 90%). The chi-square quantile is Wilson and Hilferty's, within 0.2% of the exact
    one from 3 degrees of freedom (7 df, 10%: 2.8356 vs 2.8331). NaN below 1 df."""
    if df < 1 or not math.isfinite(sd):
        return float("nan")
    c = 2.0 / (9.0 * df)
    chi2 = df * max(1.0 - c - z * math.sqrt(c), 1e-9) ** 3
    return sd * math.sqrt(df / chi2)


FIRM_MARGIN_SE = 2.0
"""A verdict is *firm* when its interval is at least this many standard errors of the mean
difference away from every threshold whose crossing would change it. Another run of the same
design (another CPU's rounding sends the trajectories elsewhere: a new draw of them) has a
mean that differs from this one's by about ``sqrt(2)`` standard errors (SD of the difference
of two independent means), so a margin of 2 keeps the verdict in about 92% of reruns for
one threshold; a smaller margin may not hold on another machine."""


def verdict(d: dict[str, float] | None, gap: float) -> dict[str, Any]:
    """What a paired interval ``d`` (``{mean, se, ci95}`` of a difference) says about 0 and a
    ``gap``: ``word`` is ``above`` / ``below`` (the interval excludes 0), ``within`` (it lies
    inside ``±gap``), ``unresolved`` (it holds 0 and reaches past ``±gap``) or ``none`` (no
    interval: one seed). ``margin_se``: how far, in standard errors, an endpoint must move to
    change the word (the distance to the nearest threshold that matters: 0 for above, below,
    within and unresolved; ``±gap`` for within and unresolved); ``firm``: margin at least
    :data:`FIRM_MARGIN_SE`."""
    if d is None or not math.isfinite(d.get("ci95", math.nan)) or not d.get("se", 0) > 0:
        return {"word": "none", "margin_se": math.nan, "firm": False}
    lo, hi, se = d["mean"] - d["ci95"], d["mean"] + d["ci95"], d["se"]
    if lo > 0 or hi < 0:
        word, margin = ("above" if lo > 0 else "below"), min(abs(lo), abs(hi))
    elif -gap <= lo and hi <= gap:
        word, margin = "within", min(hi, -lo, gap - hi, gap + lo)
    else:
        word, margin = "unresolved", min(hi, -lo, max(hi - gap, -gap - lo))
    margin_se = margin / se
    return {"word": word, "margin_se": margin_se, "firm": margin_se >= FIRM_MARGIN_SE}
