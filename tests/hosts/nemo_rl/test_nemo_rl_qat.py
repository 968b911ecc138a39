"""ModelOpt quantization-aware NVFP4 RL from one line.

``fp8: {recipe: nvfp4, qat: PRESET}`` in a NeMo RL config: ``apply`` writes NVIDIA's keys.
Each shipped recipe is checked key for key: NVIDIA's config, fully resolved through its
``defaults:`` chain (NeMo RL's loading, real OmegaConf), with its quantization keys taken
out and the one-line request put in, goes through ``nemo-fp8 apply`` and must come back as
NVIDIA's resolved config. The twins are NeMo RL 7ea279a's (``../shared/data/nemo_rl``).
The routed-expert W4A4 recipe is not in that snapshot: its values are quoted from
NVIDIA-NeMo/RL 0a30fee (cited at the test).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from nemo_rl_cases import MAIN_STACK, flatten, nemo_rl_load

from conftest import shared_nemo_rl
from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.dotted import delete_path, get_path
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_mapping
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.nemo_rl.modelopt import DEFAULT_NVFP4_IGNORE, modelopt_qat_keys
from nemo_fp8_plugin.spec import QAT_PRESETS

pytestmark = pytest.mark.torch_free

# NVIDIA's quantization keys, as their configs spell them (not read from our code).
QUANT_KEYS = (
    "policy.quant_cfg",
    "policy.quant_calib_data",
    "policy.quant_calib_size",
    "policy.quant_batch_size",
    "policy.quant_sequence_length",
    "policy.disable_modelopt_layer_spec",
    "policy.megatron_cfg.gradient_accumulation_fusion",
    "policy.generation.quant_cfg",
    "policy.generation.real_quant",
    "policy.generation.real_quant_ignore",
)

RECIPE_DIR = "examples/configs/recipes/llm"
TWINS = [
    ("examples/modelopt/qa_grpo_llama8b_megatron.v2.yaml", {"qat": "w4a16"}),
    ("examples/modelopt/qa_grpo_math_megatron.yaml", {"qat": "w4a4"}),
    ("examples/modelopt/qa_grpo_nano3_megatron.yaml", {"qat": "nano3-w4a16"}),
    (
        f"{RECIPE_DIR}/grpo-nanov3-30ba3b-4n4g-megatron-qa-nvfp4-w4a16-real.yaml",
        {"qat": {"preset": "nano3-w4a16", "rollout": "real_quant"}},
    ),
]


def _resolved(path: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(nemo_rl_load(path), resolve=False)


def _without_quant_keys(data: dict) -> dict:
    out = copy.deepcopy(data)
    for key in QUANT_KEYS:
        delete_path(out, key)
    return out


def _apply(tmp_path: Path, data: dict, *extra: str) -> int:
    src, out = tmp_path / "in.yaml", tmp_path / "out" / "qat.yaml"
    src.write_text(yaml.safe_dump(data, sort_keys=False))
    out.parent.mkdir(exist_ok=True)  # an output's folder must exist
    return cli_main(["apply", str(src), "--host", "nemo-rl", "-o", str(out), *extra])


@pytest.mark.parametrize("twin, fp8", TWINS, ids=[Path(t).stem for t, _ in TWINS])
def test_apply_on_the_twin_without_its_keys_gives_nvidias_config(tmp_path, twin, fp8):
    shipped = _resolved(shared_nemo_rl(twin))
    assert any(get_path(shipped, k) is not None for k in QUANT_KEYS[:1])  # a QAT config
    request = _without_quant_keys(shipped)
    request["fp8"] = {"recipe": "nvfp4", **fp8}
    assert _apply(tmp_path, request, "--stack", MAIN_STACK) == 0
    ours = yaml.safe_load((tmp_path / "out" / "qat.yaml").read_text())
    assert flatten(ours) == flatten(shipped)  # key for key, nothing more, nothing less


def test_routed_expert_w4a4_real_quant_keys_are_nvidias():
    # NVIDIA-NeMo/RL 0a30fee examples/configs/recipes/llm/
    # grpo-qwen3-30ba3b-4n4g-megatron-qa-nvfp4-w4a4-real.yaml: policy.quant_cfg
    # nvfp4_experts.yaml, generation.real_quant true, no real_quant_ignore; calibration and
    # gradient_accumulation_fusion from its parent examples/modelopt/
    # qa_grpo_qwen3_30ba3b_megatron.yaml (cnn_dailymail, 16 samples, batch 1, 512 tokens).
    keys = modelopt_qat_keys("experts-w4a4", real_quant=True)
    assert keys["policy.quant_cfg"] == "examples/modelopt/quant_configs/nvfp4_experts.yaml"
    assert (keys["policy.quant_calib_data"], keys["policy.quant_calib_size"]) == (
        "cnn_dailymail",
        16,
    )
    assert (keys["policy.quant_batch_size"], keys["policy.quant_sequence_length"]) == (1, 512)
    assert keys["policy.megatron_cfg.gradient_accumulation_fusion"] is False
    assert keys["policy.generation.real_quant"] is True
    assert "policy.generation.real_quant_ignore" not in keys  # NeMo RL's default list
    # 7ea279a reads the rollout's recipe from generation.quant_cfg ("When set with
    # quant_cfg, initialize rollout vLLM with real ModelOpt NVFP4 kernels",
    # models/generation/vllm/config.py); 0a30fee derives it from the policy instead.
    assert keys["policy.generation.quant_cfg"] == keys["policy.quant_cfg"]
    # the recipe file is W4A4 as NeMo RL's resolve_nvfp4_real_quant_mode reads it: enabled
    # NVFP4 input quantizers on the routed experts
    recipe = yaml.safe_load(shared_nemo_rl(keys["policy.quant_cfg"]).read_text())
    enabled = [e["quantizer_name"] for e in recipe["quantize"]["quant_cfg"] if e.get("enable")]
    assert "*.experts.*input_quantizer" in enabled


def test_every_spec_preset_has_nvidias_recipe_file():
    from nemo_fp8_plugin.hosts.nemo_rl.modelopt import QAT_PRESETS as SPELLED

    assert tuple(SPELLED) == QAT_PRESETS
    for preset in QAT_PRESETS:
        cfg = SPELLED[preset].quant_cfg
        assert cfg.endswith("_CFG") or shared_nemo_rl(cfg).is_file(), cfg


def _config(fp8: dict, **policy) -> dict:
    """A Megatron policy (NeMo RL's ModelOpt worker is a Megatron worker) asking for ``fp8``."""
    megatron = {"enabled": True, **policy.pop("megatron_cfg", {})}
    return {
        "policy": {
            "model_name": "meta-llama/Llama-3.1-8B-Instruct",
            "generation": {},
            "megatron_cfg": megatron,
            **policy,
        },
        "fp8": {"recipe": "nvfp4", **fp8},
    }


def test_qat_on_a_dtensor_policy_is_refused_naming_the_key():
    """NeMo RL's ModelOpt QAT runs on its Megatron policy worker: with the DTensor policy the
    quant_cfg keys would be read by nothing and the policy would train in BF16."""
    dtensor = _config({"qat": "w4a16"}, megatron_cfg={"enabled": False})
    dtensor["policy"]["dtensor_cfg"] = {"enabled": True}
    with pytest.raises(FP8ConfigError) as err:
        apply_mapping(NEMO_RL, dtensor)
    assert err.value.key == "policy.megatron_cfg.enabled" and "Megatron" in str(err.value)
    assert "\n" not in str(err.value)


def test_bf16_rules_become_real_quant_ignore():
    result = apply_mapping(
        NEMO_RL,
        _config(
            {
                "qat": {"preset": "w4a16", "rollout": "real_quant"},
                "bf16_layers": {"first": 1, "last": 1, "modules": ["lm_head", "*self_attn*"]},
            }
        ),
    )
    ignore = get_path(result.data, "policy.generation.real_quant_ignore")
    # a plain name as a one-character class: vLLM's ModelOpt matching reads it exactly
    assert ignore == ["[l]m_head", "*self_attn*", "*.layers.0.*", "*.layers.31.*"]  # 32 layers
    assert "fp8" not in result.data


def test_real_quant_without_rules_leaves_nemo_rls_default():
    result = apply_mapping(NEMO_RL, _config({"qat": {"preset": "w4a4", "rollout": "real_quant"}}))
    assert get_path(result.data, "policy.generation.real_quant") is True
    assert get_path(result.data, "policy.generation.real_quant_ignore") is None
    assert "lm_head" in DEFAULT_NVFP4_IGNORE


@pytest.mark.parametrize(
    "fp8, key",
    [
        ({"qat": "w4a16", "bf16_layers": {"modules": ["*router*"]}}, "fp8.bf16_layers"),
        (
            {"qat": {"preset": "w4a16", "rollout": "real_quant"}, "bf16_layers": {"last": 2}},
            "fp8.bf16_layers.last",
        ),
        (
            {
                "qat": {"preset": "w4a16", "rollout": "real_quant"},
                "bf16_layers": {"modules": ["lm_head"], "applies_to": "training"},
            },
            "fp8.bf16_layers.applies_to",
        ),
        ({"qat": "w4a8"}, "fp8.qat.preset"),
        ({"qat": {"preset": "w4a16", "rollout": "emulated"}}, "fp8.qat.rollout"),
    ],
)
def test_rules_modelopt_cannot_express_are_refused_naming_the_key(tmp_path, capsys, fp8, key):
    data = _config(fp8)
    if "last" in fp8.get("bf16_layers", {}):
        data["policy"]["model_name"] = "org/unknown-model"  # no layer count
    assert _apply(tmp_path, data) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"nemo-fp8 apply: {key}") or f" {key}:" in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_qat_with_a_transformer_engine_recipe_is_refused():
    with pytest.raises(FP8ConfigError) as err:
        apply_mapping(
            NEMO_RL, {**_config({"qat": "w4a16"}), "fp8": {"recipe": "mxfp8", "qat": "w4a16"}}
        )
    assert err.value.key == "fp8.qat"
    with pytest.raises(FP8ConfigError) as err:
        apply_mapping(
            NEMO_RL,
            _config({"qat": "w4a16"}, megatron_cfg={"fp8_cfg": {"enabled": True, "fp8": "e4m3"}}),
        )
    assert err.value.key == "policy.megatron_cfg.fp8_cfg.enabled"


def test_a_config_stating_another_value_is_refused_naming_the_key():
    with pytest.raises(FP8ConfigError) as err:
        apply_mapping(NEMO_RL, _config({"qat": "w4a16"}, quant_cfg="NVFP4_DEFAULT_CFG"))
    assert err.value.key == "policy.quant_cfg"
    with pytest.raises(FP8ConfigError) as err:
        apply_mapping(
            NEMO_RL,
            _config({"qat": "w4a16"}, megatron_cfg={"gradient_accumulation_fusion": True}),
        )
    assert err.value.key == "policy.megatron_cfg.gradient_accumulation_fusion"


def test_a_nemo_rl_without_modelopt_qat_is_refused_naming_the_release():
    """v0.6.0 declares no ModelOpt key (its PolicyConfig and VllmConfig, read in
    test_nemo_rl_releases.py); v0.7.0 and main do."""
    import dataclasses

    from nemo_fp8_plugin.hosts import mapping_context, run
    from nemo_fp8_plugin.stacks import assumed_versions

    ctx = mapping_context(_config({"qat": "w4a16"}))
    old = assumed_versions("nemo-rl-0.6.0")
    with pytest.raises(FP8ConfigError) as err:
        run(NEMO_RL, dataclasses.replace(ctx, stack=old))
    assert err.value.key == "fp8.qat"
    assert "NeMo RL v0.6.0 has no policy.quant_cfg" in str(err.value)
    assert "v0.7.0" in str(err.value)
    for release in ("nemo-rl-0.7.0", MAIN_STACK):
        new = assumed_versions(release)
        assert run(NEMO_RL, dataclasses.replace(ctx, stack=new)).data["policy"]["quant_cfg"]


def test_explain_shows_the_modelopt_keys(capsys, tmp_path):
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(_config({"qat": "w4a16"})))
    assert cli_main(["explain", str(path), "--host", "nemo-rl"]) == 0
    out = capsys.readouterr().out
    assert "quant_cfg" in out and "nvfp4_a16.yaml" in out
    # the Transformer Engine per-layer tables would describe a path that does not run
    assert "per-layer tables not shown" in out and "mlp.linear_fc1" not in out


@pytest.mark.parametrize("host", ["megatron", "nemo2", "bridge", "vllm", "te"])
def test_other_hosts_refuse_qat(host):
    from nemo_fp8_plugin.hosts import recipe_keys
    from nemo_fp8_plugin.registry import get_recipe

    spec = get_recipe("nvfp4").replace(qat="w4a16")
    with pytest.raises(FP8ConfigError) as err:
        recipe_keys(host, spec)
    assert err.value.key == "qat" and "NeMo RL" in str(err.value)
    keys = recipe_keys("nemo-rl", spec).keys
    assert keys["policy"]["quant_cfg"].endswith("nvfp4_a16.yaml")
    assert "model_overrides" not in keys["policy"].get("megatron_cfg", {})  # no TE NVFP4


def test_te_nvfp4_with_nvfp4_rollouts_is_refused_naming_what_is_missing(tmp_path, capsys):
    # NeMo RL's fp4_cfg + nvfp4_pertoken_rollout (NVIDIA-NeMo/RL PR 3566) came after 7ea279a;
    # the snapshot's VllmConfig / PolicyConfig declare neither key.
    src = shared_nemo_rl("src/nemo_rl/models/generation/vllm/config.py").read_text()
    assert "nvfp4_pertoken_rollout" not in src
    megatron = shared_nemo_rl("src/nemo_rl/models/policy/__init__.py").read_text()
    assert "fp4_cfg" not in megatron
    data = _config({"generation": "fp8"})
    assert _apply(tmp_path, data) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "fp8.generation" in line
    for fact in (
        "nvfp4_pertoken_rollout",
        "3566",
        "NeMo RL v0.6.0, v0.7.0 and main of 2026-08-22, 7ea279a",
    ):
        assert fact in line, fact
