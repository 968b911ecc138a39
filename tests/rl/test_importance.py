"""importance_weights / mismatch_metrics / KL estimators against NeMo RL's formulas.

NeMo RL's source (the shared test data's ``data/nemo_rl/src/nemo_rl/algorithms/``, Apache-2.0) is
transcribed below, line by line with the line numbers of ``loss/loss_functions.py``
(``ClippedPGLossFn.__call__``) and ``utils.py`` (``masked_mean``, ``calculate_kl``), as an
independent reference: one micro-batch, so ``global_valid_toks = mask.sum()`` and
``global_valid_seqs = sample_mask.sum()``. Each edge case has a test that computes NeMo RL's
value from that formula and checks ours against it (``atol=0`` where the arithmetic is the
same), or checks the documented difference.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl import importance_weights, mismatch_metrics
from nemo_fp8_plugin.rl.importance import (
    gen_kl_error,
    kl_estimate,
    policy_kl_error,
    truncation_window,
)

INF = float("inf")
NAN = float("nan")
F32 = torch.float32


# ------------------------------------------------------------------ NeMo RL, as written


def nrl_masked_mean(values, mask, dim=None, global_normalization_factor=None):
    # algorithms/utils.py:219-224
    normalization_factor = (
        torch.sum(mask, dim=dim)
        if global_normalization_factor is None
        else global_normalization_factor
    )
    return torch.sum(values * mask, dim=dim) / (normalization_factor + 1e-8)


def nrl_calculate_kl(logprobs, logprobs_reference, kl_type="k3"):
    # algorithms/utils.py:72 and 83-90; the mismatch metrics pass no clamps
    # (loss_functions.py:420-421)
    logr = logprobs_reference - logprobs
    if kl_type == "k1":
        return -logr
    if kl_type == "k2":
        return torch.square(logr) / 2
    return torch.exp(logr) - 1 - logr


def nemo_rl(
    prev,
    gen,
    token_mask,
    sample_mask=None,
    *,
    seq_level=False,
    tis_type=None,
    ratio=None,
    ratio_min=None,
    kl_type="k3",
):
    """ClippedPGLossFn's importance weights and mismatch metrics for one micro-batch."""
    token_mask = token_mask.to(F32)
    sample_mask = (torch.ones(prev.shape[0]) if sample_mask is None else sample_mask).to(F32)
    mask = token_mask * sample_mask.unsqueeze(-1)  # :397
    global_valid_toks, global_valid_seqs = mask.sum(), sample_mask.sum()
    out = {}
    lp_error = torch.abs(gen - prev)  # :406
    out["token_mult_prob_error"] = nrl_masked_mean(
        torch.exp(lp_error * mask),
        mask,  # :408-412
        global_normalization_factor=global_valid_toks,
    )
    out["gen_kl_error"] = nrl_masked_mean(
        nrl_calculate_kl(gen, prev, kl_type),
        mask,  # :416-427
        global_normalization_factor=global_valid_toks,
    )
    out["policy_kl_error"] = nrl_masked_mean(
        nrl_calculate_kl(prev, gen, kl_type),
        mask,  # :431-441
        global_normalization_factor=global_valid_toks,
    )
    if seq_level:  # :568-576
        seq_lp_diff = ((prev - gen) * mask).sum(dim=-1)
        w = torch.nan_to_num(torch.exp(seq_lp_diff), nan=0.0, posinf=0.0, neginf=0.0)
        w = w.unsqueeze(-1)
    else:  # :579-584
        w = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    if ratio is not None:  # :596
        if tis_type == "tis":  # :597-616
            tis_min = 0.0 if ratio_min is None else ratio_min
            oob = (w > ratio) | (w < tis_min)
            out["is_oob_ratio"] = nrl_masked_mean(
                oob.float(), mask, global_normalization_factor=global_valid_toks
            )
            w = torch.clamp(w, min=tis_min, max=ratio)
        elif tis_type == "icepop":  # :617-636
            kept = (w >= ratio_min) & (w <= ratio)
            out["is_oob_ratio"] = nrl_masked_mean(
                (~kept).float(), mask, global_normalization_factor=global_valid_toks
            )
            w = torch.where(kept, w, torch.zeros_like(w))
        elif tis_type == "seq-mask-tis":  # :637-665
            log_is_ratio = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
            geo = torch.exp(nrl_masked_mean(log_is_ratio, token_mask, dim=-1))
            kept = ((geo >= ratio_min) & (geo <= ratio)).float()
            out["is_oob_ratio"] = nrl_masked_mean(
                1.0 - kept, sample_mask, global_normalization_factor=global_valid_seqs
            )
            w = w * kept.unsqueeze(-1)
    if seq_level:  # :697-702
        out["sampling_importance_ratio"] = nrl_masked_mean(
            w, sample_mask, global_normalization_factor=global_valid_seqs
        )
    else:  # :704-707
        out["sampling_importance_ratio"] = nrl_masked_mean(
            w, mask, global_normalization_factor=global_valid_toks
        )
    out = {k: float(v) for k, v in out.items()}
    out["weights"] = w.expand_as(prev)
    out["mask"] = mask
    return out


def exact(actual, expected):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), (actual, expected)


def loss_weights(nrl):
    """NeMo RL's weights as the loss sees them (it multiplies by the mask afterwards)."""
    return torch.where(nrl["mask"].bool(), nrl["weights"], torch.zeros_like(nrl["weights"]))


def fp32_pair(target: float) -> tuple[float, float]:
    """fp32 log-probs (train, gen) whose ratio torch.exp(train - gen) is exactly fp32(target)."""
    t = torch.tensor(target, dtype=F32)
    for g0 in (-0.25, -0.5, -1.0, -0.75, -2.0):
        g = torch.tensor(g0, dtype=F32)
        start = g + torch.log(t)
        for direction in (INF, -INF):
            c = start.clone()
            for _ in range(64):
                if torch.exp(c - g) == t:
                    return c.item(), g.item()
                c = torch.nextafter(c, torch.tensor(direction, dtype=F32))
    raise AssertionError(f"no fp32 pair reaches {target}")


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=F32))


def ulp_up(x: float) -> float:
    return float(torch.nextafter(torch.tensor(x, dtype=F32), torch.tensor(INF, dtype=F32)))


def ulp_down(x: float) -> float:
    return float(torch.nextafter(torch.tensor(x, dtype=F32), torch.tensor(-INF, dtype=F32)))


def lp(*probs):
    """Log-probabilities in float64, so hand values hold to ~1e-15."""
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def close(actual, expected, tol=1e-12):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=tol, rtol=0), (actual, expected)


def random_batch(seed, shape=(5, 9), scale=0.3):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(shape, generator=g) * 4
    train = gen + torch.randn(shape, generator=g) * scale
    mask = torch.rand(shape, generator=g) < 0.8
    mask[:, 0] = True
    return train, gen, mask


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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "level, trunc, rmax, rmin",
    [
        ("token", None, 2.0, None),
        ("token", "tis", 1.2, None),
        ("token", "tis", 1.2, 0.8),
        ("token", "icepop", 1.3, 0.7),
        ("token", "seq-mask-tis", 1.05, 0.95),
        ("sequence", None, 2.0, None),
        ("sequence", "tis", 1.5, 0.5),
        ("sequence", "icepop", 2.0, 0.6),
    ],
)
def test_every_mode_matches_nemo_rl_bit_for_bit_on_finite_fp32_input(
    seed, level, trunc, rmax, rmin
):
    # Finite fp32 log-probs, finite padding: the arithmetic is NeMo RL's op for op, so the
    # weights the loss sees, is_oob_ratio and the token-level means agree with atol=0.
    train, gen, mask = random_batch(seed)
    nrl = nemo_rl(
        train,
        gen,
        mask,
        seq_level=level == "sequence",
        tis_type=trunc,
        ratio=None if trunc is None else rmax,
        ratio_min=rmin,
    )
    w = importance_weights(train, gen, mask, level, trunc, rmax, rmin)
    exact(w, loss_weights(nrl))
    m = mismatch_metrics(
        train, gen, mask, level=level, truncation=trunc, ratio_max=rmax, ratio_min=rmin
    )
    assert m["token_mult_prob_error"] == nrl["token_mult_prob_error"]
    if trunc is not None:
        assert (
            m["is_oob_ratio"]
            == m["truncated_fraction"]
            == pytest.approx(nrl["is_oob_ratio"], rel=1e-6)
        )  # NeMo RL counts in fp32; ours counts exactly
    if level == "token":
        assert m["sampling_importance_ratio"] == nrl["sampling_importance_ratio"]


def test_weights_are_detached_and_keep_bf16_as_nemo_rl_does():
    # NeMo RL evaluates exp(prev - gen) in the inputs' dtype (loss_functions.py:579), no
    # upcast first: bf16 in gives NeMo RL's bf16 weights bit for bit.
    train = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    gen = torch.tensor([[-1.5, -2.0]], dtype=torch.bfloat16)
    w = importance_weights(train, gen, torch.ones(1, 2, dtype=torch.bool))
    assert w.dtype == torch.bfloat16 and not w.requires_grad
    assert torch.equal(w, torch.exp(train.detach() - gen))


def test_leading_dimensions_and_1d_sequences():
    w = importance_weights(lp(0.5, 0.2), lp(0.25, 0.4), torch.tensor([1, 1]), level="sequence")
    close(w, [1.0, 1.0])
    w3 = importance_weights(
        lp(0.5, 0.2).expand(2, 3, 2), lp(0.25, 0.4).expand(2, 3, 2), torch.ones(2, 3, 2)
    )
    close(w3, torch.tensor([2.0, 0.5], dtype=torch.float64).expand(2, 3, 2))
    # sample_mask of a 1-D sequence is 0-dimensional
    exact(
        importance_weights(
            lp(0.5, 0.2), lp(0.25, 0.4), torch.tensor([1, 1]), sample_mask=torch.tensor(0)
        ),
        torch.zeros(2, dtype=torch.float64),
    )


def test_positional_call_of_existing_callers_still_works():
    # nemo_fp8_plugin/tools/rl_check.py passes level/truncation/ratio_* by keyword; older
    # code passes them positionally. sample_mask is keyword-only.
    train, gen = lp(0.6, 0.05)[None], lp(0.2, 0.2)[None]
    close(
        importance_weights(train, gen, torch.ones(1, 2), "token", "tis", 2.0, None), [[2.0, 0.25]]
    )
    with pytest.raises(TypeError):
        importance_weights(train, gen, torch.ones(1, 2), "token", "tis", 2.0, None, torch.ones(1))  # type: ignore[misc]


# ------------------------------------------------------------------ sample_mask


def test_sample_mask_drops_sequences_as_nemo_rls_mask_product():
    # NeMo RL: mask = token_mask * sample_mask.unsqueeze(-1) (loss_functions.py:397); every
    # token-level mean divides by mask.sum().
    train, gen, mask = random_batch(7, (4, 6))
    sample = torch.tensor([1, 0, 1, 1])
    for trunc, rmin in ((None, None), ("tis", 0.5), ("icepop", 0.6)):
        nrl = nemo_rl(
            train,
            gen,
            mask,
            sample,
            tis_type=trunc,
            ratio=None if trunc is None else 1.4,
            ratio_min=rmin,
        )
        w = importance_weights(
            train, gen, mask, truncation=trunc, ratio_max=1.4, ratio_min=rmin, sample_mask=sample
        )
        exact(w, loss_weights(nrl))
        assert (w[1] == 0).all()
        m = mismatch_metrics(
            train, gen, mask, truncation=trunc, ratio_max=1.4, ratio_min=rmin, sample_mask=sample
        )
        assert m["num_tokens"] == float(nrl["mask"].sum())
        assert m["token_mult_prob_error"] == nrl["token_mult_prob_error"]
        assert m["sampling_importance_ratio"] == nrl["sampling_importance_ratio"]
    # a bool sample_mask is the same as 0/1
    exact(
        importance_weights(train, gen, mask, sample_mask=sample.bool()),
        importance_weights(train, gen, mask, sample_mask=sample),
    )


def test_seq_mask_tis_oob_denominator_is_the_sample_mask():
    # NeMo RL: is_oob_ratio = masked_mean(1 - kept, sample_mask, global_valid_seqs)
    # (loss_functions.py:656-661): sequences with sample_mask 0 are not counted; a counted
    # sequence without valid tokens has mean log-ratio 0 / (0 + 1e-8) = 0 (utils.py:224), so
    # its geometric mean is 1, inside a window that holds 1.
    r = math.log(4.0)
    train = torch.tensor([[r, r, 0.0], [0.0, 0.0, 0.0], [r, 0.0, 0.0], [0.0, 0.0, 0.0]]) - 1
    gen = torch.full((4, 3), -1.0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
    sample = torch.tensor([1, 1, 0, 1])
    nrl = nemo_rl(train, gen, mask, sample, tis_type="seq-mask-tis", ratio=2.0, ratio_min=0.5)
    # seq 0 out (geomean 4); seq 1 in; seq 2 dropped by sample_mask; seq 3 empty, in
    assert nrl["is_oob_ratio"] == pytest.approx(1 / 3, rel=1e-7)
    m = mismatch_metrics(
        train,
        gen,
        mask,
        truncation="seq-mask-tis",
        ratio_max=2.0,
        ratio_min=0.5,
        sample_mask=sample,
    )
    assert m["is_oob_ratio"] == m["truncated_fraction"] == 1 / 3
    w = importance_weights(
        train,
        gen,
        mask,
        truncation="seq-mask-tis",
        ratio_max=2.0,
        ratio_min=0.5,
        sample_mask=sample,
    )
    exact(w, loss_weights(nrl))
    # Without sample_mask the sequences that count are those with a valid token: seqs 0-2,
    # of which 0 and 2 (geomean 4) are out.
    m = mismatch_metrics(train, gen, mask, truncation="seq-mask-tis", ratio_max=2.0, ratio_min=0.5)
    assert m["truncated_fraction"] == 2 / 3
    # every sequence counted, the empty one (kept) included: 2 of 4, as NeMo RL
    every = torch.ones(4)
    nrl = nemo_rl(train, gen, mask, every, tis_type="seq-mask-tis", ratio=2.0, ratio_min=0.5)
    m = mismatch_metrics(
        train, gen, mask, truncation="seq-mask-tis", ratio_max=2.0, ratio_min=0.5, sample_mask=every
    )
    assert m["truncated_fraction"] == 0.5 == pytest.approx(nrl["is_oob_ratio"], rel=1e-7)


# ------------------------------------------------------------------ window edges


def test_tis_clamps_to_window_with_zero_default_floor():
    train = lp(0.6, 0.2, 0.05, 0.4)[None]
    gen = lp(0.2, 0.2, 0.2, 0.1)[None]  # raw weights 3, 1, 0.25, 4
    mask = torch.ones(1, 4)
    # NeMo RL: tis_min defaults to 0.0 (loss_functions.py:598-600)
    close(
        importance_weights(train, gen, mask, truncation="tis", ratio_max=2.0),
        [[2.0, 1.0, 0.25, 2.0]],
    )
    close(
        importance_weights(train, gen, mask, truncation="tis", ratio_max=2.0, ratio_min=0.5),
        [[2.0, 1.0, 0.5, 2.0]],
    )


def test_tis_weight_exactly_on_a_bound_is_not_out_of_bounds():
    # NeMo RL: oob = (w > ratio) | (w < tis_min), strict (loss_functions.py:601-604); the
    # clamp leaves a weight on the bound as it is. NeMo RL's FP8 recipes use ratio 2.
    hi, lo = fp32_pair(2.0), fp32_pair(0.5)
    train = torch.tensor([[hi[0], lo[0], 0.0]], dtype=F32)
    gen = torch.tensor([[hi[1], lo[1], 0.0]], dtype=F32)
    mask = torch.ones(1, 3)
    raw = importance_weights(train, gen, mask)
    exact(raw, [[2.0, 0.5, 1.0]])  # the construction lands on the bounds in fp32
    nrl = nemo_rl(train, gen, mask, tis_type="tis", ratio=2.0, ratio_min=0.5)
    assert nrl["is_oob_ratio"] == 0.0
    m = mismatch_metrics(train, gen, mask, truncation="tis", ratio_max=2.0, ratio_min=0.5)
    assert m["is_oob_ratio"] == 0.0
    exact(
        importance_weights(train, gen, mask, truncation="tis", ratio_max=2.0, ratio_min=0.5),
        loss_weights(nrl),
    )
    # one fp32 ulp inside the weights' bounds makes both tokens out of bounds
    args = dict(truncation="tis", ratio_max=ulp_down(2.0), ratio_min=ulp_up(0.5))
    nrl = nemo_rl(
        train, gen, mask, tis_type="tis", ratio=args["ratio_max"], ratio_min=args["ratio_min"]
    )
    m = mismatch_metrics(train, gen, mask, **args)
    assert m["is_oob_ratio"] == pytest.approx(2 / 3) and nrl["is_oob_ratio"] == pytest.approx(2 / 3)
    exact(importance_weights(train, gen, mask, **args), loss_weights(nrl))


def test_icepop_keeps_a_weight_exactly_on_either_bound_and_drops_one_ulp_past():
    # NeMo RL: kept = (w >= ratio_min) & (w <= ratio) (loss_functions.py:618-624), reference
    # bounds 0.5 to 5 (:587). Log-probs whose fp32 ratio is exactly 5.0 and 0.5.
    hi, lo = fp32_pair(5.0), fp32_pair(0.5)
    train = torch.tensor([[hi[0], lo[0], -1.0, -1.0]], dtype=F32)
    gen = torch.tensor([[hi[1], lo[1], -1.0, -2.0]], dtype=F32)
    mask = torch.tensor([[1, 1, 1, 1]])
    exact(importance_weights(train, gen, mask), torch.exp(train - gen))
    assert importance_weights(train, gen, mask)[0, :2].tolist() == [5.0, 0.5]
    nrl = nemo_rl(train, gen, mask, tis_type="icepop", ratio=5.0, ratio_min=0.5)
    w = importance_weights(train, gen, mask, truncation="icepop", ratio_max=5.0, ratio_min=0.5)
    exact(w, loss_weights(nrl))
    assert w[0, 0] == 5.0 and w[0, 1] == 0.5  # an exclusive bound would zero them
    assert (
        mismatch_metrics(train, gen, mask, truncation="icepop", ratio_max=5.0, ratio_min=0.5)[
            "is_oob_ratio"
        ]
        == nrl["is_oob_ratio"]
        == 0.0
    )
    # the same weights one ulp past the bounds: set the bounds one fp32 ulp inside them
    w = importance_weights(
        train, gen, mask, truncation="icepop", ratio_max=ulp_down(5.0), ratio_min=ulp_up(0.5)
    )
    nrl = nemo_rl(train, gen, mask, tis_type="icepop", ratio=ulp_down(5.0), ratio_min=ulp_up(0.5))
    exact(w, loss_weights(nrl))
    assert w[0, 0] == 0.0 and w[0, 1] == 0.0 and w[0, 2] == 1.0


def test_icepop_bound_given_as_a_python_float_is_compared_in_fp32():
    # torch compares an fp32 tensor with a Python float in fp32 (NeMo RL's comparisons at
    # loss_functions.py:618-624 do the same): a weight equal to fp32(0.999) is on the bound
    # 0.999 even though fp32(0.999) != 0.999.
    train, gen = fp32_pair(0.999)
    t, g = torch.tensor([[train]], dtype=F32), torch.tensor([[gen]], dtype=F32)
    assert float(torch.exp(t - g)) == f32(0.999) != 0.999
    nrl = nemo_rl(t, g, torch.ones(1, 1), tis_type="icepop", ratio=1.002, ratio_min=0.999)
    w = importance_weights(
        t, g, torch.ones(1, 1), truncation="icepop", ratio_max=1.002, ratio_min=0.999
    )
    exact(w, loss_weights(nrl))
    assert float(w) == f32(0.999)


def test_seq_mask_tis_geometric_mean_exactly_on_either_bound_is_kept():
    # NeMo RL: geo = exp(masked_mean(nan_to_num(prev - gen), token_mask, dim=-1)),
    # kept = (geo >= ratio_min) & (geo <= ratio) (loss_functions.py:639-655); reference bounds
    # 0.999 to 1.002 (:590). Each sequence has two valid tokens with the same log-ratio d,
    # so the mean is d exactly and geo = exp(d) = fp32(bound); padding after them.
    rows = []
    for target in (1.002, 0.999, ulp_up(f32(1.002)), ulp_down(f32(0.999))):
        tr, ge = fp32_pair(target)
        rows.append(([tr, tr, 5.0, -INF], [ge, ge, -3.0, 0.0]))
    train = torch.tensor([r[0] for r in rows], dtype=F32)
    gen = torch.tensor([r[1] for r in rows], dtype=F32)
    mask = torch.tensor([[1, 1, 0, 0]] * 4)
    nrl = nemo_rl(train, gen, mask, tis_type="seq-mask-tis", ratio=1.002, ratio_min=0.999)
    w = importance_weights(
        train, gen, mask, truncation="seq-mask-tis", ratio_max=1.002, ratio_min=0.999
    )
    exact(w, loss_weights(nrl))
    # on the bounds: kept with their raw token weights; one fp32 ulp past: dropped
    assert w[0, :2].tolist() == [f32(1.002)] * 2 and w[1, :2].tolist() == [f32(0.999)] * 2
    assert (w[2:] == 0).all()
    m = mismatch_metrics(
        train, gen, mask, truncation="seq-mask-tis", ratio_max=1.002, ratio_min=0.999
    )
    assert m["is_oob_ratio"] == 0.5 == nrl["is_oob_ratio"]


def test_seq_mask_tis_leaves_padding_out_of_the_geometric_mean():
    # NeMo RL: masked_mean(log_is_ratio, token_mask, dim=-1) multiplies padding by 0 and
    # divides by the number of valid tokens (loss_functions.py:645-647, utils.py:219-224).
    # A mean over all T positions (or padding with its log-ratio) would keep sequence 0 and
    # drop sequence 1 here.
    r = math.log(1.5)
    train = torch.tensor([[r, r, 0.0, 0.0], [r, 0.0, 9.0, NAN]], dtype=F32) - 2.0
    gen = torch.full((2, 4), -2.0, dtype=F32)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]])
    nrl = nemo_rl(train, gen, mask, tis_type="seq-mask-tis", ratio=1.3, ratio_min=0.8)
    # seq 0: geomean 1.5 > 1.3, out (over all 4 positions: 1.22, in);
    # seq 1: geomean sqrt(1.5) = 1.22, in (with the padding's 9: out)
    w = importance_weights(
        train, gen, mask, truncation="seq-mask-tis", ratio_max=1.3, ratio_min=0.8
    )
    exact(w, loss_weights(nrl))
    assert (w[0] == 0).all() and w[1, 0] > 0 and w[1, 1] > 0


def test_seq_mask_tis_treats_nonfinite_token_ratios_as_zero_in_the_mean():
    # NeMo RL: nan_to_num(prev - gen, nan=0, posinf=0, neginf=0) before the mean
    # (loss_functions.py:639-644); the token itself weighs 0 (:582-584). It still counts in
    # the denominator (token_mask).
    train = torch.tensor([[math.log(0.5), -INF, math.log(0.5), NAN]], dtype=torch.float64)
    gen = torch.tensor([[math.log(0.25), math.log(0.3), math.log(1.0), -1.0]], dtype=torch.float64)
    w = importance_weights(train, gen, torch.ones(1, 4), truncation="seq-mask-tis", ratio_max=1.5)
    # log ratios log2, -inf (-> 0), log0.5, NaN (-> 0): mean 0 -> geomean 1, kept
    close(w, [[2.0, 0.0, 0.5, 0.0]])
    nrl = nemo_rl(
        train.float(),
        gen.float(),
        torch.ones(1, 4),
        tis_type="seq-mask-tis",
        ratio=1.5,
        ratio_min=1 / 1.5,
    )
    exact(
        importance_weights(
            train.float(), gen.float(), torch.ones(1, 4), truncation="seq-mask-tis", ratio_max=1.5
        ),
        loss_weights(nrl),
    )


def test_ratio_bounds_are_ignored_without_truncation():
    train, gen = lp(0.6, 0.05)[None], lp(0.2, 0.2)[None]
    close(
        importance_weights(train, gen, torch.ones(1, 2), ratio_max=1.5, ratio_min=0.9),
        [[3.0, 0.25]],
    )


def test_ratio_min_defaults_and_the_adapter_writes_the_same_bound():
    # NeMo RL: tis_min None -> 0.0 (loss_functions.py:598-600); icepop and seq-mask-tis
    # assert ratio_min is set (:316-319). Ours: None -> 1/ratio_max for those two (the
    # plugin's NeMo RL adapter writes that value, so the run and our functions agree).
    assert truncation_window("tis", 2.0) == (0.0, 2.0)
    assert truncation_window("tis", 2.0, 0.5) == (0.5, 2.0)
    assert truncation_window("icepop", 4.0) == (0.25, 4.0)
    assert truncation_window("icepop", 5.0, 0.5) == (0.5, 5.0)
    assert truncation_window("seq-mask-tis", 1.002, 0.999) == (0.999, 1.002)
    assert truncation_window(None, 2.0) == (0.0, 2.0)
    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.config import get_path
    from nemo_fp8_plugin.hosts.nemo_rl import native_keys

    for trunc, rmax in (("icepop", 4.0), ("seq-mask-tis", 1.25), ("tis", 2.0)):
        spec = get_recipe("fp8_blockwise").replace(
            importance_sampling={"truncation": trunc, "ratio_max": rmax}
        )
        keys = native_keys(spec).keys
        written = get_path(keys, "loss_fn.truncated_importance_sampling_ratio_min")
        assert (0.0 if written is None else written) == truncation_window(trunc, rmax)[0]


def test_icepop_default_window_is_symmetric():
    train = lp(0.6, 0.2, 0.05, 0.1, 0.4)[None]
    gen = lp(0.2, 0.2, 0.2, 0.2, 0.2)[None]  # raw 3, 1, 0.25, 0.5, 2
    mask = torch.ones(1, 5)
    w = importance_weights(train, gen, mask, truncation="icepop", ratio_max=2.0)
    close(w, [[0.0, 1.0, 0.0, 0.5, 2.0]], tol=1e-12)
    w = importance_weights(train, gen, mask, truncation="icepop", ratio_max=5.0, ratio_min=0.3)
    close(w, [[3.0, 1.0, 0.0, 0.5, 2.0]])


# ------------------------------------------------------------------ non-finite log-probs


def test_nonfinite_at_a_valid_token_weighs_zero_at_token_level():
    # NeMo RL: nan_to_num(exp(prev - gen), nan=0, posinf=0, neginf=0) (loss_functions.py:579-584):
    # train -inf -> exp(-inf) = 0; gen -inf -> exp(+inf) -> 0; both -inf -> NaN -> 0; NaN -> 0.
    train = torch.tensor([[-INF, -1.0, -INF, NAN, -1.0, -1.0]])
    gen = torch.tensor([[-1.0, -INF, -INF, -1.0, -1.5, NAN]])
    mask = torch.ones(1, 6)
    for trunc, rmin in ((None, None), ("tis", None), ("tis", 0.5), ("icepop", 0.5)):
        nrl = nemo_rl(
            train, gen, mask, tis_type=trunc, ratio=None if trunc is None else 2.0, ratio_min=rmin
        )
        w = importance_weights(train, gen, mask, truncation=trunc, ratio_min=rmin)
        exact(w, loss_weights(nrl))
        # they count in the denominator of sampling_importance_ratio (:704-707)
        m = mismatch_metrics(train, gen, mask, truncation=trunc, ratio_min=rmin)
        assert m["sampling_importance_ratio"] == nrl["sampling_importance_ratio"]
    exact(importance_weights(train, gen, mask), [[0, 0, 0, 0, math.exp(0.5), 0]])
    # tis with a floor lifts them to ratio_min, as NeMo RL's clamp does (:612-616)
    exact(importance_weights(train, gen, mask, truncation="tis", ratio_min=0.5)[0, :4], [0.5] * 4)


def test_nonfinite_at_a_valid_token_zeroes_the_sequence_weight():
    # NeMo RL: seq_lp_diff = ((prev - gen) * mask).sum(-1); nan_to_num(exp(.))
    # (loss_functions.py:570-574): a -inf makes the sum -inf (weight 0), a +inf makes it
    # +inf (weight 0 after nan_to_num), a NaN makes it NaN (0).
    train = torch.tensor([[-INF, -1.0], [-1.0, -1.0], [NAN, -1.0], [-1.0, -1.2]])
    gen = torch.tensor([[-1.0, -1.0], [-INF, -1.0], [-1.0, -1.0], [-1.5, -1.0]])
    mask = torch.ones(4, 2)
    nrl = nemo_rl(train, gen, mask, seq_level=True)
    w = importance_weights(train, gen, mask, level="sequence")
    exact(w, loss_weights(nrl))
    assert (w[:3] == 0).all() and (w[3] > 0).all()


def test_sequence_weight_that_overflows_is_zero_even_under_tis():
    # NeMo RL replaces +inf by 0 (loss_functions.py:572-574) before the tis clamp (:612-616):
    # a sequence whose summed log-ratio overflows fp32's exp gets 0, not ratio_max.
    train = torch.full((1, 200), -1.0)
    gen = torch.full((1, 200), -1.5)  # sum 100 -> exp overflows in fp32
    mask = torch.ones(1, 200)
    nrl = nemo_rl(train, gen, mask, seq_level=True, tis_type="tis", ratio=2.0)
    w = importance_weights(train, gen, mask, level="sequence", truncation="tis")
    exact(w, loss_weights(nrl))
    assert (w == 0).all()


def test_nonfinite_in_padding_does_not_zero_a_sequence_weight_unlike_nemo_rl():
    # Documented difference. NeMo RL: (prev - gen) * mask with -inf or NaN in the padding gives
    # -inf * 0 = NaN, the sum is NaN, nan_to_num makes the weight 0 (loss_functions.py:570-574).
    # Ours leaves padding out before the sum: the weight of the valid tokens alone.
    train = torch.tensor([[-1.0, -2.0, -INF], [-1.0, -2.0, NAN], [-1.0, -2.0, -1.0]])
    gen = torch.tensor([[-1.5, -2.0, -1.0], [-1.5, -2.0, -1.0], [-1.5, -2.0, -INF]])
    mask = torch.tensor([[1, 1, 0]] * 3)
    nrl = nemo_rl(train, gen, mask, seq_level=True)
    assert (loss_weights(nrl) == 0).all()  # NeMo RL, as written
    # NeMo RL's formula on the valid tokens only (padding replaced by 0) is ours, bit for bit
    clean = nemo_rl(
        torch.where(mask.bool(), train, 0), torch.where(mask.bool(), gen, 0), mask, seq_level=True
    )
    w = importance_weights(train, gen, mask, level="sequence")
    exact(w, loss_weights(clean))
    close(w, [[math.exp(0.5)] * 2 + [0.0]] * 3, tol=1e-6)
    # at token level padding never mattered: NeMo RL's weights there are dropped by the mask
    exact(importance_weights(train, gen, mask), loss_weights(nemo_rl(train, gen, mask)))


def test_nonfinite_differences_are_left_out_of_the_metrics_unlike_nemo_rl():
    # Documented difference. NeMo RL's metric means include every valid token and even the
    # padding: exp(|inf| * 1) = inf at a valid token, exp(inf * 0) = exp(NaN) in the padding
    # (loss_functions.py:406-412), k3 of +-inf is inf or NaN (:416-441). Ours skips tokens
    # whose difference is not finite, counts them in nonfinite_fraction, and ignores padding.
    train = torch.tensor([[-1.0, -INF, -2.0, NAN, 0.0]], dtype=torch.float64)
    gen = torch.tensor([[-1.1, -0.5, -1.8, -1.0, -INF]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    nrl = nemo_rl(train, gen, mask)
    assert math.isnan(nrl["token_mult_prob_error"]) and math.isnan(nrl["gen_kl_error"])
    finite = torch.tensor([[1, 0, 1, 0, 0]])
    # NeMo RL's formula on the finite tokens alone (the others zero-filled, then masked)
    keep = finite.bool()
    ref = nemo_rl(torch.where(keep, train, 0), torch.where(keep, gen, 0), finite)
    m = mismatch_metrics(train, gen, mask)
    assert m["token_mult_prob_error"] == ref["token_mult_prob_error"]
    assert m["gen_kl_error"] == pytest.approx(ref["gen_kl_error"], rel=1e-12)
    assert m["policy_kl_error"] == pytest.approx(ref["policy_kl_error"], rel=1e-12)
    assert m["nonfinite_fraction"] == 0.5 and m["num_tokens"] == 4.0
    assert m["max_abs_logprob_diff"] == pytest.approx(0.2, abs=1e-14)
    assert all(math.isfinite(v) for v in m.values())


def test_top_k_top_p_replacement_is_reproduced_by_zero_filling_the_train_logprobs():
    # NeMo RL replaces +-inf training log-probs (and the padding) by 0, only when top-k/top-p
    # filtering is on (algorithms/utils.py:246-255, called from loss/utils.py:97-101); the
    # token stays in the loss, with weight exp(0 - gen) = 1 / p_gen. It does not mask it out.
    train = torch.tensor([[-1.0, -INF, -0.5]])
    gen = torch.tensor([[-1.2, -3.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    is_inf = torch.isinf(train)  # utils.py:246
    keep = mask.float() * (~is_inf).float()  # utils.py:254
    filled = torch.where(keep.bool(), train, 0.0)  # utils.py:255
    nrl = nemo_rl(filled, gen, mask)
    w = importance_weights(filled, gen, mask)
    exact(w, loss_weights(nrl))
    assert float(w[0, 1]) == float(torch.exp(torch.tensor(3.0)))
    # without the filling (no top-k/top-p) the token weighs 0 in both
    assert float(importance_weights(train, gen, mask)[0, 1]) == 0.0


# ------------------------------------------------------------------ sampling_importance_ratio


def test_sequence_level_sampling_importance_ratio_is_the_mean_over_sequences():
    # NeMo RL's intent: "sampling importance ratio (mean over samples)", normalized by the
    # number of sequences (loss_functions.py:349-353, 695-702). As written, the weights are
    # [B, 1] (:576) and sample_mask is [B]: values * mask broadcasts to [B, B], so the value is
    # sum_i(w_i) * sum_j(s_j) / global_valid_seqs, the SUM of the micro-batch's sequence
    # weights. Ours is the mean over the sequences that count (documented difference).
    train = torch.stack([lp(0.5, 0.5, 0.9), lp(0.1, 0.2, 0.3), lp(0.3, 0.3, 0.3)]).float()
    gen = torch.stack([lp(0.25, 0.25, 0.1), lp(0.2, 0.2, 0.3), lp(0.3, 0.6, 0.3)]).float()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    sample = torch.tensor([1, 1, 1])
    nrl = nemo_rl(train, gen, mask, sample, seq_level=True)
    seq_w = loss_weights(nrl)[:, 0]  # 4, 0.5, 0.5
    close(seq_w, [4.0, 0.5, 0.5], tol=1e-5)
    assert nrl["sampling_importance_ratio"] == pytest.approx(float(seq_w.sum()), rel=1e-6)
    m = mismatch_metrics(train, gen, mask, level="sequence")
    assert m["sampling_importance_ratio"] == pytest.approx(float(seq_w.mean()), rel=1e-6)
    # NeMo RL's formula with the [B] weights it meant (masked_mean(w, sample_mask)) is ours
    intended = nrl_masked_mean(seq_w, sample.float(), global_normalization_factor=3.0)
    assert m["sampling_importance_ratio"] == pytest.approx(float(intended), rel=1e-6)
    # with truncation the mean is taken after it, over the sequences sample_mask keeps
    m = mismatch_metrics(
        train,
        gen,
        mask,
        level="sequence",
        truncation="tis",
        ratio_max=2.0,
        sample_mask=torch.tensor([1, 0, 1]),
    )
    assert m["sampling_importance_ratio"] == pytest.approx((2.0 + 0.5) / 2, rel=1e-6)


def test_token_level_sampling_importance_ratio_matches_nemo_rl():
    # NeMo RL: masked_mean(w, mask, global_valid_toks) after truncation (loss_functions.py:704-707)
    train, gen, mask = random_batch(3)
    for trunc in (None, "tis", "icepop", "seq-mask-tis"):
        nrl = nemo_rl(
            train,
            gen,
            mask,
            tis_type=trunc,
            ratio=None if trunc is None else 1.2,
            ratio_min=None if trunc in (None, "tis") else 0.85,
        )
        m = mismatch_metrics(
            train,
            gen,
            mask,
            truncation=trunc,
            ratio_max=1.2,
            ratio_min=None if trunc in (None, "tis") else 0.85,
        )
        assert m["sampling_importance_ratio"] == nrl["sampling_importance_ratio"]


# ------------------------------------------------------------------ all masked


def test_all_masked_input_gives_zero_weights_and_neutral_metrics_unlike_nemo_rls_zeros():
    # Documented difference. NeMo RL's masked_mean is sum / (count + 1e-8) (utils.py:224):
    # with no valid token every metric is 0 / 1e-8 = 0.0, token_mult_prob_error and
    # sampling_importance_ratio included (a micro-batch's contribution to a sum over
    # micro-batches, not a value). Ours returns the no-mismatch values.
    train = torch.tensor([[-INF, NAN], [-1.0, -2.0]])
    gen = torch.tensor([[-1.0, -INF], [-1.5, -2.0]])
    mask = torch.zeros(2, 2)
    nrl = nemo_rl(
        torch.zeros(2, 2), torch.zeros(2, 2), mask, tis_type="icepop", ratio=2.0, ratio_min=0.5
    )
    assert nrl["token_mult_prob_error"] == 0.0 and nrl["sampling_importance_ratio"] == 0.0
    assert (importance_weights(train, gen, mask, truncation="icepop") == 0).all()
    m = mismatch_metrics(train, gen, mask, truncation="seq-mask-tis")
    assert m == {
        "token_mult_prob_error": 1.0,
        "gen_kl_error": 0.0,
        "policy_kl_error": 0.0,
        "max_abs_logprob_diff": 0.0,
        "nonfinite_fraction": 0.0,
        "num_tokens": 0.0,
        "sampling_importance_ratio": 1.0,
        "truncated_fraction": 0.0,
        "is_oob_ratio": 0.0,
    }
    m = mismatch_metrics(train, gen, torch.ones(2, 2), sample_mask=torch.zeros(2), level="sequence")
    assert m["num_tokens"] == 0.0 and m["sampling_importance_ratio"] == 1.0
    empty = torch.empty(0, 5)
    m = mismatch_metrics(empty, empty, empty)
    assert m["num_tokens"] == 0.0 and m["token_mult_prob_error"] == 1.0
    assert gen_kl_error(empty, empty, empty) == 0.0 == policy_kl_error(empty, empty, empty)


# ------------------------------------------------------------------ KL estimators


@pytest.mark.parametrize("kl_type", ["k1", "k2"])
def test_gen_and_policy_kl_error_k1_k2_match_nemo_rl_exactly(kl_type):
    # NeMo RL: gen_kl_error = masked_mean(calculate_kl(logprobs=gen, logprobs_reference=prev))
    # (loss_functions.py:416-427), policy_kl_error with the roles swapped (:431-441);
    # calculate_kl: logr = ref - logprobs, k1 = -logr, k2 = logr**2 / 2 (utils.py:72, 83-87).
    train, gen, mask = random_batch(11)
    nrl = nemo_rl(train, gen, mask, kl_type=kl_type)
    assert gen_kl_error(train, gen, mask, kl_type=kl_type) == nrl["gen_kl_error"]
    assert policy_kl_error(train, gen, mask, kl_type=kl_type) == nrl["policy_kl_error"]
    m = mismatch_metrics(train, gen, mask, kl_type=kl_type)
    assert m["gen_kl_error"] == nrl["gen_kl_error"]
    assert m["policy_kl_error"] == nrl["policy_kl_error"]
    exact(kl_estimate(gen, train, kl_type), nrl_calculate_kl(gen, train, kl_type))
    if kl_type == "k1":  # k1 of KL(gen || train) is the mean of gen - train
        assert gen_kl_error(train, gen, mask, kl_type="k1") == pytest.approx(
            float((gen - train)[mask].mean()), rel=1e-6
        )


def test_k3_is_nemo_rls_estimator_evaluated_without_cancellation():
    # NeMo RL: k3 = exp(logr) - 1 - logr (utils.py:89-90), default kl_type k3
    # (loss_functions.py:131). Ours is expm1(logr) - logr: the same value in float64 to
    # rounding, and never negative in fp32, where the literal form cancels (documented).
    train, gen, mask = random_batch(5)
    t64, g64 = train.double(), gen.double()
    nrl = nemo_rl(t64, g64, mask)
    assert gen_kl_error(t64, g64, mask) == pytest.approx(nrl["gen_kl_error"], rel=1e-12)
    assert policy_kl_error(t64, g64, mask) == pytest.approx(nrl["policy_kl_error"], rel=1e-12)
    close(kl_estimate(g64, t64), nrl_calculate_kl(g64, t64), tol=1e-15)
    # hand value: ratio 2 and 0.5 -> k3 = ratio - 1 - ln(ratio)
    train, gen = lp(0.5, 0.1)[None], lp(0.25, 0.2)[None]
    k3 = [2 - 1 - math.log(2), 0.5 - 1 - math.log(0.5)]
    assert gen_kl_error(train, gen, torch.ones(1, 2)) == pytest.approx(sum(k3) / 2, abs=1e-15)
    # fp32: for r = 2**-31 exp(r) rounds to 1 and the literal form gives -r
    tiny_t = torch.tensor([[-(2.0**-31)]], dtype=F32)
    tiny_g = torch.tensor([[-(2.0**-30)]], dtype=F32)
    assert float(nrl_calculate_kl(tiny_g, tiny_t)) < 0
    assert gen_kl_error(tiny_t, tiny_g, torch.ones(1, 1)) >= 0.0


def test_kl_of_tiny_differences_is_not_negative():
    train = torch.tensor([[0.0, -1e-30, -1e-8, -2.0]])
    gen = torch.tensor([[-1e-30, 0.0, 0.0, -2.0 + 1e-7]])
    m = mismatch_metrics(train, gen, torch.ones(1, 4))
    assert m["gen_kl_error"] >= 0.0 and m["policy_kl_error"] >= 0.0


def test_token_mult_prob_error_matches_nemo_rl_exactly():
    # NeMo RL: masked_mean(exp(|gen - prev| * mask), mask) (loss_functions.py:406-412)
    train, gen, mask = random_batch(9)
    m = mismatch_metrics(train, gen, mask)
    assert m["token_mult_prob_error"] == nemo_rl(train, gen, mask)["token_mult_prob_error"]


def test_identical_policies_give_unit_weights_and_no_mismatch():
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 5
    mask = torch.ones(3, 7)
    close(importance_weights(x, x.clone(), mask), torch.ones(3, 7))
    m = mismatch_metrics(x, x.clone(), mask)
    assert m["token_mult_prob_error"] == 1.0
    assert m["gen_kl_error"] == 0.0 and m["policy_kl_error"] == 0.0
    assert m["truncated_fraction"] == 0.0 and m["num_tokens"] == 21.0
    assert "is_oob_ratio" not in m  # NeMo RL logs it only with a truncation


def test_metric_values_by_hand():
    train = lp(0.5, 0.25, 0.1, 0.3)[None]
    gen = lp(0.25, 0.25, 0.2, 0.6)[None]  # ratios 2, 1, 0.5, 0.5 ; |d| = ln2, 0, ln2, ln2
    mask = torch.ones(1, 4)
    m = mismatch_metrics(train, gen, mask)
    assert m["token_mult_prob_error"] == pytest.approx((2 + 1 + 2 + 2) / 4, abs=1e-14)
    k3 = [2 - 1 - math.log(2), 0.0, 0.5 - 1 - math.log(0.5), 0.5 - 1 - math.log(0.5)]
    assert m["gen_kl_error"] == pytest.approx(sum(k3) / 4, abs=1e-14)
    assert m["sampling_importance_ratio"] == pytest.approx((2 + 1 + 0.5 + 0.5) / 4, abs=1e-14)
    assert m["truncated_fraction"] == 0.0  # tis window [0, 2] holds every raw weight
    m = mismatch_metrics(train, gen, mask, truncation="icepop", ratio_max=1.5)
    assert m["truncated_fraction"] == 0.75  # window [2/3, 1.5]: 2, 0.5, 0.5 are out
    assert m["sampling_importance_ratio"] == pytest.approx(0.25, abs=1e-14)
    m = mismatch_metrics(train, gen, mask, truncation="tis", ratio_max=1.5, ratio_min=0.6)
    assert m["truncated_fraction"] == 0.75
    assert m["sampling_importance_ratio"] == pytest.approx((1.5 + 1 + 0.6 + 0.6) / 4, abs=1e-14)


# ------------------------------------------------------------------ argument errors


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"level": "tokens"}, "level"),
        ({"level": None}, "level"),
        ({"truncation": "clip"}, "truncation"),
        ({"truncation": "TIS"}, "truncation"),
        ({"truncation": "tis", "ratio_max": 1.0, "ratio_min": 2.0}, "ratio_min"),
        ({"truncation": "tis", "ratio_max": -1.0}, "ratio_max"),
        ({"truncation": "tis", "ratio_max": 0.0}, "ratio_max"),
        ({"truncation": "tis", "ratio_max": True}, "ratio_max"),
        ({"truncation": "tis", "ratio_max": "2"}, "ratio_max"),
        ({"truncation": "tis", "ratio_max": INF}, "ratio_max"),
        ({"truncation": "icepop", "ratio_min": NAN}, "ratio_min"),
        ({"truncation": "seq-mask-tis", "level": "sequence"}, "level"),
        ({"sample_mask": torch.ones(2)}, "sample_mask"),
        ({"sample_mask": [1]}, "sample_mask"),
        ({"sample_mask": torch.tensor([0.5])}, "sample_mask"),
        ({"sample_mask": "true"}, "sample_mask"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, key):
    x = torch.zeros(1, 2)
    for fn in (importance_weights, mismatch_metrics):
        with pytest.raises(FP8ConfigError) as err:
            fn(x, x, torch.ones(1, 2), **kwargs)
        assert err.value.key == key, err.value


def test_bad_masks_and_kl_types_name_the_argument():
    x = torch.zeros(1, 2)
    for mask in (
        torch.tensor([[0.5, 1.0]]),
        torch.tensor([[NAN, 1.0]]),
        torch.tensor([[2, 1]]),
        "true",
        [[1, 1]],
    ):
        with pytest.raises(FP8ConfigError) as err:
            importance_weights(x, x, mask)
        assert err.value.key == "mask"
    for fn in (mismatch_metrics, gen_kl_error, policy_kl_error):
        with pytest.raises(FP8ConfigError) as err:
            fn(x, x, torch.ones(1, 2), kl_type="k4")
        assert err.value.key == "kl_type"
    with pytest.raises(FP8ConfigError) as err:
        kl_estimate(x, x, "K3")
    assert err.value.key == "kl_type" and "k3" in str(err.value)
    with pytest.raises(FP8ConfigError) as err:
        kl_estimate(x, torch.zeros(1, 3))
    assert err.value.key == "logprobs_reference"
    with pytest.raises(FP8ConfigError) as err:
        truncation_window("clip", 2.0)
    assert err.value.key == "truncation"
    with pytest.raises(FP8ConfigError) as err:
        truncation_window("icepop", 2.0, 3.0)
    assert err.value.key == "ratio_min"


def test_shape_and_type_errors():
    with pytest.raises(FP8ConfigError, match="shapes differ"):
        importance_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(FP8ConfigError) as err:
        mismatch_metrics([0.0], torch.zeros(1), torch.ones(1))
    assert err.value.key == "train_logprobs"
    with pytest.raises(FP8ConfigError) as err:
        importance_weights(torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.ones(2))
    assert err.value.key == "train_logprobs"
    with pytest.raises(FP8ConfigError) as err:
        gen_kl_error(torch.zeros(2), torch.zeros(2, dtype=torch.int32), torch.ones(2))
    assert err.value.key == "gen_logprobs"


# ------------------------------------------------------------------ properties

_values = st.one_of(
    st.floats(min_value=-30, max_value=0, allow_nan=False),
    st.sampled_from([-INF, NAN, 0.0, -1e-30]),
)


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(_values, _values, st.booleans()), min_size=1, max_size=12),
    level=st.sampled_from(["token", "sequence"]),
    truncation=st.sampled_from([None, "tis", "icepop", "seq-mask-tis"]),
    ratio_max=st.floats(min_value=1.0, max_value=10.0),
    keep_sample=st.booleans(),
)
def test_any_input_gives_finite_nonnegative_weights_and_finite_metrics(
    data, level, truncation, ratio_max, keep_sample
):
    if level == "sequence" and truncation == "seq-mask-tis":
        return
    train = torch.tensor([[d[0] for d in data]])
    gen = torch.tensor([[d[1] for d in data]])
    mask = torch.tensor([[d[2] for d in data]])
    sample = torch.tensor([keep_sample])
    kw = dict(level=level, truncation=truncation, ratio_max=ratio_max, sample_mask=sample)
    w = importance_weights(train, gen, mask, **kw)
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert (w[~mask] == 0).all()
    if not keep_sample:
        assert (w == 0).all()
    if truncation in ("tis", "icepop"):
        assert (w <= ratio_max).all()
    m = mismatch_metrics(train, gen, mask, **kw)
    assert m["token_mult_prob_error"] >= 1.0 and m["gen_kl_error"] >= 0.0
    assert 0.0 <= m["truncated_fraction"] <= 1.0 and 0.0 <= m["nonfinite_fraction"] <= 1.0
    assert not any(math.isnan(v) for v in m.values())
    # with finite padding (where NeMo RL's sequence sum is not poisoned) the weights agree
    pad = ~mask
    if torch.isfinite(train[pad]).all() and torch.isfinite(gen[pad]).all():
        lo = truncation_window(truncation, ratio_max)[0]
        nrl = nemo_rl(
            train,
            gen,
            mask,
            sample,
            seq_level=level == "sequence",
            tis_type=truncation,
            ratio=None if truncation is None else ratio_max,
            ratio_min=lo,
        )
        exact(w, loss_weights(nrl))


@settings(max_examples=200)
@given(
    level=st.sampled_from(["token", "sequence"]),
    truncation=st.sampled_from([None, "tis", "icepop", "seq-mask-tis"]),
    ratio_max=st.sampled_from([1e-6, 0.5, 1.0, 2.0, 5.0, 1e6]),
    ratio_min=st.sampled_from([None, 0.0, 0.5, 1.0, 2.0, 10.0]),
)
def test_the_recipe_accepts_exactly_what_the_functions_accept(
    level, truncation, ratio_max, ratio_min
):
    """A recipe's ``importance_sampling`` block is validated in the torch-free spec, the
    arguments again in the functions: the two agree, so no recipe that loads fails at the
    first training step (and no refusal is the spec's alone)."""
    from nemo_fp8_plugin.rl.importance import _settings
    from nemo_fp8_plugin.spec import ImportanceSampling

    def accepted(fn) -> bool:
        try:
            fn()
        except FP8ConfigError:
            return False
        return True

    kw = dict(level=level, truncation=truncation, ratio_max=ratio_max, ratio_min=ratio_min)
    assert accepted(lambda: ImportanceSampling(**kw)) == accepted(lambda: _settings(**kw)), kw
