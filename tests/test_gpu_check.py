"""The GPU device check's CPU-side logic (scripts/gpu_check.sh; docs/performance.md).

On a CPU the same code runs with `--device cpu`: the quantizer part compares the device
path with the CPU reference (trivially the same device here, so this checks the
plumbing, the edge inputs and the report), the refit part measures and compares, and the
parts that need CUDA, Transformer Engine or vLLM say why they were skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from conftest import REPO
from nemo_fp8_plugin.tools import gpu_check


def test_cpu_logic_run_through_the_script(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, NEMO_FP8_FUSED="0", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out),
                           "--device", "cpu", "--quick"], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert set(parts) == set(gpu_check.PARTS)
    assert parts["quantizers"]["status"] == "ok" and parts["quantizers"]["checked"] > 100
    fake_quant = parts["quantizers"]["fake_quant"]
    assert fake_quant and all(row["bit_exact"] and row["differing"] == 0 for row in fake_quant)
    # every way the emulation fake-quantizes, eager and compiled, row- and column-wise
    assert {row["fn"] for row in fake_quant} == {
        "fake_quant_blockwise", "fake_quant_mxfp8", "fake_quant_per_tensor",
        "fake_quant_with_scale"}
    assert {row["fused"] for row in fake_quant} == {False, True}
    assert {row["case"] for row in fake_quant} == {"random", "edges"}
    tiles = {tuple(row["tile"]) for row in fake_quant if row["tile"]}
    assert {(1, 128), (128, 1), (128, 128), (1, 32), (32, 1)} <= tiles
    assert {row["fmt"] for row in fake_quant} == {"e4m3", "e5m2"}
    assert parts["refit"]["status"] == "ok" and parts["refit"]["bit_exact"] is True
    assert parts["refit"]["refit_gb_s"] > 0 and parts["refit"]["copy_gb_s"] > 0
    for name in ("gemm", "te_quantizers", "te_linear", "vllm_refit"):
        assert parts[name]["status"] == "skipped" and parts[name]["reason"], name
    assert report["environment"]["torch"] == torch.__version__


def test_a_mismatch_is_reported_as_failed(monkeypatch):
    from nemo_fp8_plugin import numerics

    real = numerics.quantize_blockwise

    def off_by_one(x, *args, **kwargs):
        q = real(x, *args, **kwargs)
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            bumped = (q.data.view(torch.uint8) ^ 1).view(q.data.dtype)
            return type(q)(data=bumped, scale_inv=q.scale_inv, fmt=q.fmt, block=q.block)
        return q

    # Only the reference path goes through the patched function; the device path must
    # then disagree, and the part must say so.
    monkeypatch.setattr(numerics, "quantize_blockwise", off_by_one)
    monkeypatch.setattr(numerics, "quantize_blockwise_fused", real)
    with numerics.fused_mode(False):
        result = gpu_check.check_quantizers(torch.device("cpu"), quick=True)
    assert result["status"] == "failed" and result["mismatches"]


def test_a_fake_quant_mismatch_is_reported_as_failed(monkeypatch):
    from nemo_fp8_plugin.numerics import fused

    real = fused.fake_quant_mxfp8

    def one_ulp_off(x, *args, **kwargs):
        out = real(x, *args, **kwargs).clone()
        out.view(torch.int32)[0, 0] ^= 1
        return out

    # The CPU reference is quantize_mxfp8(...).dequantize(), so only the checked path
    # is off by one ulp in one element.
    monkeypatch.setattr(fused, "fake_quant_mxfp8", one_ulp_off)
    with fused.fused_mode(False):
        result = gpu_check.check_quantizers(torch.device("cpu"), quick=True)
    assert result["status"] == "failed"
    bad = [row for row in result["fake_quant"] if not row["bit_exact"]]
    assert bad and all(row["fn"] == "fake_quant_mxfp8" and row["differing"] == 1 for row in bad)
    assert {row["fused"] for row in bad} == {False, True}
    assert all(row["bit_exact"] for row in result["fake_quant"] if row["fn"] != "fake_quant_mxfp8")
    assert bad[0] in result["mismatches"]


def test_cuda_requested_without_a_gpu_exits_2(tmp_path):
    if torch.cuda.is_available():
        return  # this file is about the CPU machine; on a GPU the script runs for real
    proc = subprocess.run([sys.executable, "-m", "nemo_fp8_plugin.tools.gpu_check", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_unknown_part_exits_2(tmp_path):
    assert gpu_check.main(["--device", "cpu", "--parts", "quantizers,bogus",
                           "--out", str(tmp_path / "x.json")]) == 2
