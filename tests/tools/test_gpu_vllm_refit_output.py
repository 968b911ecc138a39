"""``scripts/gpu_vllm_refit.py``'s output: a one-line verdict last, and a ``--tiny`` model
whose tokenizer vLLM loads (without one vLLM's start-up logs a chat-template traceback), and
vLLM's BF16-into-FP8 load warning filtered, since the ``nemo_fp8`` loader quantizes there."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest
import torch

from conftest import REPO
from nemo_fp8_plugin.tools.rl_check_bounds import TOKEN_MULT_PROB_ERROR_BOUND


def _script():
    path = REPO / "scripts" / "gpu_vllm_refit.py"
    spec = importlib.util.spec_from_file_location("gpu_vllm_refit_output", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def _record(script, step: int, error: float, changed: float):
    return script.StepRecord(
        step, 0.01, 0.02, 0.03, 100, 200, 0.5, 64,
        vs_fp8_trainer={"token_mult_prob_error": error},
        refit_changed_logprobs=changed,
    )  # fmt: skip


def test_the_run_ends_with_a_one_line_verdict():
    script = _script()
    good = [_record(script, s, 1.01, 0.2) for s in range(3)]
    _, failures = script.summarize(good, TOKEN_MULT_PROB_ERROR_BOUND)
    assert script.verdict(good, failures, TOKEN_MULT_PROB_ERROR_BOUND) == (
        "gpu_vllm_refit: PASS: 3 refit step(s), each changed the engine's logprobs, "
        "token_mult_prob_error vs the FP8-emulated trainer <= 1.1"
    )
    bad = good + [_record(script, 3, 1.3, 0.0)]
    _, failures = script.summarize(bad, TOKEN_MULT_PROB_ERROR_BOUND)
    line = script.verdict(bad, failures, TOKEN_MULT_PROB_ERROR_BOUND)
    assert line.startswith("gpu_vllm_refit: FAIL: step 3: token_mult_prob_error")
    assert "step 3: the refit left the engine's logprobs unchanged" in line and "\n" not in line


def test_the_tiny_model_has_a_tokenizer_and_the_engine_loads_it(tmp_path):
    from transformers import AutoTokenizer

    script = _script()
    script.write_tiny_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == script.TINY_LLAMA["vocab_size"]
    assert tokenizer.eos_token_id == script.TINY_LLAMA["eos_token_id"]
    args = script.parse_args(["--tiny"])
    assert "skip_tokenizer_init" not in script.engine_args(args, script.spec_for(args), "m", "cpu")


@pytest.mark.parametrize(
    "loaded, param, dropped",
    [
        (torch.bfloat16, torch.float8_e4m3fn, True),
        (torch.float32, torch.float8_e4m3fn, True),
        (torch.int8, torch.float8_e4m3fn, False),
        (torch.float8_e4m3fn, torch.bfloat16, False),
    ],
)
def test_only_the_quantized_on_load_warning_is_filtered(loaded, param, dropped):
    record = logging.LogRecord(
        "vllm.model_executor.models.utils",
        logging.WARNING,
        "utils.py",
        333,
        "Attempted to load weight %s with dtype %s into parameter with dtype %s",
        ("layers.0.mlp.down_proj.weight", loaded, param),
        None,
    )
    assert _script().quantized_on_load(record) is not dropped
