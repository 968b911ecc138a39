"""export_fp8_checkpoint: what it writes, bit for bit against the numerics reference, and how
it refuses bad input without leaving anything behind. (vLLM's acceptance of the output is
checked with a real vLLM in tests/vllm.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import quantize_blockwise, quantize_mxfp8
from nemo_fp8_plugin.rl import export_fp8_checkpoint

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=300,
    torch_dtype="bfloat16",
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@pytest.fixture(scope="module")
def state_dict():
    """A Llama state dict in Hugging Face naming (random bf16 values)."""
    gen = torch.Generator().manual_seed(0)
    h, i, v, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"], 128
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    sd = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(CONFIG["num_hidden_layers"]):
        for lin, shape in shapes.items():
            sd[f"model.layers.{layer}.{lin}.weight"] = shape
        sd[f"model.layers.{layer}.input_layernorm.weight"] = (h,)
        sd[f"model.layers.{layer}.post_attention_layernorm.weight"] = (h,)
    return {
        name: (0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        for name, shape in sd.items()
    }


def _read(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _qcfg(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_block_fp8_tensors_match_the_reference_bit_for_bit(tmp_path, state_dict):
    result = export_fp8_checkpoint(state_dict, tmp_path / "ckpt", "fp8_blockwise", config=CONFIG)
    out = _read(result.path)
    for i in range(2):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}.weight"
            ref = quantize_blockwise(state_dict[name], block=(128, 128))
            assert out[name].dtype == torch.float8_e4m3fn
            assert torch.equal(out[name].view(torch.uint8), ref.data.view(torch.uint8)), name
            assert torch.equal(out[name + "_scale_inv"], ref.scale_inv), name
    # intermediate 384 = 3 tiles; K of down_proj 384 -> 3 scale columns
    assert out["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.1.input_layernorm.weight",
    ):
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], state_dict[name])
    assert result.quantized == 14 and result.passed_through == len(state_dict) - 14
    qcfg = _qcfg(result.path)
    assert qcfg == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "ignored_layers": qcfg["ignored_layers"],
    }
    assert qcfg["ignored_layers"] == []  # embeddings and lm_head are never quantized by vLLM
    config = json.loads((result.path / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == CONFIG


def test_bf16_rules_leave_layers_unquantized_and_listed(tmp_path, state_dict):
    result = export_fp8_checkpoint(
        state_dict,
        tmp_path / "ckpt",
        {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1}},
        config=CONFIG,
    )
    out = _read(result.path)
    ignored = set(_qcfg(result.path)["ignored_layers"])
    for lin in LINEARS:
        assert out[f"model.layers.0.{lin}.weight"].dtype == torch.bfloat16
        assert f"model.layers.0.{lin}.weight_scale_inv" not in out
        assert f"model.layers.0.{lin}" in ignored
        assert out[f"model.layers.1.{lin}.weight"].dtype == torch.float8_e4m3fn
        assert f"model.layers.1.{lin}" not in ignored


def test_pow2_and_mxfp8_recipes(tmp_path, state_dict):
    sub = export_fp8_checkpoint(state_dict, tmp_path / "sub", "fp8_subchannel", config=CONFIG)
    scales = _read(sub.path)["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    assert torch.equal(torch.log2(scales), torch.log2(scales).round())
    assert _qcfg(sub.path)["pow2_scales"] is True

    mx = export_fp8_checkpoint(state_dict, tmp_path / "mx", "mxfp8", config=CONFIG)
    out = _read(mx.path)
    name = "model.layers.1.mlp.up_proj.weight"
    ref = quantize_mxfp8(state_dict[name], block=(1, 32))
    assert torch.equal(out[name].view(torch.uint8), ref.data.view(torch.uint8))
    assert out[name + "_scale_inv"].dtype == torch.float8_e8m0fnu
    assert torch.equal(out[name + "_scale_inv"].view(torch.uint8), ref.scale_inv.view(torch.uint8))
    qcfg = _qcfg(mx.path)
    assert qcfg["quant_method"] == "nemo_fp8" and qcfg["scheme"] == "mx"


def test_from_a_checkpoint_dir_in_shards(tmp_path, state_dict):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "generation_config.json").write_text('{"do_sample": true}')
    names = sorted(state_dict)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:]), start=1):
        save_file(
            {n: state_dict[n] for n in part}, str(src / f"model-0000{i}-of-00002.safetensors")
        )
    (src / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    n: f"model-0000{1 if n in names[:half] else 2}-of-00002.safetensors"
                    for n in names
                }
            }
        )
    )

    result = export_fp8_checkpoint(src, tmp_path / "out", max_shard_bytes=200_000)
    out_dir = result.path
    assert result.shards > 2
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    files = {f.name for f in out_dir.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == files
    assert all(
        f.startswith("model-") and f.endswith(f"-of-{result.shards:05d}.safetensors") for f in files
    )
    for f in files:  # every shard within the bound unless a single tensor exceeds it
        with safe_open(str(out_dir / f), framework="pt") as fh:
            sizes = [fh.get_slice(k).get_shape() for k in fh.keys()]
        assert len(sizes) == 1 or (out_dir / f).stat().st_size <= 200_000 + 10_000
    out = _read(out_dir)
    assert set(out) == set(index["weight_map"])
    assert len(out) == len(state_dict) + 14
    assert (out_dir / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (out_dir / "generation_config.json").exists()
    assert not list(out_dir.glob(".*"))  # no temporary shard names left


def test_existing_output_is_refused_or_replaced_whole(tmp_path, state_dict):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(state_dict, out, config=CONFIG)
    assert err.value.key == "out_dir" and (out / "keep.txt").read_text() == "mine"
    export_fp8_checkpoint(state_dict, out, config=CONFIG, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


class _FailingSource(dict):
    """A state dict whose stream breaks half way (a crash during export)."""

    def items(self):
        for i, item in enumerate(super().items()):
            if i == 5:
                raise RuntimeError("disk on fire")
            yield item


def test_a_crash_leaves_nothing_behind(tmp_path, state_dict):
    with pytest.raises(RuntimeError, match="disk on fire"):
        export_fp8_checkpoint(_FailingSource(state_dict), tmp_path / "ckpt", config=CONFIG)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"config": None}, "config"),
        ({"spec": "fp8_current"}, "spec"),
        ({"spec": {"recipe": "fp8_blockwise", "generation": "bf16"}}, "spec"),
        ({"max_shard_bytes": 0}, "max_shard_bytes"),
        ({"config": "/nonexistent/config.json"}, "config"),
    ],
)
def test_bad_input_names_the_key(tmp_path, state_dict, kwargs, key):
    args = {"config": CONFIG, **kwargs}
    spec = args.pop("spec", "fp8_blockwise")
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(state_dict, tmp_path / "ckpt", spec, **args)
    assert err.value.key == key
    assert not (tmp_path / "ckpt").exists()


def test_source_dir_problems(tmp_path, state_dict):
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(tmp_path / "missing", tmp_path / "out")
    assert err.value.key == "source"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CONFIG))
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FP8ConfigError, match="safetensors") as err:
        export_fp8_checkpoint(empty, tmp_path / "out")
    assert err.value.key == "source"
    save_file(state_dict, str(empty / "model.safetensors"))
    with pytest.raises(FP8ConfigError, match="source directory") as err:
        export_fp8_checkpoint(empty, empty, overwrite=True)
    assert err.value.key == "out_dir" and (empty / "pytorch_model.bin").exists()
