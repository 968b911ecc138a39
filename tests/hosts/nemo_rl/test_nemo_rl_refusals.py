"""What NeMo RL refuses (``hosts/nemo_rl/checks.py``): contradicting native keys, keys NeMo
RL would drop silently, requests its Megatron / vLLM paths cannot run, model overrides that
contradict the recipe, block training with MXFP8 rollouts. Shared helpers: ``nemo_rl_cases.py``."""

from __future__ import annotations

import pytest
import yaml
from nemo_rl_cases import (
    CONFIGS,
    MAIN_STACK,
    MEG,
    VLLM,
    _gen_only,
    _one_b,
    _with_native,
    eight_b,
    run_cli,
    write_input,
)

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

pytestmark = pytest.mark.torch_free


def test_output_is_idempotent(tmp_path):
    src = eight_b(tmp_path)
    out = tmp_path / "fp8.yaml"
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 0
    first = out.read_bytes()
    assert run_cli("apply", str(out), "--host", "nemo-rl", "--in-place") == 0
    assert out.read_bytes() == first
    again = apply_path(NEMO_RL, out, output=tmp_path / "elsewhere" / "x.yaml")
    assert again.data["policy"] == yaml.safe_load(first)["policy"]
    assert not again.warnings  # already FP8 in NeMo RL's keys: read back, and left as it is
    assert "already FP8 in NeMo RL's own keys, read as fp8_blockwise" in str(again.notes[0])


@pytest.mark.parametrize(
    "native, key",
    [
        (
            {
                "policy": {
                    "megatron_cfg": {"fp8_cfg": {"enabled": True, "fp8_recipe": "tensorwise"}}
                }
            },
            f"{MEG}.fp8_cfg.fp8_recipe",
        ),
        (
            {"policy": {"megatron_cfg": {"env_vars": {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}}}},
            f"{MEG}.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
        ),
        ({"policy": {"generation": {"vllm_cfg": {"is_mx": True}}}}, f"{VLLM}.is_mx"),
        (
            {"policy": {"generation": {"vllm_cfg": {"num_last_layers_in_bf16": 2}}}},
            f"{VLLM}.num_last_layers_in_bf16",
        ),
    ],
)
def test_contradicting_native_keys_are_refused_by_name(tmp_path, capsys, native, key):
    src = _with_native(tmp_path, native)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == key
    out = tmp_path / "never.yaml"
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 2
    line = capsys.readouterr().err.strip()
    assert key in line and "\n" not in line and "Traceback" not in line
    assert not out.exists()


def test_native_keys_that_agree_are_kept(tmp_path):
    src = _with_native(
        tmp_path,
        {
            "policy": {
                "megatron_cfg": {
                    "fp8_cfg": {"enabled": True},
                    "env_vars": {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": 1},
                    "pipeline_model_parallel_size": 1,  # NeMo RL's FP8 KV cache needs it
                },
                "generation": {"vllm_cfg": {"kv_cache_dtype": "fp8_e4m3", "precision": "fp8"}},
            }
        },
        kv_cache="fp8",
    )
    data = apply_path(NEMO_RL, src).data
    # the user's spellings stay (fp8_e4m3 is vLLM's name for fp8 on CUDA)
    assert data["policy"]["generation"]["vllm_cfg"]["kv_cache_dtype"] == "fp8_e4m3"
    assert data["policy"]["megatron_cfg"]["env_vars"]["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == 1


@pytest.mark.parametrize(
    "native, key",
    [
        ({"policy": {"megatron_cfg": {"fp8_cfg": {"fp8_margin": 1}}}}, f"{MEG}.fp8_cfg.fp8_margin"),
        (
            {"policy": {"generation": {"vllm_cfg": {"quantization_ignored_layers_kws": ["x"]}}}},
            f"{VLLM}.quantization_ignored_layers_kws",
        ),
    ],
)
def test_keys_nemo_rl_would_drop_silently_are_refused(tmp_path, native, key):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, _with_native(tmp_path, native))
    assert err.value.key == key


def test_removed_root_key_still_referenced_is_refused(tmp_path):
    src = write_input(
        tmp_path,
        CONFIGS / "grpo_math_8B_megatron.yaml",
        lambda d: d.update(
            precision="fp8_blockwise", checkpointing={"checkpoint_dir": "results/${precision}"}
        ),
        relative_defaults=True,
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == "checkpointing.checkpoint_dir"


def test_fp8_training_needs_the_megatron_path(tmp_path):
    src = _one_b(tmp_path, lambda d: d.update(precision="fp8_blockwise"))
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == f"{MEG}.enabled"
    # generation-only FP8 works with DTensor training
    src = _one_b(tmp_path, lambda d: d.update(fp8={"recipe": "fp8_blockwise", "training": "bf16"}))
    out = apply_path(NEMO_RL, src).data
    assert out["policy"]["generation"]["vllm_cfg"]["precision"] == "fp8"
    assert "megatron_cfg" not in out["policy"]


def test_fp8_generation_needs_the_vllm_backend(tmp_path):
    src = _with_native(tmp_path, {"policy": {"generation": {"backend": "megatron"}}})
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == "policy.generation.backend"
    # training-only FP8 does not care which engine generates
    src = _with_native(
        tmp_path, {"policy": {"generation": {"backend": "megatron"}}}, generation="bf16"
    )
    assert apply_path(NEMO_RL, src).data["policy"]["megatron_cfg"]["fp8_cfg"]["enabled"] is True


def test_config_without_generation_gets_training_keys_only(tmp_path):
    src = tmp_path / "sft.yaml"
    src.write_text(
        yaml.safe_dump(
            {
                "precision": "fp8_blockwise",
                "policy": {
                    "model_name": "meta-llama/Llama-3.1-8B-Instruct",
                    "precision": "bfloat16",
                    "megatron_cfg": {"enabled": True},
                },
            }
        )
    )
    result = apply_path(NEMO_RL, src)
    assert result.data == {
        "policy": {
            "model_name": "meta-llama/Llama-3.1-8B-Instruct",
            "precision": "bfloat16",
            "megatron_cfg": {
                "enabled": True,
                "fp8_cfg": {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise"},
                "env_vars": {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"},
            },
            # unset and no packing: the FP8 GEMMs' token alignment (tests/hosts/test_alignment.py)
            "make_sequence_length_divisible_by": 16,
        }
    }
    assert any("policy.generation" in w for w in map(str, result.warnings))
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, _gen_only(src))
    assert err.value.key == "fp8.training"


def test_generation_only_with_a_recipe_nemo_rl_cannot_generate_is_refused(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, eight_b(tmp_path, recipe="fp8_current", training="bf16"))
    assert err.value.key == "fp8.training" and "fp8_blockwise" in str(err.value)


@pytest.mark.parametrize(
    "native, fp8, key",
    [
        (
            {"num_layers_at_start_in_bf16": 2},
            {"bf16_layers": {"first": 1}},
            f"{MEG}.model_overrides.num_layers_at_start_in_bf16",
        ),
        (
            {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1},
            {},
            f"{MEG}.model_overrides.first_last_layers_bf16",
        ),
        (
            {"transformer": {"hidden_dropout": 0.0}},
            {"bf16_layers": {"last": 1}},
            f"{MEG}.model_overrides.transformer",
        ),
    ],
)
def test_model_overrides_that_contradict_the_recipe_are_refused(tmp_path, native, fp8, key):
    src = _with_native(tmp_path, {"policy": {"megatron_cfg": {"model_overrides": native}}}, **fp8)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=MAIN_STACK)
    assert err.value.key == key and "\n" not in str(err.value)


def test_model_overrides_that_agree_or_are_neutral_are_kept(tmp_path):
    src = _with_native(
        tmp_path,
        {
            "policy": {
                "megatron_cfg": {
                    "model_overrides": {
                        "num_layers_at_start_in_bf16": 1,
                        "first_last_layers_bf16": False,
                        "hidden_dropout": 0.0,
                    }
                }
            }
        },
        bf16_layers={"first": 1},
    )
    ov = apply_path(NEMO_RL, src, stack=MAIN_STACK).data["policy"]["megatron_cfg"][
        "model_overrides"
    ]
    assert ov == {
        "num_layers_at_start_in_bf16": 1,
        "first_last_layers_bf16": True,
        "hidden_dropout": 0.0,
        "num_layers_at_end_in_bf16": 0,
    }
    plain = _with_native(
        tmp_path,
        {"policy": {"megatron_cfg": {"model_overrides": {"first_last_layers_bf16": False}}}},
    )
    assert apply_path(NEMO_RL, plain, stack=MAIN_STACK).data["policy"]["megatron_cfg"][
        "model_overrides"
    ] == {"first_last_layers_bf16": False}


def test_backward_override_in_env_vars_is_refused(tmp_path):
    """NeMo RL applies policy.megatron_cfg.env_vars in its Megatron workers before they import
    Transformer Engine; TE >= 2.15 then switches every recipe's backward off FP8."""
    src = _with_native(
        tmp_path,
        {"policy": {"megatron_cfg": {"env_vars": {"NVTE_BACKWARD_OVERRIDE": "high_precision"}}}},
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == f"{MEG}.env_vars.NVTE_BACKWARD_OVERRIDE"
    assert "\n" not in str(err.value) and "backward" in str(err.value)
    # generation-only FP8 trains in BF16: the variable changes nothing there
    gen = _with_native(
        tmp_path,
        {"policy": {"megatron_cfg": {"env_vars": {"NVTE_BACKWARD_OVERRIDE": "high_precision"}}}},
        training="bf16",
    )
    apply_path(NEMO_RL, gen)


@pytest.mark.parametrize(
    "native, fp8, key",
    [
        ({"policy": {"generation": {"vllm_cfg": {"is_mx": True}}}}, {}, f"{VLLM}.is_mx"),
        (
            {"policy": {"megatron_cfg": {"fp8_cfg": {"enabled": True, "fp8_recipe": "blockwise"}}}},
            {"recipe": "mxfp8", "training": "bf16"},
            f"{MEG}.fp8_cfg.fp8_recipe",
        ),
        (
            {"policy": {"megatron_cfg": {"fp8_cfg": {"enabled": True, "fp8_recipe": "blockwise"}}}},
            {"recipe": "mxfp8"},
            f"{MEG}.fp8_cfg.fp8_recipe",
        ),
    ],
)
def test_block_training_with_mxfp8_generation_is_refused_with_the_reason(
    tmp_path, native, fp8, key
):
    src = _with_native(tmp_path, native, **fp8)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == key and "128x128" in str(err.value) and "1x32 E8M0" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("generation", [True, False], ids=["grpo", "sft"])
def test_dtensor_fp8_training_hints_fp8_generation_only_where_there_is_generation(generation):
    """SFT (DTensor, no policy.generation) was told to "ask for FP8 generation only", which
    an SFT config cannot do (and the plugin refuses: no policy.generation section)."""
    from nemo_fp8_plugin.hosts import mapping_context, run

    policy = {"precision": "fp8_blockwise", "dtensor_cfg": {"enabled": True}}
    if generation:
        policy["generation"] = {"backend": "vllm"}
    with pytest.raises(FP8ConfigError) as err:
        run(NEMO_RL, mapping_context({"policy": policy}))
    assert err.value.key == "policy.megatron_cfg.enabled"
    assert ("fp8: {training: bf16}" in err.value.hint) is generation
    if not generation:
        assert "no policy.generation" in err.value.hint


@pytest.mark.parametrize(
    "native, key",
    [
        ("policy: {generation: {vllm_cfg: {num_first_layers_in_bf16: abc}}}", "num_first"),
        ("policy: {generation: {vllm_cfg: {num_first_layers_in_bf16: .inf}}}", "num_first"),
        ("policy: {generation: {vllm_cfg: {num_last_layers_in_bf16: [1]}}}", "num_last"),
        (
            "loss_fn: {truncated_importance_sampling_type: tis, "
            "truncated_importance_sampling_ratio: 0, truncated_importance_sampling_ratio_min: 0.5}",
            "loss_fn.truncated_importance_sampling_ratio",
        ),
    ],
    ids=["abc", "inf", "list", "ratio-0"],
)
def test_native_values_read_back_are_refused_in_one_line(tmp_path, capsys, native, key):
    """Was: ValueError / OverflowError / TypeError / ZeroDivisionError tracebacks from
    ``explain`` reading NVIDIA's FP8 config back (``hosts/nemo_rl/native.py``)."""
    src = tmp_path / "native.yaml"
    src.write_text(f"defaults: {CONFIGS / 'grpo_math_8B_megatron_fp8.yaml'}\n{native}\n")
    assert run_cli("explain", str(src)) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and key in err and "Traceback" not in err
