"""`nemo-fp8 explain` with the per-layer table: the model a config names (or --model /
--model-config), decisions for both sides, rule warnings, --strict, and the 80-layer text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import nemo_rl_configs

pytestmark = pytest.mark.torch_free

MOONLIGHT = "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml"


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.fixture
def moonlight_config(tmp_path):
    """The real NeMo RL Moonlight FP8 recipe, switched to our recipe with its BF16 modules
    expressed as rules."""
    parent = nemo_rl_configs() / MOONLIGHT
    return write(
        tmp_path,
        "moonlight.yaml",
        f"""
defaults: {parent}
policy:
  precision: fp8_blockwise
fp8:
  recipe: fp8_blockwise
  bf16_layers:
    modules: ["*a_proj*", "*b_proj*"]
""",
    )


def test_explain_json_layers_for_the_model_the_config_names(moonlight_config):
    out = cli("explain", moonlight_config, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["model"] == "moonshotai/Moonlight-16B-A3B-Instruct"
    assert report["model_description"]["num_layers"] == 27
    layers = report["layers"]
    assert {tuple(sorted(d)) for d in layers} == {
        ("layer", "module", "precision", "recipe", "rule", "side")
    }
    train = {d["module"]: d for d in layers if d["side"] == "training"}
    gen = {d["module"]: d for d in layers if d["side"] == "generation"}
    assert len(train) == 27 * 4 + 1 * 2 + 26 * 5 + 1  # attention, dense MLP, MoE MLP, output
    d = train["decoder.layers.11.self_attention.linear_kv_down_proj"]
    assert d == {
        "side": "training",
        "layer": 11,
        "module": d["module"],
        "precision": "bf16",
        "recipe": None,
        "rule": "bf16_layers.modules[0]='*a_proj*'",
    }
    assert gen["model.layers.11.self_attn.kv_b_proj"]["rule"] == "bf16_layers.modules[1]='*b_proj*'"
    assert train["decoder.layers.11.mlp.experts.linear_fc1"]["recipe"] == "fp8_blockwise"
    nemo_rl = report["hosts"]["nemo-rl"]
    # NVIDIA's parent already keeps a_proj/b_proj out of FP8 in vLLM and generates in FP8:
    # the rules' keys change nothing there, so nothing is written for generation
    assert "generation" not in nemo_rl["keys"]["policy"]
    assert any("training side" in w and "'*a_proj*'" in w for w in nemo_rl["warnings"])


def test_explain_strict_turns_host_warnings_into_exit_2(moonlight_config):
    out = cli("explain", moonlight_config, "--strict")
    assert out.returncode == 2
    line = out.stderr.strip()
    assert "\n" not in line and "--strict" in line and "nemo-rl" in line and "*a_proj*" in line


def test_explain_80_layers_text_is_grouped(tmp_path):
    cfg = write(
        tmp_path,
        "c.yaml",
        """
precision: fp8_blockwise
fp8:
  bf16_layers: {first: 1, last: 1, modules: ["*a_prj*"]}
model:
  name: meta-llama/Llama-3.1-70B-Instruct
""",
    )
    out = cli("explain", cfg)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    start = text.index("training (megatron-core module names)")
    table = text[start : text.index("host ", start) if "host " in text[start:] else None]
    rows = [ln for ln in table.splitlines() if ln.strip()]
    assert len(rows) < 40  # 80 layers x 4 modules x 2 sides, grouped
    assert any(ln.split()[:1] == ["1-78"] for ln in rows)
    assert "warning: bf16_layers.modules[0]='*a_prj*' matches no module" in text
    js = json.loads(cli("explain", cfg, "--json").stdout)
    assert len([d for d in js["layers"] if d["side"] == "training"]) == 80 * 4 + 1
    strict = cli("explain", cfg, "--strict")
    assert strict.returncode == 2 and "*a_prj*" in strict.stderr


def test_model_overrides_and_unknown_models(tmp_path):
    cfg = write(
        tmp_path,
        "c.yaml",
        """
precision: fp8_current
fp8:
  bf16_layers: {first: 1, last: 1}
model:
  name: /checkpoints/our-private-model
""",
    )
    out = cli("explain", cfg, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert "layers" not in report
    assert any("--model-config" in w for w in report["warnings"])
    assert cli("explain", cfg, "--strict").returncode == 2
    bad = cli("explain", cfg, "--model", "acme/unknown-7b")
    assert bad.returncode == 2 and "--model" in bad.stderr and "--model-config" in bad.stderr
    hf = {
        "model_type": "llama",
        "num_hidden_layers": 6,
        "hidden_size": 256,
        "intermediate_size": 512,
    }
    write(tmp_path, "config.json", json.dumps(hf))
    good = json.loads(
        cli("explain", cfg, "--model-config", tmp_path / "config.json", "--json").stdout
    )
    train = [d for d in good["layers"] if d["side"] == "training" and d["layer"] is not None]
    assert {d["layer"] for d in train if d["precision"] == "bf16"} == {0, 5}
    by_name = json.loads(cli("explain", cfg, "--model", "qwen3-8b", "--json").stdout)
    assert by_name["model_description"]["num_layers"] == 36


def test_vllm_engine_config_model_key(tmp_path):
    cfg = write(
        tmp_path,
        "serve.yaml",
        """
model: Qwen/Qwen3-30B-A3B
tensor-parallel-size: 2
precision: fp8_blockwise
""",
    )
    report = json.loads(cli("explain", cfg, "--json").stdout)
    gen = {d["module"]: d for d in report["layers"] if d["side"] == "generation"}
    assert gen["model.layers.0.mlp.gate"]["rule"] == "builtin:router"
    assert gen["model.layers.0.mlp.experts"]["precision"] == "fp8"


def test_megatron_model_section_is_a_description(tmp_path):
    cfg = write(
        tmp_path,
        "c.yaml",
        """
precision: fp8_blockwise
fp8:
  bf16_layers: {modules: ["*.linear_fc2"]}
model:
  num_layers: 4
  hidden_size: 256
  ffn_hidden_size: 1024
""",
    )
    report = json.loads(cli("explain", cfg, "--json").stdout)
    assert report["model_description"]["source"] == "TransformerConfig"
    bf16 = {
        d["module"]
        for d in report["layers"]
        if d["side"] == "training" and d["precision"] == "bf16"
    }
    assert bf16 == {f"decoder.layers.{i}.mlp.linear_fc2" for i in range(4)} | {"output_layer"}


def test_contradictory_rules_exit_2_naming_the_rule(tmp_path):
    cfg = write(
        tmp_path,
        "c.yaml",
        """
precision: fp8_blockwise
fp8:
  model: llama3.1-8b
  bf16_layers: {first: 20, last: 12}
""",
    )
    out = cli("explain", cfg)
    assert out.returncode == 2
    assert "fp8.bf16_layers.last" in out.stderr and "32" in out.stderr


def test_explain_with_layers_imports_no_torch_and_no_host(moonlight_config):
    code = (
        "import sys, contextlib, io\n"
        "from nemo_fp8_plugin.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['explain', {str(moonlight_config)!r}, '--json']) == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    roots = set(json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"')))
    assert not roots & {"torch", "megatron", "nemo", "vllm", "transformers", "transformer_engine"}
