"""docs/rl.md's result blocks, rendered from an rl-check JSON (``scripts/render_rl_docs.py``).

The page marks each generated block ``<!-- rl-check:NAME -->`` ... ``<!-- /rl-check:NAME -->``;
:func:`rewrite` replaces their contents with :func:`render_blocks` of the JSON, so the page's
numbers, and every sentence whose truth depends on them ("inside the interval", "lower in 3
of 4 seeds"), come from the run the page cites. A test re-renders from the shipped JSON and
compares with the page, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

__all__ = [
    "BLOCKS",
    "render_blocks",
    "rewrite",
    "render_file",
    "command_of",
    "verdict_sentence",
]

BLOCKS = ("command", "tables", "findings", "cost")
"""The generated blocks, in page order."""

_MARK = re.compile(r"(<!-- rl-check:(\w+) -->\n)(.*?)(<!-- /rl-check:\2 -->)", re.S)


def _result(data: dict[str, Any]):
    """A :class:`~.rl_check.CheckResult` without step records: all the tables need."""
    from .rl_check import CheckResult, CheckSettings

    settings = CheckSettings(**data["settings"])
    summary = data["summary"]
    return CheckResult(settings, tuple(data["arms"]), [], summary["seconds"])


def command_of(data: dict[str, Any], json_path: str = "docs/data/rl_check.json") -> str:
    """The rl-check command line that reproduces the JSON's settings (options where they
    differ from the default run)."""
    from .rl_check import ARMS, FULL

    s = data["settings"]
    parts = ["nemo-fp8 rl-check"]
    if s.get("smoke"):
        parts.append("--quick")
    for key, flag in (("steps", "--steps"), ("seeds", "--seeds"), ("seed", "--seed")):
        if not s.get("smoke") and s[key] != getattr(FULL, key):
            parts.append(f"{flag} {s[key]}")
    for key, flag in (("recipe", "--recipe"), ("generation_numerics", "--generation-numerics")):
        if s[key] != getattr(FULL, key):
            parts.append(f"{flag} {s[key]}")
    if tuple(data["arms"]) != ARMS:
        parts.append("--arms " + ",".join(data["arms"]))
    parts += ["--json", json_path]
    where = Path(json_path)
    if where.parent.parts[-2:] == ("docs", "data"):
        # the pages' figures live in docs/img, not beside their data; elsewhere the CLI's
        # default (the JSON's path with .png) is where the figure belongs
        parts += ["--png", str(where.parent.parent / "img" / where.with_suffix(".png").name)]
    return " ".join(parts)


def verdict_sentence(d: dict[str, float] | None, gap: float) -> str:
    """What a paired interval ``d`` (final reward minus another arm's) says about 0 and
    ``gap``, with how firmly (:func:`.rl_check_stats.verdict`)."""
    from .rl_check_stats import FIRM_MARGIN_SE, verdict

    v = verdict(d, gap)
    if v["word"] == "none" or d is None:
        return "has no interval (one seed)"
    text = f"{d['mean']:+.3f} ± {d['ci95']:.3f}"
    what = {
        "above": "is above (the interval excludes 0)",
        "below": "is below (the interval excludes 0)",
        "within": f"is within {gap:g} (the interval lies inside ±{gap:g})",
        "unresolved": f"is unresolved (the interval holds 0 and reaches past ±{gap:g})",
    }[v["word"]]
    firm = (
        "firm"
        if v["firm"]
        else f"not firm: under {FIRM_MARGIN_SE:g} SE, another CPU may give another verdict"
    )
    return f"{what}: {text}, margin {v['margin_se']:.1f} SE, {firm}"


def _parity_word(diffs: list[float]) -> tuple[str, str]:
    """The verdict on per-seed differences (parity's mean mismatch minus NeMo RL's weights'):
    "lowers" / "raises" only when their 95% t-interval excludes 0; and the interval, as text."""
    from .rl_check_stats import t_interval, verdict

    d = t_interval(diffs)
    if not math.isfinite(d["ci95"]):
        return "does not measurably change", f"{d['mean']:+.5f} (one seed: no interval)"
    v = verdict(d, math.inf)
    text = f"{d['mean']:+.5f} ± {d['ci95']:.5f}, margin {v['margin_se']:.1f} SE"
    if v["word"] == "above":
        return "raises", text + " (the interval excludes 0)"
    if v["word"] == "below":
        return "lowers", text + " (the interval excludes 0)"
    return "does not measurably change", text + " (the interval holds 0)"


def _excess(row: dict[str, Any]) -> float:
    return row["token_mult_prob_error"]["mean"] - 1.0


def _per_seed_mismatch(data: dict[str, Any], arm: str) -> dict[int, float]:
    out = {}
    for r in data.get("runs", []):
        if r["arm"] == arm and r["steps"]:
            errs = [st["token_mult_prob_error"] for st in r["steps"]]
            out[r["seed"]] = sum(errs) / len(errs)
    return out


def _top(rows: list[dict[str, Any]]) -> tuple[str, float] | None:
    key = "both_sides_removed" if rows and "both_sides_removed" in rows[0] else "removed"
    ranked = [r for r in rows if r["bf16"] != "none"]
    return (ranked[0]["bf16"], ranked[0][key]["mean"]) if ranked else None


def _findings(data: dict[str, Any]) -> list[str]:
    from .rl_check_report import REFERENCE, machine_line
    from .rl_check_stats import FIRM_MARGIN_SE

    s, summary = data["settings"], data["summary"]
    arms = summary["arms"]
    gap = s["reward_gap"]
    out = []
    out.append(
        f"**Machine**: {machine_line(data.get('environment'))}. Another CPU (another vector "
        "ISA, another BLAS) rounds some sums differently, the seeds' trajectories go "
        "elsewhere, and every reward figure moves within its noise: a verdict marked firm "
        f"(margin at least {FIRM_MARGIN_SE:g} standard errors from its thresholds) should "
        "hold there, the others may not. The mismatch ordering does not depend on it."
    )
    held = "no" if summary.get("eval_disjoint") else "SOME"
    out.append(
        f"**Held out**: {held} evaluation prompt of any seed was one of its training prompts "
        "(`summary.eval_disjoint`)."
    )
    if "bf16" in arms and arms["bf16"]["learns"] is not None:  # None: a smoke run
        g = arms["bf16"]["gain"]
        se = g["se"]
        learned = "learns" if arms["bf16"]["learns"] else "does not learn (gain < 3 SE)"
        ratio = f", {g['mean'] / se:.1f} standard errors above 0" if se and se > 0 else ""
        out.append(f"**BF16 {learned}**: gain {g['mean']:.3f} ± {g['ci95']:.3f}{ratio}.")
    ref = summary.get("reference")
    if ref is not None:
        gen_only, e2e = REFERENCE
        nvidia = ref["nvidia"]
        need = ref["power"]["seeds_to_resolve"]
        out.append(
            f"**NVIDIA's comparison** (`{e2e}` minus `{gen_only}`, final reward paired by "
            f"seed; Llama 3.1 8B: {nvidia[e2e]} - {nvidia[gen_only]} = "
            f"{nvidia[e2e] - nvidia[gen_only]:+.3f}) "
            f"{verdict_sentence(ref['difference'], gap)}."
            + (
                f" Its own paired SD, {ref['paired_sd']:.4f}, needs {need} seeds to resolve "
                f"±{gap:g}."
                if need is not None
                else ""
            )
        )
    reward = [
        f"`{a}` {verdict_sentence(arms[a]['final_vs_bf16'], gap)}"
        for a in data["arms"]
        if a != "bf16"
    ]
    if reward:
        out.append("**Final reward against bf16** (paired by seed): " + "; ".join(reward) + ".")
    pooled = summary["power"]["pooled"]
    per_arm = summary["power"]["per_arm"]
    if pooled.get("half_width") is not None and math.isfinite(pooled["paired_sd"]):
        word = "resolves" if pooled["resolves"] else "does not resolve"
        short = [
            f"`{a}` {p['paired_sd']:.4f} ({p['seeds_to_resolve']} seeds)"
            for a, p in per_arm.items()
            if p["seeds_to_resolve"] is not None and p["seeds_to_resolve"] > s["seeds"]
        ]
        out.append(
            f"**Power**: the pooled paired SD, {pooled['paired_sd']:.4f}, gives {s['seeds']} "
            f"seeds a 95% half-width of {pooled['half_width']:.4f}: it {word} a {gap:g} gap "
            f"(needs {pooled['seeds_to_resolve']} seeds; at the SD's one-sided 90% upper "
            f"bound, {pooled['paired_sd_upper90']:.4f}, {pooled['seeds_to_resolve_upper90']})."
            + (
                " Arms whose own SD asks for more seeds than the run has: " + "; ".join(short) + "."
                if short
                else " Every arm's own SD is resolved by the run's seeds."
            )
        )
    drift = _drift(data)
    if drift:
        out.append(drift)
    if {"fp8-e2e", "fp8-e2e-te-refit", "bf16"} <= set(arms):
        nemo, te = _per_seed_mismatch(data, "fp8-e2e"), _per_seed_mismatch(data, "fp8-e2e-te-refit")
        seeds = sorted(set(nemo) & set(te))
        lower = sum(te[k] < nemo[k] for k in seeds)
        higher = sum(te[k] > nemo[k] for k in seeds)
        e_nemo, e_te = _excess(arms["fp8-e2e"]), _excess(arms["fp8-e2e-te-refit"])
        word, paired = _parity_word([te[k] - nemo[k] for k in seeds])
        out.append(
            f"**Exact weight parity {word} the end-to-end mismatch**: mean "
            f"`token_mult_prob_error` `fp8-e2e` "
            f"{arms['fp8-e2e']['token_mult_prob_error']['mean']:.5f} (NeMo RL's worker-side "
            f"weights) vs `fp8-e2e-te-refit` "
            f"{arms['fp8-e2e-te-refit']['token_mult_prob_error']['mean']:.5f} (the trainer's "
            f"own FP8 weights), paired by seed {paired}; lower with parity in {lower} of "
            f"{len(seeds)} seeds, higher in {higher}; `bf16` "
            f"{arms['bf16']['token_mult_prob_error']['mean']:.5f}. Parity leaves "
            f"{e_te / e_nemo:.0%} of the excess."
            if e_nemo > 0
            else "**Exact weight parity**: `fp8-e2e` shows no excess mismatch."
        )
    if {"fp8-gen", "fp8-e2e", "bf16"} <= set(arms) and _excess(arms["bf16"]) > 0:

        def ratios(arm: str) -> str:
            mean = _excess(arms[arm]) / _excess(arms["bf16"])
            med = (arms[arm]["token_mult_prob_error_median"] - 1.0) / (
                arms["bf16"]["token_mult_prob_error_median"] - 1.0
            )
            return f"{mean:.0f}x by the mean over steps, {med:.0f}x by the median step"

        out.append(
            f"**Excess mismatch** (`token_mult_prob_error - 1` against BF16's): generation only "
            f"(`fp8-gen`) {ratios('fp8-gen')}; end to end (`fp8-e2e`) {ratios('fp8-e2e')}."
        )
    kv_arm = next((a for a in data["arms"] if a.endswith("-kv")), None)
    if kv_arm is not None:
        sh = arms[kv_arm]["shares"]
        out.append(
            f"**KV-scale calibration** costs {sh['kv_calibration']:.0%} of `{kv_arm}`'s step "
            f"here (generation {sh['generate']:.0%}), against 2-3% in NVIDIA's GPU runs: it is "
            f"one more trainer forward over the step's batch, a large share of a step of "
            f"{s['digits']}-token answers, a small one of a step spent generating long ones."
        )
    checks = [
        f"`{a}` {r['nightly_bound']['seeds_passing']} of {r['nightly_bound']['seeds']} "
        f"(`{r['nightly_bound']['check']}`)"
        for a, r in arms.items()
    ]
    out.append(
        "**NeMo RL's nightly checks**, each seed's run against its arm's suite: "
        + "; ".join(checks)
        + "."
    )
    tops = []
    for arm in data["arms"]:
        top = _top(arms[arm]["attribution"]) if arms[arm]["attribution"] else None
        if top:
            tops.append(f"`{arm}` {top[0]} ({top[1]:+.0%})")
    if tops:
        out.append(
            "**Attribution** (the candidate whose BF16 keeping removes the largest share of "
            "the arm's excess; one at a time, so shares overlap; a ranking of close shares "
            "may differ on another CPU): " + "; ".join(tops) + "."
        )
        suggestion = _analyze_suggestion(data)
        if suggestion:
            out.append(suggestion)
    return [f"- {line}" for line in out]


def _drift(data: dict[str, Any], window: int = 5) -> str | None:
    """How the arms drift apart: the paired SD over seeds of the training reward (mean over
    ``window`` steps) minus bf16's, root mean square over the FP8 arms, in the first and the
    last window of the run."""
    runs = {(r["arm"], r["seed"]): r for r in data.get("runs", [])}
    seeds = sorted({r["seed"] for r in data.get("runs", [])})
    steps = data["settings"]["steps"]
    if len(seeds) < 2 or steps < 2 * window or "bf16" not in data["arms"]:
        return None

    def sd_at(lo: int) -> float:
        sds = []
        for arm in data["arms"]:
            if arm == "bf16":
                continue
            diffs = [
                sum(
                    runs[(arm, k)]["steps"][i]["reward"] - runs[("bf16", k)]["steps"][i]["reward"]
                    for i in range(lo, lo + window)
                )
                / window
                for k in seeds
            ]
            mean = sum(diffs) / len(diffs)
            sds.append(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1))
        return math.sqrt(sum(sds) / len(sds))

    first, last = sd_at(0), sd_at(steps - window)
    grows = (
        ": the arms' trajectories drift apart as they train, so fewer steps give a smaller "
        "paired SD"
        if last > first
        else ""
    )
    return (
        f"**Drift**: the paired SD of the training reward against bf16 (mean over {window} "
        f"steps, root mean square over the FP8 arms) is {first:.4f} over steps 1-{window} and "
        f"{last:.4f} over steps {steps - window + 1}-{steps}{grows}."
    )


def _analyze_suggestion(data: dict[str, Any]) -> str | None:
    """What ``nemo-fp8 analyze --attribution`` makes of the JSON (its default arm)."""
    from ..analyze.attribution import report_from_data
    from ..errors import FP8ConfigError

    try:
        report = report_from_data(data, "rl_check.json")
    except FP8ConfigError:
        return None  # a JSON from before the attribution named its modules
    rules = report["suggestions"][report["recipes"][0]]
    chosen = ", ".join(report["chosen"]) or "nothing"
    return (
        f"**`nemo-fp8 analyze --attribution`** on this JSON (arm `{report['arm']}`) keeps "
        f"{chosen} in BF16: `bf16_layers: {json.dumps(rules)}`."
    )


def _cost(data: dict[str, Any]) -> list[str]:
    summary = data["summary"]
    arms = summary["arms"]
    lines = [
        "| arm | CPU s per step | vs bf16 |",
        "|---|---:|---:|",
    ]
    steps = data["settings"]["steps"] * data["settings"]["seeds"]
    base = arms.get("bf16", {}).get("cpu_seconds")
    for arm in data["arms"]:
        cpu = arms[arm].get("cpu_seconds")
        if cpu is None:
            return []
        rel = f"{cpu / base:.2f}x" if base else "-"
        lines.append(f"| {arm} | {cpu / steps:.3f} | {rel} |")
    load = summary.get("load_average") or [math.nan, math.nan]
    total = summary.get("cpu_seconds", math.nan)
    wall = summary["seconds"]
    lines += [
        "",
        f"The run took {wall:.0f} s wall and {total:.0f} CPU s in all "
        f"(load average {load[0]:.1f} at the start, {load[1]:.1f} at the end); CPU per step "
        f"includes the arm's evaluations and attribution. {_idle_time(wall, total)}",
    ]
    return lines


IDLE_SLACK = 1.15
"""A run whose wall time is within this factor of its CPU seconds over two (the least two
worker processes can take) had two cores as good as idle: its wall time is the measurement."""


def _idle_time(wall: float, cpu: float) -> str:
    """What the run takes on two idle cores: measured when this run had them, else estimated."""
    least = cpu / 2
    if wall <= least * IDLE_SLACK:
        return (
            f"On two cores it took {wall / 60:.1f} minutes, within {wall / least - 1:.0%} of its "
            "CPU seconds over two (the least two worker processes can take): the cores were as "
            "good as idle, so this is the measured time."
        )
    return (
        f"On two idle cores (two worker processes, seeds split evenly) it would take about "
        f"{least / 60:.0f} minutes: an estimate, the CPU seconds over two, since this run's wall "
        "time on a shared machine is its neighbours' as much as its own."
    )


def render_blocks(data: dict[str, Any], json_path: str = "docs/data/rl_check.json") -> dict:
    """Each block's Markdown, from the rl-check JSON ``data``."""
    from .rl_check_report import render_tables

    return {
        # tests/test_docs.py runs every bash block; this one rewrites the shipped JSON, and
        # the page's --quick examples above are the runnable ones
        "command": "<!-- doc-test: skip rewrites the shipped JSON; the examples above run -->\n"
        f"```bash\n{command_of(data, json_path)}\n```\n",
        "tables": render_tables(_result(data), data["summary"], data.get("environment")),
        "findings": "\n".join(_findings(data)) + "\n",
        "cost": "\n".join(_cost(data)) + "\n",
    }


def rewrite(page: str, blocks: dict[str, str]) -> str:
    """``page`` with every marked block's contents replaced (a page may mark some of the
    blocks: docs/performance.md holds the cost only); a page marking no block, or one the
    renderer does not make, is an error."""
    marked = [m.group(2) for m in _MARK.finditer(page)]
    unknown = sorted(set(marked) - set(blocks))
    if not marked or unknown:
        raise ValueError(f"the page marks {marked}; the renderer makes {sorted(blocks)}")
    return _MARK.sub(lambda m: m.group(1) + "\n" + blocks[m.group(2)] + "\n" + m.group(4), page)


def render_file(json_path: str | Path, doc_path: str | Path, *, write: bool = True) -> bool:
    """Rewrite ``doc_path``'s blocks from ``json_path``, atomically (with ``write``); True
    when the page was (or, without ``write``, would be) changed."""
    from .._io import atomic_write_text

    data = json.loads(Path(json_path).read_text())
    doc = Path(doc_path)
    old = doc.read_text()
    shown = Path(json_path)
    try:  # the command as run from the repository root (docs/..)
        shown = shown.resolve().relative_to(doc.resolve().parent.parent)
    except ValueError:
        pass
    new = rewrite(old, render_blocks(data, str(shown)))
    if write and new != old:
        atomic_write_text(doc, new)
    return new != old


ANALYZE_BEGIN = "<!-- analyze-attribution: docs/data/rl_check.json -->"
ANALYZE_END = "<!-- /analyze-attribution -->"


def analyze_example(data: dict[str, Any], json_path: str = "docs/data/rl_check.json") -> str:
    """docs/analyze.md's example: ``nemo-fp8 analyze --attribution`` on the JSON, as printed."""
    from ..analyze.attribution import render_attribution, report_from_data

    text = render_attribution(report_from_data(data, json_path))
    return f"\n```text\n$ nemo-fp8 analyze --attribution {json_path}\n{text}```\n"


def render_analyze_file(json_path: str | Path, doc_path: str | Path, *, write: bool = True) -> bool:
    """Rewrite docs/analyze.md's example from the JSON (atomically); True when it changed."""
    from .._io import atomic_write_text

    doc = Path(doc_path)
    old = doc.read_text()
    if old.count(ANALYZE_BEGIN) != 1 or old.count(ANALYZE_END) != 1:
        raise ValueError(f"{doc} does not mark the analyze example once")
    head, rest = old.split(ANALYZE_BEGIN)
    tail = rest.split(ANALYZE_END)[1]
    data = json.loads(Path(json_path).read_text())
    new = head + ANALYZE_BEGIN + analyze_example(data) + ANALYZE_END + tail
    if write and new != old:
        atomic_write_text(doc, new)
    return new != old
