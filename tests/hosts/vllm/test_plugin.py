"""The vLLM plugin against a real vLLM: entry point, registration, vLLM's own config parsing,
the engine arguments, and ``nemo-fp8 apply --host vllm``. No engine is started here."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import yaml

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_mapping, get_adapter
from nemo_fp8_plugin.hosts.vllm import QUANT_METHOD, engine_kwargs, engine_spelling


def apply_vllm(config):
    """``apply --host vllm`` on a mapping: (output, warnings)."""
    result = apply_mapping(get_adapter("vllm"), config)
    return result.data, [str(w) for w in result.warnings]


pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]


def test_entry_point_is_declared_and_discovered():
    found = {e.name: e for e in entry_points(group="vllm.general_plugins")}
    assert found["nemo_fp8"].value == "nemo_fp8_plugin.hosts.vllm:register"

    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    loaded = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)  # vLLM's own discovery
    from nemo_fp8_plugin.hosts.vllm import register

    assert loaded["nemo_fp8"] is register


def test_general_plugins_register_the_method_and_nothing_else():
    from vllm.model_executor.layers import quantization as q
    from vllm.plugins import load_general_plugins

    before = list(q.QUANTIZATION_METHODS)
    load_general_plugins()
    from nemo_fp8_plugin.hosts.vllm import register
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    register()  # a second call in one process is harmless
    after = list(q.QUANTIZATION_METHODS)
    assert QUANT_METHOD in after
    assert [m for m in after if m != QUANT_METHOD] == [m for m in before if m != QUANT_METHOD]
    assert after.count(QUANT_METHOD) == 1
    assert q.get_quantization_config(QUANT_METHOD) is NemoFp8Config
    assert q.get_quantization_config("fp8").__name__ == "Fp8Config"  # untouched


def test_importing_the_package_pulls_neither_torch_nor_vllm():
    code = (
        "import sys, nemo_fp8_plugin.hosts.vllm as v; v.engine_kwargs('fp8_blockwise'); "
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _engine_config(tmp_path, model_dir, **overrides):
    """Write a `vllm serve --config` YAML for the tiny model (plus ``overrides``)."""
    cfg = {
        "model": str(model_dir),
        "max-model-len": 128,
        "enforce-eager": True,
        "skip-tokenizer-init": True,
        "dtype": "float32",
        **overrides,
    }
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _vllm_config(path):
    """Parse it with vLLM's own argument machinery and build vLLM's engine config."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--config", str(path)])
    return EngineArgs.from_cli_args(args).create_engine_config()


def test_apply_output_is_parsed_by_vllms_config_machinery(tmp_path, tiny_llama_dir):
    """`nemo-fp8 apply --host vllm` writes a file `vllm serve --config` takes; vLLM builds its
    config from it and instantiates our quantization config from the hf_overrides."""
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    src = _engine_config(
        tmp_path,
        tiny_llama_dir,
        fp8={"recipe": "fp8_blockwise", "bf16_layers": {"first": 1, "modules": ["*down_proj"]}},
    )
    out = tmp_path / "native.yaml"
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("nemo-fp8")),
            "apply",
            str(src),
            "--host",
            "vllm",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    written = yaml.safe_load(out.read_text())
    assert "fp8" not in written and written["quantization"] == QUANT_METHOD
    vcfg = _vllm_config(out)
    assert vcfg.model_config.quantization == QUANT_METHOD
    quant = vcfg.quant_config
    assert isinstance(quant, NemoFp8Config)
    assert quant.weight_block_size == [128, 128] and quant.scheme == "block"
    # The rules as vLLM applies them (spelled as patterns and counts, or as exact module
    # names when apply reads the model's config.json: either way the same layers).
    quant.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    quant._num_layers = 3
    assert quant.is_bf16("model.layers.0.self_attn.qkv_proj")  # bf16_layers.first = 1
    assert quant.is_bf16("model.layers.2.mlp.down_proj")  # *down_proj
    assert not quant.is_bf16("model.layers.1.self_attn.qkv_proj")
    assert not quant.is_bf16("model.layers.2.mlp.gate_up_proj")
    assert vcfg.cache_config.cache_dtype == "auto"


def test_vllm_reports_a_bad_quantization_config(tmp_path, tiny_llama_dir):
    kwargs = engine_kwargs("fp8_blockwise")
    qcfg = dict(kwargs["hf_overrides"]["quantization_config"], activation_scheme="static")
    path = _engine_config(
        tmp_path,
        tiny_llama_dir,
        quantization=QUANT_METHOD,
        **{"hf-overrides": {"quantization_config": qcfg}},
    )
    with pytest.raises(ValueError, match="activation_scheme"):
        _vllm_config(path)


def test_engine_kwargs_per_recipe():
    block = engine_kwargs("fp8_blockwise")
    assert block["quantization"] == QUANT_METHOD and block["kv_cache_dtype"] == "auto"
    qcfg = block["hf_overrides"]["quantization_config"]
    assert qcfg["weight_block_size"] == [128, 128] and qcfg["pow2_scales"] is False
    assert (
        engine_kwargs("fp8_subchannel")["hf_overrides"]["quantization_config"]["pow2_scales"]
        is True
    )
    mx = engine_kwargs("mxfp8")["hf_overrides"]["quantization_config"]
    assert mx["scheme"] == "mx" and mx["weight_block_size"] == [1, 32]
    kv = engine_kwargs({"recipe": "fp8_blockwise", "kv_cache": "fp8"})
    # vLLM 0.32's EngineArgs has no calculate_kv_scales: KV scales come with each refit.
    assert kv["kv_cache_dtype"] == "fp8_e4m3" and "calculate_kv_scales" not in kv
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(model="m", **kv)  # vllm.LLM(**kwargs) takes every key (TypeError otherwise)
    with pytest.warns(UserWarning, match="per-tensor|tensorwise|BF16"):
        assert engine_kwargs("fp8_current") == {}


def test_cpu_backend_fp8_kv_cache_trap_is_handled():
    kwargs, found = engine_spelling({"recipe": "fp8_blockwise", "kv_cache": "fp8"}, platform="cpu")
    assert kwargs["kv_cache_dtype"] == "auto"
    assert any("E5M2" in w for w in found)
    gpu, found_gpu = engine_spelling({"recipe": "fp8_blockwise", "kv_cache": "fp8"})
    assert gpu["kv_cache_dtype"] == "fp8_e4m3" and not found_gpu


def test_bf16_rules_with_a_model_become_exact_vllm_names():
    kwargs = engine_kwargs(
        {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1, "last": 1}},
        model="meta-llama/Llama-3.1-8B",
    )
    qcfg = kwargs["hf_overrides"]["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qcfg["ignored_layers"]
    assert "model.layers.31.mlp.down_proj" in qcfg["ignored_layers"]
    assert qcfg["num_first_layers_in_bf16"] == 0 and qcfg["num_last_layers_in_bf16"] == 0
    # vLLM's own fp8 config takes the same list.
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    fp8 = Fp8Config.from_config({**qcfg, "quant_method": "fp8"})
    assert fp8.ignored_layers == qcfg["ignored_layers"]


# --------------------------------------------------------------------------- NemoFp8Config


def _config(**kw):
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    cfg = NemoFp8Config.from_config({"quant_method": QUANT_METHOD, **kw})
    cfg.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    cfg._num_layers = 4
    return cfg


def test_bf16_rule_decisions_on_vllm_module_names():
    cfg = _config(
        num_first_layers_in_bf16=1,
        num_last_layers_in_bf16=1,
        ignored_layers=["*.mlp.down_proj", "model.layers.2.self_attn.o_proj"],
    )
    assert cfg.is_bf16("model.layers.0.self_attn.qkv_proj")  # first
    assert cfg.is_bf16("model.layers.3.mlp.gate_up_proj")  # last
    assert not cfg.is_bf16("model.layers.1.self_attn.qkv_proj")
    assert cfg.is_bf16("model.layers.1.mlp.down_proj")  # glob
    assert cfg.is_bf16("model.layers.2.self_attn.o_proj")  # exact
    assert not cfg.is_bf16("model.layers.1.self_attn.o_proj")
    # Megatron naming in a pattern reaches the vLLM module through the name mapping.
    mg = _config(ignored_layers=["decoder.layers.1.self_attention.linear_qkv"])
    assert mg.is_bf16("model.layers.1.self_attn.qkv_proj")
    assert not mg.is_bf16("model.layers.2.self_attn.qkv_proj")


def test_exact_names_must_cover_a_fused_module():
    cfg = _config(ignored_layers=["model.layers.1.self_attn.q_proj"])
    with pytest.raises(ValueError, match="one fused GEMM"):
        cfg.is_bf16("model.layers.1.self_attn.qkv_proj")
    full = _config(ignored_layers=[f"model.layers.1.self_attn.{p}_proj" for p in "qkv"])
    assert full.is_bf16("model.layers.1.self_attn.qkv_proj")


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"fmt": "e5m2"}, "fmt"),
        ({"scheme": "tensor"}, "scheme"),
        ({"weight_block_size": [64, 64]}, "weight_block_size"),
        ({"backend": "cuda"}, "backend"),
        ({"typo": 1}, "unknown"),
    ],
)
def test_config_errors_name_the_key(bad, match):
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with pytest.raises(ValueError, match=match):
        NemoFp8Config.from_config({"quant_method": QUANT_METHOD, **bad})


def test_claims_an_fp8_checkpoint_only_when_asked():
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    ckpt = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert NemoFp8Config.override_quantization_method(ckpt, QUANT_METHOD) == QUANT_METHOD
    assert NemoFp8Config.override_quantization_method(ckpt, None) is None
    assert NemoFp8Config.override_quantization_method(ckpt, "fp8") is None
    per_tensor = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert NemoFp8Config.override_quantization_method(per_tensor, QUANT_METHOD) is None


# --------------------------------------------------------------------------- apply --host vllm


def test_apply_keeps_keys_and_style_and_is_idempotent():
    src = {
        "model": "m",
        "tensor-parallel-size": 2,
        "precision": "fp8_blockwise",
        "hf-overrides": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    }
    out, found = apply_vllm(src)
    assert not found
    assert out["tensor-parallel-size"] == 2 and "precision" not in out
    # kv-cache-dtype: auto is EngineArgs' default, so it is not written
    assert out["quantization"] == QUANT_METHOD and "kv-cache-dtype" not in out
    assert out["hf-overrides"]["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert "hf_overrides" not in out and "kv_cache_dtype" not in out
    again = apply_mapping(get_adapter("vllm"), out)  # its own output: read back, left as it is
    assert again.data == out and not again.warnings
    assert "already FP8 in vLLM's own keys, read as fp8_blockwise" in str(again.notes[0])
    underscored, _ = apply_vllm(
        {"model": "m", "fp8": {"recipe": "fp8_blockwise", "kv_cache": "fp8"}}
    )
    assert "hf_overrides" in underscored and underscored["kv_cache_dtype"] == "fp8_e4m3"


@pytest.mark.parametrize(
    "native,key",
    [
        ({"quantization": "fp8"}, "quantization"),
        ({"kv-cache-dtype": "fp8_e5m2"}, "kv-cache-dtype"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        (
            {"hf_overrides": {"quantization_config": {"quant_method": "fp8"}}},
            "hf_overrides.quantization_config",
        ),
    ],
)
def test_apply_refuses_contradicting_native_keys(native, key):
    with pytest.raises(FP8ConfigError) as err:
        apply_vllm({"model": "m", "precision": "fp8_blockwise", **native})
    assert err.value.key == key


def test_apply_accepts_agreeing_native_keys():
    out, _ = apply_vllm(
        {
            "model": "m",
            "precision": "fp8_blockwise",
            "quantization": "nemo_fp8",
            "kv_cache_dtype": "auto",
        }
    )
    assert out["quantization"] == "nemo_fp8"
    fp8_kv, _ = apply_vllm(
        {
            "model": "m",
            "fp8": {"recipe": "fp8_blockwise", "kv_cache": "fp8"},
            "kv_cache_dtype": "fp8",
        }
    )
    assert fp8_kv["kv_cache_dtype"] == "fp8_e4m3"


def test_apply_on_cpu_device_keeps_the_kv_cache_in_model_dtype():
    out, found = apply_vllm(
        {"model": "m", "device": "cpu", "fp8": {"recipe": "fp8_blockwise", "kv_cache": "fp8"}}
    )
    # the model dtype is EngineArgs' default kv_cache_dtype (auto): nothing written for it
    assert "kv_cache_dtype" not in out and any("E5M2" in w for w in found)
    # vLLM 0.32 has no `device` engine argument: read as the platform, left out, named.
    assert "device" not in out and any(w.startswith("vllm: device:") for w in found)
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs(**out)
    hyphen, found = apply_vllm(
        {"model": "m", "device": "cpu", "max-model-len": 64, "precision": "fp8_blockwise"}
    )
    assert "device" not in hyphen and any("device" in w for w in found)


def test_cli_error_is_one_line_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: m\nprecision: fp8_blockwise\nquantization: awq\n")
    run = subprocess.run(
        [str(Path(sys.executable).with_name("nemo-fp8")), "apply", str(path), "--host", "vllm"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "quantization" in run.stderr


def test_shipped_example_applies(tmp_path):
    examples = sorted((REPO / "conf" / "examples").glob("vllm_*.yaml"))
    assert examples, "conf/examples/vllm_*.yaml"
    for example in examples:
        out, _ = apply_vllm(yaml.safe_load(example.read_text()))
        assert out["quantization"] == QUANT_METHOD, example
        json.dumps(out)


def test_gpu_kernel_binding_keeps_loadable_parameters_and_updates_in_place():
    """The CUDA path hands vLLM's block-FP8 kernel a view of the layer; vLLM's CPU build has no
    such kernel, so a stub stands in for it here (the only stub in these tests): it rewrites the
    scale tensor after loading, as DeepGEMM's layout conversion does."""
    from nemo_fp8_plugin.hosts.vllm.methods import NemoFp8LinearMethod

    class RewritingKernel:
        def process_weights_after_loading(self, layer):
            layer.weight_scale_inv = torch.nn.Parameter(
                layer.weight_scale_inv.data * 2.0, requires_grad=False
            )

    method = NemoFp8LinearMethod(_config())
    method.use_vllm, method._kernel = True, RewritingKernel()
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(
        torch.zeros(256, 128, dtype=torch.float8_e4m3fn), requires_grad=False
    )
    layer.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 1), requires_grad=False)
    for attr in (
        "weight_block_size",
        "logical_widths",
        "input_size_per_partition",
        "output_size_per_partition",
        "orig_dtype",
    ):
        setattr(layer, attr, None)
    params = {n: id(p) for n, p in layer.named_parameters()}

    method.process_weights_after_loading(layer)
    view = method._view
    assert view.weight.data_ptr() == layer.weight.data_ptr()  # the weight is shared
    kernel_scale = view.weight_scale_inv
    assert torch.equal(kernel_scale, torch.full((2, 1), 2.0))

    layer.weight_scale_inv.data.fill_(3.0)  # a refit writes into the layer's own parameter
    method.after_refit(layer)
    assert method._view.weight_scale_inv is kernel_scale  # same tensor, updated in place
    assert torch.equal(kernel_scale, torch.full((2, 1), 6.0))
    assert {n: id(p) for n, p in layer.named_parameters()} == params
