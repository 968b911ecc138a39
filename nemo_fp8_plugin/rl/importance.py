"""Importance-sampling correction and generation/training mismatch metrics.

In RL the rollouts come from the generation engine (vLLM, possibly in FP8) while the
loss is computed with the training model's log-probabilities. The two policies differ
slightly (kernels, precision), so each token's loss is weighted by
``exp(train_logprob - gen_logprob)``. These are framework-neutral torch functions with
NeMo RL's semantics (``nemo_rl/algorithms/loss/loss_functions.py``,
``ClippedPGLossFn``), so a custom loop gets the same numbers a NeMo RL run logs:

* token level: ``w = exp(train - gen)``; sequence level: ``w = exp(sum_t(train - gen))``
  over the sequence's valid tokens, the same weight for all of them;
* a non-finite weight (NaN, +inf, a NaN log-prob) becomes 0, as ``torch.nan_to_num(...,
  nan=0, posinf=0, neginf=0)`` does in NeMo RL: such a token says nothing reliable;
* ``tis`` clamps to ``[ratio_min or 0, ratio_max]``; ``icepop`` zeroes tokens outside
  ``[ratio_min, ratio_max]``; ``seq-mask-tis`` zeroes whole sequences whose geometric-mean
  ratio ``exp(mean_t(train - gen))`` (non-finite per-token log-ratios counted as 0) is
  outside ``[ratio_min, ratio_max]`` and keeps plain token weights elsewhere. NeMo RL
  requires ``ratio_min`` for the last two; here ``None`` means ``1 / ratio_max`` (the
  symmetric window), as :class:`~nemo_fp8_plugin.spec.ImportanceSampling` documents.

Both functions take ``train_logprobs``, ``gen_logprobs`` and ``mask`` of the same shape
``[..., T]`` (the last dimension is the sequence); ``mask`` is bool or numeric, nonzero =
a generated token that counts. Padding may hold anything, -inf and NaN included.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FP8ConfigError
from ..spec import ImportanceSampling

__all__ = ["importance_weights", "mismatch_metrics", "truncation_window"]


def truncation_window(truncation: str | None, ratio_max: float = 2.0,
                      ratio_min: float | None = None) -> tuple[float, float]:
    """The ``[low, high]`` weight window a truncation mode uses.

    ``tis`` (and no truncation, for the ``truncated_fraction`` metric): ``[ratio_min or 0,
    ratio_max]``. ``icepop`` / ``seq-mask-tis``: ``[ratio_min or 1/ratio_max, ratio_max]``.
    """
    if truncation in ("icepop", "seq-mask-tis"):
        return (1.0 / ratio_max if ratio_min is None else ratio_min), ratio_max
    return (0.0 if ratio_min is None else ratio_min), ratio_max


def _settings(level: str, truncation: str | None, ratio_max: float,
              ratio_min: float | None) -> ImportanceSampling:
    # One place validates these arguments for the YAML block and for Python callers alike.
    settings = ImportanceSampling(enabled=True, level=level, truncation=truncation,
                                  ratio_max=ratio_max, ratio_min=ratio_min)
    if settings.truncation == "seq-mask-tis" and settings.level == "sequence":
        raise FP8ConfigError("seq-mask-tis masks sequences but weights tokens; it cannot be "
                             "combined with sequence-level ratios", key="level", value="sequence",
                             hint="use level: token (NeMo RL refuses the combination too)")
    return settings


def _prepare(train_logprobs: Any, gen_logprobs: Any, mask: Any):
    """Validated float copies (fp32 or wider), detached, and a bool mask."""
    tensors = []
    for name, value in (("train_logprobs", train_logprobs), ("gen_logprobs", gen_logprobs)):
        if not isinstance(value, torch.Tensor):
            raise FP8ConfigError(f"expected a torch.Tensor, got {type(value).__name__}", key=name)
        if not (value.is_floating_point()):
            raise FP8ConfigError(f"expected a floating-point tensor, got {value.dtype}", key=name)
        tensors.append(value)
    train, gen = tensors
    if not isinstance(mask, torch.Tensor):
        raise FP8ConfigError(f"expected a torch.Tensor, got {type(mask).__name__}", key="mask")
    if train.shape != gen.shape or mask.shape != train.shape:
        raise FP8ConfigError(f"shapes differ: train_logprobs {tuple(train.shape)}, gen_logprobs "
                             f"{tuple(gen.shape)}, mask {tuple(mask.shape)}", key="mask",
                             hint="pass [batch, tokens] tensors aligned token for token")
    if train.dim() == 0:
        raise FP8ConfigError("expected at least one dimension (tokens)", key="train_logprobs")
    dtype = torch.promote_types(torch.promote_types(train.dtype, gen.dtype), torch.float32)
    valid = mask.detach() != 0
    if valid.dtype != torch.bool:
        valid = valid.bool()
    return train.detach().to(dtype), gen.detach().to(dtype), valid.to(train.device)


def _zero_nonfinite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _raw_weights(train: torch.Tensor, gen: torch.Tensor, valid: torch.Tensor, level: str):
    """Untruncated weights, 0 where invalid or non-finite, and the token log-ratios."""
    log_ratio = train - gen  # NaN where both are -inf, +-inf where one is
    if level == "sequence":
        # Padding is excluded before the sum (NeMo RL multiplies by the mask, which turns a
        # -inf in the padding into NaN and silently zeroes the whole sequence).
        seq = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1, keepdim=True)
        weights = _zero_nonfinite(torch.exp(seq)).expand_as(train)
    else:
        weights = _zero_nonfinite(torch.exp(log_ratio))
    return torch.where(valid, weights, torch.zeros_like(weights)), log_ratio


def _seq_geomean(log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """exp(mean of finite per-token log-ratios over valid tokens), 1 for an empty sequence."""
    lr = torch.where(valid, _zero_nonfinite(log_ratio), torch.zeros_like(log_ratio))
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.exp(lr.sum(dim=-1, keepdim=True) / count)


def importance_weights(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                       mask: torch.Tensor, level: str = "token", truncation: str | None = None,
                       ratio_max: float = 2.0, ratio_min: float | None = None) -> torch.Tensor:
    """Per-token importance weights correcting for sampling from the generation policy.

    Args:
        train_logprobs: log-probabilities of the sampled tokens under the training model,
            ``[..., T]``.
        gen_logprobs: the same tokens' log-probabilities reported by the generation engine.
        mask: nonzero where a token counts (generated, not padding).
        level: ``"token"`` (default): ``exp(train - gen)`` per token. ``"sequence"``:
            ``exp(sum(train - gen))`` over the sequence's valid tokens, given to each of them.
        truncation: None (default), ``"tis"``, ``"icepop"`` or ``"seq-mask-tis"`` (see the
            module docstring).
        ratio_max: upper bound of the truncation window. Default 2.0. Used only with a
            truncation.
        ratio_min: lower bound; None (default) = 0 for ``tis``, ``1/ratio_max`` for
            ``icepop`` and ``seq-mask-tis``. Used only with a truncation.

    Returns:
        Weights of the input's shape, dtype at least float32, detached (they scale the
        loss; gradients do not flow through them), 0 at masked positions.
    """
    settings = _settings(level, truncation, ratio_max, ratio_min)
    train, gen, valid = _prepare(train_logprobs, gen_logprobs, mask)
    weights, log_ratio = _raw_weights(train, gen, valid, settings.level)
    if settings.truncation is None:
        return weights
    low, high = truncation_window(settings.truncation, settings.ratio_max, settings.ratio_min)
    if settings.truncation == "tis":
        weights = weights.clamp(min=low, max=high)
    elif settings.truncation == "icepop":
        keep = (weights >= low) & (weights <= high)
        weights = torch.where(keep, weights, torch.zeros_like(weights))
    else:  # seq-mask-tis
        geo = _seq_geomean(log_ratio, valid)
        keep = (geo >= low) & (geo <= high)
        weights = weights * keep.to(weights.dtype)
    return torch.where(valid, weights, torch.zeros_like(weights))


def mismatch_metrics(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                     mask: torch.Tensor, *, level: str = "token", truncation: str | None = None,
                     ratio_max: float = 2.0, ratio_min: float | None = None) -> dict[str, float]:
    """How far the generation policy is from the training policy on the sampled tokens.

    Returns a dict of Python floats (NeMo RL's metric names where they exist):

    ``token_mult_prob_error``
        mean over valid tokens of ``exp(|gen - train|)``; 1.0 means identical. NeMo RL's
        nightly bound for FP8 end-to-end is < 1.1.
    ``gen_kl_error``
        KL(gen || train) by the k3 estimator on the generated samples: with
        ``r = train - gen``, the mean of ``exp(r) - 1 - r``.
    ``policy_kl_error``
        KL(train || gen), k3 with ``r = gen - train``.
    ``truncated_fraction``
        share of valid tokens (of non-empty sequences for ``seq-mask-tis``) whose weight is
        outside the truncation window, i.e. that truncation changes (NeMo RL
        ``is_oob_ratio``). Without a truncation, the share a ``tis`` clamp at
        ``[ratio_min or 0, ratio_max]`` would change.
    ``sampling_importance_ratio``
        mean importance weight over valid tokens, after truncation.
    ``max_abs_logprob_diff``
        largest ``|gen - train|`` over valid tokens with finite log-probs.
    ``nonfinite_fraction``
        share of valid tokens whose log-prob difference is not finite (a token one side
        rules impossible, or NaN). These are left out of the three error means above, as
        NeMo RL masks ``-inf`` log-probs out, and counted here instead.
    ``num_tokens``
        number of valid tokens.

    With no valid token the errors take their no-mismatch values (1.0 and 0.0) and
    ``num_tokens`` is 0, so logging never sees NaN.
    """
    settings = _settings(level, truncation, ratio_max, ratio_min)
    train, gen, valid = _prepare(train_logprobs, gen_logprobs, mask)
    diff = gen - train
    finite = valid & torch.isfinite(diff)
    n_valid = int(valid.sum())
    n_finite = int(finite.sum())
    zero = torch.zeros_like(diff)

    def finite_mean(values: torch.Tensor, empty: float) -> float:
        if n_finite == 0:
            return empty
        return float(torch.where(finite, values, zero).sum() / n_finite)

    safe = torch.where(finite, diff, zero)  # keeps exp() of padding from overflowing
    r = -safe  # train - gen
    metrics: dict[str, float] = {
        "token_mult_prob_error": finite_mean(torch.exp(safe.abs()), 1.0),
        # k3 as expm1(r) - r: exp(r) - 1 - r cancels catastrophically for small r and can even
        # come out negative; expm1(r) >= r holds exactly after rounding.
        "gen_kl_error": finite_mean(torch.expm1(r) - r, 0.0),
        "policy_kl_error": finite_mean(torch.expm1(safe) - safe, 0.0),
        "max_abs_logprob_diff": float(safe.abs().max()) if n_finite else 0.0,
        "nonfinite_fraction": (n_valid - n_finite) / n_valid if n_valid else 0.0,
        "num_tokens": float(n_valid),
    }

    weights = importance_weights(train, gen, valid, level=settings.level,
                                 truncation=settings.truncation, ratio_max=settings.ratio_max,
                                 ratio_min=settings.ratio_min)
    metrics["sampling_importance_ratio"] = (float(weights.sum() / n_valid) if n_valid else 1.0)

    raw, log_ratio = _raw_weights(train, gen, valid, settings.level)
    low, high = truncation_window(settings.truncation, settings.ratio_max, settings.ratio_min)
    if settings.truncation == "seq-mask-tis":
        geo = _seq_geomean(log_ratio, valid).squeeze(-1)
        nonempty = valid.any(dim=-1)
        out = ((geo < low) | (geo > high)) & nonempty
        n_seq = int(nonempty.sum())
        metrics["truncated_fraction"] = float(out.sum()) / n_seq if n_seq else 0.0
    else:
        out = ((raw < low) | (raw > high)) & valid
        metrics["truncated_fraction"] = float(out.sum()) / n_valid if n_valid else 0.0
    return metrics
