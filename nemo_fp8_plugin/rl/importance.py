"""Importance-sampling correction and generation/training mismatch metrics.

In RL the rollouts come from the generation engine (vLLM, possibly in FP8) while the
loss is computed with the training model's log-probabilities. The two policies differ
slightly (kernels, precision), so each token's loss is weighted by
``exp(train_logprob - gen_logprob)``. These are framework-neutral torch functions with
the semantics of NeMo RL's ``ClippedPGLossFn`` (``nemo_rl/algorithms/loss/loss_functions.py``),
so a custom loop gets the numbers a NeMo RL run logs; where they differ on purpose, the
difference is listed below and in ``docs/rl.md``. ``train_logprobs`` is NeMo RL's
``prev_logprobs``, ``gen_logprobs`` its ``generation_logprobs``.

Inputs: ``train_logprobs``, ``gen_logprobs`` and ``mask`` of the same shape ``[..., T]``
(the last dimension is the sequence); ``mask`` (NeMo RL ``token_mask``) is bool or 0/1,
1 = a generated token that counts. ``sample_mask`` (keyword, shape ``[...]``; NeMo RL
``sample_mask``) drops whole sequences; a token counts where both masks are 1. Without
it, the sequences that count are those with at least one valid token. Padding may hold
anything, -inf and NaN included.

As NeMo RL computes them:

* token level: ``w = exp(train - gen)``; sequence level: ``w = exp(sum_t(train - gen))``
  over the sequence's valid tokens, the same weight for all of them;
* a non-finite weight (a -inf or NaN log-prob at a valid token, an overflow) becomes 0
  (NeMo RL ``torch.nan_to_num(..., nan=0, posinf=0, neginf=0)``), before any truncation:
  a sequence-level weight that overflows is 0 even under ``tis``;
* ``tis`` clamps to ``[ratio_min or 0, ratio_max]``; ``icepop`` zeroes tokens outside
  the inclusive window ``[ratio_min, ratio_max]``; ``seq-mask-tis`` zeroes whole sequences
  whose geometric-mean ratio ``exp(mean_t(train - gen))`` over their valid tokens
  (non-finite per-token log-ratios counted as 0, padding left out of sum and count) is
  outside the inclusive window, and keeps plain token weights elsewhere. Bounds are
  compared in the weights' dtype, as torch compares a tensor with a Python float.

Deliberate differences from NeMo RL:

* ``ratio_min=None`` for ``icepop`` / ``seq-mask-tis`` means ``1 / ratio_max`` (NeMo RL
  asserts it is set; the plugin's NeMo RL adapter writes this value, so both agree);
* the returned weights are 0 at masked positions (NeMo RL leaves them and masks the
  loss); the loss is the same;
* sequence level: -inf or NaN in the *padding* does not zero the sequence (NeMo RL
  multiplies by the mask, ``-inf * 0 = NaN``, then ``nan_to_num`` makes the weight 0);
* the metrics skip tokens whose log-prob difference is not finite and count them in
  ``nonfinite_fraction`` (NeMo RL's means become inf or NaN, from padding too);
* the k3 estimator is evaluated as ``expm1(r) - r`` (NeMo RL: ``exp(r) - 1 - r``, which
  cancels in fp32 for small ``r`` and can come out negative);
* sequence-level ``sampling_importance_ratio`` is the mean over the sequences that count
  (NeMo RL's intent, ``MetricNormalizer.SEQUENCES``; as written it broadcasts ``[B, 1]``
  against ``[B]`` and logs the sum over the micro-batch's sequences);
* with no valid token the metrics take their no-mismatch values (1.0 for the ratio and
  the multiplicative error, 0.0 otherwise); NeMo RL's ``sum / (count + 1e-8)`` gives 0.0.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, overload

import torch

from ..errors import FP8ConfigError, format_value, suggest
from ..spec import check_importance_combination

__all__ = [
    "importance_weights",
    "mismatch_metrics",
    "truncation_window",
    "gen_kl_error",
    "policy_kl_error",
    "kl_estimate",
]

LEVELS = ("token", "sequence")
TRUNCATIONS = ("tis", "icepop", "seq-mask-tis")
KL_TYPES = ("k1", "k2", "k3")


# ------------------------------------------------------------------ argument checks


@overload
def _choice(
    key: str, value: Any, choices: tuple[str, ...], optional: Literal[False] = False
) -> str: ...
@overload
def _choice(key: str, value: Any, choices: tuple[str, ...], optional: bool) -> str | None: ...
def _choice(key: str, value: Any, choices: tuple[str, ...], optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, str) and value in choices:
        return value
    near = suggest(value, choices) if isinstance(value, str) else None
    raise FP8ConfigError(
        f"expected one of {', '.join(choices)}"
        f"{' or None' if optional else ''}, got {format_value(value)}",
        key=key,
        value=value,
        hint=f"did you mean {near!r}?" if near else None,
    )


@overload
def _bound(key: str, value: Any, optional: Literal[False] = False) -> float: ...
@overload
def _bound(key: str, value: Any, optional: bool) -> float | None: ...
def _bound(key: str, value: Any, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    # bool is an int subclass; `ratio_max=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FP8ConfigError(f"expected a number, got {format_value(value)}", key=key, value=value)
    given = value
    try:
        value = float(value)
    except OverflowError:  # an int past float's range (10**400)
        value = math.inf
    if not math.isfinite(value) or value < 0:
        raise FP8ConfigError(
            f"must be a finite number >= 0, got {format_value(given)}", key=key, value=given
        )
    return value


class _Settings(NamedTuple):
    level: str
    truncation: str | None
    ratio_max: float
    ratio_min: float | None


def _settings(level: Any, truncation: Any, ratio_max: Any, ratio_min: Any) -> _Settings:
    level = _choice("level", level, LEVELS)
    truncation = _choice("truncation", truncation, TRUNCATIONS, optional=True)
    high = _bound("ratio_max", ratio_max)
    low = _bound("ratio_min", ratio_min, optional=True)
    if high == 0:  # NeMo RL: "truncated_importance_sampling_ratio should be positive"
        raise FP8ConfigError("must be positive, got 0.0", key="ratio_max", value=ratio_max)
    if low is not None and low > high:  # NeMo RL: "ratio_min must be <= ratio"
        raise FP8ConfigError(
            f"ratio_min ({low}) exceeds ratio_max ({high})", key="ratio_min", value=ratio_min
        )
    check_importance_combination(level, truncation)
    return _Settings(level, truncation, high, low)


def truncation_window(
    truncation: str | None, ratio_max: float = 2.0, ratio_min: float | None = None
) -> tuple[float, float]:
    """The inclusive ``[low, high]`` weight window a truncation mode uses.

    ``tis`` (and no truncation, for the ``truncated_fraction`` metric): ``[ratio_min or 0,
    ratio_max]`` (NeMo RL's default lower bound for ``tis`` is 0). ``icepop`` /
    ``seq-mask-tis``: ``[ratio_min or 1/ratio_max, ratio_max]`` (NeMo RL requires
    ``ratio_min``; the plugin's adapter writes ``1/ratio_max`` when the spec leaves it out).
    A weight exactly on a bound is inside the window.
    """
    s = _settings("token", truncation, ratio_max, ratio_min)
    if s.truncation in ("icepop", "seq-mask-tis"):
        return (1.0 / s.ratio_max if s.ratio_min is None else s.ratio_min), s.ratio_max
    return (0.0 if s.ratio_min is None else s.ratio_min), s.ratio_max


def _mask_bool(name: str, value: Any, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise FP8ConfigError(f"expected a torch.Tensor, got {type(value).__name__}", key=name)
    if value.shape != shape:
        raise FP8ConfigError(
            f"expected shape {tuple(shape)}, got {tuple(value.shape)}",
            key=name,
            hint="mask is [..., T] like the log-probs, sample_mask is [...]: one "
            "entry per sequence",
        )
    value = value.detach()
    if value.is_complex():
        raise FP8ConfigError(f"expected a bool or 0/1 tensor, got {value.dtype}", key=name)
    if value.dtype != torch.bool:
        if not bool(((value == 0) | (value == 1)).all()):
            # NeMo RL multiplies by the mask, so a 0.5 would weight a token by half; this API
            # takes membership only, and a fractional or NaN entry is refused, not guessed.
            raise FP8ConfigError(
                "expected only 0 and 1 (or a bool tensor)",
                key=name,
                hint="scale the loss yourself to weight tokens",
            )
        value = value != 0
    return value.to(device)


class _Inputs(NamedTuple):
    train: torch.Tensor
    gen: torch.Tensor
    valid: torch.Tensor  # token counts: mask & sample_mask, [..., T]
    token: torch.Tensor  # mask alone (NeMo RL's token_mask), [..., T]
    samples: torch.Tensor  # sequences that count, [...]
    token_as_given: torch.Tensor  # the caller's mask tensor, its dtype kept (0/1 checked)
    sequence_dtype: torch.dtype  # what a sequence-level sum runs in (see _sequence_dtype)


def _sequence_dtype(dtype: torch.dtype, *masks: Any) -> torch.dtype:
    """The dtype NeMo RL's sequence-level sum runs in: ``((prev - gen) * mask).sum(-1)`` with
    ``mask = token_mask * sample_mask.unsqueeze(-1)`` (``loss_functions.py`` v0.6.0 ~430,
    v0.7.0 ~506, main ~570). NeMo RL's ``sample_mask`` is a float tensor (GRPO's
    ``loss_multiplier``, fp32), so the product, the sum and ``exp`` run in fp32 at least: bf16
    log-probs give fp32 weights. A wider floating mask (fp64) widens it, as torch promotes."""
    out = torch.promote_types(dtype, torch.float32)
    for mask in masks:
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            out = torch.promote_types(out, mask.dtype)
    return out


def _prepare(
    train_logprobs: Any, gen_logprobs: Any, mask: Any, sample_mask: Any, upcast: bool = True
) -> _Inputs:
    """Validated float copies, detached, and bool masks.

    ``upcast``: compute in fp32 or wider (the metrics). The weights pass False: NeMo RL
    evaluates token-level ``exp(prev - gen)`` in the log-probs' own dtype
    (``torch.promote_types`` of the two; the truncation comes before any ``* mask``), so
    bf16 input gives bf16 token weights there, and here; its sequence-level sum runs in
    ``sequence_dtype``.
    """
    tensors = []
    for name, value in (("train_logprobs", train_logprobs), ("gen_logprobs", gen_logprobs)):
        if not isinstance(value, torch.Tensor):
            raise FP8ConfigError(f"expected a torch.Tensor, got {type(value).__name__}", key=name)
        if not value.is_floating_point():
            raise FP8ConfigError(f"expected a floating-point tensor, got {value.dtype}", key=name)
        tensors.append(value)
    train, gen = tensors
    if not isinstance(mask, torch.Tensor):
        raise FP8ConfigError(f"expected a torch.Tensor, got {type(mask).__name__}", key="mask")
    if train.shape != gen.shape or mask.shape != train.shape:
        raise FP8ConfigError(
            f"shapes differ: train_logprobs {tuple(train.shape)}, gen_logprobs "
            f"{tuple(gen.shape)}, mask {tuple(mask.shape)}",
            key="mask",
            hint="pass [batch, tokens] tensors aligned token for token",
        )
    if train.dim() == 0:
        raise FP8ConfigError("expected at least one dimension (tokens)", key="train_logprobs")
    if gen.device != train.device:
        raise FP8ConfigError(
            f"on {gen.device}, train_logprobs on {train.device}",
            key="gen_logprobs",
            hint="move both to one device",
        )
    dtype = torch.promote_types(train.dtype, gen.dtype)
    if upcast:
        dtype = torch.promote_types(dtype, torch.float32)
    token = _mask_bool("mask", mask, train.shape, train.device)
    if sample_mask is None:
        samples = token.any(dim=-1)
        valid = token
    else:
        samples = _mask_bool("sample_mask", sample_mask, train.shape[:-1], train.device)
        valid = token & samples.unsqueeze(-1)
    given = mask.detach().to(train.device)
    return _Inputs(
        train.detach().to(dtype),
        gen.detach().to(dtype),
        valid,
        token,
        samples,
        given,
        _sequence_dtype(dtype, mask, sample_mask),
    )


# ------------------------------------------------------------------ weights


def _zero_nonfinite(x: torch.Tensor) -> torch.Tensor:
    # torch.nan_to_num(x, nan=0, posinf=0, neginf=0), as NeMo RL writes it
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.zeros_like(x))


def _seq_log_ratio_mean(
    log_ratio: torch.Tensor, token: torch.Tensor, token_as_given: torch.Tensor
) -> torch.Tensor:
    """mean_t over ``token`` of the log-ratio, non-finite values counted as 0; 0 if empty.

    NeMo RL (``algorithms/utils.py`` ``masked_mean``, snapshot 7ea279a):
    ``sum(nan_to_num(prev - gen) * token_mask) / (sum(token_mask) + 1e-8)``. The 1e-8 is
    kept as written, in the dtype torch gives ``sum(mask) + 1e-8`` (fp32 for a bool or
    integer mask, where it vanishes for a count >= 1; fp64 for an fp64 mask, where it does
    not: a geometric mean exactly on a bound then falls just inside or outside it, as in
    NeMo RL). An empty sequence stays at 0.
    """
    total = _masked(_zero_nonfinite(log_ratio), token).sum(dim=-1)
    count = token_as_given.sum(dim=-1) + 1e-8
    return total / count


class _Weights(NamedTuple):
    raw: torch.Tensor  # untruncated: per token [..., T] or per sequence [...]
    truncated: torch.Tensor  # truncated, raw's shape (unmasked)
    weights: torch.Tensor  # truncated, per token [..., T], 0 where not valid
    out: torch.Tensor  # out of the window: per token (tis/icepop/None) or sequence
    per_sequence: bool  # whether `out` counts sequences


def _compute(x: _Inputs, s: _Settings) -> _Weights:
    log_ratio = x.train - x.gen  # NaN where both are -inf or either is NaN, +-inf where one is
    if s.level == "sequence":
        # The difference in the log-probs' dtype, then summed in NeMo RL's (fp32 for bf16
        # log-probs: its float mask promotes the product). Padding is excluded before the sum
        # (NeMo RL multiplies by the mask, which turns a -inf in the padding into NaN and
        # zeroes the whole sequence).
        summed = _masked(log_ratio.to(x.sequence_dtype), x.valid).sum(dim=-1)
        raw = _zero_nonfinite(torch.exp(summed))
    else:
        raw = _zero_nonfinite(torch.exp(log_ratio))
    low, high = truncation_window(s.truncation, s.ratio_max, s.ratio_min)
    truncated = raw
    per_sequence = False
    if s.truncation == "seq-mask-tis":
        geo = torch.exp(_seq_log_ratio_mean(log_ratio, x.token, x.token_as_given))
        kept = (geo >= low) & (geo <= high)
        out = ~kept
        per_sequence = True
        # NeMo RL multiplies by ``seq_kept_mask.float()`` (:649-664): bf16 weights come out
        # fp32 on this path, as there.
        truncated = raw * kept.unsqueeze(-1).to(torch.float32)
    else:
        if s.truncation == "icepop":
            kept = (raw >= low) & (raw <= high)
            out = ~kept
            truncated = _masked(raw, kept)
        else:  # tis, and None for the metric: what a tis clamp would change
            out = (raw > high) | (raw < low)
            if s.truncation == "tis":
                truncated = raw.clamp(min=low, max=high)
    per_token = truncated
    if s.level == "sequence":
        per_token = truncated.unsqueeze(-1).expand_as(log_ratio)
        out = out.unsqueeze(-1).expand_as(log_ratio)
    return _Weights(raw, truncated, _masked(per_token, x.valid), out, per_sequence)


def importance_weights(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    truncation: str | None = None,
    ratio_max: float = 2.0,
    ratio_min: float | None = None,
    *,
    sample_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token importance weights correcting for sampling from the generation policy.

    Args:
        train_logprobs: log-probabilities of the sampled tokens under the training model,
            ``[..., T]`` (NeMo RL ``prev_logprobs``).
        gen_logprobs: the same tokens' log-probabilities reported by the generation engine
            (NeMo RL ``generation_logprobs``).
        mask: bool or 0/1, 1 where a token counts (generated, not padding); NeMo RL
            ``token_mask``.
        level: ``"token"`` (default): ``exp(train - gen)`` per token. ``"sequence"``:
            ``exp(sum(train - gen))`` over the sequence's valid tokens, given to each of them.
        truncation: None (default), ``"tis"``, ``"icepop"`` or ``"seq-mask-tis"`` (see the
            module docstring).
        ratio_max: upper bound of the truncation window. Default 2.0. Used only with a
            truncation.
        ratio_min: lower bound; None (default) = 0 for ``tis``, ``1/ratio_max`` for
            ``icepop`` and ``seq-mask-tis``. Used only with a truncation.
        sample_mask: optional bool or 0/1 tensor of shape ``[...]`` (one entry per sequence;
            NeMo RL ``sample_mask``): 0 drops the whole sequence.

    Returns:
        Weights of the input's shape, in the dtype NeMo RL computes them in, detached (they
        scale the loss; gradients do not flow through them), 0 at masked positions. Token
        level: the log-probs' dtype (bf16 in, bf16 out: NeMo RL does not upcast first).
        Sequence level, and ``seq-mask-tis``: fp32 at least (NeMo RL multiplies by its float
        masks before the sum), wider for fp64 log-probs or masks.
    """
    settings = _settings(level, truncation, ratio_max, ratio_min)
    inputs = _prepare(train_logprobs, gen_logprobs, mask, sample_mask, upcast=False)
    return _compute(inputs, settings).weights


# ------------------------------------------------------------------ KL estimators


def kl_estimate(
    logprobs: torch.Tensor, logprobs_reference: torch.Tensor, kl_type: str = "k3"
) -> torch.Tensor:
    """Per-token KL(P || P_ref) estimate on samples drawn from P (Schulman's k1/k2/k3).

    NeMo RL's ``calculate_kl`` (``nemo_rl/algorithms/utils.py``) without its clamps (the
    mismatch metrics pass ``input_clamp_value=None, output_clamp_value=None``): with
    ``r = logprobs_reference - logprobs``, k1 = ``-r``, k2 = ``r**2 / 2``, k3 = ``exp(r) - 1 - r``,
    evaluated here as ``expm1(r) - r`` (>= 0 after rounding, where the literal form
    cancels in fp32 for small ``r``).
    """
    kl_type = _choice("kl_type", kl_type, KL_TYPES)
    for name, value in (("logprobs", logprobs), ("logprobs_reference", logprobs_reference)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise FP8ConfigError(
                f"expected a floating-point torch.Tensor, got "
                f"{getattr(value, 'dtype', type(value).__name__)}",
                key=name,
            )
    if logprobs.shape != logprobs_reference.shape:
        raise FP8ConfigError(
            f"shapes differ: logprobs {tuple(logprobs.shape)}, logprobs_reference "
            f"{tuple(logprobs_reference.shape)}",
            key="logprobs_reference",
        )
    return _kl(logprobs_reference - logprobs, kl_type)


def _kl(r: torch.Tensor, kl_type: str) -> torch.Tensor:
    if kl_type == "k1":
        return -r
    if kl_type == "k2":
        return torch.square(r) / 2
    return torch.expm1(r) - r


def _finite_mean(values: torch.Tensor, finite: torch.Tensor, n_finite: int, empty: float) -> float:
    if n_finite == 0:
        return empty
    return float(_masked(values, finite).sum() / n_finite)


def _kl_error(
    train_logprobs: Any,
    gen_logprobs: Any,
    mask: Any,
    sample_mask: Any,
    kl_type: Any,
    gen_side: bool,
) -> float:
    kl_type = _choice("kl_type", kl_type, KL_TYPES)
    x = _prepare(train_logprobs, gen_logprobs, mask, sample_mask)
    r = x.train - x.gen
    finite = x.valid & torch.isfinite(r)
    safe = _masked(r, finite)  # keeps exp() of padding from overflowing
    return _finite_mean(_kl(safe if gen_side else -safe, kl_type), finite, int(finite.sum()), 0.0)


def gen_kl_error(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    sample_mask: torch.Tensor | None = None,
    kl_type: str = "k3",
) -> float:
    """KL(P_gen || P_train) estimated on the generated tokens: NeMo RL's ``gen_kl_error``.

    NeMo RL: ``calculate_kl(logprobs=generation_logprobs, logprobs_reference=prev_logprobs,
    kl_type=reference_policy_kl_type)`` (default k3), masked mean over valid tokens. So with
    ``r = train - gen``, k3 is the mean of ``exp(r) - 1 - r`` (see :func:`kl_estimate`).
    Tokens whose difference is not finite are left out (NeMo RL's mean would be inf or
    NaN); 0.0 with no valid token.
    """
    return _kl_error(train_logprobs, gen_logprobs, mask, sample_mask, kl_type, gen_side=True)


def policy_kl_error(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    sample_mask: torch.Tensor | None = None,
    kl_type: str = "k3",
) -> float:
    """KL(P_train || P_gen) by the same estimator with the roles swapped: NeMo RL's
    ``policy_kl_error`` (``calculate_kl(logprobs=prev_logprobs,
    logprobs_reference=generation_logprobs)``, ``r = gen - train``). Still evaluated on
    the generated samples, so it is a plug-in estimate, not an unbiased one."""
    return _kl_error(train_logprobs, gen_logprobs, mask, sample_mask, kl_type, gen_side=False)


# ------------------------------------------------------------------ metrics


def mismatch_metrics(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    truncation: str | None = None,
    ratio_max: float = 2.0,
    ratio_min: float | None = None,
    sample_mask: torch.Tensor | None = None,
    kl_type: str = "k3",
) -> dict[str, float]:
    """How far the generation policy is from the training policy on the sampled tokens.

    Returns a dict of Python floats (NeMo RL's metric names where they exist):

    ``token_mult_prob_error``
        mean over valid tokens of ``exp(|gen - train|)``; 1.0 means identical. NeMo RL's
        nightly bound for FP8 end-to-end is < 1.1.
    ``gen_kl_error``
        :func:`gen_kl_error` (``kl_type``, default k3 as NeMo RL's
        ``reference_policy_kl_type``).
    ``policy_kl_error``
        :func:`policy_kl_error`.
    ``truncated_fraction``
        share of valid tokens (of the sequences that count, for ``seq-mask-tis``) whose
        weight is outside the truncation window, i.e. that truncation changes. With a
        truncation this is NeMo RL's ``is_oob_ratio`` and is also returned under that name.
        Without one, the share a ``tis`` clamp at ``[ratio_min or 0, ratio_max]`` would
        change.
    ``sampling_importance_ratio``
        mean importance weight after truncation: over valid tokens (token level), over the
        sequences that count (sequence level).
    ``max_abs_logprob_diff``
        largest ``|gen - train|`` over valid tokens with finite log-probs.
    ``nonfinite_fraction``
        share of valid tokens whose log-prob difference is not finite (a token one side
        rules impossible, or NaN). These are left out of the three error means above and
        counted here instead (NeMo RL's means would be inf or NaN).
    ``num_tokens``
        number of valid tokens.

    With no valid token the errors take their no-mismatch values (1.0 and 0.0),
    ``sampling_importance_ratio`` is 1.0 and ``num_tokens`` 0, so logging never sees NaN.
    """
    settings = _settings(level, truncation, ratio_max, ratio_min)
    kl_type = _choice("kl_type", kl_type, KL_TYPES)
    x = _prepare(train_logprobs, gen_logprobs, mask, sample_mask)
    diff = x.gen - x.train
    finite = x.valid & torch.isfinite(diff)
    n_valid = int(x.valid.sum())
    n_finite = int(finite.sum())
    safe = _masked(diff, finite)  # keeps exp() of padding from overflowing
    metrics: dict[str, float] = {
        "token_mult_prob_error": _finite_mean(torch.exp(safe.abs()), finite, n_finite, 1.0),
        "gen_kl_error": _finite_mean(_kl(-safe, kl_type), finite, n_finite, 0.0),
        "policy_kl_error": _finite_mean(_kl(safe, kl_type), finite, n_finite, 0.0),
        "max_abs_logprob_diff": float(safe.abs().max()) if n_finite else 0.0,
        "nonfinite_fraction": (n_valid - n_finite) / n_valid if n_valid else 0.0,
        "num_tokens": float(n_valid),
    }

    w = _compute(x, settings)
    if settings.level == "sequence":
        # the sequence weight itself (1 for a counted sequence without valid tokens, as in
        # NeMo RL), averaged over the sequences that count
        n_seq = int(x.samples.sum())
        metrics["sampling_importance_ratio"] = (
            float(_masked(w.truncated, x.samples).sum() / n_seq) if n_seq else 1.0
        )
    else:
        metrics["sampling_importance_ratio"] = float(w.weights.sum() / n_valid) if n_valid else 1.0
    if w.per_sequence:
        n_seq = int(x.samples.sum())
        frac = float((w.out & x.samples).sum()) / n_seq if n_seq else 0.0
    else:
        frac = float((w.out & x.valid).sum()) / n_valid if n_valid else 0.0
    metrics["truncated_fraction"] = frac
    if settings.truncation is not None:
        metrics["is_oob_ratio"] = frac
    return metrics
