"""NeMo RL's nightly bounds on ``token_mult_prob_error``: the one definition that rl-check,
``scripts/gpu_vllm_refit.py`` and the tests use.

Each bound is a line of a NeMo RL test script, ``tests/check_metrics.py`` conditions on the
run's per-step values (NVIDIA-NeMo/RL, ``tests/test_suites/llm/`` unless noted):

* FP8 end to end, ``grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.sh``:
  ``mean(...) < 1.1`` and the last step's value ``< 1.1``;
* FP8 generation only, ``grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.sh``:
  ``median(...) < 1.1`` and ``ratio_above(..., 1.1) < 0.1``;
* FP8 KV cache, ``grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.sh``: ``median(...) < 2.0``
  (its comment: the FP8 KV cache "can cause the logprob to be slightly higher than fp8 linear
  only path, so we allow a larger tolerance");
* ``max(...) < 2.0`` is ``tests/functional/grpo_vllm_mxfp8_rollout_gb200.sh``'s check (MXFP8
  rollouts with a BF16 KV cache), not the FP8 KV-cache suite's.

Torch-free, so a script can take its command-line defaults from here without importing the
RL loop."""

from __future__ import annotations

__all__ = ["TOKEN_MULT_PROB_ERROR_BOUND", "TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV", "bound_for"]

TOKEN_MULT_PROB_ERROR_BOUND = 1.1
"""NeMo RL's nightly bound on ``token_mult_prob_error`` for FP8 linear layers (end to end or
generation only; the statistic it bounds depends on the suite, above)."""

TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV = 2.0
"""The bound of NeMo RL's FP8 KV-cache suite (on the median over the run's steps)."""


def bound_for(fp8_kv_cache: bool) -> float:
    """The bound that applies to a run with (True) or without an FP8 KV cache."""
    return TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV if fp8_kv_cache else TOKEN_MULT_PROB_ERROR_BOUND
