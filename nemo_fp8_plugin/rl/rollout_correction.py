"""Rollout-correction variants of verl and slime, as plain torch functions on ``[B, T]``.

NeMo RL's own importance sampling (tis / icepop / seq-mask-tis) is ``rl/importance.py``.
Users who come from verl or slime ask for theirs, so here are their semantics, checked
against their own code (``tests/rl/test_rollout_correction.py``: verl 0.9.1's
``verl/trainer/ppo/rollout_corr_helper.py`` loaded from its wheel; slime's
``examples/train_infer_mismatch_helper/mis.py`` at commit cfab168, a licensed fixture).

Inputs everywhere: ``train_logprobs`` (verl ``old_log_prob``, slime ``train_log_probs``),
``rollout_logprobs`` (the generation engine's), ``mask`` (1 = a token that counts), all
``[B, T]``. ``log_ratio = train - rollout``, clamped to ``[-20, 20]`` before any ``exp``
(both projects' ``SAFETY_BOUND``). Inputs are expected finite at valid tokens (neither
project sanitises them; ``importance.py`` documents NeMo RL's handling of -inf).

Divergence estimators (per token, of ``r = log_ratio``), verl's convention:
``k1 = -r``, ``k2 = r**2 / 2``, ``k3 = exp(r) - 1 - r``.

``nemo_rl_loss_keys`` says which variants NeMo RL's ``loss_fn`` can express, and refuses
the others naming why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import FP8ConfigError

__all__ = [
    "SAFETY_BOUND",
    "divergence",
    "verl_is_weights",
    "verl_rejection_mask",
    "slime_mis_weights",
    "nemo_rl_loss_keys",
]

SAFETY_BOUND = 20.0
"""|log-ratio| bound before ``exp`` (verl and slime: exp(20) ~ 4.9e8)."""

ESTIMATORS = ("k1", "k2", "k3")
VERL_RS_OPTIONS = tuple(
    [f"token_{k}" for k in ESTIMATORS]
    + [f"seq_{agg}_{k}" for agg in ("sum", "mean") for k in ESTIMATORS]
    + ["seq_max_k2", "seq_max_k3"]
)
"""verl's ``rollout_rs`` options (``SUPPORTED_ROLLOUT_RS_OPTIONS``)."""


def _clamped_log_ratio(train: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    return torch.clamp(train - rollout, min=-SAFETY_BOUND, max=SAFETY_BOUND)


def divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token divergence estimate ``k1`` / ``k2`` / ``k3`` of a (clamped) log-ratio."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise FP8ConfigError(
        f"unknown estimator {estimator!r}", key="estimator", value=estimator, hint="k1, k2 or k3"
    )


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # verl_F.masked_sum: values outside the mask (NaN included) count as 0
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=-1)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # verl_F.masked_mean: / (count + 1e-8)
    return _masked_sum(values, mask) / (mask.sum(dim=-1) + 1e-8)


def _positive(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FP8ConfigError(f"expected a number, got {value!r}", key=key, value=value)
    if not (math.isfinite(value) and value > 0):
        raise FP8ConfigError(f"must be a finite number > 0, got {value}", key=key, value=value)
    return float(value)


def _window(key: str, ratio_max: Any, ratio_min: Any) -> tuple[float, float | None]:
    high = _positive(key, ratio_max)
    low = None if ratio_min is None else _positive(key + "_min", ratio_min)
    if low is not None and low > high:
        raise FP8ConfigError(f"lower bound {low} exceeds upper bound {high}", key=key + "_min")
    return high, low


# ------------------------------------------------------------------ verl


def verl_is_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    ratio_max: float = 2.0,
    ratio_min: float | None = None,
    batch_normalize: bool = False,
) -> torch.Tensor:
    """verl's ``compute_rollout_correction_weights`` (``rollout_is``, single process).

    ``level``: ``"token"`` (``exp(r)`` per token) or ``"sequence"`` (``exp(sum_t r)``,
    clamped after the sum, for every token). ``ratio_min=None``: TIS, clamp at
    ``ratio_max`` (verl ``rollout_is_threshold: 2.0``); set: IcePop, weights outside the
    inclusive ``[ratio_min, ratio_max]`` become 0 (verl ``"min_max"`` string).
    ``batch_normalize`` (verl ``rollout_is_batch_normalize``) divides by the batch mean
    weight: over valid tokens for ``token``, over sequences with a valid token for
    ``sequence``; unless that mean is <= 1e-8. Weights are 0 off the mask, detached.
    """
    high, low = _window("ratio_max", ratio_max, ratio_min)
    if level == "token":
        raw = torch.exp(_clamped_log_ratio(train_logprobs, rollout_logprobs))
    elif level == "sequence":
        total = _masked_sum(train_logprobs - rollout_logprobs, mask).unsqueeze(-1)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(train_logprobs)
    else:
        raise FP8ConfigError(
            f"unknown level {level!r}", key="level", value=level, hint="token or sequence"
        )
    raw = raw * mask
    if low is None:
        weights = raw.clamp(max=high)
    else:
        kept = (raw >= low) & (raw <= high)
        weights = torch.where(kept, raw, torch.zeros_like(raw))
    weights = weights.detach()
    if batch_normalize:
        if level == "token":
            mean = _masked_sum(weights, mask).sum() / (mask.sum() + 1e-8)
        else:
            seq_w = _masked_mean(weights, mask)
            has_token = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (seq_w * has_token).sum() / has_token.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
    return weights


def _rs_statistic(option: str, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The option's statistic: per token, or per sequence broadcast to ``[B, T]``."""
    if option.startswith("token_"):
        return k
    if option.startswith("seq_sum_"):
        seq = _masked_sum(k, mask)
    elif option.startswith("seq_mean_"):
        seq = _masked_mean(k, mask)
    else:  # seq_max_: 0 for a sequence with no valid token
        peak = k.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
        seq = torch.where(peak == float("-inf"), torch.zeros_like(peak), peak)
    return seq.unsqueeze(-1).expand_as(k)


def verl_rejection_mask(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    options: Sequence[str],
    thresholds: Sequence[float | tuple[float, float]],
) -> torch.Tensor:
    """verl's ``compute_rollout_rejection_mask`` (``rollout_rs``): the mask with rejects at 0.

    ``options`` from ``VERL_RS_OPTIONS`` (``token_k1``, ``seq_mean_k3``, ...), all of
    which must pass; ``thresholds`` one per option (or one for all): an upper bound on the
    divergence, or for ``*_k1`` a ratio window ``(low, high)`` (a single number ``h``
    means ``(1/h, h)``), compared as ``log(low) <= k1 <= log(high)``. A sequence option
    rejects every token of the sequence. Returned in ``mask``'s dtype.
    """
    if not options:
        raise FP8ConfigError("needs at least one option", key="options", hint=str(VERL_RS_OPTIONS))
    if len(thresholds) not in (1, len(options)):
        raise FP8ConfigError(
            f"{len(thresholds)} thresholds for {len(options)} options",
            key="thresholds",
            hint="give one threshold, or one per option",
        )
    specs = list(thresholds) * len(options) if len(thresholds) == 1 else list(thresholds)
    r = _clamped_log_ratio(train_logprobs, rollout_logprobs)
    keep = torch.ones_like(mask, dtype=r.dtype)
    for option, spec in dict(zip(options, specs, strict=True)).items():
        if option not in VERL_RS_OPTIONS:
            raise FP8ConfigError(
                f"unknown option {option!r}", key="options", value=option, hint=str(VERL_RS_OPTIONS)
            )
        stat = _rs_statistic(option, divergence(r, option[-2:]), mask)
        if option.endswith("k1"):
            low, high = spec if isinstance(spec, tuple) else (1.0 / spec, spec)
            _window(option, high, low)
            ok = (stat >= math.log(low)) & (stat <= math.log(high))
        else:
            if isinstance(spec, tuple):
                raise FP8ConfigError(
                    "takes one upper bound, not a window", key=option, value=str(spec)
                )
            ok = stat <= _positive(option, spec)
        keep = keep * ok.to(r.dtype)
    return (mask * keep).to(mask.dtype)


# ------------------------------------------------------------------ slime


def _slime_log_ratio(raw: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return raw
    total = (raw * mask).sum(dim=-1, keepdim=True)
    if level == "sequence":
        return total.expand_as(raw)
    if level == "geometric":  # the geometric mean's log: mean_t r
        return (total / mask.sum(dim=-1, keepdim=True).clamp_min(1)).expand_as(raw)
    raise FP8ConfigError(
        f"unknown level {level!r}", key="level", value=level, hint="token, sequence or geometric"
    )


def _slime_veto(raw: torch.Tensor, mask: torch.Tensor, kind: str, threshold: float) -> torch.Tensor:
    """slime's trust-region sequence veto: 1 where the sequence is kept, ``[B, 1]``."""
    if kind == "max":  # the largest per-token k2
        kl = raw**2 / 2.0
        seq = kl.masked_fill(~mask.bool(), float("-inf")).max(dim=-1, keepdim=True).values
        seq = torch.where(seq == float("-inf"), torch.zeros_like(seq), seq)
    elif kind == "avg":  # the mean k3 of KL(rollout || train)
        neg = -raw
        kl = neg.exp() - 1 - neg
        seq = (kl * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp_min(1)
    else:
        raise FP8ConfigError(
            f"unknown trust region {kind!r}", key="trust_region", value=kind, hint="max or avg"
        )
    return (seq <= threshold).float()


def slime_mis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    ratio_max: float = 2.0,
    ratio_min: float | None = None,
    *,
    rs_level: str | None = None,
    rs_max: float | None = None,
    rs_min: float | None = None,
    trust_region: str | None = None,
    trust_region_threshold: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slime's ``compute_mis_weights`` (masked importance sampling), batched.

    IS: ``level`` ``token`` / ``sequence`` (``exp(sum_t r)``) / ``geometric``
    (``exp(mean_t r)``); ``mode`` ``truncate`` (clamp to ``[0, ratio_max]``), ``clip``
    (``[ratio_min, ratio_max]``) or ``mask`` (weights kept, tokens outside the window
    dropped from the mask); ``ratio_min=None`` means ``1/ratio_max``.
    Rejection (``rs_level`` set): tokens whose ratio at ``rs_level`` is outside
    ``[rs_min, rs_max]`` (defaults: the IS window) leave the mask. ``trust_region``
    ``"max"`` (largest token k2) or ``"avg"`` (mean k3) vetoes whole sequences above
    ``trust_region_threshold`` (slime reads it only with rejection on; here it also works
    alone). ``batch_normalize`` divides by the batch mean weight (over
    all valid tokens for ``token``, the mean of the per-sequence means for ``sequence``,
    every row counted); slime refuses it for ``geometric``.

    Returns ``(weights, mask)``: weights 0 off the input mask, the mask as float.
    """
    high, low_given = _window("ratio_max", ratio_max, ratio_min)
    low = 1.0 / high if low_given is None else low_given
    if mode in ("clip", "mask") and not low < high:
        raise FP8ConfigError(f"needs ratio_min < ratio_max, got {low}", key="ratio_min")
    loss_mask = mask.float()
    raw = train_logprobs - rollout_logprobs
    log_ratio = _slime_log_ratio(raw, loss_mask, level)
    weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    kept = loss_mask.clone()
    if mode == "truncate":
        weights = weights.clamp(0, high) * loss_mask
    elif mode == "clip":
        weights = weights.clamp(low, high) * loss_mask
    elif mode == "mask":
        kept = loss_mask * ((weights >= low) & (weights <= high)).float()
        weights = weights * loss_mask
    else:
        raise FP8ConfigError(
            f"unknown mode {mode!r}", key="mode", value=mode, hint="truncate, clip or mask"
        )
    if rs_level is not None:
        rs_high = high if rs_max is None else _positive("rs_max", rs_max)
        rs_low = low if rs_min is None else _positive("rs_min", rs_min)
        rs_ratio = log_ratio if rs_level == level else _slime_log_ratio(raw, loss_mask, rs_level)
        rs_w = torch.exp(rs_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        kept = kept * ((rs_w >= rs_low) & (rs_w <= rs_high)).float()
    if trust_region is not None:
        if trust_region_threshold is None:
            raise FP8ConfigError("needs a threshold", key="trust_region_threshold")
        kept = kept * _slime_veto(raw, loss_mask, trust_region, trust_region_threshold)
    weights = weights.detach()
    if batch_normalize:
        weights = _slime_batch_normalize(weights, mask, level)
    return weights, kept.detach()


def _slime_batch_normalize(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        mean = (weights * mask).sum() / mask.sum().clamp_min(1)
    elif level == "sequence":
        per_seq = (weights * mask).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1)
        mean = per_seq.sum() / per_seq.numel()
    else:
        raise FP8ConfigError(
            "batch normalization is defined for token and sequence levels only (slime)",
            key="batch_normalize",
            value=level,
        )
    return weights / mean if mean > 1e-8 else weights


# ------------------------------------------------------------------ NeMo RL


NEMO_RL_IS_MODES = {"truncate": "tis", "clip": "tis", "icepop": "icepop"}
"""Modes (verl TIS = slime ``truncate``; slime ``clip``; verl IcePop) and NeMo RL's
``truncated_importance_sampling_type`` for each."""


def nemo_rl_loss_keys(
    level: str = "token",
    mode: str = "truncate",
    ratio_max: float = 2.0,
    ratio_min: float | None = None,
    *,
    rs_level: str | None = None,
    **unsupported: Any,
) -> dict[str, Any]:
    """``loss_fn`` keys that make NeMo RL compute a verl/slime variant, or a refusal.

    NeMo RL (``ClippedPGLossConfig``, snapshot 7ea279a, ``loss/loss_functions.py:115-155``)
    has token or sequence IS (``sequence_level_importance_ratios``, which needs
    ``token_level_loss: false``) with ``tis`` (clamp to ``[min or 0, max]``), ``icepop``
    (zero outside ``[min, max]``) and, token level only, ``seq-mask-tis`` (drop sequences
    by geometric-mean ratio, raw token weights).

    ``mode``: ``truncate`` (verl TIS, slime truncate), ``clip`` (slime; ``ratio_min``
    defaults to ``1/ratio_max``), ``icepop`` (verl ``"min_max"``), or ``none`` with
    ``rs_level="geometric"`` (slime's geometric rejection over raw token weights, which is
    seq-mask-tis). Any other option given a value (rejection options, k1/k2/k3
    thresholds, trust-region vetoes, batch normalization, slime's ``mask`` mode, geometric
    IS weights) has no NeMo RL key and is refused, naming it.
    """
    for key, value in unsupported.items():
        if value not in (None, False):
            raise FP8ConfigError(
                "NeMo RL's loss_fn has no equivalent (ClippedPGLossConfig, NeMo RL 7ea279a)",
                key=key,
                value=value,
                hint="apply nemo_fp8_plugin.rl.rollout_correction in a custom loss",
            )
    high, low = _window("ratio_max", ratio_max, ratio_min)
    keys: dict[str, Any] = {"use_importance_sampling_correction": True}
    if level == "sequence":
        keys["sequence_level_importance_ratios"] = True
        keys["token_level_loss"] = False
    elif level != "token":
        raise FP8ConfigError(
            f"NeMo RL has no {level!r} importance weights (token or sequence only)",
            key="level",
            value=level,
        )
    if mode == "none" and rs_level == "geometric" and level == "token":
        kind = "seq-mask-tis"
    elif mode in NEMO_RL_IS_MODES and rs_level is None:
        kind = NEMO_RL_IS_MODES[mode]
    else:
        key = "rs_level" if rs_level is not None else "mode"
        raise FP8ConfigError(
            f"NeMo RL has no {mode!r} importance sampling with rejection at "
            f"{rs_level or 'no'} level for {level} weights (tis, icepop, token-level "
            "seq-mask-tis only; NeMo RL 7ea279a)",
            key=key,
            value=rs_level if rs_level is not None else mode,
        )
    if low is None and (kind != "tis" or mode == "clip"):
        low = 1.0 / high
    keys["truncated_importance_sampling_type"] = kind
    keys["truncated_importance_sampling_ratio"] = high
    if low is not None:
        keys["truncated_importance_sampling_ratio_min"] = low
    return keys
