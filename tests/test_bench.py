"""`nemo-fp8 bench` runs end to end and reports ratios (a smoke run: the figures themselves
are benchmarks, recorded in docs/performance.md, never asserted in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one end-to-end `nemo-fp8 bench --quick`


def test_bench_quick_reports_every_ratio(tmp_path):
    out = tmp_path / "bench.json"
    # eager kernels: this checks the plumbing, not speed, and skips minutes of compiling
    env = dict(os.environ, NEMO_FP8_FUSED="0")
    proc = subprocess.run([str(Path(sys.executable).with_name("nemo-fp8")), "bench", "--quick",
                           "--skip-bf16", "--json", str(out)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quantize"]["rows"]["clone"]["x_clone"] == 1.0
    assert {"eager 1x128", "fused 128x128", "fused mxfp8 1x32"} <= set(result["quantize"]["rows"])
    linear = result["linear"]["rows"]
    for recipe in ("fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"):
        assert linear[recipe]["x_fp32"] > 0
    assert result["refit"]["rows"]["copy (clone)"]["x_copy"] == 1.0
    assert result["refit"]["rows"]["refit fused"]["GB/s"] > 0
    for heading in ("Block quantization", "Linear fwd+bwd", "Refit quantizer"):
        assert heading in proc.stdout
