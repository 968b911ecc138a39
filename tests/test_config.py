"""Finding the FP8 request in user configs, across the keys each host uses."""

from __future__ import annotations

import pytest
import yaml

from conftest import nemo_rl_configs
from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin.config import find_fp8_request, load_config, resolve_config

pytestmark = pytest.mark.torch_free


def request(cfg, **kw):
    return find_fp8_request(cfg, **kw)


@pytest.mark.parametrize(
    "cfg, keys",
    [
        ({"precision": "fp8_blockwise"}, ("precision",)),
        ({"policy": {"precision": "fp8_blockwise"}}, ("policy.precision",)),
        ({"mixed_precision": "fp8_blockwise"}, ("mixed_precision",)),
        ({"fp8": "fp8_blockwise"}, ("fp8",)),
        ({"fp8": {"recipe": "fp8_blockwise"}}, ("fp8",)),
        ({"precision": "fp8_blockwise", "fp8": {"recipe": "fp8_blockwise"}}, ("precision", "fp8")),
        ({"precision": "fp8_blockwise", "fp8": {"pow2_scales": False}}, ("precision", "fp8")),
    ],
)
def test_request_keys(cfg, keys):
    req = request(cfg)
    assert req.spec.name == "fp8_blockwise"
    assert req.keys == keys


@pytest.mark.parametrize(
    "value", ["bfloat16", "bf16-mixed", "16-mixed", "float32", 32, None, "${policy.dtype}"]
)
def test_standard_precisions_pass_through(value):
    assert request({"precision": value}) is None
    assert request({"policy": {"precision": value}}) is None


def test_bridge_names_that_are_not_ours_pass_through():
    assert request({"mixed_precision": "bf16_with_fp8_current_scaling_mixed"}) is None


def test_overrides_apply():
    req = request(
        {
            "fp8": {
                "recipe": "fp8_blockwise",
                "pow2_scales": True,
                "bf16_layers": {"first": 1, "last": 1},
            }
        }
    )
    assert req.spec.pow2_scales is True
    assert (req.spec.bf16_layers.first, req.spec.bf16_layers.last) == (1, 1)
    assert req.spec == get_recipe("fp8_blockwise").replace(
        pow2_scales=True, bf16_layers={"first": 1, "last": 1}
    )


@pytest.mark.parametrize(
    "cfg, key, text",
    [
        ({"precision": "fp8_bogus"}, "precision", "valid recipes: fp8_delayed"),
        (
            {"policy": {"precision": "fp8_blokwise"}},
            "policy.precision",
            "did you mean 'fp8_blockwise'",
        ),
        ({"fp8": {"recipe": "fp9"}}, "fp8.recipe", "valid recipes"),
        ({"fp8": {"pow2_scales": True}}, "fp8.recipe", "must start from a registered recipe"),
        (
            {"fp8": {"recipe": "fp8_blockwise", "pow2": True}},
            "fp8.pow2",
            "did you mean 'pow2_scales'",
        ),
        ({"fp8": {"recipe": "fp8_blockwise", "margin": "x"}}, "fp8.margin", "expected an integer"),
        ({"fp8": 3}, "fp8", "expected a recipe name or a mapping"),
        ({"precision": ["fp8_blockwise"]}, "precision", "expected a precision name"),
        (
            {"precision": "fp8_blockwise", "fp8": {"recipe": "fp8_current"}},
            "fp8.recipe",
            "conflicting",
        ),
        (
            {"precision": "fp8_current", "policy": {"precision": "fp8_blockwise"}},
            "policy.precision",
            "conflicting",
        ),
        ({"fp8": {"recipe": "fp8_blockwise", "hardware": "b200"}}, "fp8.pow2_scales", "Blackwell"),
        (
            {"fp8": {"recipe": "fp8_blockwise", "bf16_layers": {"modules": "*a_proj*", "x": 1}}},
            "fp8.bf16_layers.x",
            "unknown key",
        ),
    ],
)
def test_errors_name_the_key(cfg, key, text):
    with pytest.raises(FP8ConfigError) as info:
        request(cfg)
    assert info.value.key == key
    assert text in str(info.value)
    assert str(info.value).startswith(key)


def test_hardware_argument_overrides_and_validates():
    with pytest.raises(FP8ConfigError, match="MXFP8 training needs Blackwell"):
        request({"precision": "mxfp8"}, hardware="h100")
    assert request({"precision": "mxfp8"}, hardware="b200").spec.hardware == "blackwell"
    with pytest.raises(FP8ConfigError) as info:
        request({"precision": "mxfp8"}, hardware="tpu-v5")
    assert info.value.key == "--hardware"


def test_model_named_by_host_keys():
    assert (
        request(
            {
                "precision": "fp8_blockwise",
                "policy": {"model_name": "meta-llama/Llama-3.1-8B-Instruct"},
            }
        ).model
        == "meta-llama/Llama-3.1-8B-Instruct"
    )
    assert (
        request({"fp8": {"recipe": "fp8_blockwise", "model": "llama3.1-8b"}}).model == "llama3.1-8b"
    )


def test_real_nemo_rl_chain_is_merged_parent_first():
    base = nemo_rl_configs()
    cfg = load_config(base / "grpo_math_8B_megatron_fp8.yaml")
    # from the file itself
    assert cfg["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_recipe"] == "blockwise"
    # from its parent (grpo_math_8B_megatron.yaml)
    assert cfg["policy"]["model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
    # from the grandparent chain (grpo_math_1B.yaml), not overridden below
    assert cfg["policy"]["generation"]["vllm_cfg"]["kv_cache_dtype"] == "auto"
    assert "defaults" not in cfg
    # a BF16 NeMo RL config asks for no recipe; its precision passes through
    assert find_fp8_request(load_config(base / "grpo_math_8B_megatron.yaml")) is None


def test_defaults_relative_to_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text("a: 1\nb: {c: 2, d: 3}\nprecision: bfloat16\n")
    (tmp_path / "sub" / "child.yaml").write_text(
        "defaults: ../base.yaml\nb: {c: 5}\nprecision: fp8_current\n"
    )
    cfg, req = resolve_config(tmp_path / "sub" / "child.yaml")
    assert cfg == {"a": 1, "b": {"c": 5, "d": 3}, "precision": "fp8_current"}
    assert req.spec.name == "fp8_current"


def test_defaults_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(FP8ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: missing.yaml\n")
    with pytest.raises(FP8ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert info.value.key == "defaults"


def test_hydra_style_defaults_are_left_alone(tmp_path):
    (tmp_path / "h.yaml").write_text(
        "defaults:\n  - _self_\n  - model: llama\nprecision: fp8_current\n"
    )
    cfg = load_config(tmp_path / "h.yaml")
    assert cfg["defaults"] == ["_self_", {"model": "llama"}]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("precision: [unclosed\n", "not valid YAML"),
        ("- a\n- b\n", "mapping at the top level"),
        ("!!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
    ],
)
def test_bad_files(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(FP8ConfigError, match=fragment):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(FP8ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_is_loaded_safely(tmp_path):
    """A Python object tag must never construct anything."""
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump({"x": 1}) + "y: !!python/name:os.system\n")
    with pytest.raises(FP8ConfigError):
        load_config(path)


def test_floats_read_as_omegaconf_reads_them(tmp_path):
    """NeMo RL writes `adam_eps: 1e-8`; YAML 1.1 would make that a string."""
    from omegaconf import OmegaConf

    path = tmp_path / "f.yaml"
    path.write_text("a: 1e-8\nb: 5e3\nc: '1e-8'\nd: .5\ne: 1_000\nf: v1e5\ng: 3\n")
    assert load_config(path) == OmegaConf.to_container(OmegaConf.load(path))
    assert load_config(path)["a"] == 1e-8
