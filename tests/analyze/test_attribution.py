"""`nemo-fp8 analyze --attribution RL_CHECK.json`: bf16_layers from rl-check's mismatch
attribution. One real rl-check run (two arms, one seed, the smoke size) feeds the end-to-end
test; rankings of chosen shape (as rl-check writes them) pin the rule shapes; broken files
and shapes are one-line errors naming the key."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import pytest
import yaml

from conftest import LLAMA_LINEARS
from nemo_fp8_plugin import FP8ConfigError
from nemo_fp8_plugin.analyze.attribution import attribution_report, render_attribution
from nemo_fp8_plugin.analyze.suggest import suggestion_yaml

KINDS = LLAMA_LINEARS
# the HF config of rl-check's TinyLlama (rl_check_model.TinyLlama: Llama names, 2 layers)
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 16,
}


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _interval(mean):
    return {"mean": mean, "se": 0.01, "ci95": 0.05, "n": 2}


def _document(shares: dict[str, float], layers: int = 2, both: bool = True) -> dict:
    """An rl-check JSON reduced to what analyze reads, with the candidates rl-check's
    ``attribution_groups`` forms for a ``layers``-layer TinyLlama and the given shares."""
    groups = {f"layer.{i}": [f"model.layers.{i}.{k}" for k in KINDS] for i in range(layers)}
    for kind in KINDS:
        groups[kind.rpartition(".")[2]] = [f"model.layers.{i}.{kind}" for i in range(layers)]
    none = {"bf16": "none", "modules": [], "token_mult_prob_error": _interval(1.01)}
    none |= {"removed": _interval(0.0)}
    if both:
        none |= {"both_sides": _interval(1.01), "both_sides_removed": _interval(0.0)}
    rows = [none]
    for name, members in groups.items():
        share = shares.get(name, -0.05)
        row = {
            "bf16": name,
            "modules": sorted(members),
            "token_mult_prob_error": _interval(1.0),
            # engine-side share: other than both sides' (a wrong key would rank otherwise)
            "removed": _interval(share - 0.5 if both else share),
        }
        if both:
            row |= {
                "both_sides": _interval(1.01 - 0.01 * share),
                "both_sides_removed": _interval(share),
            }
        rows.append(row)
    return {
        "settings": {"recipe": "fp8_blockwise", "steps": 80, "attribution_step": -1},
        "summary": {"arms": {"bf16": {"attribution": []}, "fp8-e2e-is": {"attribution": rows}}},
    }


def _write(tmp_path, doc, name="rl.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
FUSED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _engine_names(modules) -> list[str]:
    """Hugging Face module names as vLLM's engine holds them: q/k/v and gate/up are one fused
    GEMM each there, so a rule for one member keeps the fused GEMM in BF16."""
    out = set()
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        out.add(f"{parent}.{FUSED.get(leaf, leaf)}")
    return sorted(out)


def _resolved_bf16(report) -> list[str]:
    """The generation-side modules explain's resolver keeps in BF16 under the suggestion."""
    from nemo_fp8_plugin.config import find_fp8_request
    from nemo_fp8_plugin.rules import describe_model, resolve

    block = yaml.safe_load(suggestion_yaml(report, report["recipes"][0]))
    request = find_fp8_request(block)
    gen = resolve(request.spec, describe_model(TINY), "generation")
    return sorted(d.module for d in gen.decisions if d.precision == "bf16" and d.layer is not None)


def test_rule_shapes_follow_the_ranking(tmp_path):
    # a whole layer ranks first: first: 1, which keeps exactly that layer's linears
    layer = attribution_report(_write(tmp_path, _document({"layer.0": 0.6, "k_proj": 0.3})))
    assert layer["arm"] == "fp8-e2e-is" and layer["ranked_by"] == "both_sides_removed"
    assert layer["attribution_step"] == 79
    assert layer["chosen"] == ["layer.0"]
    assert layer["suggestions"] == {"fp8_blockwise": {"first": 1}}
    assert _resolved_bf16(layer) == _engine_names(f"model.layers.0.{k}" for k in KINDS)
    assert "fused" not in render_attribution(layer)  # a whole layer: nothing widened
    # a module kind: one layer-wildcard glob over its every layer
    kind = attribution_report(_write(tmp_path, _document({"v_proj": 0.5, "layer.1": 0.2})))
    assert kind["chosen"] == ["v_proj"]
    (pattern,) = kind["suggestions"]["fp8_blockwise"]["modules"]
    assert _resolved_bf16(kind) == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]
    assert "fused" in render_attribution(kind)
    assert "*" in pattern
    # the two best: the kind and the other layer, together
    two = attribution_report(_write(tmp_path, _document({"v_proj": 0.5, "layer.1": 0.2})), top=2)
    assert two["chosen"] == ["v_proj", "layer.1"]
    assert _resolved_bf16(two) == _engine_names(
        {"model.layers.0.self_attn.v_proj"} | {f"model.layers.1.{k}" for k in KINDS}
    )


def test_a_suggestion_covering_every_layer_is_null(tmp_path):
    doc = _document({"layer.0": 0.6, "layer.1": 0.5})
    report = attribution_report(_write(tmp_path, doc), top=2)
    assert report["chosen"] == ["layer.0", "layer.1"]
    assert report["suggestions"] == {"fp8_blockwise": None}
    assert "choose fewer (--top)" in render_attribution(report)
    assert "bf16_layers" not in suggestion_yaml(report, "fp8_blockwise")


def test_only_candidates_that_lower_the_mismatch_are_chosen(tmp_path):
    # nothing removes a positive share: no rules; the kv_cache candidate (no linears) never
    doc = _document({})
    rows = doc["summary"]["arms"]["fp8-e2e-is"]["attribution"]
    rows.append(
        {
            "bf16": "kv_cache",
            "modules": [],
            "token_mult_prob_error": _interval(1.0),
            "removed": _interval(0.9),
            "both_sides": _interval(1.0),
            "both_sides_removed": _interval(0.9),
        }
    )
    report = attribution_report(_write(tmp_path, doc), top=3)
    assert report["ranking"][0]["candidate"] == "kv_cache"
    assert report["chosen"] == [] and report["suggestions"] == {"fp8_blockwise": {}}
    assert "no bf16_layers needed" in render_attribution(report)
    # a generation-only arm ranks by the engine-side share
    gen = _document({"layer.1": 0.4}, both=False)
    gen["summary"]["arms"] = {"fp8-gen": gen["summary"]["arms"]["fp8-e2e-is"]}
    report = attribution_report(_write(tmp_path, gen))
    assert report["arm"] == "fp8-gen" and report["ranked_by"] == "removed"
    assert report["chosen"] == ["layer.1"]


def test_a_positive_share_whose_interval_holds_0_is_not_chosen(tmp_path):
    """Only a share whose 95% interval lies above 0 is evidence: a larger mean with a wide
    interval is passed over and marked, and a
    one-seed run (no interval) chooses nothing."""
    doc = _document({"o_proj": 0.5, "layer.1": 0.3, "k_proj": 0.2})
    rows = {r["bf16"]: r for r in doc["summary"]["arms"]["fp8-e2e-is"]["attribution"]}
    rows["o_proj"]["both_sides_removed"]["ci95"] = 0.6  # 0.5 ± 0.6: holds 0
    report = attribution_report(_write(tmp_path, doc), top=2)
    assert report["ranking"][0]["candidate"] == "o_proj"
    assert report["chosen"] == ["layer.1", "k_proj"]
    text = render_attribution(report)
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("o_proj")]
    assert line.endswith("(interval includes 0)")
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("layer.1")]
    assert line.endswith(" *")
    for row in rows.values():
        for key in ("removed", "both_sides_removed"):
            row[key]["ci95"] = float("nan")
    one = attribution_report(_write(tmp_path, doc), top=2)
    assert one["chosen"] == [] and one["suggestions"] == {"fp8_blockwise": {}}
    assert "(no interval)" in render_attribution(one)


def test_rl_checks_own_json_gives_a_suggestion_explain_accepts(tmp_path):
    """The real thing: rl-check (two arms, one seed, the smoke size) writes its attribution,
    analyze reads it through the CLI, and the printed block resolves to the chosen modules."""
    from nemo_fp8_plugin.cli import main as cli_main

    out = tmp_path / "rl.json"
    argv = ["rl-check", "--quick", "--quiet", "--seeds", "1", "--arms", "bf16,fp8-e2e-is"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main([*argv, "--json", str(out)]) == 0
    res = cli("analyze", "--attribution", out, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["arm"] == "fp8-e2e-is" and report["ranked_by"] == "both_sides_removed"
    shipped = json.loads(out.read_text())["summary"]["arms"]["fp8-e2e-is"]["attribution"]
    # chosen: the best-ranked candidate with linears whose interval lies above 0 (one seed
    # gives ci95 NaN, no interval: then nothing)
    resolved = sorted(
        (
            r
            for r in shipped
            if r["bf16"] != "none"
            and r["modules"]
            and math.isfinite(r["both_sides_removed"]["ci95"])
            and r["both_sides_removed"]["mean"] - r["both_sides_removed"]["ci95"] > 0
        ),
        key=lambda r: -r["both_sides_removed"]["mean"],
    )
    best = resolved[0] if resolved else None
    chosen = best["bf16"] if best else None
    assert report["chosen"] == ([chosen] if chosen else [])
    if best:
        assert _resolved_bf16(report) == _engine_names(best["modules"])
    text = cli("analyze", "--attribution", out)
    assert text.returncode == 0 and "fp8-e2e-is" in text.stdout
    if chosen:
        block = text.stdout[text.stdout.index("    fp8:") :]
        data = yaml.safe_load("\n".join(ln[4:] for ln in block.splitlines()))
        assert data["fp8"]["bf16_layers"] == report["suggestions"]["fp8_blockwise"]


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.pop("summary"), "summary.arms"),
        (lambda d: d["summary"]["arms"]["fp8-e2e-is"].pop("attribution"), "attribution"),
        (
            lambda d: d["summary"]["arms"]["fp8-e2e-is"]["attribution"][1].pop("modules"),
            "summary.arms.fp8-e2e-is.attribution[1].modules",
        ),
        (
            lambda d: d["summary"]["arms"]["fp8-e2e-is"]["attribution"][2].update(
                both_sides_removed={"mean": "high"}
            ),
            "summary.arms.fp8-e2e-is.attribution[2].both_sides_removed",
        ),
        (lambda d: d["settings"].pop("recipe"), "settings.recipe"),
    ],
)
def test_bad_shapes_name_the_key(tmp_path, mutate, needle):
    doc = _document({"layer.0": 0.5})
    mutate(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(FP8ConfigError) as err:
        attribution_report(path)
    assert err.value.key == "--attribution" and needle in str(err.value)


def test_bad_files_and_flags_are_one_line_errors(tmp_path):
    good = _write(tmp_path, _document({"layer.0": 0.5}))
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    cases = [
        (("--attribution", tmp_path / "missing.json"), "not found"),
        (("--attribution", junk), "is not a readable JSON file"),
        (("--attribution", _write(tmp_path, [1, 2], "list.json")), "rl-check's JSON object"),
        (("--attribution", good, "--attribution-arm", "fp8-gen"), "--attribution-arm"),
        (("--attribution", good, "--top", "0"), "--top"),
        (("--attribution", good, "--top", "two"), "--top"),
        (("--attribution", good, "--activations"), "--activations"),
        (("--attribution", good, tmp_path), "either CHECKPOINT or --attribution"),
        (("--top", "2", tmp_path), "--top: belongs to --attribution"),
        ((), "CHECKPOINT"),
    ]
    for args, needle in cases:
        res = cli("analyze", *args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert res.stderr.count("\n") == 1 and needle in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr


def test_docs_show_the_shipped_runs_suggestion():
    """docs/analyze.md's example is this command's output on the shipped rl-check JSON."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", "analyze", "--attribution",
         "docs/data/rl_check.json"],
        capture_output=True, text=True, timeout=120, cwd=repo,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    page = (repo / "docs" / "analyze.md").read_text()
    begin = "<!-- analyze-attribution: docs/data/rl_check.json -->"
    block = page.split(begin)[1].split("<!-- /analyze-attribution -->")[0]
    expected = (
        "\n```text\n$ nemo-fp8 analyze --attribution docs/data/rl_check.json\n"
        + res.stdout
        + "```\n"
    )
    assert block == expected
