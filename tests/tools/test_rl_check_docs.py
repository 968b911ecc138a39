"""docs/rl.md against the run it cites: the page's generated blocks are what
``scripts/render_rl_docs.py`` renders from the shipped ``docs/data/rl_check.json``, byte for
byte, and the data-dependent sentences follow the data (fed intervals of known position)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_fp8_plugin.tools import rl_check_docs
from nemo_fp8_plugin.tools.rl_check_docs import render_blocks, rewrite, verdict_sentence

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "rl.md"
SHIPPED = REPO / "docs" / "data" / "rl_check.json"
SCRIPT = REPO / "scripts" / "render_rl_docs.py"


def _shipped() -> dict:
    return json.loads(SHIPPED.read_text())


PERF = REPO / "docs" / "performance.md"


def test_the_pages_are_what_the_shipped_json_renders():
    """No figure or data-dependent sentence of the result blocks is typed by hand: rewriting
    rl.md (every block but the cost) and performance.md (the cost, its one place) from the
    shipped JSON changes nothing."""
    page = DOC.read_text()
    for name in rl_check_docs.BLOCKS:
        assert page.count(f"<!-- rl-check:{name} -->") == (name != "cost"), name
    blocks = render_blocks(_shipped(), "docs/data/rl_check.json")
    assert rewrite(page, blocks) == page
    perf = PERF.read_text()
    assert perf.count("<!-- rl-check:cost -->") == 1
    assert rewrite(perf, blocks) == perf


def test_the_script_checks_and_rewrites_atomically(tmp_path):
    # a copy of the repository's layout: the page's command names the JSON from the root
    (tmp_path / "docs" / "data").mkdir(parents=True)
    page = tmp_path / "docs" / "rl.md"
    shipped = tmp_path / "docs" / "data" / "rl_check.json"
    shipped.write_bytes(SHIPPED.read_bytes())
    stale = DOC.read_text().replace("| bf16 |", "| bf16 (typed by hand) |", 1)
    page.write_text(stale)
    run = [sys.executable, str(SCRIPT), str(shipped), "--doc", str(page)]  # rl.md only
    check = subprocess.run([*run, "--check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and "stale" in check.stderr
    assert page.read_text() == stale
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "rewritten" in done.stdout, done.stderr
    assert page.read_text() == DOC.read_text()
    assert sorted(p.name for p in page.parent.iterdir()) == ["data", "rl.md"]  # no temp file
    again = subprocess.run([*run, "--check"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0


def test_a_marked_block_the_renderer_lacks_is_an_error():
    page = "<!-- rl-check:tables -->\nold\n<!-- /rl-check:tables -->\n"
    with pytest.raises(ValueError, match="marks"):
        rewrite(page, {"findings": "y\n"})
    with pytest.raises(ValueError, match="marks"):
        rewrite("no markers\n", {"tables": "x\n"})
    assert rewrite(page, {"tables": "new\n"}) == (
        "<!-- rl-check:tables -->\n\nnew\n\n<!-- /rl-check:tables -->\n"
    )


def test_verdicts_follow_the_interval_and_say_how_firmly():
    def d(mean, se, t=2.3):
        return {"mean": mean, "se": se, "ci95": t * se, "n": 10}

    assert verdict_sentence(d(0.05, 0.005), 0.03).startswith("is above")
    assert verdict_sentence(d(-0.05, 0.005), 0.03).startswith("is below")
    assert verdict_sentence(d(0.0, 0.004), 0.03).startswith("is within 0.03")
    assert verdict_sentence(d(0.0, 0.02), 0.03).startswith("is unresolved")
    assert verdict_sentence(d(0.0, float("nan"), float("nan")), 0.03) == (
        "has no interval (one seed)"
    )
    assert verdict_sentence(None, 0.03) == "has no interval (one seed)"
    # the margin decides "firm": [0.027, 0.073] is 5.4 SE from 0; [0.001, 0.047] 0.2 SE
    assert verdict_sentence(d(0.05, 0.01), 0.03).endswith("margin 2.7 SE, firm")
    assert "not firm" in verdict_sentence(d(0.024, 0.01), 0.03)


def test_findings_change_with_the_data():
    """The sentences are computed: flip the data and the words flip with it."""
    data = _shipped()
    base = render_blocks(data)["findings"]
    seeds = data["settings"]["seeds"]
    lowers = "parity lowers" in base
    flipped = _with_parity_deltas(data, [-0.001 if not lowers else 0.001] * seeds)
    flipped["summary"]["eval_disjoint"] = False
    other = render_blocks(flipped)["findings"]
    assert ("parity lowers" in base) != ("parity lowers" in other)
    assert "**Held out**: no evaluation" in base and "**Held out**: SOME" in other


def _with_parity_deltas(data: dict, deltas: list[float]) -> dict:
    """``data`` with each seed's ``fp8-e2e-te-refit`` mismatch set to ``fp8-e2e``'s plus
    ``deltas[seed]``; the summary's means favour parity whatever the deltas (the verdict must
    come from the paired differences, not from them)."""
    out = copy.deepcopy(data)
    nemo = rl_check_docs._per_seed_mismatch(out, "fp8-e2e")
    for r in out["runs"]:
        if r["arm"] == "fp8-e2e-te-refit":
            for st in r["steps"]:
                st["token_mult_prob_error"] = nemo[r["seed"]] + deltas[r["seed"]]
    arms = out["summary"]["arms"]
    arms["fp8-e2e-te-refit"]["token_mult_prob_error"]["mean"] = (
        arms["fp8-e2e"]["token_mult_prob_error"]["mean"] - 0.0005
    )
    return out


def _parity_line(data: dict) -> str:
    (line,) = [ln for ln in render_blocks(data)["findings"].splitlines() if "parity" in ln]
    return line


def test_the_parity_verdict_is_the_paired_interval():
    """The verdict is "lowers" / "raises" only when the paired per-seed interval excludes 0,
    and the line counts the seeds each way; lower means alone do not make it "lowers"."""
    n = _shipped()["settings"]["seeds"]
    mixed = _parity_line(_with_parity_deltas(_shipped(), [-0.002, 0.001] * (n // 2)))
    assert "parity does not measurably change" in mixed and "(the interval holds 0)" in mixed
    assert f"lower with parity in {n // 2} of {n} seeds, higher in {n // 2}" in mixed
    up = _parity_line(_with_parity_deltas(_shipped(), [0.001, 0.0012] * (n // 2)))
    assert "parity raises" in up and "(the interval excludes 0)" in up
    assert f"lower with parity in 0 of {n} seeds, higher in {n}" in up
    down = _parity_line(_with_parity_deltas(_shipped(), [-0.001, -0.0012] * (n // 2)))
    assert "parity lowers" in down and f"lower with parity in {n} of {n} seeds" in down


def test_the_png_goes_to_docs_img_only_for_docs_data():
    """--png docs/img/NAME.png for a JSON under docs/data; elsewhere no --png, so the CLI's
    default (beside the JSON) stands."""
    from nemo_fp8_plugin.cli import build_parser

    data = _shipped()
    parse = build_parser().parse_args
    tmp = rl_check_docs.command_of(data, "/tmp/rl.json")
    assert "--png" not in tmp and parse(tmp.split()[1:]).json == "/tmp/rl.json"
    nested = parse(rl_check_docs.command_of(data, "out/docs/data/x.json").split()[1:])
    assert nested.png == "out/docs/img/x.png"
    assert "--png" not in rl_check_docs.command_of(data, "data/rl.json")


def test_the_command_reproduces_the_settings():
    """The page's command, parsed by the real CLI, builds exactly the JSON's settings."""
    from dataclasses import asdict

    from nemo_fp8_plugin.cli import build_parser
    from nemo_fp8_plugin.tools.rl_check import ARMS, FULL, QUICK, with_overrides

    data = _shipped()
    args = build_parser().parse_args(rl_check_docs.command_of(data).split()[1:])
    assert args.json == "docs/data/rl_check.json" and args.png == "docs/img/rl_check.png"

    def num(text):
        return None if text is None else int(text)

    built = with_overrides(
        QUICK if args.quick else FULL,
        steps=num(args.steps),
        seeds=num(args.seeds),
        seed=num(args.seed),
        recipe=args.recipe,
        generation_numerics=args.generation_numerics,
    )
    assert asdict(built) == data["settings"]
    assert (args.arms.split(",") if args.arms else list(ARMS)) == data["arms"]


def test_the_shipped_run_is_the_default_and_names_its_machine():
    """The page cites the default run, and says which CPU (and vector ISA) produced it."""
    from dataclasses import asdict

    from nemo_fp8_plugin.tools.rl_check import ARMS, FULL
    from nemo_fp8_plugin.tools.rl_check_report import machine_line

    data = _shipped()
    assert data["settings"] == asdict(FULL) and data["arms"] == list(ARMS)
    assert data["summary"]["eval_disjoint"] is True
    env = data["environment"]
    assert env["isa"] and env["cpu"]
    page = " ".join(DOC.read_text().split())
    assert f"on {machine_line(env)}" in page and f"CPU ISA {env['isa']}" in page
    # the prose describing the default names its size
    assert f"The default's design: {FULL.steps} steps x {FULL.seeds} seeds" in page
    for typed in (
        f"Adam at 1e-3, {FULL.steps} steps by default",
        f"**GRPO**: {FULL.prompts_per_step} prompts x {FULL.generations_per_prompt} samples",
        f"each seed draws {FULL.eval_prompts} distinct evaluation prompts",
        f"prompt `BOS d1..d{FULL.digits} SEP`",
        f"reaches {FULL.warmup_target:g} (checked every {FULL.warmup_check_every} steps)",
    ):
        assert typed in page, typed
    # NVIDIA's comparison is reported, with its verdict
    assert "**NVIDIA's comparison** (`fp8-e2e-is` minus `fp8-gen-is`" in page
    assert data["summary"]["reference"]["arms"] == ["fp8-gen-is", "fp8-e2e-is"]


@pytest.mark.parametrize(
    "wall, measured",
    [(760.0, True), (870.0, True), (880.0, False), (3165.0, False)],
)
def test_the_idle_time_is_measured_only_when_the_run_had_two_idle_cores(wall, measured):
    """1,518 CPU s over two worker processes take at least 759 s: a wall time within 15% of
    that is the measurement; a longer one shared its cores, and the page estimates."""
    block = "\n".join(render_blocks(_with_wall(wall))["cost"].splitlines())
    assert ("this is the measured time" in block) is measured
    assert ("an estimate" in block) is not measured
    assert f"{wall:.0f} s wall" in block


def _with_wall(wall: float) -> dict:
    data = copy.deepcopy(_shipped())
    data["summary"]["seconds"] = wall
    data["summary"]["cpu_seconds"] = 1518.0
    return data
