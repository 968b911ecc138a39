"""The format constants: ``numerics.formats`` derives them from
``torch.finfo`` and the bit layouts (as torchao's ``mx_formats/constants.py`` does), and the
torch-free capability table states the same numbers."""

from __future__ import annotations

import torch

from nemo_fp8_plugin import capabilities
from nemo_fp8_plugin.numerics import formats, nvfp4, vllm_numerics
from nemo_fp8_plugin.rl import kv_scales


def test_table_maxima_equal_torch_and_the_bit_layouts():
    assert capabilities.FP8_MAX == {"e4m3": formats.E4M3_MAX, "e5m2": formats.E5M2_MAX}
    assert capabilities.FORMAT_MAX == {
        "e4m3": float(torch.finfo(torch.float8_e4m3fn).max),
        "e5m2": float(torch.finfo(torch.float8_e5m2).max),
        "e2m1": formats.E2M1_MAX,
        "e8m0": float(torch.finfo(torch.float8_e8m0fnu).max),
    }
    for kind, row in capabilities.CAPABILITIES.items():
        want = formats.E2M1_MAX if row.element_format == "e2m1" else formats.fp8_max("e4m3")
        assert row.element_max == want, kind


def test_fp8_maxima_are_the_largest_finite_codes():
    """Decoding every byte: the largest finite value of each FP8 dtype is the constant."""
    codes = torch.arange(256, dtype=torch.uint8)
    for dtype, top in (
        (torch.float8_e4m3fn, formats.E4M3_MAX),
        (torch.float8_e5m2, formats.E5M2_MAX),
    ):
        values = codes.view(dtype).float()
        assert values[torch.isfinite(values)].abs().max().item() == top
        assert formats.fp8_max(dtype) == top


def test_e2m1_max_is_the_largest_code():
    assert max(nvfp4.E2M1_VALUES) == formats.E2M1_MAX == 6.0
    assert nvfp4.E2M1_MAX is formats.E2M1_MAX


def test_e8m0_constants_from_the_bytes():
    scale = torch.tensor([0, 127, 0xFE, formats.E8M0_NAN], dtype=torch.uint8).view(
        torch.float8_e8m0fnu
    )
    got = scale.float().tolist()
    assert got[:3] == [formats.E8M0_MIN, 1.0, formats.E8M0_MAX]
    assert got[1] == 2.0 ** (127 - formats.E8M0_EXPONENT_BIAS)
    assert torch.isnan(scale.float()[3])


def test_users_of_the_e4m3_maximum_read_it():
    assert vllm_numerics.VLLM_FP8_MAX == kv_scales.FP8_E4M3_MAX == formats.E4M3_MAX == 448.0
