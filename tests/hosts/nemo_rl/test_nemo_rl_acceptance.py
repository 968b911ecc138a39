"""`nemo-fp8 apply CONFIG --host nemo-rl` against NVIDIA's own NeMo RL configs, pair by pair
: the BF16 file plus one FP8 line resolves to exactly the FP8 twin's values of the FP8
keys and to the BF16 file's value of every other key; the shipped examples too. Shared
helpers: ``nemo_rl_cases.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from nemo_rl_cases import (
    CONFIGS,
    MEG,
    VLLM,
    check_against_twin,
    check_pair,
    example_input,
    flatten,
    resolved,
    run_cli,
    write_input,
)

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

pytestmark = pytest.mark.torch_free


@pytest.mark.parametrize("where", ["policy.precision", "root precision"])
@pytest.mark.parametrize("relative_defaults", [True, False])
def test_llama_8b_pair(tmp_path, where, relative_defaults):
    def edit(d):
        if where == "policy.precision":
            d["policy"]["precision"] = "fp8_blockwise"
        else:
            d["precision"] = "fp8_blockwise"

    out, data = check_pair(
        tmp_path,
        "grpo_math_8B_megatron.yaml",
        "grpo_math_8B_megatron_fp8.yaml",
        edit,
        relative_defaults,
    )
    # an overlay: the file still inherits, and the parent reference keeps the input's style
    assert Path(data["defaults"]).is_absolute() is (not relative_defaults)


def test_moonlight_pair(tmp_path):
    def edit(d):
        d["fp8"] = {"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*a_proj*", "*b_proj*"]}}

    check_pair(
        tmp_path,
        "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
        "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml",
        edit,
    )


def test_moonlight_warns_that_training_cannot_keep_modules_in_bf16(tmp_path):
    src = write_input(
        tmp_path,
        CONFIGS / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
        lambda d: d.update(
            fp8={"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*a_proj*", "*b_proj*"]}}
        ),
        relative_defaults=True,
    )
    result = apply_path(NEMO_RL, src, output=tmp_path / "o.yaml")
    assert result.warnings, "NeMo RL's training side has no per-module BF16 key"
    with pytest.raises(FP8ConfigError):
        apply_path(NEMO_RL, src, output=tmp_path / "o.yaml", strict=True)


@pytest.mark.parametrize(
    "name, bf16_name, twin_name",
    [
        (
            "grpo_llama8b_fp8_e2e.yaml",
            "grpo_math_8B_megatron.yaml",
            "grpo_math_8B_megatron_fp8.yaml",
        ),
        (
            "grpo_moonlight_fp8_e2e.yaml",
            "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
            "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml",
        ),
    ],
)
def test_shipped_examples_give_the_twins(tmp_path, name, bf16_name, twin_name):
    src = example_input(tmp_path, name, CONFIGS / bf16_name)
    check_against_twin(tmp_path, src, bf16_name, twin_name)


def test_shipped_rollouts_example(tmp_path):
    src = example_input(
        tmp_path, "grpo_llama8b_fp8_rollouts.yaml", CONFIGS / "grpo_math_8B_megatron.yaml"
    )
    out = tmp_path / "out.yaml"
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 0
    ours = flatten(resolved(out))
    assert ours[f"{MEG}.fp8_cfg.enabled"] is False and ours[f"{VLLM}.precision"] == "fp8"
    assert ours[f"{VLLM}.kv_cache_dtype"] == "fp8"
    assert (
        ours["loss_fn.truncated_importance_sampling_type"],
        ours["loss_fn.truncated_importance_sampling_ratio"],
        ours["loss_fn.truncated_importance_sampling_ratio_min"],
    ) == ("icepop", 5.0, 0.5)


def test_self_contained_conf_example(tmp_path):
    src = Path(__file__).resolve().parents[2] / "fixtures" / "nemo_rl_grpo_trimmed.yaml"
    out = tmp_path / "native.yaml"
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 0
    data = yaml.safe_load(out.read_text())
    assert "precision" not in data and data["policy"]["precision"] == "bfloat16"
    assert data["policy"]["megatron_cfg"]["fp8_cfg"]["enabled"] is True
    assert data["policy"]["megatron_cfg"]["env_vars"] == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert data["policy"]["megatron_cfg"]["moe_router_dtype"] == "fp64"
    assert data["policy"]["generation"]["vllm_cfg"]["precision"] == "fp8"
    assert data["loss_fn"]["use_importance_sampling_correction"] is True
