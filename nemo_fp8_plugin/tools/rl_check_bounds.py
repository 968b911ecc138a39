"""NeMo RL's nightly bounds on ``token_mult_prob_error``: the one definition that rl-check,
``scripts/gpu_vllm_refit.py`` and the tests use.

Torch-free, so a script can take its command-line defaults from here without importing the
RL loop."""

from __future__ import annotations

__all__ = ["TOKEN_MULT_PROB_ERROR_BOUND", "TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV", "bound_for"]

TOKEN_MULT_PROB_ERROR_BOUND = 1.1
"""NeMo RL's nightly bound on ``token_mult_prob_error`` (its test suites'
``tests/check_metrics.py`` conditions, ``< 1.1``, on the median or the max over the run's
steps depending on the suite)."""

TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV = 2.0
"""The same bound for NeMo RL's FP8 KV-cache recipe (``max(...) < 2.0``, "a more relaxed
tolerance for FP8 quantization noise")."""


def bound_for(fp8_kv_cache: bool) -> float:
    """The bound that applies to a run with (True) or without an FP8 KV cache."""
    return TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV if fp8_kv_cache else TOKEN_MULT_PROB_ERROR_BOUND
