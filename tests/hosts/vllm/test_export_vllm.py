"""`export_fp8_checkpoint` output against vLLM's own ``fp8`` method: its config parser and
vLLM's engine-config machinery (which method it picks). The weight-shape checks run inside
the engine of ``test_engine.py``, which serves this same export (vLLM's parameter helpers
need its tensor-parallel group)."""

from __future__ import annotations

import json

import pytest

from tiny_models import LLAMA, llama_state_dict

pytestmark = pytest.mark.vllm

SPEC = {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1}}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    out = tmp_path_factory.mktemp("export") / "fp8"
    export_fp8_checkpoint(llama_state_dict(), out, SPEC, config=LLAMA)
    return out


def test_vllm_fp8_config_accepts_it(exported):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    qcfg = json.loads((exported / "config.json").read_text())["quantization_config"]
    cfg = Fp8Config.from_config(qcfg)
    assert cfg.is_checkpoint_fp8_serialized and cfg.activation_scheme == "dynamic"
    assert cfg.weight_block_size == [128, 128]
    assert set(cfg.ignored_layers) >= {
        f"model.layers.0.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert not any(name.startswith("model.layers.1.") for name in cfg.ignored_layers)


def _vllm_config(model_dir, quantization=None):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        quantization=quantization,
        max_model_len=128,
        enforce_eager=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",
    ).create_engine_config()


def test_vllm_picks_its_own_fp8_method_unless_nemo_fp8_is_asked_for(exported):
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    native = _vllm_config(exported)
    assert native.model_config.quantization == "fp8"
    assert type(native.quant_config).__name__ == "Fp8Config"
    ours = _vllm_config(exported, quantization="nemo_fp8")
    assert ours.model_config.quantization == "nemo_fp8"
    assert isinstance(ours.quant_config, NemoFp8Config)
    assert ours.quant_config.weight_block_size == [128, 128]
    assert "model.layers.0.self_attn.q_proj" in ours.quant_config.ignored_layers
