"""importance_weights / mismatch_metrics against hand-computed values (NeMo RL semantics:
nemo_rl/algorithms/loss/loss_functions.py, ClippedPGLossFn), truncation modes and
degenerate inputs (-inf, NaN, empty masks)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl import importance_weights, mismatch_metrics
from nemo_fp8_plugin.rl.importance import truncation_window

INF = float("inf")
NAN = float("nan")


def lp(*probs):
    """Log-probabilities in float64, so hand values hold to ~1e-15."""
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def close(actual, expected, tol=1e-12):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=tol, rtol=0), (actual, expected)


# ------------------------------------------------------------------ plain weights


def test_token_weights_are_probability_ratios():
    train = lp(0.5, 0.25, 0.1, 0.3)[None]
    gen = lp(0.25, 0.25, 0.2, 0.3)[None]
    mask = torch.tensor([[1, 1, 1, 0]])
    close(importance_weights(train, gen, mask), [[2.0, 1.0, 0.5, 0.0]])


def test_sequence_weights_multiply_the_token_ratios_of_valid_tokens():
    train = torch.stack([lp(0.5, 0.5, 0.9), lp(0.1, 0.2, 0.3)])
    gen = torch.stack([lp(0.25, 0.25, 0.1), lp(0.2, 0.2, 0.3)])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w = importance_weights(train, gen, mask, level="sequence")
    # seq 0: 2 * 2 = 4 (third token is padding); seq 1: 0.5 * 1 * 1 = 0.5
    close(w, [[4.0, 4.0, 0.0], [0.5, 0.5, 0.5]])


def test_identical_policies_give_unit_weights_and_no_mismatch():
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 5
    mask = torch.ones(3, 7)
    close(importance_weights(x, x.clone(), mask), torch.ones(3, 7))
    m = mismatch_metrics(x, x.clone(), mask)
    assert m["token_mult_prob_error"] == 1.0
    assert m["gen_kl_error"] == 0.0 and m["policy_kl_error"] == 0.0
    assert m["truncated_fraction"] == 0.0 and m["num_tokens"] == 21.0


def test_weights_are_detached_and_at_least_fp32():
    train = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    gen = torch.tensor([[-1.5, -2.0]], dtype=torch.bfloat16)
    w = importance_weights(train, gen, torch.ones(1, 2, dtype=torch.bool))
    assert w.dtype == torch.float32 and not w.requires_grad
    close(w, [[math.exp(0.5), 1.0]], tol=1e-6)


def test_leading_dimensions_and_1d_sequences():
    w = importance_weights(lp(0.5, 0.2), lp(0.25, 0.4), torch.tensor([1, 1]), level="sequence")
    close(w, [1.0, 1.0])
    w3 = importance_weights(lp(0.5, 0.2).expand(2, 3, 2), lp(0.25, 0.4).expand(2, 3, 2),
                            torch.ones(2, 3, 2))
    close(w3, torch.tensor([2.0, 0.5], dtype=torch.float64).expand(2, 3, 2))


# ------------------------------------------------------------------ truncation


def test_tis_clamps_to_window_with_zero_default_floor():
    train = lp(0.6, 0.2, 0.05, 0.4)[None]
    gen = lp(0.2, 0.2, 0.2, 0.1)[None]  # raw weights 3, 1, 0.25, 4
    mask = torch.ones(1, 4)
    close(importance_weights(train, gen, mask, truncation="tis", ratio_max=2.0), [[2.0, 1.0, 0.25, 2.0]])
    close(importance_weights(train, gen, mask, truncation="tis", ratio_max=2.0, ratio_min=0.5),
          [[2.0, 1.0, 0.5, 2.0]])


def test_ratio_bounds_are_ignored_without_truncation():
    train, gen = lp(0.6, 0.05)[None], lp(0.2, 0.2)[None]
    close(importance_weights(train, gen, torch.ones(1, 2), ratio_max=1.5, ratio_min=0.9),
          [[3.0, 0.25]])


def test_icepop_zeroes_tokens_outside_the_inclusive_window():
    train = lp(0.6, 0.2, 0.05, 0.1, 0.4)[None]
    gen = lp(0.2, 0.2, 0.2, 0.2, 0.2)[None]  # raw 3, 1, 0.25, 0.5, 2
    mask = torch.ones(1, 5)
    # ratio_min None -> 1 / ratio_max = 0.5; bounds inclusive (NeMo RL uses >= and <=)
    w = importance_weights(train, gen, mask, truncation="icepop", ratio_max=2.0)
    close(w, [[0.0, 1.0, 0.0, 0.5, 2.0]], tol=1e-12)
    w = importance_weights(train, gen, mask, truncation="icepop", ratio_max=5.0, ratio_min=0.3)
    close(w, [[3.0, 1.0, 0.0, 0.5, 2.0]])


def test_seq_mask_tis_masks_sequences_by_geometric_mean_and_keeps_raw_token_weights():
    train = torch.stack([lp(0.4, 0.1, 0.3), lp(0.8, 0.8, 0.3), lp(0.3, 0.3, 0.3)])
    gen = torch.stack([lp(0.2, 0.2, 0.3), lp(0.2, 0.2, 0.3), lp(0.3, 0.3, 0.3)])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    w = importance_weights(train, gen, mask, truncation="seq-mask-tis", ratio_max=2.0)
    # seq 0: ratios 2, 0.5, 1 -> geomean 1, kept, raw weights (2 is not clamped)
    # seq 1: ratios 4, 4 -> geomean 4 > 2, dropped; seq 2 has no valid token
    close(w, [[2.0, 0.5, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    m = mismatch_metrics(train, gen, mask, truncation="seq-mask-tis", ratio_max=2.0)
    assert m["truncated_fraction"] == 0.5  # one of the two non-empty sequences


def test_seq_mask_tis_treats_nonfinite_token_ratios_as_zero_in_the_mean():
    train = torch.tensor([[math.log(0.5), -INF, math.log(0.5)]], dtype=torch.float64)
    gen = torch.tensor([[math.log(0.25), math.log(0.3), math.log(1.0)]], dtype=torch.float64)
    w = importance_weights(train, gen, torch.ones(1, 3), truncation="seq-mask-tis",
                           ratio_max=1.5)
    # log ratios log2, -inf (-> 0), log0.5: mean 0 -> geomean 1, kept; the -inf token weighs 0
    close(w, [[2.0, 0.0, 0.5]])


def test_truncation_windows():
    assert truncation_window("tis", 2.0) == (0.0, 2.0)
    assert truncation_window("tis", 2.0, 0.5) == (0.5, 2.0)
    assert truncation_window("icepop", 4.0) == (0.25, 4.0)
    assert truncation_window("seq-mask-tis", 1.002, 0.999) == (0.999, 1.002)
    assert truncation_window(None, 2.0) == (0.0, 2.0)


# ------------------------------------------------------------------ degenerate inputs


def test_nonfinite_logprobs_give_zero_weight_and_never_leak_from_padding():
    train = torch.tensor([[-INF, -1.0, -INF, NAN, -1.0, NAN]], dtype=torch.float64)
    gen = torch.tensor([[-1.0, -INF, -INF, -1.0, -1.0, -INF]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    for level in ("token", "sequence"):
        for trunc in (None, "tis", "icepop", "seq-mask-tis"):
            if level == "sequence" and trunc == "seq-mask-tis":
                continue
            w = importance_weights(train, gen, mask, level=level, truncation=trunc)
            assert torch.isfinite(w).all() and (w >= 0).all(), (level, trunc, w)
    # token level: -inf train -> 0; -inf gen -> +inf -> 0 (NeMo RL nan_to_num posinf=0);
    # both -inf -> NaN -> 0; NaN -> 0; equal -> 1; padding -> 0
    close(importance_weights(train, gen, mask), [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    # sequence level: the -inf/NaN in the padding does not poison a clean sequence
    clean = importance_weights(torch.tensor([[-1.0, -2.0, -INF]]), torch.tensor([[-1.5, -2.0, NAN]]),
                               torch.tensor([[1, 1, 0]]), level="sequence")
    close(clean, [[math.exp(0.5), math.exp(0.5), 0.0]], tol=1e-6)


def test_metrics_skip_and_count_nonfinite_tokens():
    train = torch.tensor([[-1.0, -INF, -2.0, NAN]], dtype=torch.float64)
    gen = torch.tensor([[-1.1, -0.5, -1.8, -1.0]], dtype=torch.float64)
    m = mismatch_metrics(train, gen, torch.ones(1, 4))
    # finite tokens: d = gen - train = -0.1, +0.2
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2, abs=1e-14)
    r = [0.1, -0.2]  # train - gen
    assert m["gen_kl_error"] == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 2, abs=1e-14)
    assert m["policy_kl_error"] == pytest.approx(sum(math.exp(-x) - 1 + x for x in r) / 2, abs=1e-14)
    assert m["nonfinite_fraction"] == 0.5
    assert m["max_abs_logprob_diff"] == pytest.approx(0.2, abs=1e-14)
    assert all(math.isfinite(v) for v in m.values())


def test_empty_mask_gives_neutral_finite_metrics_and_zero_weights():
    train = torch.tensor([[-INF, NAN]])
    gen = torch.tensor([[-1.0, -INF]])
    mask = torch.zeros(1, 2)
    assert (importance_weights(train, gen, mask, truncation="icepop") == 0).all()
    m = mismatch_metrics(train, gen, mask, truncation="seq-mask-tis")
    assert m == {"token_mult_prob_error": 1.0, "gen_kl_error": 0.0, "policy_kl_error": 0.0,
                 "max_abs_logprob_diff": 0.0, "nonfinite_fraction": 0.0, "num_tokens": 0.0,
                 "sampling_importance_ratio": 1.0, "truncated_fraction": 0.0}
    empty = torch.empty(0, 5)
    m = mismatch_metrics(empty, empty, empty)
    assert m["num_tokens"] == 0.0 and m["token_mult_prob_error"] == 1.0


def test_metric_values_by_hand():
    train = lp(0.5, 0.25, 0.1, 0.3)[None]
    gen = lp(0.25, 0.25, 0.2, 0.6)[None]  # ratios 2, 1, 0.5, 0.5 ; |d| = ln2, 0, ln2, ln2
    mask = torch.ones(1, 4)
    m = mismatch_metrics(train, gen, mask)
    assert m["token_mult_prob_error"] == pytest.approx((2 + 1 + 2 + 2) / 4, abs=1e-14)
    # k3 with r = ln(ratio): ratio - 1 - ln(ratio)
    k3 = [2 - 1 - math.log(2), 0.0, 0.5 - 1 - math.log(0.5), 0.5 - 1 - math.log(0.5)]
    assert m["gen_kl_error"] == pytest.approx(sum(k3) / 4, abs=1e-14)
    assert m["sampling_importance_ratio"] == pytest.approx((2 + 1 + 0.5 + 0.5) / 4, abs=1e-14)
    assert m["truncated_fraction"] == 0.0  # tis window [0, 2] holds every raw weight
    m = mismatch_metrics(train, gen, mask, truncation="icepop", ratio_max=1.5)
    # window [2/3, 1.5]: 2, 0.5, 0.5 are out
    assert m["truncated_fraction"] == 0.75
    assert m["sampling_importance_ratio"] == pytest.approx(0.25, abs=1e-14)
    m = mismatch_metrics(train, gen, mask, truncation="tis", ratio_max=1.5, ratio_min=0.6)
    assert m["truncated_fraction"] == 0.75
    assert m["sampling_importance_ratio"] == pytest.approx((1.5 + 1 + 0.6 + 0.6) / 4, abs=1e-14)


# ------------------------------------------------------------------ argument errors


@pytest.mark.parametrize("kwargs, key", [
    ({"level": "tokens"}, "level"),
    ({"truncation": "clip"}, "truncation"),
    ({"truncation": "tis", "ratio_max": 1.0, "ratio_min": 2.0}, "ratio_min"),
    ({"truncation": "tis", "ratio_max": -1.0}, "ratio_max"),
    ({"truncation": "seq-mask-tis", "level": "sequence"}, "level"),
])
def test_bad_arguments_name_the_argument(kwargs, key):
    x = torch.zeros(1, 2)
    for fn in (importance_weights, mismatch_metrics):
        with pytest.raises(FP8ConfigError) as err:
            fn(x, x, torch.ones(1, 2), **kwargs)
        assert err.value.key == key


def test_shape_and_type_errors():
    with pytest.raises(FP8ConfigError, match="shapes differ"):
        importance_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(FP8ConfigError) as err:
        mismatch_metrics([0.0], torch.zeros(1), torch.ones(1))
    assert err.value.key == "train_logprobs"
    with pytest.raises(FP8ConfigError):
        importance_weights(torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.ones(2))


# ------------------------------------------------------------------ properties

_values = st.one_of(st.floats(min_value=-30, max_value=0, allow_nan=False),
                    st.sampled_from([-INF, NAN, 0.0, -1e-30]))


@settings(max_examples=150, deadline=None)
@given(data=st.lists(st.tuples(_values, _values, st.booleans()), min_size=1, max_size=12),
       level=st.sampled_from(["token", "sequence"]),
       truncation=st.sampled_from([None, "tis", "icepop", "seq-mask-tis"]),
       ratio_max=st.floats(min_value=1.0, max_value=10.0))
def test_any_input_gives_finite_nonnegative_weights_and_finite_metrics(data, level, truncation,
                                                                       ratio_max):
    if level == "sequence" and truncation == "seq-mask-tis":
        return
    train = torch.tensor([[d[0] for d in data]])
    gen = torch.tensor([[d[1] for d in data]])
    mask = torch.tensor([[d[2] for d in data]])
    w = importance_weights(train, gen, mask, level=level, truncation=truncation, ratio_max=ratio_max)
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert (w[~mask] == 0).all()
    if truncation in ("tis", "icepop"):
        assert (w <= ratio_max).all()
    m = mismatch_metrics(train, gen, mask, level=level, truncation=truncation, ratio_max=ratio_max)
    assert m["token_mult_prob_error"] >= 1.0 and m["gen_kl_error"] >= 0.0
    assert 0.0 <= m["truncated_fraction"] <= 1.0 and 0.0 <= m["nonfinite_fraction"] <= 1.0
    assert not any(math.isnan(v) for v in m.values())


def test_kl_of_tiny_differences_is_not_negative():
    # exp(r) - 1 - r cancels to -r in fp32 for |r| ~ 1e-30; expm1(r) - r stays >= 0
    train = torch.tensor([[0.0, -1e-30, -1e-8, -2.0]])
    gen = torch.tensor([[-1e-30, 0.0, 0.0, -2.0 + 1e-7]])
    m = mismatch_metrics(train, gen, torch.ones(1, 4))
    assert m["gen_kl_error"] >= 0.0 and m["policy_kl_error"] >= 0.0
