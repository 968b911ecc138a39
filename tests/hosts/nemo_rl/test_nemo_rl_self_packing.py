"""Sequence alignment for models NeMo RL does not pack.

NeMo RL 7ea279a hands models that pack inside their forward (``_model_self_packs_for_cp``,
``megatron_policy_worker.py:147-165``: ``model_owns_packing`` or Megatron-Bridge's
``Qwen3VLModel``, which Bridge 0.6.2 builds for Qwen3.5 / Qwen3.5-MoE) an unpacked batch,
so its packer's FP8 padding never runs: there, and for any model not in our table,
``policy.make_sequence_length_divisible_by`` must carry TE's alignment x TP x 2 CP.
Run on NVIDIA's real configs (``tests/fixtures/nemo_rl``) through ``apply``.
"""

from __future__ import annotations

import zipfile

import pytest
import yaml
from nemo_rl_cases import MAIN_STACK

from conftest import UPSTREAM, nemo_rl_configs
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.nemo_rl.alignment import model_self_packs
from nemo_fp8_plugin.rules import describe_model

pytestmark = pytest.mark.torch_free

CONFIGS = nemo_rl_configs()
LLAMA_8B = "grpo_math_8B_megatron.yaml"  # packing on, TP 1 in the base
KEY = "make_sequence_length_divisible_by"


def _input(tmp_path, model, fp8, megatron=None):
    src = CONFIGS / LLAMA_8B
    data = yaml.safe_load(src.read_text())
    data["defaults"] = str((src.parent / data["defaults"]).resolve())
    data["fp8"] = fp8
    data["policy"]["model_name"] = model
    data["policy"]["tokenizer"] = {"name": model}
    if megatron:
        data["policy"].setdefault("megatron_cfg", {}).update(megatron)
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_self_packing_table_names_the_models_bridge_builds_as_qwen3vl():
    wheel = UPSTREAM / "megatron_bridge-0.6.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        src = zf.read("megatron/bridge/models/qwen_vl/qwen35_vl_bridge.py").decode()
    for model_type in ('model_type="qwen3_5_moe"', 'model_type="qwen3_5"'):
        assert model_type in src and "target=Qwen3VLModel" in src
    assert model_self_packs("Qwen/Qwen3.5-35B-A3B")
    assert model_self_packs("Qwen/Qwen3.5-27B")
    assert model_self_packs("Qwen/Qwen3-VL-8B-Instruct")
    assert model_self_packs("Qwen/Qwen3-8B") is None
    assert model_self_packs("meta-llama/Llama-3.1-8B-Instruct") is None


@pytest.mark.parametrize(
    "megatron, need",
    [
        ({}, 16),
        ({"tensor_model_parallel_size": 2, "sequence_parallel": False}, 32),
        ({"tensor_model_parallel_size": 2, "context_parallel_size": 2}, 128),
    ],
)
def test_a_packed_self_packing_model_gets_the_alignment_written(tmp_path, megatron, need):
    result = apply_path(
        NEMO_RL, _input(tmp_path, "Qwen/Qwen3.5-35B-A3B", {"recipe": "fp8_blockwise"}, megatron)
    )
    assert result.data["policy"][KEY] == need
    assert any("delegate_pack_to_model" in n for n in result.notes)


def test_a_packed_unknown_model_gets_the_alignment_written(tmp_path):
    result = apply_path(
        NEMO_RL,
        _input(
            tmp_path,
            "acme/never-heard-of-it-7b",
            {"recipe": "fp8_blockwise"},
            {"tensor_model_parallel_size": 4, "sequence_parallel": False},
        ),
    )
    assert result.data["policy"][KEY] == 64
    assert any("not in the model table" in n for n in result.notes)


def test_a_packed_known_model_is_still_left_to_nemo_rls_packer(tmp_path):
    result = apply_path(
        NEMO_RL, _input(tmp_path, "meta-llama/Llama-3.1-8B-Instruct", {"recipe": "fp8_blockwise"})
    )
    assert KEY not in result.data["policy"]


def test_nvfp4_packing_is_allowed_for_a_self_packing_model(tmp_path):
    result = apply_path(
        NEMO_RL, _input(tmp_path, "Qwen/Qwen3.5-27B", {"recipe": "nvfp4"}), stack=MAIN_STACK
    )
    assert result.data["policy"][KEY] == 128


@pytest.mark.parametrize(
    "name, layers, hidden, ffn",
    [
        # Qwen/Qwen2.5-*/config.json: num_hidden_layers, hidden_size, intermediate_size
        ("Qwen/Qwen2.5-0.5B", 24, 896, 4864),
        ("Qwen/Qwen2.5-1.5B", 28, 1536, 8960),
        ("Qwen/Qwen2.5-7B-Instruct", 28, 3584, 18944),
    ],
)
def test_qwen25_is_in_the_model_table(name, layers, hidden, ffn):
    model = describe_model(name)
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (layers, hidden, ffn)


def test_grpo_math_1b_default_model_is_known():
    data = yaml.safe_load((CONFIGS / "grpo_math_1B.yaml").read_text())
    assert describe_model(data["policy"]["model_name"]).num_layers == 28


def test_self_packing_is_a_version_fact_of_the_stacks_table():
    from nemo_fp8_plugin import stacks

    fact = stacks.fact("nemo-rl", "delegate_pack_to_model:qwen3.5")
    assert fact is not None and "7ea279a" in fact.source
    assert model_self_packs("Qwen/Qwen3.5-27B") == fact.doc


def test_a_nemo_rl_version_before_the_facts_range_still_gets_the_alignment(tmp_path):
    """Only 7ea279a (0.6) was read: an older NeMo RL is not known to hand Qwen3.5 a packed
    batch, so the cautious per-sequence alignment is written for it too."""
    from nemo_fp8_plugin.hosts.nemo_rl.alignment import sequence_alignment
    from nemo_fp8_plugin.registry import get_recipe

    resolved = {
        "policy": {
            "model_name": "Qwen/Qwen3.5-27B",
            "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 2},
            "sequence_packing": {"enabled": True},
        }
    }
    spec = get_recipe("fp8_blockwise")
    written = {v: sequence_alignment(spec, resolved, v)[0] for v in ("0.5.0", "0.6.0", None)}
    # TE's alignment (16) x TP 2, whatever the version
    assert all(
        keys == {"policy.make_sequence_length_divisible_by": 32} for keys in written.values()
    )


@pytest.mark.parametrize("model", ["Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-35B-A3B-Base"])
def test_qwen35_is_in_the_model_table_and_still_gets_the_alignment(tmp_path, model):
    # NeMo RL's examples train these (dapo-qwen3.5-9b-base / -35b-a3b-base-*-megatron*.yaml):
    # known to the table, they are still aligned per sequence because they pack themselves.
    assert describe_model(model).layer_kinds  # a hybrid description, not a guess
    megatron = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    result = apply_path(NEMO_RL, _input(tmp_path, model, {"recipe": "fp8_blockwise"}, megatron))
    assert result.data["policy"][KEY] == 32
    assert any("delegate_pack_to_model" in n for n in result.notes)
    assert not any("not in the model table" in n for n in result.notes)
    assert not any("not in the architecture table" in w for w in result.warnings)
