"""Exact shard layout of an export (rl/export.py, rl/safetensors_io.py ShardWriter): the
Hugging Face names ``model-0000i-of-0000N.safetensors``, the index of exactly two shards,
and the size limit at its boundary (a shard of exactly ``max_bytes``, header included, is
kept; one more 8-byte tensor opens the next shard). Every expected value is a literal."""

from __future__ import annotations

import json
import struct

import torch

from nemo_fp8_plugin.rl import safetensors_io as st
from nemo_fp8_plugin.rl.export import export_fp8_checkpoint

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), len(raw)


def test_two_shards_exact_names_and_index(tmp_path):
    # three 1-D bf16 tensors (norms and biases pass through unquantized), 4000 bytes each
    sd = {
        f"model.layers.0.norm{i}.weight": torch.full((2000,), float(i), dtype=torch.bfloat16)
        for i in range(3)
    }
    out = tmp_path / "out"
    result = export_fp8_checkpoint(sd, out, config=CONFIG, max_shard_bytes=10_000)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert result.shards == 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == {
        "metadata": {"total_size": 12_000},
        "weight_map": {
            "model.layers.0.norm0.weight": "model-00001-of-00002.safetensors",
            "model.layers.0.norm1.weight": "model-00001-of-00002.safetensors",
            "model.layers.0.norm2.weight": "model-00002-of-00002.safetensors",
        },
    }
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        header, size = _header(out / shard)
        assert size <= 10_000
        listed = {n for n in header if n != "__metadata__"}
        assert listed == {n for n, f in index["weight_map"].items() if f == shard}


def test_one_shard_is_model_safetensors_without_an_index(tmp_path):
    sd = {"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    out = tmp_path / "out"
    export_fp8_checkpoint(sd, out, config=CONFIG)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_ten_shards_are_numbered_with_five_digits(tmp_path):
    w = st.ShardWriter(tmp_path, 1100, shown=tmp_path)
    for i in range(10):
        w.add(f"t{i}", torch.zeros(8, dtype=torch.uint8))
        w.close_shard()
    weight_map = w.finish()
    assert weight_map["t0"] == "model-00001-of-00010.safetensors"
    assert weight_map["t9"] == "model-00010-of-00010.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"model-{i:05d}-of-00010.safetensors" for i in range(1, 11)
    ]


def test_a_shard_of_exactly_the_limit_is_kept_and_8_bytes_more_opens_the_next(tmp_path):
    limit = 100_000
    w = st.ShardWriter(tmp_path, limit, shown=tmp_path)
    room = w.default_room
    assert room == 1568  # round8(100_000 // 64): the header room a shard reserves
    first = limit - 8 - room - 8  # the first tensor leaves the shard 8 bytes short
    w.add("a", torch.zeros(first, dtype=torch.uint8))
    w.add("b", torch.zeros(8, dtype=torch.uint8))  # exactly at the limit: same shard
    w.add("c", torch.zeros(8, dtype=torch.uint8))  # 8 bytes past it: a new shard
    weight_map = w.finish()
    assert weight_map == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    header, size = _header(tmp_path / "model-00001-of-00002.safetensors")
    assert size == limit  # 8-byte length + reserved header + data, not one byte more
    assert header["b"]["data_offsets"] == [first, first + 8]


def test_a_tensor_one_byte_over_the_limit_goes_to_the_next_shard(tmp_path):
    limit = 100_000
    w = st.ShardWriter(tmp_path, limit, shown=tmp_path)
    first = limit - 8 - w.default_room - 8
    w.add("a", torch.zeros(first, dtype=torch.uint8))
    w.add("b", torch.zeros(9, dtype=torch.uint8))  # one byte past the limit
    assert w.finish() == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
    }
    assert _header(tmp_path / "model-00001-of-00002.safetensors")[1] == limit - 8
