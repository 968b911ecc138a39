"""Part f, ``vllm_refit``: a small vLLM generation in block FP8 with a refit every step.

Runs ``scripts/gpu_vllm_refit.py`` in a child process (vLLM takes over the process: its own
CUDA context, memory pool and compile caches) on its ``--tiny`` random Llama, so nothing is
downloaded, with the FP8 KV cache and its per-step scales, and reads the JSON file the script
writes (``--json PATH``): the per-step records and the script's own verdict (``failures``).

:func:`refit_command` and :func:`read_refit_result` are the two ends of that exchange; the
tests hold the first to the script's real argument parser and feed the second what the
script's own ``result_payload`` writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .result import failed, skipped

__all__ = [
    "refit_script",
    "vllm_missing",
    "refit_command",
    "read_refit_result",
    "check_vllm_refit",
    "MIN_SECONDS",
    "TIMEOUT_S",
]

TIMEOUT_S = 300.0
"""Longest the child may run: vLLM's import and engine start (eager, tiny model) take about a
minute on an H100, the two refit steps seconds."""

MIN_SECONDS = 90.0
"""Below this much of the check's time budget the part is skipped rather than started: an
engine start alone can take a minute."""

CHILD_RECIPE = "fp8_blockwise"
"""The recipe the child runs (``gpu_vllm_refit.py``'s default ``--recipe``)."""

STEPS, PROMPTS, MAX_TOKENS = 2, 4, 16
"""The child's run: two refits (one to compare before and after), four prompts of 16 tokens."""


def _package_root() -> Path:
    """The folder holding the ``nemo_fp8_plugin`` package (a source checkout's root)."""
    return Path(__file__).resolve().parents[3]


def refit_script() -> Path:
    """``scripts/gpu_vllm_refit.py`` of the source checkout this package runs from."""
    return _package_root() / "scripts" / "gpu_vllm_refit.py"


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None. Asked of the import system without importing vLLM
    (seconds of start-up, and it would set up CUDA in the checking process)."""
    spec = importlib.util.find_spec("vllm")
    # A spec without an origin is a namespace package: some folder named vllm on sys.path
    # (the tests' own tests/hosts/vllm is one), not vLLM.
    if spec is None or spec.origin is None:
        return "vLLM is not installed here"
    return None


def refit_command(script: Path, out_json: Path, *, python: str = sys.executable) -> list[str]:
    """The child's command line: the tiny model on CUDA, FP8 KV cache, eager (CUDA-graph
    capture would cost more than the run), results to ``out_json``."""
    return [
        python,
        str(script),
        "--tiny",
        "--device",
        "cuda",
        "--kv-cache",
        "fp8",
        "--steps",
        str(STEPS),
        "--prompts",
        str(PROMPTS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--enforce-eager",
        "--json",
        str(out_json),
    ]


def _tail(text: str | bytes | None, n: int = 2000) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return (text or "")[-n:]


def read_refit_result(out_json: Path, returncode: int, stderr: str | None = "") -> dict[str, Any]:
    """The part's result from the child's exit code and the JSON file it wrote.

    ``ok`` needs exit code 0 and no ``failures`` in the file; a missing or unreadable file is a
    failure with the end of the child's stderr (a crash before the results were written)."""
    name = out_json.name
    if not out_json.is_file():
        return failed(
            f"gpu_vllm_refit.py exited {returncode} without writing {name}", stderr=_tail(stderr)
        )
    try:
        data = json.loads(out_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return failed(f"{name} is not readable JSON ({exc})", stderr=_tail(stderr))
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        return failed(f"{name} holds no records", stderr=_tail(stderr))
    problems = [str(f) for f in data.get("failures", [])]
    if returncode != 0 or problems:
        return failed(
            "; ".join(problems) or f"gpu_vllm_refit.py exited {returncode}",
            result=data,
            stderr=_tail(stderr),
        )
    return {"status": "ok", "result": data}


def _child_env() -> dict[str, str]:
    """The child's environment: this one, the package on ``PYTHONPATH``, and the variables
    ``engine_env`` asks for the recipe the child runs (its default, ``fp8_blockwise`` with an
    FP8 KV cache), unless already set: a stock CUDA install's ``VLLM_USE_DEEP_GEMM_E8M0=1``
    would make the ``nemo_fp8`` method refuse it at load. (The script applies them too.)"""
    from ...hosts.vllm import engine_env

    env = dict(os.environ)
    for name, value in engine_env({"recipe": CHILD_RECIPE, "kv_cache": "fp8"}).items():
        env.setdefault(name, value)
    root = str(_package_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def check_vllm_refit(
    device,
    *,
    timeout_s: float = TIMEOUT_S,
    script: Path | None = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> dict[str, Any]:
    """Part f (see the module docstring). ``run`` starts the child (``subprocess.run``'s
    signature; the tests pass a stand-in), ``script`` defaults to :func:`refit_script`."""
    why = vllm_missing()
    if why is not None:
        return skipped(why)
    if torch.device(device).type != "cuda":
        return skipped("vLLM's FP8 kernels need a CUDA device")
    script = refit_script() if script is None else script
    if not script.is_file():
        return skipped(f"{script} is not here: the vLLM part runs from a source checkout")
    torch.cuda.empty_cache()  # the child's vLLM sizes its memory pool from what is free
    with tempfile.TemporaryDirectory(prefix="gpu_check_vllm_") as tmp:
        out_json = Path(tmp) / "vllm_refit.json"
        cmd = refit_command(script, out_json)
        try:
            proc = run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_child_env())
        except subprocess.TimeoutExpired as exc:
            return failed(
                f"gpu_vllm_refit.py did not finish within {timeout_s:.0f} s",
                stderr=_tail(exc.stderr),
            )
        result = read_refit_result(out_json, proc.returncode, proc.stderr)
    result["command"] = " ".join(cmd[1:])
    return result
