"""export_fp8_checkpoint: what it writes, bit for bit against the numerics reference, and how
it refuses bad input without leaving anything behind. (vLLM's acceptance of the output is
checked with a real vLLM in tests/hosts/vllm.)"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import LLAMA_LINEARS
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
LINEARS = LLAMA_LINEARS


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
    """A state dict whose stream breaks half way (a crash during export): the first pass
    (the export's up-front check of names and tensors) goes through, the second, which
    feeds the quantizer and the writer, breaks at the sixth tensor."""

    passes = 0

    def items(self):
        self.passes += 1
        for i, item in enumerate(super().items()):
            if i == 5 and self.passes > 1:
                raise RuntimeError("disk on fire")
            yield item


def test_a_crash_leaves_nothing_behind(tmp_path, state_dict):
    source = _FailingSource(state_dict)
    with pytest.raises(RuntimeError, match="disk on fire"):
        export_fp8_checkpoint(source, tmp_path / "ckpt", config=CONFIG)
    assert source.passes == 2 and list(tmp_path.iterdir()) == []


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


def _write_dir(root: Path, state_dict, parts: int = 2) -> Path:
    """``state_dict`` as a sharded Hugging Face checkpoint directory with an index."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(state_dict)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = names[i::parts]
        save_file({n: state_dict[n] for n in chunk}, str(root / file))
        weight_map.update({n: file for n in chunk})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def test_a_directory_exports_what_its_state_dict_exports(tmp_path, state_dict):
    """Tensors are read into one reused buffer: every tensor of the output must still be the
    one a state-dict export writes, bit for bit (a tensor overwritten by the next read would
    differ)."""
    src = _write_dir(tmp_path / "src", state_dict, parts=3)
    from_dir = _read(export_fp8_checkpoint(src, tmp_path / "a", max_shard_bytes=150_000).path)
    from_dict = _read(export_fp8_checkpoint(state_dict, tmp_path / "b", config=CONFIG).path)
    assert set(from_dir) == set(from_dict)
    for name, tensor in from_dict.items():
        other = from_dir[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)), name


def test_shards_stay_within_max_shard_bytes_header_included(tmp_path, state_dict):
    result = export_fp8_checkpoint(
        state_dict, tmp_path / "ckpt", config=CONFIG, max_shard_bytes=100_000
    )
    files = sorted(result.path.glob("*.safetensors"))
    assert len(files) == result.shards > 3
    for f in files:
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])  # the reserved room is padded with spaces
        assert n % 8 == 0 and raw[8 + n - 1 : 8 + n] in (b" ", b"}")
        tensors = [k for k in header if k != "__metadata__"]
        assert len(tensors) == 1 or len(raw) <= 100_000, (f.name, len(raw))
        ends = sorted(header[k]["data_offsets"] for k in tensors)
        assert ends[-1][1] == len(raw) - 8 - n  # data fills the rest of the file exactly


def test_progress_bar_on_request_only(tmp_path, state_dict, capsys):
    export_fp8_checkpoint(state_dict, tmp_path / "a", config=CONFIG, progress=True)
    assert "export" in capsys.readouterr().err
    export_fp8_checkpoint(state_dict, tmp_path / "b", config=CONFIG, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"overwrite": "false"}, "overwrite"),
        ({"overwrite": 0}, "overwrite"),
        ({"copy_other_files": "true"}, "copy_other_files"),
        ({"progress": "false"}, "progress"),
        ({"progress": 1}, "progress"),
        ({"max_shard_bytes": True}, "max_shard_bytes"),
        ({"max_shard_bytes": 1.5e9}, "max_shard_bytes"),
        ({"max_shard_bytes": "5GB"}, "max_shard_bytes"),
        ({"max_shard_bytes": -1}, "max_shard_bytes"),
        ({"config": 42}, "config"),
        ({"config": ""}, "config"),
    ],
)
def test_argument_types_are_checked_and_named(tmp_path, state_dict, kwargs, key):
    args = {"config": CONFIG, **kwargs}
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(state_dict, tmp_path / "ckpt", **args)
    assert err.value.key == key
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", [7, None, "", True, b"/tmp/x"])
def test_out_dir_must_be_a_path(tmp_path, state_dict, out):
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(state_dict, out, config=CONFIG)
    assert err.value.key == "out_dir"


@pytest.mark.parametrize("source", [3, "", ["a"], {"model.x.weight": [[1.0]]}, {1: torch.ones(2)}])
def test_source_must_be_a_state_dict_or_a_directory(tmp_path, source):
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(source, tmp_path / "ckpt", config=CONFIG)
    assert err.value.key == "source"
    assert list(tmp_path.iterdir()) == []


def test_overwrite_never_replaces_a_file_or_the_sources_parent(tmp_path, state_dict):
    target = tmp_path / "file.txt"
    target.write_text("mine")
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(state_dict, target, config=CONFIG, overwrite=True)
    assert err.value.key == "out_dir" and target.read_text() == "mine"
    src = _write_dir(tmp_path / "models" / "src", state_dict)
    with pytest.raises(FP8ConfigError, match="delete the source") as err:
        export_fp8_checkpoint(src, tmp_path / "models", overwrite=True)
    assert err.value.key == "out_dir" and (src / "config.json").is_file()


def test_a_tensor_in_two_shards_is_refused_before_any_work(tmp_path, state_dict):
    src = _write_dir(tmp_path / "src", state_dict)
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({name: state_dict[name]}, str(src / "extra.safetensors"))
    (src / "model.safetensors.index.json").unlink()  # every *.safetensors file is read
    with pytest.raises(FP8ConfigError, match="appears in both") as err:
        export_fp8_checkpoint(src, tmp_path / "out")
    assert err.value.key == name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("damage", ["truncated", "header-length", "not-json", "gap", "short"])
def test_damaged_shards_are_refused_naming_the_file(tmp_path, state_dict, damage):
    src = _write_dir(tmp_path / "src", state_dict, parts=1)
    shard = src / "model-00001-of-00001.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "truncated":
        raw = raw[: len(raw) - 100]
    elif damage == "header-length":
        raw = struct.pack("<Q", len(raw)) + raw[8:]
    elif damage == "not-json":
        raw = raw[:8] + b"[" * n + raw[8 + n :]
    elif damage == "gap":  # a tensor's offsets moved past the next one's
        header = json.loads(raw[8 : 8 + n])
        first = min(
            (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
        )
        header[first]["data_offsets"][0] += 2
        text = json.dumps(header, separators=(",", ":")).encode().ljust(n, b" ")
        assert len(text) == n
        raw = raw[:8] + text + raw[8 + n :]
    else:
        raw = raw[:5]
    shard.write_bytes(raw)
    with pytest.raises(FP8ConfigError, match="not a readable safetensors file") as err:
        export_fp8_checkpoint(src, tmp_path / "out")
    assert err.value.key == "source" and shard.name in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli_export(tmp_path, state_dict, capsys):
    import argparse

    from nemo_fp8_plugin.cli import export as export_cli

    parser = argparse.ArgumentParser()
    export_cli.register(parser.add_subparsers())
    src = _write_dir(tmp_path / "src", state_dict)
    args = parser.parse_args(
        [
            "export",
            str(src),
            "-o",
            str(tmp_path / "out"),
            "--max-shard-size",
            "100kB",
            "--json",
            "--no-progress",
        ]
    )
    assert args.run(args) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["quantized"] == 14 and report["shards"] > 3 and captured.err == ""
    assert report["quantization_config"]["weight_block_size"] == [128, 128]
    for f in (tmp_path / "out").glob("*.safetensors"):  # one tensor over the size: alone
        with safe_open(str(f), framework="pt") as fh:
            assert len(fh.keys()) == 1 or f.stat().st_size <= 100_000, f.name
    for argv, key in (
        (["export", str(src), "-o", str(tmp_path / "out")], "-o"),  # exists
        (["export", str(src), "-o", str(tmp_path / "x"), "--recipe", "fp8_current"], "--recipe"),
        (
            ["export", str(src), "-o", str(tmp_path / "x"), "--max-shard-size", "5 parsecs"],
            "--max-shard-size",
        ),
        (
            ["export", str(src), "-o", str(tmp_path / "x"), "--max-shard-size", "0"],
            "--max-shard-size",
        ),
        (["export", str(tmp_path / "nope"), "-o", str(tmp_path / "x")], "CHECKPOINT"),
    ):
        args = parser.parse_args(argv)
        with pytest.raises(FP8ConfigError) as err:
            args.run(args)
        assert err.value.key == key, argv
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "text,size", [("1024", 1024), ("500MB", 500 * 10**6), ("5GiB", 5 * 2**30), ("1.5 kb", 1500)]
)
def test_cli_sizes(text, size):
    from nemo_fp8_plugin.cli.export import parse_size

    assert parse_size(text, "--max-shard-size") == size


def _write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with the tensors in the given order (no alignment): what another
    writer may produce, e.g. a bf16 tensor after an odd-sized uint8 one."""
    header, blobs, at = {}, [], 0
    for name, (dtype, t) in tensors.items():
        blob = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [at, at + len(blob)],
        }
        blobs.append(blob)
        at += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-aligned, as the library writes it
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_unaligned_and_unlisted_dtypes_are_read_exactly(tmp_path, state_dict, monkeypatch):
    """A bf16 weight at an odd offset (read, not mapped) and a dtype outside the reader's
    table (float8_e4m3fnuz: read through the safetensors library) pass through intact."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    odd = torch.arange(7, dtype=torch.uint8)
    fnuz = torch.linspace(-2, 2, 16).to(torch.float8_e4m3fnuz)
    q_name = "model.layers.1.self_attn.q_proj.weight"
    _write_raw_safetensors(
        src / "model.safetensors",
        {
            "model.odd_buffer": ("U8", odd),
            q_name: ("BF16", state_dict[q_name]),
            "model.norm.weight": ("BF16", state_dict["model.norm.weight"]),
            "model.extra_scale": ("F8_E4M3FNUZ", fnuz),
        },
    )
    from nemo_fp8_plugin.rl import safetensors_io as export_module

    reads = []
    real_read_into = export_module._read_into
    monkeypatch.setattr(
        export_module, "_read_into", lambda *a: reads.append(a[2]) or real_read_into(*a)
    )
    out = _read(export_fp8_checkpoint(src, tmp_path / "out").path)
    assert len(reads) == 2  # the two bf16 tensors at odd offsets; the uint8 one is mapped
    ref = quantize_blockwise(state_dict[q_name], block=(128, 128))
    assert torch.equal(out[q_name].view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(out[q_name + "_scale_inv"], ref.scale_inv)
    assert torch.equal(out["model.odd_buffer"], odd)
    assert torch.equal(out["model.norm.weight"], state_dict["model.norm.weight"])
    assert out["model.extra_scale"].dtype == torch.float8_e4m3fnuz
    assert torch.equal(out["model.extra_scale"].view(torch.uint8), fnuz.view(torch.uint8))
