"""ModelOpt QAT NVFP4 presets write NVIDIA's keys.

Each shipped recipe's keys are compared with its twin in the NeMo RL snapshot
(``../shared/data/nemo_rl``, commit 7ea279a): ``examples/modelopt/
qa_grpo_llama8b_megatron.v2.yaml``, ``qa_grpo_nano3_megatron.yaml`` and the real-quant
recipe ``grpo-nanov3-30ba3b-4n4g-megatron-qa-nvfp4-w4a16-real.yaml``; the keys are the
ones NeMo RL's TypedDicts declare (``models/policy/__init__.py``,
``models/generation/vllm/config.py``), read by ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from conftest import SHARED_NEMO_RL
from nemo_fp8_plugin.dotted import get_path
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.nemo_rl.modelopt import (
    DEFAULT_NVFP4_IGNORE,
    modelopt_qat_keys,
    real_quant_ignore,
)
from nemo_fp8_plugin.spec import BF16Rules

pytestmark = pytest.mark.torch_free

SNAPSHOT = SHARED_NEMO_RL
MODELOPT = SNAPSHOT / "examples" / "modelopt"
RECIPE = (
    SNAPSHOT
    / "examples/configs/recipes/llm/grpo-nanov3-30ba3b-4n4g-megatron-qa-nvfp4-w4a16-real.yaml"
)


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _declared(path: str, cls: str) -> set[str]:
    tree = ast.parse((SNAPSHOT / "src" / path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}


@pytest.mark.parametrize(
    "preset, twin",
    [
        ("w4a16", MODELOPT / "qa_grpo_llama8b_megatron.v2.yaml"),
        ("nano3-w4a16", MODELOPT / "qa_grpo_nano3_megatron.yaml"),
        ("w4a4", MODELOPT / "qa_grpo_math_megatron.yaml"),
    ],
)
def test_preset_keys_are_the_twin_configs_values(preset, twin):
    shipped = _yaml(twin)
    keys = modelopt_qat_keys(preset)
    for key, value in keys.items():
        assert get_path(shipped, key) == value, key
    # every quantization key the twin sets is written
    policy = shipped["policy"]
    for name in [k for k in policy if k.startswith("quant_") or k == "disable_modelopt_layer_spec"]:
        assert f"policy.{name}" in keys
    assert "policy.generation.quant_cfg" in keys


def test_real_quant_recipe_ignore_list_comes_from_the_bf16_rules():
    shipped = _yaml(RECIPE)["policy"]["generation"]
    rules = BF16Rules(modules=tuple(shipped["real_quant_ignore"]))
    keys = modelopt_qat_keys("nano3-w4a16", rules, real_quant=True)
    assert keys["policy.generation.real_quant"] is shipped["real_quant"] is True
    # NVIDIA's globs as written; its one plain name as a one-character class, which vLLM's
    # ModelOpt matching reads as that name alone (a plain entry also matches as a substring)
    assert shipped["real_quant_ignore"][0] == "lm_head"
    assert keys["policy.generation.real_quant_ignore"] == [
        "[l]m_head",
        *shipped["real_quant_ignore"][1:],
    ]


def test_first_and_last_layers_become_layer_globs():
    rules = BF16Rules(first=1, last=2, modules=("lm_head",))
    assert real_quant_ignore(rules, num_layers=52) == [
        "[l]m_head",
        "*.layers.0.*",
        "*.layers.50.*",
        "*.layers.51.*",
    ]
    with pytest.raises(FP8ConfigError) as err:
        real_quant_ignore(BF16Rules(last=1))
    assert err.value.key == "bf16_layers.last"


def test_without_rules_real_quant_uses_nemo_rls_default_list():
    src = (SNAPSHOT / "src/nemo_rl/modelopt/utils.py").read_text()
    tree = ast.parse(src)
    assign = next(
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "DEFAULT_NVFP4_IGNORE"
    )
    assert list(DEFAULT_NVFP4_IGNORE) == ast.literal_eval(assign.value)
    # without rules the key is left out, as NVIDIA's configs do: NeMo RL applies this list
    keys = modelopt_qat_keys("w4a16", real_quant=True)
    assert "policy.generation.real_quant_ignore" not in keys


def test_every_written_key_is_one_nemo_rl_declares():
    policy = _declared("nemo_rl/models/policy/__init__.py", "PolicyConfig")
    generation = _declared("nemo_rl/models/generation/vllm/config.py", "VllmConfig")
    keys = modelopt_qat_keys("nano3-w4a16", BF16Rules(modules=("lm_head",)), real_quant=True)
    for key in keys:
        parts = key.split(".")
        if parts[1] == "generation":
            assert parts[2] in generation, key
        elif parts[1] != "megatron_cfg":
            assert parts[1] in policy, key


def test_generation_rules_without_real_quant_are_refused_naming_the_key():
    with pytest.raises(FP8ConfigError) as err:
        modelopt_qat_keys("w4a16", BF16Rules(modules=("*router*",)))
    assert err.value.key == "bf16_layers" and "real_quant_ignore" in str(err.value)
    with pytest.raises(FP8ConfigError) as err:
        modelopt_qat_keys("w4a8")
    assert err.value.key == "qat.preset"


def test_the_nvfp4_generation_refusal_names_the_versions_and_the_modelopt_route():
    from nemo_fp8_plugin.capabilities import NVFP4_GENERATION_REFUSAL, capability

    assert capability("nvfp4").generation_refusal == NVFP4_GENERATION_REFUSAL
    from nemo_fp8_plugin.stacks import NEMO_RL_MAIN, release_label, release_version

    main = release_label(NEMO_RL_MAIN)
    for fact in (
        f"{main} rolls out",
        f"vLLM ({release_version(NEMO_RL_MAIN, 'vllm')} under {main}",
        "policy.generation.quant_cfg",
        "modelopt",
    ):
        assert fact in NVFP4_GENERATION_REFUSAL
