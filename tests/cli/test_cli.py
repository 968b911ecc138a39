"""The `nemo-fp8` CLI as users run it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NEMO_RL_TRIMMED, REPO
from nemo_fp8_plugin.cli import COMMANDS, build_parser

FIVE = ("fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8")


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_recipes_json_lists_the_five_with_their_fields():
    out = cli("recipes", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(FIVE) <= set(rows)
    for name in FIVE:
        for key in (
            "description",
            "scaling",
            "fp8_format",
            "activation_block",
            "weight_block",
            "pow2_scales",
            "amax_history_len",
            "bf16_layers",
            "kv_cache",
        ):
            assert key in rows[name], (name, key)
    assert rows["fp8_blockwise"]["weight_block"] == [128, 128]
    assert rows["fp8_blockwise"]["activation_block"] == [1, 128]
    assert rows["fp8_delayed"]["amax_history_len"] == 1024


def test_recipes_text_a_header_then_one_line_each():
    out = cli("recipes")
    header, *lines = out.stdout.strip().splitlines()
    assert header.split() == ["recipe", "scaling", "description"]
    assert [ln.split()[0] for ln in lines[:5]] == list(FIVE)
    # the columns line up under the header
    at = header.index("scaling")
    assert all(ln[at - 2 : at] == "  " and ln[at] != " " for ln in lines)


def test_a_recipe_name_in_the_wrong_case_gets_a_did_you_mean(tmp_path):
    out = cli("explain", write(tmp_path, "precision: FP8_BLOCKWISE\n"))
    assert out.returncode == 2
    assert "did you mean 'fp8_blockwise'?" in out.stderr


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_explain_precision_name(tmp_path):
    out = cli("explain", write(tmp_path, "precision: fp8_blockwise\n"), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["recipe"]["name"] == "fp8_blockwise"
    assert report["recipe"]["pow2_scales"] is False
    assert report["keys"] == ["precision"]
    text = cli("explain", write(tmp_path, "precision: fp8_blockwise\n"))
    assert "recipe: fp8_blockwise" in text.stdout


def test_explain_mapping_override(tmp_path):
    out = cli(
        "explain", write(tmp_path, "fp8:\n  recipe: fp8_blockwise\n  pow2_scales: true\n"), "--json"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["recipe"]["pow2_scales"] is True


def test_explain_bogus_recipe_exits_2_with_one_line(tmp_path):
    out = cli("explain", write(tmp_path, "precision: fp8_bogus\n"))
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    for name in FIVE:
        assert name in lines[0]
    assert "did you mean 'fp8_blockwise'" in lines[0]
    assert "precision" in lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ("explain", "/nonexistent/c.yaml"),
        ("explain",),
        ("apply", "x.yaml"),
        ("frobnicate",),
    ],
)
def test_usage_errors_exit_2_without_traceback(args):
    out = cli(*args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_not_a_mapping(tmp_path):
    out = cli("explain", write(tmp_path, "- 1\n- 2\n"))
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_no_request_is_reported_not_refused(tmp_path):
    out = cli("explain", write(tmp_path, "precision: bf16-mixed\n"), "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout)["recipe"] is None


@pytest.mark.slow
def test_help_on_every_command():
    assert cli("--help").returncode == 0
    names = set(build_parser()._subparsers._group_actions[0].choices)
    assert len(names) == len(COMMANDS)
    for name in names:
        out = cli(name, "--help")
        assert out.returncode == 0, name
        assert "usage: nemo-fp8" in out.stdout


def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("nemo-fp8")
    out = subprocess.run([str(exe), "recipes"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "fp8_blockwise" in out.stdout


@pytest.mark.slow
def test_example_configs_explain():
    for path in sorted((REPO / "conf" / "examples").glob("*.yaml")) + [NEMO_RL_TRIMMED]:
        out = cli("explain", path, "--json")
        assert out.returncode == 0, (path, out.stderr)


# --------------------------------------------------------------------------- review findings


def assert_one_line_error(out, *needles):
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1, out.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def test_apply_to_a_directory_is_a_user_error_and_writes_nothing(tmp_path):
    config = write(tmp_path, "precision: fp8_blockwise\nmodel: {num_layers: 4, hidden_size: 256}\n")
    target = tmp_path / "out"
    target.mkdir()
    out = cli("apply", config, "--host", "megatron", "-o", target)
    assert_one_line_error(out, str(target), "directory")
    assert list(target.iterdir()) == []


def test_apply_output_file_gets_the_users_umask_not_0600(tmp_path):
    import os

    config = write(tmp_path, "precision: fp8_blockwise\nmodel: {num_layers: 4, hidden_size: 256}\n")
    target = tmp_path / "out.yaml"
    old = os.umask(0o022)
    try:
        out = cli("apply", config, "--host", "megatron", "-o", target)
    finally:
        os.umask(old)
    assert out.returncode == 0, out.stderr
    assert target.stat().st_mode & 0o777 == 0o644
    target.chmod(0o640)  # rewriting keeps the file's own mode
    assert cli("apply", config, "--host", "megatron", "-o", target).returncode == 0
    assert target.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    "text, key",
    [
        (
            "precision: fp8_blockwise\ntrainer:\n  plugins:\n"
            "    _target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision\n"
            "    precision: bf16-mixed\n    fp8: hybrid\n",
            "trainer.plugins.fp8",
        ),
        (
            "precision: fp8_blockwise\nmodel: {num_layers: 4, hidden_size: 256, fp8_recipe: delayed}\n",
            "model.fp8_recipe",
        ),
        (
            "precision: fp8_blockwise\nmixed_precision: bf16_with_fp8_delayed_scaling_mixed\n",
            "mixed_precision",
        ),
    ],
)
def test_explain_refuses_native_keys_that_contradict_the_recipe(tmp_path, text, key):
    assert_one_line_error(cli("explain", write(tmp_path, text)), f"{key}:")


def test_explain_accepts_apply_output_unchanged(tmp_path):
    config = write(tmp_path, "precision: fp8_blockwise\nmodel: {num_layers: 4, hidden_size: 256}\n")
    applied = tmp_path / "applied.yaml"
    assert cli("apply", config, "--host", "megatron", "-o", applied).returncode == 0
    out = cli("explain", applied)
    assert out.returncode == 0, out.stderr


def test_duplicate_keys_are_refused_with_both_lines(tmp_path):
    out = cli("explain", write(tmp_path, "precision: fp8_blockwise\nseed: 1\nprecision: mxfp8\n"))
    assert_one_line_error(out, "duplicate key 'precision'", "line 1", "line 3")


def test_mxfp8_on_a_model_with_partial_32_blocks_is_an_error(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "num_hidden_layers": 4,
                "hidden_size": 1008,
                "intermediate_size": 3024,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "vocab_size": 1000,
            }
        )
    )
    out = cli("explain", write(tmp_path, "precision: mxfp8\n"), "--model-config", cfg)
    assert_one_line_error(out, "--model-config: hidden_size 1008", "1008", "32")
    # block scaling only warns: partial 128-tiles work, at a cost (1008 is 16-aligned, as
    # every FP8 GEMM needs)
    out = cli("explain", write(tmp_path, "precision: fp8_blockwise\n"), "--model-config", cfg)
    assert out.returncode == 0 and "not a multiple of 128" in out.stdout, out.stderr


def test_bridge_hyphenated_alias_and_typos(tmp_path):
    out = cli("explain", write(tmp_path, "mixed_precision: fp8-blockwise\n"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["recipe"]["name"] == "fp8_blockwise"
    assert_one_line_error(
        cli("explain", write(tmp_path, "mixed_precision: fp8_blockwize\n")),
        "mixed_precision:",
        "did you mean 'fp8_blockwise'",
    )
    # Bridge's own presets are Bridge's business
    out = cli("explain", write(tmp_path, "mixed_precision: bf16_with_fp8_current_scaling_mixed\n"))
    assert out.returncode == 0 and "no FP8 recipe requested" in out.stdout


def test_hardware_flag_is_blamed_as_the_flag(tmp_path):
    # apply refuses (exit 2), naming the flag or the key; explain reports (exit 0) and
    # refuses only under --strict (tests/hosts/test_retarget.py per GPU)
    out = cli(
        "apply", write(tmp_path, "precision: mxfp8\n"), "--host", "megatron", "--hardware", "h100"
    )
    assert_one_line_error(out, "--hardware:", "Blackwell")
    out = cli("apply", write(tmp_path, "fp8: {recipe: mxfp8, hardware: h100}\n"), "--host", "te")
    assert_one_line_error(out, "fp8.hardware:")
    out = cli("explain", write(tmp_path, "precision: mxfp8\n"), "--hardware", "h100")
    assert out.returncode == 0 and "--hardware h100: mxfp8 cannot run" in out.stdout
    out = cli("explain", write(tmp_path, "fp8: {recipe: mxfp8, hardware: h100}\n"), "--strict")
    assert_one_line_error(out, "--strict:", "fp8.hardware")


def test_host_accepts_the_package_spelling_of_nemo_rl():
    config = NEMO_RL_TRIMMED
    a, b = cli("apply", config, "--host", "nemo_rl"), cli("apply", config, "--host", "nemo-rl")
    assert a.returncode == 0 and a.stdout == b.stdout, a.stderr


def test_native_fp8_switch_at_the_root_points_to_model(tmp_path):
    out = cli("explain", write(tmp_path, "fp8: hybrid\n"))
    assert_one_line_error(out, "fp8:", "'hybrid'", "model:")


@pytest.mark.parametrize(
    "args_of",
    [
        lambda d: ["demo", "--steps", "1", "--out", d / "afile"],
        lambda d: ["demo", "--steps", "1", "--out", d / "afile" / "sub"],
        lambda d: ["bench", "--quick", "--json", d],
        lambda d: ["rl-check", "--quick", "--json", d],
        lambda d: ["analyze", d / "none.safetensors", "--plot", d / "adir.png"],
    ],
)
@pytest.mark.slow
def test_bad_output_paths_fail_before_any_work(tmp_path, args_of):
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "adir.png").mkdir()
    out = cli(*args_of(tmp_path))
    assert_one_line_error(out, str(tmp_path))
    assert (tmp_path / "afile").read_text() == "keep me"
    assert "step" not in out.stdout  # refused up front: nothing trained, benchmarked or analyzed


@pytest.mark.parametrize(
    "args", [["demo", "--recipes", ","], ["rl-check", "--arms", ","], ["rl-check", "--arms", ""]]
)
@pytest.mark.slow
def test_empty_name_lists_are_refused(args):
    assert_one_line_error(cli(*args), args[1])


@pytest.mark.slow
def test_demo_refuses_keys_it_would_ignore(tmp_path):
    out = cli(
        "demo", write(tmp_path, "precision: fp8_blockwise\ntrian: {steps: 5}\n"), "--steps", "1"
    )
    assert_one_line_error(out, "trian:", "did you mean 'train'")


def test_a_directory_is_not_a_config(tmp_path):
    assert_one_line_error(cli("explain", tmp_path), "is a directory")


def test_recipe_fields_at_the_top_level_are_refused(tmp_path):
    out = cli(
        "apply",
        write(tmp_path, "precision: fp8_blockwise\npow2_scales: true\n"),
        "--host",
        "megatron",
    )
    assert_one_line_error(out, "pow2_scales:", "fp8: {recipe: fp8_blockwise")


@pytest.mark.slow
def test_analyze_with_nothing_to_analyze_is_an_error_naming_the_tensors(tmp_path):
    import torch
    from safetensors.torch import save_file

    only_odd = tmp_path / "odd.safetensors"
    save_file(
        {
            "model.layers.0.mlp.down_proj.weight": torch.full((128, 128), float("nan")),
            "model.norm.weight": torch.ones(128),
        },
        str(only_odd),
    )
    out = cli("analyze", only_odd, "--no-progress")
    assert_one_line_error(out, "CHECKPOINT", "model.layers.0.mlp.down_proj.weight", "non-finite")

    mixed = tmp_path / "mixed.safetensors"
    save_file(
        {
            "model.layers.0.mlp.down_proj.weight": torch.full((128, 128), float("nan")),
            "model.layers.0.mlp.up_proj.weight": torch.randn(128, 128),
        },
        str(mixed),
    )
    out = cli("analyze", mixed, "--no-progress", "--recipes", "fp8_blockwise")
    assert out.returncode == 0, out.stderr
    assert "skipped (non-finite values): model.layers.0.mlp.down_proj.weight" in out.stdout


def test_a_misspelt_request_key_is_pointed_out(tmp_path):
    out = cli("explain", write(tmp_path, "precison: fp8_blockwise\n"))
    assert out.returncode == 0 and "`precison: fp8_blockwise` looks like `precision:`" in out.stdout


@pytest.mark.parametrize(
    "args, key",
    [
        (["rl-check", "--recipe", "fp8_blokwise"], "--recipe:"),
        (["analyze", "nothing", "--recipes", "fp8_blokwise"], "--recipes:"),
    ],
)
@pytest.mark.slow
def test_recipe_flags_are_named_in_their_errors(args, key):
    assert_one_line_error(cli(*args), key, "did you mean 'fp8_blockwise'")


def test_apply_detects_the_host_as_explain_does(tmp_path):
    """`apply` required --host although `explain` detects it; now both read the shape."""
    config = write(
        tmp_path,
        "policy:\n  precision: fp8_blockwise\n  model_name: meta-llama/Llama-3.1-8B-Instruct\n"
        "  megatron_cfg:\n    enabled: true\n  generation:\n    backend: vllm\n",
    )
    detected = cli("apply", config)
    given = cli("apply", config, "--host", "nemo-rl")
    assert detected.returncode == 0, detected.stderr
    assert detected.stdout == given.stdout and "fp8_cfg:" in detected.stdout
    assert "host: nemo-rl (detected from the config's shape)" in detected.stderr
    # an informational line is a note, not a warning
    assert "apply: note: nemo-rl: policy.make_sequence_length_divisible_by" in detected.stderr
    assert "warning:" not in detected.stderr
    bare = cli("apply", write(tmp_path, "precision: fp8_blockwise\n"))
    assert bare.returncode == 2 and "Traceback" not in bare.stderr
    assert "--host: the config's shape names no host" in bare.stderr


def test_apply_and_explain_show_the_vllm_environment_and_the_mla_kv_note():
    """vLLM's start-up variable (engine_env) was never shown for a vLLM config, and an FP8
    KV cache on MLA (Moonlight) was silent that its scales stay 1.0."""
    moonlight = REPO / "conf" / "examples" / "vllm_moonlight_fp8_kv.yaml"
    applied = cli("apply", moonlight)
    assert applied.returncode == 0, applied.stderr
    assert "env: set VLLM_USE_DEEP_GEMM_E8M0=0 where vLLM starts" in applied.stderr
    assert "multi-head latent attention: vLLM keeps the KV cache's scales at 1.0" in applied.stderr
    explained = cli("explain", moonlight)
    assert "env: VLLM_USE_DEEP_GEMM_E8M0=0 (in vLLM's environment" in explained.stdout
    llama = cli("apply", REPO / "conf" / "examples" / "vllm_llama8b_fp8_blockwise.yaml")
    assert "latent attention" not in llama.stderr  # not MLA: the scales come with each refit
