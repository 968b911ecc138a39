"""Pattern lint: a glob whose ``*`` continues a name component is shown with what it hits."""

from __future__ import annotations

import json

import pytest

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.rules import describe_model
from nemo_fp8_plugin.rules.lint import overreaching_rules, strict_glob
from nemo_fp8_plugin.spec import BF16Rules

pytestmark = pytest.mark.torch_free


@pytest.mark.parametrize(
    "pattern, name, strict",
    [
        ("*mlp.gate*", "model.layers.0.mlp.gate", True),
        ("*mlp.gate*", "model.layers.0.mlp.gate.weight", True),
        ("*mlp.gate*", "model.layers.0.mlp.gate_proj", False),
        ("*mlp.gate*", "model.layers.0.mlp.gate_up_proj", False),
        ("*experts.1*", "model.layers.0.mlp.experts.1.down_proj", True),
        ("*experts.1*", "model.layers.0.mlp.experts.12.down_proj", False),
        ("*q_proj*", "model.layers.0.self_attn.q_proj", True),
        ("*a_proj*", "model.layers.0.self_attn.kv_a_proj_with_mqa", False),
        ("*.linear_fc2", "decoder.layers.3.mlp.linear_fc2", True),
        ("decoder.layers.1*", "decoder.layers.1.mlp.linear_fc1", True),
        ("decoder.layers.1*", "decoder.layers.10.mlp.linear_fc1", False),
        ("*", "output_layer", True),
        # a literal starting or ending with '_' sets the boundary on purpose: a suffix or
        # prefix rule is not over-reaching
        ("*_proj", "model.layers.0.self_attn.q_proj", True),
        ("*_proj", "model.layers.0.mlp.gate_up_proj", True),
        ("q_*", "q_proj", True),
        ("*linear_fc*", "decoder.layers.0.mlp.linear_fc1", False),
    ],
)
def test_strict_glob_refuses_a_star_that_continues_a_word(pattern, name, strict):
    assert bool(strict_glob(pattern).match(name)) is strict


def test_the_router_rule_that_also_hits_the_dense_ffn_is_listed_with_its_modules():
    """Llama's `*mlp.gate*` means no router (it has none) but hits every gate_proj."""
    m = describe_model("llama3.1-8b")
    (lint,) = overreaching_rules(BF16Rules(modules=("*mlp.gate*", "*q_proj*")), m)
    assert lint.label == "bf16_layers.modules[0]='*mlp.gate*'"
    assert lint.modules == ("model.layers.*.mlp.gate_proj",)
    assert lint.count == m.num_layers
    assert "also matches inside longer names" in lint.line and "gate_proj" in lint.line


def test_well_bounded_rules_give_no_lint():
    m = describe_model("qwen3-30b-a3b")
    rules = BF16Rules(modules=("*mlp.gate", "*.linear_fc2", "model.layers.3.*", "*experts.1.*"))
    assert overreaching_rules(rules, m) == []


def test_explain_shows_the_lint_lines_and_json_carries_them(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "fp8:\n  recipe: fp8_blockwise\n  model: llama3.1-8b\n"
        "  bf16_layers: {modules: ['*mlp.gate*']}\n"
    )
    assert main(["explain", str(cfg)]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("lint: ")]
    assert "'*mlp.gate*'" in line and "model.layers.*.mlp.gate_proj" in line
    assert main(["explain", str(cfg), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lint"] == [line.removeprefix("lint: ")]
