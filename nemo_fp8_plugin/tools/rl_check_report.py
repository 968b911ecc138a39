"""What ``nemo-fp8 rl-check`` reports: the summary of a run's records, its tables, its JSON
document and its curves.

:func:`summarize` is a pure function of the records and the settings (a JSON document gives
them back through :func:`result_from_json`), so the page that cites a run can be re-rendered
from its JSON alone.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

from .rl_check import (
    ARM_SPECS,
    CheckResult,
    CheckSettings,
    SeedArmResult,
    StepRecord,
    attribution_index,
    mismatch_bound,
)
from .rl_check_stats import power_analysis, sd_upper_bound, t_interval, verdict

__all__ = [
    "REFERENCE",
    "NIGHTLY_CHECKS",
    "summarize",
    "render_tables",
    "result_from_json",
    "to_json",
    "plot_curves",
]

REFERENCE = ("fp8-gen-is", "fp8-e2e-is")
"""NVIDIA's comparison, paired by seed: FP8 generation only and FP8 end to end, both with
importance sampling (NeMo RL runs FP8 generation only with the correction on). Llama 3.1 8B:
0.586 and 0.613 validation accuracy, a gap of 0.027 (BF16 0.616)."""

NIGHTLY_CHECKS = {
    "generation": "median < {b:g} and share of steps >= {b:g} < 0.1",
    "end_to_end": "mean < {b:g} and last step < {b:g}",
    "kv_cache": "median < {b:g}",
}
"""What NeMo RL's nightly suite of each kind checks on a run's per-step
``token_mult_prob_error`` (:mod:`.rl_check_bounds` names the scripts); here each seed of an
arm is one run."""

_COSTS = ("generate_s", "train_s", "quantize_s", "load_s", "kv_calibration_s", "kv_refresh_s")


def _check_kind(arm: str) -> str:
    a = ARM_SPECS.get(arm)
    if a is not None and a.fp8_kv_cache:
        return "kv_cache"
    if a is not None and a.fp8_generation and not a.fp8_training:
        return "generation"
    return "end_to_end"  # bf16 too: the plain end-to-end rule is the strictest on it


def _passes(kind: str, errors: list[float], bound: float) -> bool:
    if not errors:
        return False
    if kind == "generation":
        share = sum(e >= bound for e in errors) / len(errors)
        return statistics.median(errors) < bound and share < 0.1
    if kind == "kv_cache":
        return statistics.median(errors) < bound
    return sum(errors) / len(errors) < bound and errors[-1] < bound


def summarize(result: CheckResult) -> dict[str, Any]:
    """Per arm: final and start reward (mean, 95% t-interval over seeds), the paired change
    against the start and against ``bf16`` with its verdict, mismatch means, medians and worst
    step against NeMo RL's nightly checks, the attribution, cost shares; for the run: the
    reference comparison (:data:`REFERENCE`), power, CPU time."""
    arms: dict[str, Any] = {}
    s = result.settings
    base = {r.seed: r for r in result.of("bf16")}
    for arm in result.arms:
        runs = result.of(arm)
        steps = [st for r in runs for st in r.steps]
        step_total = sum(st.step_s for st in steps)
        errors = [st.token_mult_prob_error for st in steps]
        row: dict[str, Any] = {
            "arm": arm,
            "seeds": [r.seed for r in runs],
            "final_reward": t_interval(r.final_reward for r in runs),
            "start_reward": t_interval(r.start_reward for r in runs),
            "gain": t_interval(r.final_reward - r.start_reward for r in runs),
            "train_reward_first": t_interval(_head(r, "reward") for r in runs),
            "train_reward_last": t_interval(_tail(r, "reward") for r in runs),
            "token_mult_prob_error": t_interval(r.mean("token_mult_prob_error") for r in runs),
            "token_mult_prob_error_median": statistics.median(errors) if errors else math.nan,
            "token_mult_prob_error_max": max(errors, default=math.nan),
            "gen_kl_error": t_interval(r.mean("gen_kl_error") for r in runs),
            "truncated_fraction": t_interval(r.mean("truncated_fraction") for r in runs),
            "step_s": step_total / len(steps) if steps else math.nan,
            "shares": {
                c[:-2]: (sum(getattr(st, c) for st in steps) / step_total if step_total else 0.0)
                for c in _COSTS
            },
            "refit_mib": runs[0].steps[-1].refit_bytes / 2**20 if runs and runs[0].steps else 0.0,
            "cpu_seconds": sum(r.cpu_seconds for r in runs),
        }
        paired = [(r.final_reward - base[r.seed].final_reward) for r in runs if r.seed in base]
        row["final_vs_bf16"] = t_interval(paired) if arm != "bf16" and paired else None
        row["final_vs_bf16_sd"] = statistics.stdev(paired) if len(paired) >= 2 else math.nan
        row["final_vs_bf16_verdict"] = (
            verdict(row["final_vs_bf16"], s.reward_gap) if arm != "bf16" else None
        )
        gain = row["gain"]
        row["learns"] = (
            None if s.smoke else bool(gain["n"] >= 2 and gain["mean"] >= 3 * gain["se"] > 0)
        )
        row["nightly_bound"] = _bound_row(arm, runs)
        row["eval_overlap"] = max((r.eval_overlap for r in runs), default=-1)
        row["attribution"] = _attribution_summary(runs)
        kv = [r.kv_scales for r in runs if r.kv_scales]
        row["kv_scales_last"] = kv[0] if kv else {}
        arms[arm] = row
    warmups = {r.seed: r.warmup_cpu_seconds for r in result.runs}
    return {
        "arms": arms,
        "reference": _reference(result),
        "seconds": result.seconds,
        # CPU time is what the run costs whatever shares the machine: on N idle cores with N
        # worker processes the wall time is about cpu_seconds / N (seeds spread evenly)
        "cpu_seconds": sum(r.cpu_seconds for r in result.runs) + sum(warmups.values()),
        "load_average": list(result.load_average),
        "eval_disjoint": all(r.eval_overlap == 0 for r in result.runs),
        "power": _power(result, arms),
    }


def _reference(result: CheckResult) -> dict[str, Any] | None:
    """NVIDIA's comparison: ``fp8-e2e-is`` minus ``fp8-gen-is``, final reward, paired."""
    gen_only, e2e = REFERENCE
    if not {gen_only, e2e} <= set(result.arms):
        return None
    s = result.settings
    other = {r.seed: r.final_reward for r in result.of(gen_only)}
    diffs = [r.final_reward - other[r.seed] for r in result.of(e2e) if r.seed in other]
    d = t_interval(diffs)
    sd = statistics.stdev(diffs) if len(diffs) >= 2 else math.nan
    return {
        "arms": list(REFERENCE),
        "difference": d,
        "paired_sd": sd,
        "verdict": verdict(d, s.reward_gap),
        "power": power_analysis(sd, s.reward_gap, seeds=len(diffs)),
        "nvidia": {"fp8-gen-is": 0.586, "fp8-e2e-is": 0.613, "bf16": 0.616},
    }


def _bound_row(arm: str, runs: list[SeedArmResult]) -> dict[str, Any]:
    """NeMo RL's nightly ``token_mult_prob_error`` bound against the arm's steps, and its
    suite's check (:data:`NIGHTLY_CHECKS`) on each seed's run."""
    bound = mismatch_bound(arm)
    errors = [st.token_mult_prob_error for r in runs for st in r.steps]
    above = sum(e >= bound for e in errors)
    kind = _check_kind(arm)
    passing = sum(_passes(kind, [st.token_mult_prob_error for st in r.steps], bound) for r in runs)
    return {
        "bound": bound,
        "steps": len(errors),
        "steps_above": above,
        "share_above": above / len(errors) if errors else math.nan,
        "median": statistics.median(errors) if errors else math.nan,
        "max": max(errors, default=math.nan),
        "check": NIGHTLY_CHECKS[kind].format(b=bound),
        "seeds_passing": passing,
        "seeds": len(runs),
    }


def _attribution_summary(runs: list[SeedArmResult]) -> list[dict[str, Any]]:
    """Per candidate: the FP8 modules it keeps in BF16 (``modules``; the ``kv_cache``
    candidate keeps none: its queries, keys and values) and the mean over seeds of the
    attributed ``token_mult_prob_error`` and of the share of the excess it removes, ranked by
    that share (``none`` first)."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        for row in r.attribution:
            by_name.setdefault(row["bf16"], []).append(row)
    rows = []
    for name, xs in by_name.items():
        row = {k: t_interval(x[k] for x in xs) for k in xs[0] if k not in ("bf16", "modules")}
        rows.append({"bf16": name, "modules": xs[0].get("modules", []), **row})
    key = "both_sides_removed" if rows and "both_sides_removed" in rows[0] else "removed"
    rows.sort(key=lambda r: (r["bf16"] != "none", -r[key]["mean"]))
    return rows


def _power(result: CheckResult, arms: dict[str, Any]) -> dict[str, Any]:
    """The power statement from this run's own paired SDs of final reward vs ``bf16``: per
    arm, and pooled over the FP8 arms (root mean square of their SDs)."""
    s = result.settings
    sds = {a: r["final_vs_bf16_sd"] for a, r in arms.items() if a != "bf16"}
    finite = [v for v in sds.values() if math.isfinite(v)]
    pooled = math.sqrt(sum(v * v for v in finite) / len(finite)) if finite else math.nan
    out = power_analysis(pooled, s.reward_gap, seeds=s.seeds)
    # an SD from a few seeds is itself uncertain: the seeds that resolve the gap even if the
    # true SD is at the estimate's one-sided 90% upper confidence bound
    upper = sd_upper_bound(pooled, s.seeds - 1)
    out["paired_sd_upper90"] = upper
    out["seeds_to_resolve_upper90"] = power_analysis(upper, s.reward_gap)["seeds_to_resolve"]
    return {
        "pooled": out,
        "per_arm": {a: power_analysis(v, s.reward_gap, seeds=s.seeds) for a, v in sds.items()},
    }


def _head(r: SeedArmResult, attr: str, frac: float = 0.1) -> float:
    values = [getattr(s, attr) for s in r.steps]
    k = max(1, int(len(values) * frac))
    return sum(values[:k]) / k if values else math.nan


def _tail(r: SeedArmResult, attr: str, frac: float = 0.1) -> float:
    values = [getattr(s, attr) for s in r.steps]
    k = max(1, int(len(values) * frac))
    return sum(values[-k:]) / k if values else math.nan


# --------------------------------------------------------------------------- tables


def _ci(x: dict[str, float] | None, fmt: str = ".3f") -> str:
    if x is None:
        return "-"
    if math.isnan(x["ci95"]):
        return f"{x['mean']:{fmt}}"
    return f"{x['mean']:{fmt}} ± {x['ci95']:{fmt}}"


def verdict_text(v: dict[str, Any] | None, gap: float) -> str:
    """A verdict of :func:`.rl_check_stats.verdict` in words, with its margin."""
    if v is None:
        return "-"
    if v["word"] == "none":
        return "no interval (one seed)"
    word = {
        "above": "above",
        "below": "below",
        "within": f"within ±{gap:g}",
        "unresolved": "unresolved",
    }[v["word"]]
    firm = "" if v["firm"] else ", not firm"
    return f"{word} ({v['margin_se']:.1f} SE{firm})"


def machine_line(environment: dict[str, Any] | None) -> str:
    """Which CPU (and vector ISA) produced a run's figures."""
    if not environment:
        return "machine not recorded"
    return (
        f"{environment.get('cpu', '?')}, torch {environment.get('torch', '?')} "
        f"(CPU ISA {environment.get('isa', '?')})"
    )


def render_tables(
    result: CheckResult,
    summary: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
) -> str:
    """The summary tables, as Markdown; ``environment`` (:func:`.harness.environment`) names
    the machine."""
    summary = summary or summarize(result)
    s = result.settings
    n = s.seeds
    cost = f"{result.seconds:.0f} s wall"
    if "cpu_seconds" in summary:
        cost += f", {summary['cpu_seconds']:.0f} CPU s"
    load = summary.get("load_average") or []
    if len(load) == 2 and all(math.isfinite(x) for x in load):
        cost += f" (load average {load[0]:.1f} at the start, {load[1]:.1f} at the end)"
    lines = [
        f"rl-check: {len(result.arms)} arms x {n} seed(s) x {s.steps} GRPO steps "
        f"({s.prompts_per_step} prompts x {s.generations_per_prompt} samples, answers of "
        f"{s.digits} tokens), recipe {s.recipe}, generation numerics {s.generation_numerics}; "
        f"{cost}; on {machine_line(environment)}",
        "",
    ]
    if s.smoke:
        lines += [
            "SMOKE RUN (--quick): too few and too small steps to learn; the rewards and the "
            "verdicts say nothing about FP8 (run without --quick for that).",
            "",
        ]
    disjoint = summary.get("eval_disjoint")
    gap = s.reward_gap
    lines += [
        f"Reward: greedy, {s.eval_prompts} held-out prompts "
        f"({'none' if disjoint else 'SOME'} of them among the seed's training prompts), by the "
        f"arm's engine; mean ± 95% t-interval over {n} seed(s). vs bf16: paired by seed; the "
        f"verdict's margin is the distance to the nearest threshold (0, ±{gap:g}) in standard "
        "errors. Power: the arm's own paired SD, and the seeds that resolve ±"
        f"{gap:g} with it.",
        "",
        "| arm | start | final | gain | learns (gain >= 3 SE) | final - bf16 | vs bf16 "
        "| paired SD (seeds) |",
        "|---|---:|---:|---:|---|---:|---|---:|",
    ]
    per_arm = summary["power"]["per_arm"]
    for arm in result.arms:
        r = summary["arms"][arm]
        p = per_arm.get(arm)
        power = (
            f"{p['paired_sd']:.4f} ({p['seeds_to_resolve']})"
            if p and math.isfinite(p["paired_sd"])
            else "-"
        )
        lines.append(
            f"| {arm} | {_ci(r['start_reward'])} | {_ci(r['final_reward'])} | "
            f"{_ci(r['gain'])} | {_learns(r['learns'])} | {_ci(r['final_vs_bf16'])} | "
            f"{verdict_text(r['final_vs_bf16_verdict'], gap)} | {power} |"
        )
    lines += ["", _reference_line(summary.get("reference"), gap)]
    lines += ["", _power_line(summary["power"]["pooled"])]
    lines += [
        "",
        "Mismatch on the sampled tokens: token_mult_prob_error, mean over steps then mean ± "
        "95% t-interval over seeds; median and worst over all steps; NeMo RL's nightly check "
        "of the arm's kind applied to each seed's run.",
        "",
        "| arm | mean | median | worst | steps >= bound | NeMo RL's check: seeds passing "
        "| gen_kl_error | TIS-clamped tokens |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for arm in result.arms:
        r = summary["arms"][arm]
        b = r["nightly_bound"]
        lines.append(
            f"| {arm} | {_ci(r['token_mult_prob_error'], '.5f')} | "
            f"{r['token_mult_prob_error_median']:.5f} | {r['token_mult_prob_error_max']:.4f} | "
            f"{b['steps_above']}/{b['steps']} | {b['check']}: {b['seeds_passing']}/{b['seeds']} "
            f"| {_ci(r['gen_kl_error'], '.2e')} | {_ci(r['truncated_fraction'], '.2%')} |"
        )
    lines += _attribution_lines(result, summary)
    lines += [
        "",
        "Measured cost of each phase, share of the step's wall time (all steps and seeds).",
        "",
        "| arm | step (s) | generate | train | trainer quantize | engine load | "
        "KV calibration | KV refresh | refit payload |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in result.arms:
        r = summary["arms"][arm]
        sh = r["shares"]
        pct = {k: (f"{v:.2%}" if v else "-") for k, v in sh.items()}
        lines.append(
            f"| {arm} | {r['step_s']:.3f} | {pct['generate']} | {pct['train']} | "
            f"{pct['quantize']} | {pct['load']} | {pct['kv_calibration']} | "
            f"{pct['kv_refresh']} | {r['refit_mib']:.2f} MiB |"
        )
    return "\n".join(lines) + "\n"


def _learns(value: bool | None) -> str:
    return "- (smoke run)" if value is None else ("yes" if value else "no")


def _reference_line(ref: dict[str, Any] | None, gap: float) -> str:
    if ref is None:
        return "NVIDIA's comparison: needs the arms " + " and ".join(REFERENCE) + "."
    gen_only, e2e = ref["arms"]
    p = ref["power"]
    need = (
        f"; paired SD {ref['paired_sd']:.4f}: {p['seeds_to_resolve']} seeds resolve ±{gap:g}"
        if math.isfinite(ref["paired_sd"])
        else ""
    )
    return (
        f"NVIDIA's comparison, {e2e} - {gen_only} (FP8 end to end vs generation only, both "
        f"with importance sampling; Llama 3.1 8B: 0.613 - 0.586 = +0.027), final reward "
        f"paired by seed: {_ci(ref['difference'])}, {verdict_text(ref['verdict'], gap)}{need}."
    )


def _power_line(p: dict[str, Any]) -> str:
    sd = p["paired_sd"]
    if not math.isfinite(sd):
        return "Power: needs two or more seeds."
    word = "resolves" if p["resolves"] else "does NOT resolve"
    return (
        f"Power: paired SD of final reward vs bf16 {sd:.4f} (pooled over the FP8 arms); "
        f"{p['seeds']} seeds give a 95% half-width of {p['half_width']:.4f}, which "
        f"{word} a {p['gap']:g} gap; resolving it needs {p['seeds_to_resolve']} seeds, "
        f"detecting it with {p['power']:.0%} power {p['seeds_for_power']}."
    )


def _attribution_lines(result: CheckResult, summary: dict[str, Any]) -> list[str]:
    rows = {a: summary["arms"][a]["attribution"] for a in result.arms}
    rows = {a: r for a, r in rows.items() if r}
    if not rows:
        return []
    step = attribution_index(result.settings)
    lines = [
        "",
        f"Mismatch attribution at step {step}: token_mult_prob_error with one candidate kept "
        "in BF16 on the generation side (trainer unchanged; end-to-end arms*: on both sides); "
        "the share of the arm's excess (error - 1) it removes, mean over seeds. Top three "
        "per arm.",
        "",
        "| arm | as run | 1st | 2nd | 3rd |",
        "|---|---:|---|---|---|",
    ]
    for arm, r in rows.items():
        key = "both_sides_removed" if "both_sides_removed" in r[0] else "removed"
        top = [f"{x['bf16']} {x[key]['mean']:+.0%}" for x in r if x["bf16"] != "none"][:3]
        if key != "removed":
            arm = f"{arm}*"
        top += ["-"] * (3 - len(top))
        lines.append(
            f"| {arm} | {r[0]['token_mult_prob_error']['mean']:.5f} | " + " | ".join(top) + " |"
        )
    return lines


# --------------------------------------------------------------------------- JSON


def result_from_json(data: dict[str, Any]) -> CheckResult:
    """The :class:`CheckResult` of a ``--json`` document, records included (its summary is
    recomputed by :func:`summarize`: a pure function of the records and the settings)."""
    runs = []
    for r in data["runs"]:
        run = SeedArmResult(
            r["arm"],
            r["seed"],
            steps=[StepRecord(**st) for st in r["steps"]],
            start_reward=r["start_reward"],
            final_reward=r["final_reward"],
            kv_scales=r["kv_scales"],
            seconds=r["seconds"],
            warmup_steps=r["warmup_steps"],
            cpu_seconds=r.get("cpu_seconds", 0.0),
            warmup_cpu_seconds=r.get("warmup_cpu_seconds", 0.0),
            eval_overlap=r["eval_overlap"],
            attribution=r["attribution"],
        )
        runs.append(run)
    summary = data.get("summary", {})
    return CheckResult(
        CheckSettings(**data["settings"]),
        tuple(data["arms"]),
        runs,
        seconds=summary.get("seconds", 0.0),
        load_average=tuple(summary.get("load_average", ())),
    )


def to_json(result: CheckResult, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` document (without the environment, which the CLI adds)."""
    return {
        "settings": asdict(result.settings),
        "arms": list(result.arms),
        "summary": summary or summarize(result),
        "runs": [
            {
                "arm": r.arm,
                "seed": r.seed,
                "start_reward": r.start_reward,
                "final_reward": r.final_reward,
                "seconds": r.seconds,
                "cpu_seconds": r.cpu_seconds,
                "warmup_cpu_seconds": r.warmup_cpu_seconds,
                "warmup_steps": r.warmup_steps,
                "kv_scales": r.kv_scales,
                "eval_overlap": r.eval_overlap,
                "attribution": r.attribution,
                "steps": [asdict(st) for st in r.steps],
            }
            for r in result.runs
        ],
    }


# --------------------------------------------------------------------------- picture


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_curves(result: CheckResult, path, window: int | None = None):
    """Three panels, one line per arm (mean over seeds), written atomically to ``path`` as PNG:
    the training reward (moving average over ``window`` steps, band: 95% t-interval over seeds);
    the same minus the ``bf16`` arm's, paired by seed (band likewise); and
    ``token_mult_prob_error - 1`` per step on a log scale (band: lowest to highest seed)."""
    from .harness import pyplot, write_png

    plt = pyplot()
    s = result.settings
    window = window or max(1, s.steps // 12)
    fig, (ax_r, ax_d, ax_m) = plt.subplots(1, 3, figsize=(13, 3.8), dpi=72)
    colors = plt.get_cmap("tab10")
    base = {r.seed: [st.reward for st in r.steps] for r in result.of("bf16")}

    def band(ax, x, curves, color, label, spread):
        mean = [sum(col) / len(col) for col in zip(*curves)]
        ax.plot(x, mean, color=color, label=label, lw=1.3)
        if len(curves) < 2:
            return
        if spread == "ci":
            stats = [t_interval(col) for col in zip(*curves)]
            lo = [c["mean"] - c["ci95"] for c in stats]
            hi = [c["mean"] + c["ci95"] for c in stats]
        else:
            lo = [min(col) for col in zip(*curves)]
            hi = [max(col) for col in zip(*curves)]
        ax.fill_between(x, lo, hi, color=color, alpha=0.12, lw=0)

    for i, arm in enumerate(result.arms):
        runs = result.of(arm)
        if not runs or not runs[0].steps:
            continue
        x = [st.step + 1 for st in runs[0].steps]
        rewards = [[st.reward for st in r.steps] for r in runs]
        band(ax_r, x, [_smooth(c, window) for c in rewards], colors(i), arm, "ci")
        if arm != "bf16" and base:
            diffs = [
                _smooth([a - b for a, b in zip(c, base[r.seed])], window)
                for c, r in zip(rewards, runs)
                if r.seed in base
            ]
            if diffs:
                band(ax_d, x, diffs, colors(i), arm, "ci")
        mult = [[max(st.token_mult_prob_error - 1.0, 1e-7) for st in r.steps] for r in runs]
        band(ax_m, x, mult, colors(i), arm, "range")
    ax_r.set_title(f"training reward ({window}-step moving average)", fontsize=10)
    ax_d.set_title("training reward minus bf16's, paired by seed", fontsize=10)
    ax_d.axhline(0.0, color="0.5", lw=0.8)
    ax_m.set_title("token_mult_prob_error - 1 (band: seed range)", fontsize=10)
    ax_m.set_yscale("log")
    for ax in (ax_r, ax_d, ax_m):
        ax.set_xlabel("GRPO step")
    ax_r.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"nemo-fp8 rl-check: {len(result.arms)} arms, mean over {s.seeds} seed(s); "
        "reward bands: 95% t-interval over seeds",
        fontsize=10,
    )
    fig.tight_layout()
    return write_png(path, fig)
