"""importance_weights and the sequence masking against NeMo RL's own code, per release.

The reference is NeMo RL's ``ClippedPGLossFn`` and GRPO's
``compute_and_apply_seq_logprob_error_masking``, compiled from the shared source of v0.6.0,
v0.7.0 and the main snapshot (``nemo_rl_loss.py`` says how). Compared bit for bit, dtype
included.
"""

from __future__ import annotations

import pytest
import torch
from nemo_rl_loss import RELEASES, BatchedDataDict, nemo_rl_grpo, nemo_rl_importance_weights

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl.importance import importance_weights
from nemo_fp8_plugin.rl.sequence_mask import sequence_error, sequence_error_mask

pytestmark = pytest.mark.host


def batch(seed: int, dtype: torch.dtype, b: int = 6, t: int = 24, spread: float = 0.05):
    gen = torch.Generator().manual_seed(seed)
    prev = -torch.rand(b, t, generator=gen) * 4
    other = prev + torch.randn(b, t, generator=gen) * spread
    token_mask = (torch.rand(b, t, generator=gen) > 0.25).float()
    token_mask[0] = 0  # a sequence without a valid token
    sample_mask = torch.ones(b)
    sample_mask[1] = 0  # a sequence the batch drops
    return prev.to(dtype), other.to(dtype), token_mask, sample_mask


def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


@pytest.mark.parametrize("release", list(RELEASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("truncation", [None, "tis", "icepop"])
def test_sequence_level_weights_equal_nemo_rls_dtype_and_bits(release, dtype, truncation):
    # NeMo RL multiplies the bf16 log-ratio by its float mask before the sum: fp32 weights
    # (loss_functions.py v0.6.0 ~430, v0.7.0 ~506, main ~570).
    cfg = {"sequence_level_importance_ratios": True}
    if truncation is not None:
        cfg.update(
            truncated_importance_sampling_type=truncation,
            truncated_importance_sampling_ratio=1.3,
            truncated_importance_sampling_ratio_min=0.8 if truncation == "icepop" else None,
        )
    for seed in range(4):
        prev, gen, token_mask, sample_mask = batch(seed, dtype, spread=0.05 + 0.05 * seed)
        theirs = nemo_rl_importance_weights(release, prev, gen, token_mask, sample_mask, **cfg)
        assert theirs.dtype == torch.float32  # bf16 in, fp32 out
        valid = (token_mask * sample_mask.unsqueeze(-1)).bool()
        theirs = torch.where(valid, theirs.expand_as(valid), torch.zeros(()))  # ours: 0 off it
        ours = importance_weights(
            prev,
            gen,
            token_mask,
            level="sequence",
            truncation=truncation,
            ratio_max=1.3,
            ratio_min=0.8 if truncation == "icepop" else None,
            sample_mask=sample_mask,
        )
        same(ours, theirs)


@pytest.mark.parametrize("release", list(RELEASES))
def test_token_level_bf16_weights_stay_bf16_as_nemo_rls(release):
    prev, gen, token_mask, sample_mask = batch(7, torch.bfloat16)
    theirs = nemo_rl_importance_weights(release, prev, gen, token_mask, sample_mask)
    valid = (token_mask * sample_mask.unsqueeze(-1)).bool()
    theirs = torch.where(valid, theirs, torch.zeros((), dtype=theirs.dtype))
    same(importance_weights(prev, gen, token_mask, sample_mask=sample_mask), theirs)


# --------------------------------------------------------------------------- sequence masking


def nemo_rl_masking(release, prev, gen, token_mask, sample_mask, threshold):
    fn = nemo_rl_grpo(release, "compute_and_apply_seq_logprob_error_masking")

    def pad(x):
        return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)

    data = BatchedDataDict(
        token_mask=pad(token_mask),
        sample_mask=sample_mask.clone(),
        prev_logprobs=pad(prev),
        generation_logprobs=pad(gen),
    )
    fn(data, torch.zeros(len(sample_mask)), threshold)
    return data["sample_mask"]


def test_every_release_has_the_masking_and_reads_the_grpo_key():
    # grpo.seq_logprob_error_threshold: in GRPOConfig and read by the training loop of each
    # release (absent before v0.6.0).
    from conftest import shared_nemo_rl

    for tree in RELEASES.values():
        src = (shared_nemo_rl(tree) / "nemo_rl/algorithms/grpo.py").read_text()
        assert "    seq_logprob_error_threshold:" in src  # the GRPOConfig field
        assert "compute_and_apply_seq_logprob_error_masking(" in src


@pytest.mark.parametrize("release", list(RELEASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_sequence_error_mask_keeps_what_nemo_rl_keeps(release, dtype):
    if dtype == torch.bfloat16 and release != "v0.6.0":
        # v0.7.0 and main store the fp32 error into a bf16 tensor by indexed assignment,
        # which torch refuses: they cannot run on bf16 log-probs (ours gives v0.6.0's).
        prev, gen, token_mask, sample_mask = batch(0, dtype)
        with pytest.raises(RuntimeError, match="dtypes match"):
            nemo_rl_masking(release, prev, gen, token_mask, sample_mask, 1.5)
        return
    kept_some = dropped_some = False
    for seed in range(6):
        prev, gen, token_mask, sample_mask = batch(seed, dtype, spread=0.02 * (seed + 1))
        errors = sequence_error(prev, gen, token_mask, sample_mask=sample_mask)
        assert errors.dtype == torch.promote_types(dtype, torch.float32)
        # fixed thresholds, and thresholds on the errors themselves (the bound is inclusive)
        for threshold in (1.02, 1.05, float(errors.max()), float(errors[2:].median())):
            theirs = nemo_rl_masking(release, prev, gen, token_mask, sample_mask, threshold)
            ours = sequence_error_mask(prev, gen, token_mask, threshold, sample_mask=sample_mask)
            assert ours.dtype == torch.bool
            assert torch.equal(ours, theirs.bool()), (release, dtype, seed, threshold)
            kept_some |= bool(ours[2:].any())
            dropped_some |= bool((~ours[2:]).any())
    assert kept_some and dropped_some  # the thresholds cut through the batches


def test_a_non_finite_valid_token_drops_its_sequence_padding_does_not():
    prev = torch.tensor([[-1.0, float("-inf"), -2.0], [-1.0, -1.0, float("nan")]])
    gen = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the NaN of row 1 is padding
    assert sequence_error_mask(prev, gen, mask, 1.5).tolist() == [False, True]


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"max_error": 0.99}, "max_error"),
        ({"max_error": float("nan")}, "max_error"),
        ({"max_error": "1.5"}, "max_error"),
        ({"max_error": 1.5, "sample_mask": torch.ones(2)}, "sample_mask"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, key):
    prev, gen, token_mask, _ = batch(0, torch.float32)
    with pytest.raises(FP8ConfigError) as err:
        sequence_error_mask(prev, gen, token_mask, **kwargs)
    assert err.value.key == key
