"""`nemo-fp8 apply CONFIG --host nemo-rl` against NVIDIA's own NeMo RL configs.

Acceptance, pair by pair (issue 6): the BF16 file plus one FP8 line must resolve to exactly
the FP8 twin's values of the FP8 keys, and to the BF16 file's value of every other key.
Inputs are written to a temp dir whose `defaults:` points at the real, read-only parent
chain in tests/fixtures/nemo_rl; the shared files are never modified.

NeMo RL itself cannot be installed (HOSTS.md), so outputs are resolved the way its
`nemo_rl/utils/config.py::load_config_with_inheritance` does it, with the real OmegaConf:
`OmegaConf.load` per file, parents (relative to the file's directory) merged first with
`OmegaConf.merge`. That keeps the check independent of the plugin's own YAML loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from conftest import nemo_rl_configs
from nemo_fp8_plugin._io import dump_yaml
from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import HostAdapter, apply_path, get_adapter
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.nemo_rl import NeMoRLAdapter, native_keys
from nemo_fp8_plugin.registry import get_recipe

pytestmark = pytest.mark.torch_free

CONFIGS = nemo_rl_configs()
VLLM = "policy.generation.vllm_cfg"
MEG = "policy.megatron_cfg"

# The keys issue 6 lists as the FP8 keys of NVIDIA's twins.
FP8_KEYS = (
    "loss_fn.use_importance_sampling_correction",
    "loss_fn.truncated_importance_sampling_type",
    "loss_fn.truncated_importance_sampling_ratio",
    "policy.precision",
    f"{MEG}.fp8_cfg",
    f"{MEG}.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
    f"{MEG}.optimizer.use_precision_aware_optimizer",
    f"{MEG}.moe_router_dtype",
    f"{VLLM}.precision",
    f"{VLLM}.use_deep_gemm",
    f"{VLLM}.kv_cache_dtype",
    f"{VLLM}.num_first_layers_in_bf16",
    f"{VLLM}.num_last_layers_in_bf16",
    f"{VLLM}.quantization_ignored_layer_kws",
)


# ------------------------------------------------------------------ helpers


def nemo_rl_load(path: Path) -> DictConfig:
    """NeMo RL's loading semantics (see module docstring), with the real OmegaConf."""
    path = Path(path)
    cfg = OmegaConf.load(path)
    if "defaults" in cfg:
        parents = cfg.pop("defaults")
        parents = [parents] if isinstance(parents, str) else [str(p) for p in parents]
        base = OmegaConf.create({})
        for parent in parents:
            parent_path = Path(parent) if parent.startswith("/") else path.parent / parent
            base = OmegaConf.merge(base, nemo_rl_load(parent_path))
        cfg = OmegaConf.merge(base, cfg)
    return cfg


def resolved(path: Path) -> dict:
    return OmegaConf.to_container(nemo_rl_load(path), resolve=False)


def flatten(mapping, prefix=""):
    out = {}
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted))
        else:
            out[dotted] = value
    return out


def is_fp8_key(key: str) -> bool:
    """Listed, under a listed key, or an ancestor of one (e.g. `env_vars` itself)."""
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in FP8_KEYS)


MISSING = "<absent>"


def write_input(tmp_path: Path, bf16_file: Path, edit, *, relative_defaults: bool) -> Path:
    """The BF16 file's own keys, edited, in tmp_path, with `defaults:` at the real parent."""
    data = yaml.safe_load(bf16_file.read_text())
    parent = (bf16_file.parent / data["defaults"]).resolve()
    data["defaults"] = os.path.relpath(parent, tmp_path) if relative_defaults else str(parent)
    edit(data)
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_cli(*args: str) -> int:
    return cli_main(list(args))


def check_pair(tmp_path: Path, bf16_name: str, twin_name: str, edit, relative_defaults=True):
    src = write_input(tmp_path, CONFIGS / bf16_name, edit, relative_defaults=relative_defaults)
    return check_against_twin(tmp_path, src, bf16_name, twin_name)


ALIGNMENT_DEVIATIONS = {
    "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml": {
        # Packing off, so the unpacked path pads sequences only to this value, and the twin's
        # ${policy.megatron_cfg.tensor_model_parallel_size} is 1: TE's assert_dim_for_fp8_exec
        # needs the tokens per GEMM to be a multiple of 16 (get_align_size_for_quantization),
        # so the plugin raises it (tests/hosts/test_alignment.py) where the twin would depend on luck.
        "policy.make_sequence_length_divisible_by": 16,
    },
}
"""Keys where the plugin's output deliberately differs from NVIDIA's twin, with the value it
writes and why."""


def check_against_twin(tmp_path: Path, src: Path, bf16_name: str, twin_name: str):
    out = tmp_path / "written" / "fp8.yaml"  # another directory: `defaults:` must be re-pointed
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 0
    ours, twin, bf16 = (
        flatten(resolved(p)) for p in (out, CONFIGS / twin_name, CONFIGS / bf16_name)
    )
    deviations = ALIGNMENT_DEVIATIONS.get(twin_name, {})
    for key, value in deviations.items():
        assert ours[key] == value and twin.get(key) != value, key
    for key in sorted(set(ours) | set(twin)):
        if any(key == k or key.startswith(k + ".") for k in FP8_KEYS):
            assert ours.get(key, MISSING) == twin.get(key, MISSING), key
    for key in sorted(set(ours) | set(bf16)):
        if not is_fp8_key(key) and key not in deviations:
            assert ours.get(key, MISSING) == bf16.get(key, MISSING), key
    text = out.read_text()
    data = yaml.safe_load(text)
    assert "fp8" not in data and "precision" not in data  # our keys are consumed
    return out, data


# ------------------------------------------------------------------ acceptance


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


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "nemo_rl"


def example_input(tmp_path: Path, name: str, parent: Path) -> Path:
    """A shipped example with its `defaults:` pointed at the real parent it is meant to sit by."""
    data = yaml.safe_load((EXAMPLES / name).read_text())
    assert (parent.parent / data["defaults"]) == parent  # the example names the right parent
    data["defaults"] = str(parent)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


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
    src = (
        Path(__file__).resolve().parents[2]
        / "conf"
        / "examples"
        / "nemo_rl_grpo_fp8_blockwise.yaml"
    )
    out = tmp_path / "native.yaml"
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 0
    data = yaml.safe_load(out.read_text())
    assert "precision" not in data and data["policy"]["precision"] == "bfloat16"
    assert data["policy"]["megatron_cfg"]["fp8_cfg"]["enabled"] is True
    assert data["policy"]["megatron_cfg"]["env_vars"] == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert data["policy"]["megatron_cfg"]["moe_router_dtype"] == "fp64"
    assert data["policy"]["generation"]["vllm_cfg"]["precision"] == "fp8"
    assert data["loss_fn"]["use_importance_sampling_correction"] is True


# ------------------------------------------------------------------ idempotence, refusal


def eight_b(tmp_path, **fp8_edits):
    def edit(d):
        if fp8_edits:
            d["fp8"] = {"recipe": "fp8_blockwise", **fp8_edits}
        else:
            d["policy"]["precision"] = "fp8_blockwise"

    return write_input(
        tmp_path, CONFIGS / "grpo_math_8B_megatron.yaml", edit, relative_defaults=True
    )


def test_output_is_idempotent(tmp_path):
    src = eight_b(tmp_path)
    out = tmp_path / "fp8.yaml"
    assert run_cli("apply", str(src), "--host", "nemo-rl", "-o", str(out)) == 0
    first = out.read_bytes()
    assert run_cli("apply", str(out), "--host", "nemo-rl", "--in-place") == 0
    assert out.read_bytes() == first
    again = apply_path(NEMO_RL, out, output=tmp_path / "elsewhere" / "x.yaml")
    assert again.data["policy"] == yaml.safe_load(first)["policy"]
    assert any("no FP8 recipe requested" in w for w in again.warnings)


def _with_native(tmp_path, native: dict, **fp8_edits):
    src = eight_b(tmp_path, **fp8_edits)
    data = yaml.safe_load(src.read_text())
    from nemo_fp8_plugin.config import deep_merge

    src.write_text(yaml.safe_dump(deep_merge(data, native), sort_keys=False))
    return src


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
        (
            {"policy": {"generation": {"vllm_cfg": {"kv_cache_dtype": "fp8"}}}},
            f"{VLLM}.kv_cache_dtype",
        ),
        ({"policy": {"generation": {"vllm_cfg": {"is_mx": True}}}}, f"{VLLM}.is_mx"),
        (
            {"policy": {"generation": {"vllm_cfg": {"num_last_layers_in_bf16": 2}}}},
            f"{VLLM}.num_last_layers_in_bf16",
        ),
        (
            {"policy": {"generation": {"vllm_cfg": {"pow2_weight_scaling_factors": True}}}},
            f"{VLLM}.pow2_weight_scaling_factors",
        ),
        (
            {
                "loss_fn": {
                    "truncated_importance_sampling_type": "tis",
                    "truncated_importance_sampling_ratio": 2.0,
                }
            },
            "loss_fn.truncated_importance_sampling_type",
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


# ------------------------------------------------------------------ the other recipes and modes


def apply_8b(tmp_path, **fp8):
    result = apply_path(NEMO_RL, eight_b(tmp_path, **fp8), output=tmp_path / "out.yaml")
    (tmp_path / "out.yaml").write_text(yaml.safe_dump(result.data, sort_keys=False))
    return flatten(resolved(tmp_path / "out.yaml")), result.warnings


BF16_8B = None


def bf16_8b():
    global BF16_8B
    if BF16_8B is None:
        BF16_8B = flatten(resolved(CONFIGS / "grpo_math_8B_megatron.yaml"))
    return BF16_8B


def changed(ours: dict) -> dict:
    """Keys whose resolved value differs from the BF16 8B config's."""
    base = bf16_8b()
    return {
        k: ours.get(k, MISSING)
        for k in set(ours) | set(base)
        if ours.get(k, MISSING) != base.get(k, MISSING)
    }


IS_ON = {"loss_fn.use_importance_sampling_correction": True}


def test_fp8_subchannel_is_block_fp8_on_both_sides_with_pow2_scales(tmp_path):
    ours, warnings = apply_8b(tmp_path, recipe="fp8_subchannel")
    assert changed(ours) == {
        f"{MEG}.fp8_cfg.enabled": True,
        f"{MEG}.fp8_cfg.fp8": "hybrid",
        f"{MEG}.env_vars": MISSING,
        f"{MEG}.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0",
        f"{MEG}.optimizer.use_precision_aware_optimizer": False,
        f"{VLLM}.precision": "fp8",
        f"{VLLM}.use_deep_gemm": True,
        f"{VLLM}.pow2_weight_scaling_factors": True,
        f"{VLLM}.pow2_activation_scaling_factors": True,
        **IS_ON,
    }
    assert warnings == []


def test_mxfp8_is_mxfp8_training_and_mx_generation(tmp_path):
    ours, warnings = apply_8b(tmp_path, recipe="mxfp8")
    assert changed(ours) == {
        f"{MEG}.fp8_cfg.enabled": True,
        f"{MEG}.fp8_cfg.fp8_recipe": "mxfp8",
        f"{MEG}.optimizer.use_precision_aware_optimizer": False,
        f"{VLLM}.precision": "fp8",
        f"{VLLM}.is_mx": True,
        # NVIDIA's MXFP8 rollout keys: NeMo RL refuses MXFP8 without power-of-2 scales
        f"{VLLM}.pow2_weight_scaling_factors": True,
        f"{VLLM}.pow2_activation_scaling_factors": True,
        **IS_ON,
    }
    # The preset's fp8_param: true is not carried over (NeMo RL issue 1164), and it is said.
    assert ours[f"{MEG}.fp8_cfg.fp8_param"] is False
    assert any("fp8_param" in w and "1164" in w for w in warnings)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_current"])
def test_preset_fp8_param_true_is_written_false_for_nemo_rl(tmp_path, recipe):
    assert get_recipe(recipe).fp8_param is True  # the premise: these presets gather FP8 params
    src = write_input(
        tmp_path,
        CONFIGS / "grpo_math_8B_megatron.yaml",
        lambda d: d["policy"].update(precision=recipe),
        relative_defaults=True,
    )
    result = apply_path(NEMO_RL, src)
    assert result.data["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_param"] is False
    (warning,) = [w for w in result.warnings if "fp8_param" in w]
    assert "token_mult_prob_error" in warning and "fp8_param: true" in warning
    hk = native_keys(get_recipe(recipe))
    assert hk.keys["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_param"] is False
    assert any("fp8_param" in w for w in hk.warnings)


def test_fp8_param_stated_by_the_user_is_kept(tmp_path):
    for sub in ("block", "native"):
        (tmp_path / sub).mkdir()
    ours, warnings = apply_8b(tmp_path / "block", recipe="mxfp8", fp8_param=True)
    assert ours[f"{MEG}.fp8_cfg.fp8_param"] is True
    assert not any("fp8_param" in w for w in warnings)
    native = _with_native(
        tmp_path / "native",
        {
            "policy": {
                "megatron_cfg": {
                    "fp8_cfg": {"enabled": True, "fp8_recipe": "mxfp8", "fp8_param": True}
                }
            }
        },
        recipe="mxfp8",
    )
    data = apply_path(NEMO_RL, native).data
    assert data["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_param"] is True
    assert native_keys(get_recipe("mxfp8"), fp8_param_stated=True).warnings == []


def test_fp8_current_trains_tensorwise_generates_bf16_and_warns(tmp_path):
    ours, warnings = apply_8b(tmp_path, recipe="fp8_current")
    diff = changed(ours)
    assert (
        diff[f"{MEG}.fp8_cfg.fp8_recipe"] == "tensorwise" and diff[f"{MEG}.fp8_cfg.fp8"] == "hybrid"
    )
    assert (
        ours[f"{VLLM}.precision"] == "${policy.precision}"
        and ours["policy.precision"] == "bfloat16"
    )
    assert not any(k.startswith(VLLM) for k in diff)
    assert diff["loss_fn.use_importance_sampling_correction"] is True
    assert any("BF16" in w and "differ" in w for w in warnings)


def test_fp8_current_with_fp8_kv_cache_is_refused(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, eight_b(tmp_path, recipe="fp8_current", kv_cache="fp8"))
    assert err.value.key == "fp8.kv_cache"


@pytest.mark.parametrize("how", ["policy.precision", "fp8 block"])
def test_fp8_delayed_is_refused_with_a_suggestion(tmp_path, capsys, how):
    def edit(d):
        if how == "policy.precision":
            d["policy"]["precision"] = "fp8_delayed"
        else:
            d["fp8"] = {"recipe": "fp8_delayed"}

    src = write_input(
        tmp_path, CONFIGS / "grpo_math_8B_megatron.yaml", edit, relative_defaults=True
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == ("policy.precision" if how == "policy.precision" else "fp8.recipe")
    assert "fp8_blockwise" in str(err.value)
    assert run_cli("apply", str(src), "--host", "nemo-rl") == 2
    assert "fp8_blockwise" in capsys.readouterr().err


def test_generation_only_mode(tmp_path):
    ours, _ = apply_8b(tmp_path, training="bf16")
    assert changed(ours) == {f"{VLLM}.precision": "fp8", f"{VLLM}.use_deep_gemm": True, **IS_ON}


def test_generation_only_refuses_enabled_fp8_training(tmp_path):
    src = _with_native(
        tmp_path, {"policy": {"megatron_cfg": {"fp8_cfg": {"enabled": True}}}}, training="bf16"
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src)
    assert err.value.key == f"{MEG}.fp8_cfg.enabled"


def test_training_only_mode_keeps_bf16_generation(tmp_path):
    ours, _ = apply_8b(tmp_path, generation="bf16")
    diff = changed(ours)
    assert diff[f"{MEG}.fp8_cfg.enabled"] is True
    assert not any(k.startswith(VLLM) for k in diff)


def test_fp8_kv_cache(tmp_path):
    ours, _ = apply_8b(tmp_path, kv_cache="fp8")
    assert ours[f"{VLLM}.kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize(
    "is_block, expected",
    [
        ({"truncation": "tis"}, ("tis", 2.0, None, False)),
        ({"truncation": "tis", "ratio_max": 3.0, "ratio_min": 0.2}, ("tis", 3.0, 0.2, False)),
        ({"truncation": "icepop", "ratio_max": 5.0, "ratio_min": 0.5}, ("icepop", 5.0, 0.5, False)),
        # NeMo RL requires the lower bound for icepop; the spec's default is 1/ratio_max
        ({"truncation": "icepop", "ratio_max": 4.0}, ("icepop", 4.0, 0.25, False)),
        (
            {"truncation": "seq-mask-tis", "ratio_max": 1.002, "ratio_min": 0.999},
            ("seq-mask-tis", 1.002, 0.999, False),
        ),
    ],
)
def test_importance_sampling_keys(tmp_path, is_block, expected):
    ours, _ = apply_8b(tmp_path, importance_sampling=is_block)
    got = tuple(
        ours[f"loss_fn.{k}"]
        for k in (
            "truncated_importance_sampling_type",
            "truncated_importance_sampling_ratio",
            "truncated_importance_sampling_ratio_min",
            "sequence_level_importance_ratios",
        )
    )
    assert got == expected
    assert ours["loss_fn.use_importance_sampling_correction"] is True


def test_sequence_level_needs_a_sequence_level_loss(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, eight_b(tmp_path, importance_sampling={"level": "sequence"}))
    assert err.value.key == "loss_fn.token_level_loss"
    src = _with_native(
        tmp_path,
        {"loss_fn": {"token_level_loss": False}},
        importance_sampling={"level": "sequence"},
    )
    assert apply_path(NEMO_RL, src).data["loss_fn"]["sequence_level_importance_ratios"] is True


def test_importance_sampling_off_leaves_the_loss_alone(tmp_path):
    ours, _ = apply_8b(tmp_path, importance_sampling=False)
    assert not any(k.startswith("loss_fn") for k in changed(ours))


def test_moe_router_dtype_only_for_moe_models(tmp_path):
    ours, _ = apply_8b(tmp_path)
    assert ours[f"{MEG}.moe_router_dtype"] == "fp64"  # Llama 3.1 8B is dense: inherited value
    ours, _ = apply_8b(tmp_path, training="bf16", model="moonshotai/Moonlight-16B-A3B-Instruct")
    assert ours[f"{MEG}.moe_router_dtype"] == "fp64"  # no FP8 training, no change
    ours, _ = apply_8b(tmp_path, model="moonshotai/Moonlight-16B-A3B-Instruct")
    assert ours[f"{MEG}.moe_router_dtype"] == "fp32"


# ------------------------------------------------------------------ output forms


def test_stdout_overlay_points_at_absolute_parents(tmp_path, capsys):
    src = eight_b(tmp_path)
    assert run_cli("apply", str(src), "--host", "nemo-rl") == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert Path(data["defaults"]).is_absolute()
    assert Path(data["defaults"]) == (CONFIGS / "grpo_math_1B_megatron.yaml").resolve()


def test_resolved_output_has_no_defaults_and_every_key(tmp_path):
    src = eight_b(tmp_path)
    overlay = apply_path(NEMO_RL, src, output=tmp_path / "a.yaml")
    full = apply_path(NeMoRLAdapter(resolve=True), src)
    assert "defaults" not in full.data
    (tmp_path / "a.yaml").write_text(dump_yaml(overlay.data))
    (tmp_path / "full.yaml").write_text(dump_yaml(full.data))
    assert resolved(tmp_path / "full.yaml") == resolved(tmp_path / "a.yaml")


def test_request_in_a_parent_root_key_falls_back_to_resolved_output(tmp_path):
    parent = write_input(
        tmp_path,
        CONFIGS / "grpo_math_8B_megatron.yaml",
        lambda d: d.update(precision="fp8_blockwise"),
        relative_defaults=True,
    )
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {parent.name}\ngrpo:\n  max_num_steps: 7\n")
    result = apply_path(NEMO_RL, child, output=tmp_path / "out.yaml")
    assert "defaults" not in result.data and "precision" not in result.data
    assert result.data["grpo"]["max_num_steps"] == 7
    assert any("fully resolved" in w for w in result.warnings)


def test_adapter_contract():
    adapter = get_adapter("nemo_rl")
    assert isinstance(adapter, HostAdapter) and adapter.name == "nemo-rl"
    hk = adapter.spell(get_recipe("fp8_blockwise"))
    assert hk.keys["policy"]["megatron_cfg"]["fp8_cfg"] == {
        "enabled": True,
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "fp8_param": False,
    }
    assert hk.env == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    delayed = native_keys(get_recipe("fp8_delayed"))
    assert delayed.keys == {} and "fp8_blockwise" in delayed.warnings[0]


# ------------------------------------------------------------------ what NeMo RL would ignore


def _one_b(tmp_path, edit):
    """A child of NeMo RL's grpo_math_1B.yaml (DTensor training, Megatron off), edited."""
    data = {"defaults": str(CONFIGS / "grpo_math_1B.yaml")}
    edit(data)
    path = tmp_path / "one_b.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


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
    assert any("policy.generation" in w for w in result.warnings)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, _gen_only(src))
    assert err.value.key == "fp8.training"


def _gen_only(src: Path) -> Path:
    data = yaml.safe_load(src.read_text())
    data.pop("precision")
    data["fp8"] = {"recipe": "fp8_blockwise", "training": "bf16"}
    out = src.with_name("gen_only.yaml")
    out.write_text(yaml.safe_dump(data))
    return out


def test_generation_only_with_a_recipe_nemo_rl_cannot_generate_is_refused(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, eight_b(tmp_path, recipe="fp8_current", training="bf16"))
    assert err.value.key == "fp8.training" and "fp8_blockwise" in str(err.value)


# ------------------------------------------------------------------ first/last BF16 layers in training

NEMO_RL_SRC = Path("/work/shared/data/nemo_rl/src")


def nemo_rl_model_override_functions():
    """NeMo RL's own ``_merge_model_overrides``, ``_merge_model_override_value`` and
    ``_validate_model_override_conflicts``, compiled from the real
    ``nemo_rl/models/megatron/setup.py``. That module cannot be imported here (it imports
    Megatron-Bridge, which needs Python >= 3.12 and Transformer Engine), so only these three
    functions are taken from it, with the standard-library names they use; ``MegatronConfig``
    is a stand-in whose annotations are read from the real ``nemo_rl/models/policy/__init__.py``
    (the one thing ``_validate_model_override_conflicts`` asks of it)."""
    import ast
    import copy as copy_module
    from collections.abc import Mapping as MappingABC
    from dataclasses import fields, is_dataclass, replace
    from typing import Any

    setup = NEMO_RL_SRC / "nemo_rl" / "models" / "megatron" / "setup.py"
    tree = ast.parse(setup.read_text())
    wanted = {
        "_merge_model_overrides",
        "_merge_model_override_value",
        "_validate_model_override_conflicts",
    }
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted
    policy = ast.parse((NEMO_RL_SRC / "nemo_rl" / "models" / "policy" / "__init__.py").read_text())
    cls = next(n for n in policy.body if isinstance(n, ast.ClassDef) and n.name == "MegatronConfig")
    annotations = {n.target.id: Any for n in cls.body if isinstance(n, ast.AnnAssign)}
    stand_in = type("MegatronConfig", (), {"__annotations__": annotations})
    namespace = {
        "Mapping": MappingABC,
        "fields": fields,
        "is_dataclass": is_dataclass,
        "replace": replace,
        "copy": copy_module,
        "Any": Any,
        "MegatronConfig": stand_in,
    }
    exec(compile(ast.Module(body=body, type_ignores=[]), str(setup), "exec"), namespace)
    return namespace


@pytest.mark.host
def test_first_last_layers_reach_training_through_model_overrides(tmp_path):
    """NeMo RL merges policy.megatron_cfg.model_overrides into the Bridge model provider (a
    megatron-core TransformerConfig) before building the model, so BF16 first/last layers are
    expressible for training: written there, not warned about."""
    from megatron.core.transformer import TransformerConfig

    ours, warnings = apply_8b(tmp_path, bf16_layers={"first": 1, "last": 2})
    diff = changed(ours)
    overrides = {
        k.rsplit(".", 1)[1]: v for k, v in diff.items() if k.startswith(f"{MEG}.model_overrides.")
    }
    assert overrides == {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 2,
    }
    assert (diff[f"{VLLM}.num_first_layers_in_bf16"], diff[f"{VLLM}.num_last_layers_in_bf16"]) == (
        1,
        2,
    )
    assert not any("training runs them in FP8" in w for w in warnings)
    # NeMo RL's own merge and conflict check accept it, and megatron-core validates the result.
    fns = nemo_rl_model_override_functions()
    out = yaml.safe_load((tmp_path / "out.yaml").read_text())
    megatron_cfg = {**resolved(tmp_path / "out.yaml")["policy"]["megatron_cfg"]}
    fns["_validate_model_override_conflicts"](megatron_cfg, megatron_cfg["model_overrides"])
    provider = TransformerConfig(num_layers=8, hidden_size=256, num_attention_heads=4, bf16=True)
    merged = fns["_merge_model_overrides"](
        provider, out["policy"]["megatron_cfg"]["model_overrides"]
    )
    fp8_cfg = megatron_cfg["fp8_cfg"]  # NeMo RL then sets these three from fp8_cfg
    merged.fp8, merged.fp8_recipe, merged.fp8_param = (
        fp8_cfg["fp8"],
        fp8_cfg["fp8_recipe"],
        fp8_cfg["fp8_param"],
    )
    merged.__post_init__()
    assert (
        merged.first_last_layers_bf16,
        merged.num_layers_at_start_in_bf16,
        merged.num_layers_at_end_in_bf16,
    ) == (True, 1, 2)


def test_fp8_current_preset_first_last_layers_in_native_keys():
    hk = native_keys(get_recipe("fp8_current"))
    assert hk.keys["policy"]["megatron_cfg"]["model_overrides"] == {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 1,
    }
    assert not any("bf16_layers.first" in w or "bf16_layers.last" in w for w in hk.warnings)
    # generation-only BF16 layers leave training alone; per-module globs still cannot be said
    gen = native_keys(
        get_recipe(
            {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1, "applies_to": "generation"}}
        )
    )
    assert "model_overrides" not in gen.keys["policy"]["megatron_cfg"]
    mods = native_keys(
        get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*q_proj*"]}})
    )
    assert any("'*q_proj*'" in w and "training" in w for w in mods.warnings)


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
        apply_path(NEMO_RL, src)
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
    ov = apply_path(NEMO_RL, src).data["policy"]["megatron_cfg"]["model_overrides"]
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
    assert apply_path(NEMO_RL, plain).data["policy"]["megatron_cfg"]["model_overrides"] == {
        "first_last_layers_bf16": False
    }


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


# ------------------------------------------------------------------ MXFP8 rollouts (issue 13, item 2)


def test_mxfp8_rollouts_give_nvidias_keys(tmp_path):
    """BF16 training, MXFP8 generation: precision fp8, is_mx, power-of-2 scales (NeMo RL's
    init_fp8 refuses anything else for MXFP8), attention projections kept out by keyword."""
    ours, warnings = apply_8b(
        tmp_path,
        recipe="mxfp8",
        training="bf16",
        bf16_layers={"modules": ["*q_proj*", "*k_proj*", "*v_proj*", "*o_proj*"]},
    )
    assert changed(ours) == {
        f"{VLLM}.precision": "fp8",
        f"{VLLM}.is_mx": True,
        f"{VLLM}.pow2_weight_scaling_factors": True,
        f"{VLLM}.pow2_activation_scaling_factors": True,
        f"{VLLM}.quantization_ignored_layer_kws": ["q_proj", "k_proj", "v_proj", "o_proj"],
        **IS_ON,
    }
    assert ours[f"{MEG}.fp8_cfg.enabled"] is False and warnings == []
    # the keys NeMo RL's own init_fp8 checks for MXFP8 (its source, read with ast)
    src = Path("/work/shared/data/nemo_rl/src/nemo_rl/models/generation/vllm/quantization/fp8.py")
    import ast

    fn = next(
        n
        for n in ast.walk(ast.parse(src.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "init_fp8"
    )
    refused_if_false = {
        c.args[0].value
        for n in ast.walk(fn)
        if isinstance(n, ast.Compare)
        and isinstance(n.ops[0], ast.Is)
        and isinstance(n.comparators[0], ast.Constant)
        and n.comparators[0].value is False
        for c in [n.left]
        if isinstance(c, ast.Call) and c.args
    }
    assert refused_if_false == {"pow2_weight_scaling_factors", "pow2_activation_scaling_factors"}
    assert all(ours[f"{VLLM}.{k}"] is True for k in refused_if_false)


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


# ------------------------------------------------------------------ per-module training rules (item 3)


@pytest.mark.host
def test_model_overrides_cannot_carry_a_per_module_quant_recipe():
    """NeMo RL's only per-module route on its Megatron side would be model_overrides.quant_recipe:
    its own merge (`_merge_model_overrides`, from its source) keeps the nested mapping as a
    plain dict on the provider, and megatron-core then calls `.match()` on it when it builds the
    model. So the plugin does not write it, and says training runs those modules in FP8."""
    import ast
    import copy as copy_module
    import dataclasses
    from collections.abc import Mapping
    from typing import Any

    from megatron.core.quantization.utils import get_quant_config_or_none
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_plugin.hosts import megatron as mg

    tree = ast.parse(
        Path("/work/shared/data/nemo_rl/src/nemo_rl/models/megatron/setup.py").read_text()
    )
    defs = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and n.name in ("_merge_model_overrides", "_merge_model_override_value")
    ]
    scope = {
        "Mapping": Mapping,
        "Any": Any,
        "copy": copy_module,
        "replace": dataclasses.replace,
        "is_dataclass": dataclasses.is_dataclass,
        "fields": dataclasses.fields,
    }
    exec(compile(ast.Module(body=defs, type_ignores=[]), "setup.py", "exec"), scope)
    spec = get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*linear_proj"]}})
    mapping = mg.transformer_config_fields(spec).keys["quant_recipe"]
    merged = scope["_merge_model_overrides"](
        TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4),
        {"quant_recipe": mapping},
    )
    assert isinstance(merged.quant_recipe, dict)  # survives the merge, as a dict
    with pytest.raises(AttributeError, match="match"):
        get_quant_config_or_none("decoder.layers.0.self_attention.linear_proj", merged.quant_recipe)
    # the real RecipeConfig would have worked: the dict is the problem, not the rule
    assert (
        get_quant_config_or_none(
            "decoder.layers.0.self_attention.linear_proj", mg.quant_recipe_object(mapping)
        )
        is not None
    )
    # what the plugin writes instead: nothing per module for training, and a warning
    hk = native_keys(spec)
    assert "quant_recipe" not in json.dumps(hk.keys)
    assert any("training runs the modules it matches in FP8" in w for w in hk.warnings)


@pytest.mark.parametrize(
    ("numerics", "named"),
    [
        ("vllm", None),
        ("trainer", "generation_numerics=trainer"),
        ("vllm_deepgemm_ue8m0", "VLLM_USE_DEEP_GEMM_E8M0=0"),
    ],
)
def test_generation_numerics_nemo_rl_cannot_express_is_said(numerics, named):
    """NeMo RL generates with vLLM's own kernels (vLLM's numerics) and turns DeepGEMM's E8M0
    mode off whenever it turns DeepGEMM on (its generation/vllm/quantization/fp8.py), so
    only ``generation_numerics: vllm`` is what NeMo RL runs; the others are said, not
    silently dropped. A BF16-generation recipe has nothing to say."""
    spec = get_recipe({"recipe": "fp8_blockwise", "generation_numerics": numerics})
    said = [w for w in native_keys(spec).warnings if "generation_numerics" in w]
    if named is None:
        assert said == []
    else:
        (warning,) = said
        assert named in warning
    bf16_gen = get_recipe({"recipe": "fp8_current", "generation_numerics": "trainer"})
    assert not [w for w in native_keys(bf16_gen).warnings if "generation_numerics" in w]
