"""``apply`` writes only what changes behaviour: a key the input's file does not
set, whose value is what the config already means (a ``defaults:`` parent's value, else the
host's own default), is left out; a key the file sets, or a parent sets otherwise, is written;
informational lines are ``note:``."""

from __future__ import annotations

import pytest
import yaml

from conftest import NEMO_RL_TRIMMED, shared_nemo_rl
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.dotted import flatten, get_path
from nemo_fp8_plugin.hosts import apply_mapping, get_adapter

pytestmark = pytest.mark.torch_free

_MISSING = object()
NO_OPS = (
    "kv_cache_dtype: auto",
    "num_first_layers_in_bf16: 0",
    "num_last_layers_in_bf16: 0",
    "truncated_importance_sampling_type: null",
    "truncated_importance_sampling_ratio: null",
    "truncated_importance_sampling_ratio_min: null",
    "sequence_level_importance_ratios: false",
    "num_layers_at_start_in_bf16: 0",
    "num_layers_at_end_in_bf16: 0",
)


def _apply(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["apply", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _child(tmp_path, parent, body: str):
    cfg = tmp_path / "child.yaml"
    cfg.write_text(f"defaults: {parent}\n{body}")
    return cfg


@pytest.mark.parametrize(
    "body",
    [
        "policy:\n  precision: fp8_blockwise\n",
        "fp8:\n  recipe: fp8_blockwise\n  training: bf16\n",
        "fp8:\n  recipe: fp8_blockwise\n  bf16_layers: {modules: ['*a_proj*']}\n",
    ],
)
def test_nemo_rl_diff_has_no_key_that_changes_nothing(tmp_path, capsys, body):
    parent = shared_nemo_rl("examples/configs/grpo_math_8B_megatron.yaml")
    rc, out, err = _apply(capsys, _child(tmp_path, parent, body), "--diff")
    assert rc == 0, err
    added = [line[1:].strip() for line in out.splitlines() if line.startswith("+ ")]
    assert added and not [line for line in added if line in NO_OPS], added
    assert "precision: fp8" in added  # what does change is there
    assert "warning:" not in err or "training runs the modules" in err  # notes are notes
    assert all(line.startswith("nemo-fp8 apply: ") for line in err.splitlines())


def test_every_nvidia_config_gets_no_no_op_key(tmp_path, capsys):
    configs = shared_nemo_rl("examples/configs")
    parents = [p for p in configs.rglob("*megatron.yaml") if "fp8" not in p.name]
    assert len(parents) >= 2
    for parent in sorted(parents):
        rc, out, err = _apply(
            capsys, _child(tmp_path, parent, "policy:\n  precision: fp8_blockwise\n"), "--diff"
        )
        assert rc == 0, (parent.name, err)
        added = [line[1:].strip() for line in out.splitlines() if line.startswith("+ ")]
        assert not [line for line in added if line in NO_OPS], (parent.name, added)


def test_a_parent_value_that_differs_is_written_and_the_files_own_key_stays(tmp_path, capsys):
    parent = shared_nemo_rl("examples/configs/grpo_math_8B_megatron.yaml")
    cfg = _child(
        tmp_path,
        parent,
        "policy:\n  precision: fp8_blockwise\nloss_fn:\n  sequence_level_importance_ratios: false\n",
    )
    out = tmp_path / "out.yaml"
    rc, _, err = _apply(capsys, cfg, "-o", out)
    assert rc == 0, err
    data = yaml.safe_load(out.read_text())
    # the parent's use_importance_sampling_correction: false is reset: written
    assert data["loss_fn"]["use_importance_sampling_correction"] is True
    # the file's own key is kept as written, though it equals the default
    assert data["loss_fn"]["sequence_level_importance_ratios"] is False
    # the parent's use_precision_aware_optimizer: true is reset to false
    assert data["policy"]["megatron_cfg"]["optimizer"]["use_precision_aware_optimizer"] is False


def test_a_key_nemo_rl_requires_is_written_where_the_chain_lacks_it():
    """NeMo RL's init_fp8 reads vllm_cfg["kv_cache_dtype"] without a default (a KeyError at
    start-up): auto is written, though it means no FP8 KV cache."""
    base = yaml.safe_load(NEMO_RL_TRIMMED.read_text())
    del base["policy"]["generation"]["vllm_cfg"]["kv_cache_dtype"]
    data = apply_mapping(get_adapter("nemo-rl"), base).data
    assert get_path(data, "policy.generation.vllm_cfg.kv_cache_dtype") == "auto"


def test_loss_keys_at_their_defaults_are_left_out():
    """ClippedPGLossConfig's defaults (no truncation) are not written into a config whose
    loss_fn does not set them."""
    base = yaml.safe_load(NEMO_RL_TRIMMED.read_text())
    for key in [k for k in base["loss_fn"] if k.startswith("truncated_")]:
        del base["loss_fn"][key]
    data = apply_mapping(get_adapter("nemo-rl"), base).data
    assert not [k for k in data["loss_fn"] if k.startswith("truncated_")]
    assert data["loss_fn"]["use_importance_sampling_correction"] is True


@pytest.mark.parametrize(
    ("request_", "written", "absent"),
    [
        (
            "precision: fp8_blockwise",
            {"model.fp8": "e4m3", "model.fp8_recipe": "blockwise"},
            ["model.num_layers_at_start_in_bf16", "model.fp8_margin", "ddp"],
        ),
        (
            "fp8: {recipe: fp8_blockwise, bf16_layers: {first: 2}}",
            {"model.first_last_layers_bf16": True, "model.num_layers_at_start_in_bf16": 2},
            ["model.fp8_wgrad"],
        ),
        (
            "precision: fp8_current",
            {"model.fp8_param": True, "ddp.fp8_param_gather": True},
            ["model.fp8_amax_history_len"],
        ),
    ],
)
def test_megatron_writes_what_differs_from_transformer_config(request_, written, absent):
    config = yaml.safe_load(f"model: {{num_layers: 8, hidden_size: 256}}\n{request_}\n")
    data = apply_mapping(get_adapter("megatron"), config).data
    for key, value in written.items():
        assert get_path(data, key) == value, key
    for key in absent:
        assert get_path(data, key, _MISSING) is _MISSING, key
    if request_ == "precision: fp8_blockwise":  # a count the file sets stays
        config["model"]["num_layers_at_start_in_bf16"] = 0
        data = apply_mapping(get_adapter("megatron"), config).data
        assert get_path(data, "model.num_layers_at_start_in_bf16") == 0


def test_vllm_kv_cache_dtype_only_when_it_changes(tmp_path, capsys):
    config = {"model": "m", "max_model_len": 64, "precision": "fp8_blockwise"}
    data = apply_mapping(get_adapter("vllm"), config).data
    assert "kv_cache_dtype" not in data and data["quantization"] == "nemo_fp8"
    config = {
        "model": "m",
        "max_model_len": 64,
        "fp8": {"recipe": "fp8_blockwise", "kv_cache": "fp8"},
    }
    data = apply_mapping(get_adapter("vllm"), config).data
    assert data["kv_cache_dtype"] == "fp8_e4m3"
    assert {k for k, _ in flatten(data)} >= {"hf_overrides.quantization_config.kv_cache_dtype"}
