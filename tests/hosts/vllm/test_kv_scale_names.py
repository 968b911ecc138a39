"""The KV/Q scale names the calibrator writes are the ones vLLM 0.32's own loaders load.

``refresh_scales`` names scales ``model.layers.<i>.self_attn.attn.{q,k,v}_scale``: vLLM's
attention parameters themselves. Checked here against vLLM's real code, not a copy of it:

* the two remapping paths of vLLM 0.32: the quantization config's cache-scale mapper that
  ``AutoWeightsLoader`` applies (Llama, Qwen2/3, Qwen3-MoE, Mixtral) and
  ``maybe_remap_kv_scale_name`` (DeepSeek-V2/V3's loading loop);
* ``load_weights`` of real vLLM models (a tiny Llama and a tiny Mixtral, built by vLLM's
  ``initialize_model`` with an FP8 KV cache, under vLLM's own ``fp8`` method as NeMo RL
  configures it and under the plugin's ``nemo_fp8``), fed the calibrator's output for the
  Hugging Face twin of the model: every scale must land in its parameter.

The model building runs in a subprocess: it initialises vLLM's distributed state, which the
engine tests of this directory must not inherit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import LLAMA, MIXTRAL, llama_state_dict, write_checkpoint

pytestmark = [pytest.mark.vllm]

HERE = Path(__file__).resolve().parent


def _ours(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn.{r}_scale" for i in range(num_layers) for r in "qkv"]


def _vllm_attention_params(num_layers: int) -> dict[str, torch.nn.Parameter]:
    """A params_dict with vLLM's attention scale parameters, created by vLLM's own
    ``BaseKVCacheMethod.create_weights`` on one module per layer (the names are checked
    against a real model in ``test_real_models_load_the_calibrated_scales``)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    params: dict[str, torch.nn.Parameter] = {}
    for i in range(num_layers):
        attn = torch.nn.Module()
        BaseKVCacheMethod(None).create_weights(attn)
        for name, param in attn.named_parameters():
            params[f"model.layers.{i}.self_attn.attn.{name}"] = param
        params[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.nn.Parameter(torch.empty(1))
    return params


def test_calibrator_names_pass_both_vllm_remappings():
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    params = _vllm_attention_params(2)
    mappers = {
        "base": QuantizationConfig.get_cache_scale_mapper(),
        "fp8": Fp8Config.get_cache_scale_mapper(),
    }
    for name in _ours(2):
        assert name in params
        assert maybe_remap_kv_scale_name(name, params) == name  # DeepSeek's loop
        for kind, mapper in mappers.items():
            assert mapper.map_name(name) == name, kind  # AutoWeightsLoader


@pytest.mark.parametrize("role", ["q", "k", "v"])
@pytest.mark.parametrize("written", ["ours", "nemo_rl", "old"])
def test_nemo_rl_and_old_names_land_on_the_same_parameters(written, role):
    """NeMo RL writes ...self_attn.{k,v}_scale and ...self_attn.attn.q_scale; the plugin used
    to write ...self_attn.{q,k,v}_scale. With a quantization config (the cache-scale
    mapper) every spelling reaches ...self_attn.attn.<r>_scale; ours needs no remapping."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    target = f"model.layers.1.self_attn.attn.{role}_scale"
    name = {
        "ours": target,
        "nemo_rl": target if role == "q" else f"model.layers.1.self_attn.{role}_scale",
        "old": f"model.layers.1.self_attn.{role}_scale",
    }[written]
    params = _vllm_attention_params(2)
    assert Fp8Config.get_cache_scale_mapper().map_name(name) == target
    assert maybe_remap_kv_scale_name(name, params) == target


PROBE = r"""
import json, os, sys
sys.path.insert(0, {here!r})
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import initialize_model

import nemo_fp8_plugin.hosts.vllm as plugin

plugin.register()
scales = {{k: torch.tensor(v) for k, v in json.load(open({scales!r})).items()}}
# What NeMo RL hands vLLM, with the GEMMs left unquantized (vLLM's CPU FP8 linear kernels need
# AMX; the attention layers keep vLLM's Fp8KVCacheMethod, which is what is under test).
linears = [f"model.layers.{{i}}.{{m}}" for i in range({layers})
           for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "block_sparse_moe.gate", "block_sparse_moe.experts",
                     "block_sparse_moe.experts.routed_experts")]
block_fp8 = {{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128], "ignored_layers": linears + ["lm_head"]}}
out = {{}}
for i, (method, overrides) in enumerate([("fp8", {{"quantization_config": block_fp8}}),
                                         ("nemo_fp8", {{}})]):
    cfg = EngineArgs(model={model!r}, quantization=method, hf_overrides=overrides,
                     kv_cache_dtype="fp8", load_format="dummy", dtype="bfloat16",
                     enforce_eager=True, max_model_len=128,
                     skip_tokenizer_init=True).create_engine_config()
    with set_current_vllm_config(cfg):
        if i == 0:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method="tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=cfg)
        loaded = model.load_weights(list(scales.items()))
    params = dict(model.named_parameters())
    out[method] = {{
        "class": type(model).__name__,
        "loaded": sorted(n for n in loaded if n.endswith(("q_scale", "k_scale", "v_scale"))),
        "scale_params": sorted(n for n in params if n.endswith(("q_scale", "k_scale", "v_scale"))),
        "values": {{n: float(params[n]) for n in scales if n in params}},
    }}
print(json.dumps(out))
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_scales(config: dict, state_dict) -> dict[str, float]:
    """The calibrator on the Hugging Face twin of the model (same config, same weights)."""
    from nemo_fp8_plugin.rl import refresh_scales

    if config["model_type"] == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    else:
        from transformers import MixtralConfig as Config
        from transformers import MixtralForCausalLM as Model
    torch.manual_seed(0)
    model = Model(Config(**config)).eval()
    if state_dict is not None:
        model.load_state_dict({k: v.float() for k, v in state_dict.items()})
    ids = torch.randint(
        0, config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )
    update = refresh_scales(model, forward=lambda: model(ids))
    return {name: float(value) for name, value in update.items()}


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.slow
def test_real_models_load_the_calibrated_scales(tmp_path, arch):
    config = LLAMA if arch == "llama" else MIXTRAL
    weights = llama_state_dict() if arch == "llama" else None
    model_dir = write_checkpoint(tmp_path / arch, config, weights if weights is not None else {})
    scales = _hf_scales(config, weights)
    assert sorted(scales) == sorted(_ours(config["num_hidden_layers"]))
    (tmp_path / "scales.json").write_text(json.dumps(scales))
    probe = PROBE.format(
        here=str(HERE),
        scales=str(tmp_path / "scales.json"),
        model=str(model_dir),
        port=_free_port(),
        layers=config["num_hidden_layers"],
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for method, got in result.items():
        # the parameters vLLM created are exactly the names we write, and all of them load
        assert got["scale_params"] == sorted(scales), (method, got["scale_params"])
        assert got["loaded"] == sorted(scales), method
        assert got["values"] == scales, method
