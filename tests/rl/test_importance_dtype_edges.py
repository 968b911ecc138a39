"""The two dtype edges where importance_weights must equal NeMo RL, not a cleaner formula.

NeMo RL (snapshot 7ea279a, ``src/nemo_rl/algorithms/loss/loss_functions.py:637-665`` and
``algorithms/utils.py:212-224``, in ``../shared/data/nemo_rl``) computes the
seq-mask-tis geometric mean as ``sum(x * token_mask) / (sum(token_mask) + 1e-8)`` and the
weights as ``exp(prev - gen)`` in the inputs' dtype. Both are transcribed below as the
reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_fp8_plugin.rl import importance_weights


def nrl_masked_mean(values, mask, dim=None):
    # algorithms/utils.py:219-224 (no global normalization factor)
    return torch.sum(values * mask, dim=dim) / (torch.sum(mask, dim=dim) + 1e-8)


def nrl_weights(prev, gen, token_mask, truncation, high, low):
    # loss_functions.py:578-584 (token level) and the truncation branch :597-665
    w = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    if truncation == "tis":
        return torch.clamp(w, min=low, max=high)
    if truncation == "icepop":
        kept = (w >= low) & (w <= high)
        return torch.where(kept, w, torch.zeros_like(w))
    log_is = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
    geo = torch.exp(nrl_masked_mean(log_is, token_mask, dim=-1))
    kept = ((geo >= low) & (geo <= high)).float()
    return w * kept.unsqueeze(-1)


def test_fp64_seq_mask_tis_keeps_a_sequence_nemo_rls_1e8_pulls_inside_the_bound():
    # One token, log-ratio a hair above log(2): exp(r) > 2, so a plain mean drops the
    # sequence; NeMo RL divides by 1 + 1e-8, which in fp64 brings it back under 2.
    r = math.log(2.0) * (1 + 5e-9)
    prev = torch.tensor([[r]], dtype=torch.float64)
    gen = torch.zeros(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    assert math.exp(r) > 2.0
    ref = nrl_weights(prev, gen, mask, "seq-mask-tis", 2.0, 0.5)
    assert ref.item() == pytest.approx(math.exp(r))  # NeMo RL keeps it
    ours = importance_weights(prev, gen, mask, truncation="seq-mask-tis", ratio_max=2.0)
    assert torch.equal(ours, ref)


def test_fp64_with_a_bool_mask_has_nemo_rls_fp32_denominator():
    # sum(bool) is int64, + 1e-8 is fp32 (torch's default dtype), so the 1e-8 vanishes:
    # the same sequence is dropped, in NeMo RL and here.
    r = math.log(2.0) * (1 + 5e-9)
    prev = torch.tensor([[r]], dtype=torch.float64)
    gen = torch.zeros(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    ref = nrl_weights(prev, gen, mask, "seq-mask-tis", 2.0, 0.5)
    assert ref.item() == 0.0
    ours = importance_weights(prev, gen, mask, truncation="seq-mask-tis", ratio_max=2.0)
    assert torch.equal(ours, ref)


_lp = st.floats(-6.0, 0.0, allow_nan=False, width=32)


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(_lp, _lp, st.booleans()), min_size=1, max_size=12),
    truncation=st.sampled_from(["tis", "icepop", "seq-mask-tis"]),
    high=st.sampled_from([1.001, 1.2, 2.0, 5.0]),
    mask_dtype=st.sampled_from([torch.int64, torch.float64]),
)
def test_bf16_and_fp64_weights_equal_nemo_rls_bit_for_bit(data, truncation, high, mask_dtype):
    for dtype in (torch.bfloat16, torch.float64):
        prev = torch.tensor([[d[0] for d in data]], dtype=dtype)
        gen = torch.tensor([[d[1] for d in data]], dtype=dtype)
        mask = torch.tensor([[int(d[2]) for d in data]], dtype=mask_dtype)
        low = 0.0 if truncation == "tis" else 1.0 / high
        ref = nrl_weights(prev, gen, mask, truncation, high, low)
        ref = torch.where(mask.bool(), ref, torch.zeros_like(ref))  # ours: 0 off the mask
        ours = importance_weights(prev, gen, mask, truncation=truncation, ratio_max=high)
        assert ours.dtype == ref.dtype
        assert torch.equal(ours, ref.to(ours.dtype))
