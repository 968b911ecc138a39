"""Sequence masking on the generation/training log-prob error: NeMo RL's
``grpo.seq_logprob_error_threshold``, the recipe's ``importance_sampling.max_sequence_error``.

NeMo RL (``algorithms/grpo.py`` ``compute_and_apply_seq_logprob_error_masking``: v0.6.0
~1218, v0.7.0 ~1996, main ~2513) computes each sequence's error as the per-sequence form of
``token_mult_prob_error`` and, with the threshold set, drops the sequences above it by
rewriting the batch's ``sample_mask`` before the advantages and the loss. Inputs and masks as
:func:`nemo_fp8_plugin.rl.importance_weights` takes them (same validation).
"""

from __future__ import annotations

import torch

from ..errors import FP8ConfigError, format_value
from .importance import _bound, _Inputs, _masked, _prepare

__all__ = ["sequence_error", "sequence_error_mask"]


def sequence_error(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    sample_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's log-prob error: the mean over its valid tokens of ``exp(|gen - train|)``.

    NeMo RL's ``compute_and_apply_seq_logprob_error_masking`` (``algorithms/grpo.py``: v0.6.0
    ~1218, v0.7.0 ~1996, main ~2513), the per-sequence form of ``token_mult_prob_error``:
    ``(exp(|gen - prev| * mask) * mask).sum(-1) / mask.sum(-1).clamp(min=1)``. The difference
    is taken in the log-probs' dtype; the product with NeMo RL's float mask makes the rest fp32
    (fp64 for fp64 inputs), and so is the result. For bf16 log-probs that is v0.6.0's result;
    v0.7.0 and main raise there (they store the error into a tensor of the log-probs' dtype
    with an indexed assignment, which refuses an fp32 source), and agree with v0.6.0 for
    fp32 and fp64 log-probs.

    A sequence with no valid token (or whose ``sample_mask`` is 0) has error 0, as in NeMo RL.
    A non-finite log-prob at a valid token makes the error inf or NaN (NeMo RL's as well); in
    the padding it is left out (NeMo RL multiplies it by 0, which gives NaN for an inf).

    Returns:
        ``[...]``, one error per sequence (``mask``'s shape without the last dimension).
    """
    x = _prepare(train_logprobs, gen_logprobs, mask, sample_mask, upcast=False)
    return _sequence_error(x)


def _sequence_error(x: _Inputs) -> torch.Tensor:
    lp_error = (x.gen - x.train).abs()
    wide = _masked(torch.exp(lp_error.to(x.sequence_dtype)), x.valid)
    count = x.valid.sum(dim=-1).clamp(min=1).to(x.sequence_dtype)
    return wide.sum(dim=-1) / count


def sequence_error_mask(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    max_error: float,
    *,
    sample_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which sequences still count once those whose log-prob error exceeds ``max_error`` are
    dropped: the recipe's ``importance_sampling.max_sequence_error``, NeMo RL's
    ``grpo.seq_logprob_error_threshold``.

    NeMo RL (``algorithms/grpo.py``, as :func:`sequence_error`) keeps a sequence where
    ``seq_mult_prob_error <= threshold`` (inclusive) and its sample mask was 1, and writes
    the result back as the batch's ``sample_mask`` before the advantages and the loss. Pass
    the result as ``sample_mask`` to :func:`~nemo_fp8_plugin.rl.importance_weights` and
    :func:`~nemo_fp8_plugin.rl.mismatch_metrics`.

    Args:
        train_logprobs, gen_logprobs, mask: as :func:`~nemo_fp8_plugin.rl.importance_weights`.
        max_error: the threshold (>= 1.0; 1.0 means the two policies agree on every token).
        sample_mask: the sequences that counted before (NeMo RL ``sample_mask``); default: the
            sequences with at least one valid token.

    Returns:
        A bool tensor ``[...]``: True for the sequences that still count.
    """
    bound = _bound("max_error", max_error)
    assert bound is not None  # not optional
    if bound < 1.0:
        raise FP8ConfigError(
            f"must be at least 1.0, got {format_value(max_error)}: every sequence's error is "
            f">= 1.0, so every sequence would be dropped",
            key="max_error",
            value=max_error,
        )
    x = _prepare(train_logprobs, gen_logprobs, mask, sample_mask, upcast=False)
    return (_sequence_error(x) <= bound) & x.samples
