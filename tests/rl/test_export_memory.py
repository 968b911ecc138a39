"""export_fp8_checkpoint's memory bound, measured in a fresh Python.

A 400 MB checkpoint of 16 MB tensors in two shards (208 and 192 MiB): the bound (twice the largest
tensor plus 300 MiB above the interpreter's baseline, 332 MB) is below the checkpoint, below
one source shard plus its quantized copy, and below the whole quantized output, so an export
that holds a shard (or a memory map of one), or the output, in memory fails it; a streaming
one (one tensor and its FP8 copy) passes with room to spare.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open

from nemo_fp8_plugin.tools.bench_export import (
    RSS_SLACK_BYTES,
    measure_export_memory,
    write_synthetic_checkpoint,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]

LAYERS = 6
SHAPES = (
    [("model.embed_tokens.weight", (2048, 4096))]
    + [
        (f"model.layers.{i}.{lin}.weight", (2048, 4096))
        for i in range(LAYERS)
        for lin in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    + [("model.norm.weight", (4096,))]
)


def test_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    src = tmp_path / "src"
    info = write_synthetic_checkpoint(
        src,
        SHAPES,
        shard_bytes=208 * 2**20,
        config={"num_hidden_layers": LAYERS, "hidden_size": 4096},
    )
    assert info["shards"] == 2 and info["largest"] == 16 * 2**20
    bound = 2 * info["largest"] + RSS_SLACK_BYTES
    assert info["bytes"] > bound  # the whole checkpoint does not fit the bound
    # the default max_shard_bytes (5 GiB): the whole output would be one shard
    mem = measure_export_memory(src, tmp_path / "out")
    assert mem["quantized"] == 4 * LAYERS and mem["shards"] == 1
    assert mem["delta_bytes"] < bound, (
        f"peak RSS {mem['delta_bytes'] / 2**20:.0f} MiB above baseline, bound "
        f"{bound / 2**20:.0f} MiB"
    )
    # the streamed shard is a valid safetensors file with every tensor
    out = tmp_path / "out" / "model.safetensors"
    with safe_open(str(out), framework="pt") as fh:
        names = set(fh.keys())
        assert fh.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn
    assert len(names) == len(SHAPES) + 4 * LAYERS
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"


def test_quick_benchmark_reports_every_figure(tmp_path):
    from nemo_fp8_plugin.tools.bench_export import bench_export, render_export

    result = bench_export(quick=True, workdir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the synthetic checkpoint is removed
    for key in ("export_s", "copy_s", "first_export_s", "export_gbps", "copy_gbps"):
        assert result[key] > 0, key
    assert result["ratio"] == pytest.approx(result["copy_s"] / result["export_s"])
    assert 40e6 < result["checkpoint_bytes"] < 60e6 and result["source_shards"] > 1
    assert 0 < result["peak_rss_bytes"] < result["rss_bound_bytes"]
    assert len(result["load_samples"]) == result["rounds"]  # ratios count only when quiet
    assert result["quiet_rounds"] == sum(x < 1.5 for x in result["load_samples"])
    assert 0 < result["stages"]["read_s"] and 0 < result["stages"]["read_quantize_s"]
    table = render_export(result)
    assert "load average per round" in table and "stages" in table
    assert table.startswith("| export benchmark |") and "ratio" in table
    with pytest.raises(TypeError):
        bench_export(quick="yes")  # type: ignore[arg-type]
