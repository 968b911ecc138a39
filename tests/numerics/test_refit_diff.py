"""The refit comparison's verdicts: bit-equal, within the scale difference of two faithful
quantizers (NeMo RL's own ``cast_tensor_to_fp8_blockwise`` against Transformer Engine's),
different (with the worst tile), on seeded defects of one tile."""

from __future__ import annotations

import pytest
import torch
from test_nemo_rl_numerics import nemo_rl_cast

from nemo_fp8_plugin.numerics import quantize_blockwise, quantize_mxfp8
from nemo_fp8_plugin.numerics.refit_diff import (
    SCALE_ULPS,
    compare_high_precision,
    compare_quantized,
)

BLOCK = (128, 128)


def weight(seed: int = 0, shape=(512, 384)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)


def te(w):
    q = quantize_blockwise(w, BLOCK, "e4m3")
    return q.data, q.scale_inv


def test_identical_weights_are_bit_equal():
    data, scale = te(weight())
    check = compare_quantized("w", data, scale, data.clone(), scale.clone(), BLOCK)
    assert check.status == "bit_equal" and check.ok and check.worst is None
    assert check.tiles == 12


@pytest.mark.host
def test_nemo_rls_worker_quantizer_is_within_ulp_of_te_never_bit_equal_nor_different():
    # NeMo RL's own function from the shared source: reciprocal(amax) * 448 against TE's
    # division; over these weights some tiles differ, every one of them within the bound.
    cast = nemo_rl_cast()
    near = 0
    for seed in range(6):
        w = weight(seed)
        check = compare_quantized("w", *cast(w), *te(w), BLOCK)
        assert check.status in ("bit_equal", "within_ulp"), check.detail
        assert check.tiles_different == 0
        near += check.tiles_within_ulp
        if check.worst is not None:
            assert check.worst.scale_ulps is not None and check.worst.scale_ulps <= SCALE_ULPS
    assert near > 0  # the two quantizers really differ on these weights


def test_a_seeded_one_tile_code_defect_is_different_and_named():
    data, scale = te(weight())
    bad = data.clone()
    bad[200:210, 300:305] = torch.zeros(10, 5).to(torch.float8_e4m3fn)  # tile (1, 2)
    check = compare_quantized("w", bad, scale, data, scale, BLOCK)
    assert check.status == "different" and not check.ok
    assert check.tiles_different == 1 and check.worst.tile == (1, 2)
    assert check.worst.rows == (128, 256) and check.worst.cols == (256, 384)
    assert check.worst.codes_differing == int((data[200:210, 300:305] != 0).sum())
    assert check.worst.max_abs_diff > 0 and "tile (1, 2)" in check.detail


def test_one_code_step_with_equal_scales_is_within_ulp_two_steps_are_not():
    data, scale = te(weight())
    for steps, status in ((1, "within_ulp"), (2, "different")):
        bits = data.view(torch.uint8).clone()
        assert 0 < bits[5, 7] & 0x7F < 0x7E - steps
        bits[5, 7] += steps
        check = compare_quantized("w", bits.view(torch.float8_e4m3fn), scale, data, scale, BLOCK)
        assert check.status == status, steps
        assert check.worst.tile == (0, 0)


def _stepped(data, *moves):
    bits = data.view(torch.uint8).clone()
    for (r, c), step in moves:
        assert 0 < bits[r, c] & 0x7F < 0x7E
        bits[r, c] += step
    return bits.view(torch.float8_e4m3fn)


def test_codes_of_one_tile_moving_both_ways_are_different():
    """One scale per tile moves every magnitude one way; up here and down there is a fault."""
    data, scale = te(weight())
    check = compare_quantized(
        "w", _stepped(data, ((5, 7), 1), ((9, 3), -1)), scale, data, scale, BLOCK
    )
    assert check.status == "different" and check.worst.tile == (0, 0)
    same_way = _stepped(data, ((5, 7), 1), ((9, 3), 1))
    assert compare_quantized("w", same_way, scale, data, scale, BLOCK).status == "within_ulp"


def test_codes_must_move_the_way_the_scale_moved():
    """A smaller stored ``scale_inv`` is a larger multiplying scale: magnitudes go up only."""
    data, scale = te(weight())
    smaller = scale.clone()
    smaller.view(torch.int32)[0, 0] -= 1
    for step, status in ((1, "within_ulp"), (-1, "different")):
        moved = _stepped(data, ((5, 7), step))
        check = compare_quantized("w", moved, smaller, data, scale, BLOCK)
        assert check.status == status, step


@pytest.mark.parametrize("ulps, status", [(1, "within_ulp"), (2, "within_ulp"), (3, "different")])
def test_scale_ulps(ulps, status):
    data, scale = te(weight())
    moved = scale.clone()
    moved.view(torch.int32)[3, 2] += ulps
    check = compare_quantized("w", data, moved, data, scale, BLOCK)
    assert check.status == status
    assert check.worst.tile == (3, 2) and check.worst.scale_ulps == ulps


def test_the_worst_tile_is_a_different_one_before_a_near_one():
    data, scale = te(weight())
    moved = scale.clone()
    moved.view(torch.int32)[0, 0] += 1  # near
    moved[2, 1] *= 1.5  # different
    check = compare_quantized("w", data, moved, data, scale, BLOCK)
    assert check.status == "different" and check.worst.tile == (2, 1)
    assert check.tiles_within_ulp == 1 and check.tiles_different == 1


def test_mx_scales_one_step_apart_are_different():
    w = weight()
    q = quantize_mxfp8(w, (1, 32), "e4m3")
    bits = q.scale_inv.view(torch.uint8).clone()
    bits[9, 4] += 1
    check = compare_quantized(
        "w", q.data, bits.view(torch.float8_e8m0fnu), q.data, q.scale_inv, (1, 32)
    )
    assert check.status == "different" and check.worst.tile == (9, 4)
    assert check.worst.scale_ulps is None


def test_nan_on_one_side_is_different_with_an_infinite_gap():
    data, scale = te(weight())
    bits = data.view(torch.uint8).clone()
    bits[0, 0] = 0x7F  # NaN
    check = compare_quantized("w", bits.view(torch.float8_e4m3fn), scale, data, scale, BLOCK)
    assert check.status == "different" and check.worst.max_abs_diff == float("inf")


def test_shape_dtype_and_scale_layout_mismatches_are_different():
    data, scale = te(weight())
    assert compare_quantized("w", data[:256], scale[:2], data, scale, BLOCK).status == "different"
    assert compare_quantized("w", data, scale[:, :2], data, scale, BLOCK).status == "different"
    hp = weight().float()
    assert compare_quantized("w", hp, scale, data, scale, BLOCK).status == "different"
    assert compare_high_precision("w", data, weight()).status == "different"


def test_large_weights_are_compared_band_by_band(monkeypatch):
    import nemo_fp8_plugin.numerics.refit_diff as rd

    monkeypatch.setattr(rd, "_BAND_ELEMENTS", 128 * 384)  # one tile row per band
    data, scale = te(weight())
    bad = scale.clone()
    bad[3, 0] *= 2
    check = compare_quantized("w", data, bad, data, scale, BLOCK)
    assert check.status == "different" and check.worst.tile == (3, 0)


def test_high_precision_weights_bit_for_bit_after_the_engines_cast():
    w = weight()
    assert compare_high_precision("w", w.float(), w).status == "bit_equal"
    moved = w.float().clone()
    moved[7, 9] += 0.5
    check = compare_high_precision("w", moved, w)
    assert check.status == "different" and check.tiles_different == 1
    assert check.max_abs_diff == 0.5 and "[7, 9]" in check.detail


def test_the_byte_comparison_sees_a_difference_in_any_chunk(monkeypatch):
    import nemo_fp8_plugin.numerics.refit_diff as rd

    monkeypatch.setattr(rd, "_COMPARE_CHUNK", 1000)  # 196608 bytes: 197 chunks
    data, scale = te(weight())
    for row, col in ((0, 0), (255, 100), (511, 383)):
        bits = data.view(torch.uint8).clone()
        bits[row, col] ^= 0x01
        assert not rd._same(bits.view(torch.float8_e4m3fn), data)
    assert rd._same(data.clone(), data)
    assert not rd._same(data[:256], data)  # sizes differ
