"""``examples/vllm/refit_loop.py`` run as a user runs it: its step lines, then one verdict
line; vLLM's own log at warning level, with neither the chat-template traceback a model
without a tokenizer gives nor vLLM's BF16-into-FP8 load warnings (the ``nemo_fp8`` loader
quantizes there; the example checks the engine holds the trainer's FP8 bytes)."""

from __future__ import annotations

import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm" / "refit_loop.py"


@pytest.mark.slow  # an engine start and three refits: ~35 s on two cores
def test_the_example_ends_with_its_verdict_and_vllm_at_warning_level(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines[-4:-1]] == ["step 0", "step 1", "step 2"]
    assert lines[-1].startswith("refit_loop: PASS: 3 refits in place (")
    assert "Traceback" not in out and "Chat template warmup failed" not in out
    assert "Attempted to load weight" not in out
    assert " INFO " not in out  # vLLM's start-up log stays at warning level


def test_the_load_filter_drops_only_the_quantized_on_load_message(monkeypatch):
    """The filter keeps every other dtype message of vLLM's loader."""
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the example's setdefaults stay here
    module = runpy.run_path(str(EXAMPLE), run_name="refit_loop_example")
    keep = module["quantized_on_load"]

    def record(*args):
        return logging.LogRecord(
            "vllm.model_executor.models.utils",
            logging.WARNING,
            "utils.py",
            333,
            "Attempted to load weight %s with dtype %s into parameter with dtype %s",
            args,
            None,
        )

    import torch

    assert not keep(record("layers.0.mlp.down_proj.weight", torch.bfloat16, torch.float8_e4m3fn))
    assert keep(record("layers.0.mlp.down_proj.weight", torch.int8, torch.float8_e4m3fn))
    assert keep(record("embed_tokens.weight", torch.float8_e4m3fn, torch.bfloat16))
