"""Properties of :mod:`nemo_fp8_plugin.numerics.vllm_numerics` (no vLLM needed here; the
bit-exactness against vLLM's own code is ``tests/hosts/vllm/test_generation_numerics.py``).

The point of the module is a real, small difference from the trainer's numerics: on random
BF16 activations vLLM's ``x / (amax / 448)`` and TE's ``x * (448 / amax)`` disagree on a few
E4M3 codes in ten thousand and on the last bit of many scales, never by more than one code
step or one scale ulp.
"""

from __future__ import annotations

import ast
import textwrap
import types

import pytest
import torch

from conftest import upstream_wheel
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import QTensor, fp8_gemm, quantize_blockwise
from nemo_fp8_plugin.numerics.vllm_numerics import (
    DEEPGEMM_AMAX_FLOOR,
    NUMERICS,
    VLLM_MIN_SCALE,
    quantize_activation,
    quantize_activation_vllm,
    requantize_ue8m0,
)

FLOOR = torch.tensor(VLLM_MIN_SCALE, dtype=torch.float32).item()
"""vLLM's scale floor 1/229376 as the fp32 its clamp applies."""


def _codes(q: QTensor) -> torch.Tensor:
    """E4M3 bytes as signed integers ordered like the values (sign-magnitude -> two's)."""
    b = q.data.view(torch.uint8).to(torch.int32)
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)


def _random_bf16(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).bfloat16()


def test_vllm_codes_differ_from_the_trainers_in_a_small_measured_fraction():
    x = _random_bf16(2048, 1024, seed=0)
    v = quantize_activation(x, "vllm")
    t = quantize_activation(x, "trainer")
    differ = _codes(v) != _codes(t)
    fraction = differ.float().mean().item()
    # Measured 3.2e-4 at this size and seed (NUMERICS.md: about 3e-4).
    assert 1e-5 < fraction < 1e-2, fraction
    # Never more than one code step apart: the same value rounded on either side of a tie.
    assert (_codes(v) - _codes(t)).abs().max().item() == 1
    scales_differ = (v.scale_inv != t.scale_inv).float().mean().item()
    assert 0.05 < scales_differ < 0.95, scales_differ
    # amax / 448 and 1 / (448 / amax) are both within an ulp of the exact quotient.
    torch.testing.assert_close(v.scale_inv, t.scale_inv, rtol=2.4e-7, atol=0)


def test_pow2_recipes_agree_with_the_trainer_on_ordinary_data():
    """Under ``vllm`` a power-of-2 recipe gets vLLM's UE8M0 scales (what the method makes
    vLLM's kernels compute): on data above vLLM's floor they are TE's power-of-2 scales."""
    x = _random_bf16(512, 1024, seed=1)
    v = quantize_activation(x, "vllm", pow2_scales=True)
    t = quantize_activation(x, "trainer", pow2_scales=True)
    assert torch.equal(v.scale_inv, t.scale_inv)
    assert torch.equal(v.data.view(torch.uint8), t.data.view(torch.uint8))
    # The DeepGEMM variant is UE8M0 whatever the recipe says.
    d = quantize_activation(x, "vllm_deepgemm_ue8m0")
    assert torch.equal(d.scale_inv, v.scale_inv)


def test_ue8m0_scales_are_powers_of_two_that_cover_the_amax():
    x = _random_bf16(256, 512, seed=2) * torch.logspace(-2, 3, 512).bfloat16()
    q = quantize_activation_vllm(x, ue8m0=True)
    s = q.scale_inv
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    amax = x.float().abs().reshape(256, 4, 128).amax(-1)
    assert bool((s * 448 >= amax).all())
    assert bool((s * 224 < amax).all())  # the smallest such power of two
    assert q.data.float().abs().max().item() <= 448


def test_zero_nan_and_inf_groups():
    x = torch.randn(4, 384).bfloat16()
    x[0, :128] = 0.0
    x[1, 130] = float("nan")
    x[2, 300] = float("inf")
    for ue8m0 in (False, True):
        q = quantize_activation_vllm(x, ue8m0=ue8m0)
        d, s = q.data.float(), q.scale_inv
        # vLLM's floor, after the UE8M0 rounding (up to 0.32): not a power of two.
        assert s[0, 0].item() == FLOOR
        assert bool((d[0, :128] == 0).all())
        assert torch.isnan(s[1, 1]) and bool(torch.isnan(d[1, 128:256]).all())
        assert torch.isinf(s[2, 2])
        assert torch.isnan(d[2, 300]) and bool((d[2, 256:300] == 0).all())
        # Other groups of the same rows are untouched by the bad ones.
        clean = quantize_activation_vllm(x[3:], ue8m0=ue8m0)
        assert torch.equal(q.data[3:].view(torch.uint8), clean.data.view(torch.uint8))
        assert torch.isfinite(s[1, 0]) and torch.isfinite(s[2, 1])


def test_ue8m0_rounding_is_torchs_log2():
    """vLLM's ``forward_native`` rounds with ``exp2(ceil(log2(s)))``: where ``s = amax / 448``
    sits a few ulps above a power of two, torch's fp32 ``log2`` can land on the integer, the
    scale stays below ``amax / 448`` and the group's maximum saturates to 448 (vLLM's CUDA
    kernel bumps the exponent bits instead and would pick the next power of two)."""
    amax = torch.nextafter(torch.tensor(448 * 2.0**-10), torch.tensor(1.0))
    assert (amax / 448).item() > 2.0**-10
    x = torch.zeros(1, 128)
    x[0, 0] = amax
    x[0, 1] = 448 * 2.0**-10
    q = quantize_activation_vllm(x, ue8m0=True)
    assert q.scale_inv.item() == 2.0**-10
    assert q.data[0, :2].float().tolist() == [448.0, 448.0]


def test_tiny_groups_meet_vllms_scale_floor():
    """A group with amax < 448 * floor = 1/512 keeps the floor scale: its codes shrink (TE's
    numerics would scale it up to the full range)."""
    x = torch.full((1, 128), 1e-4)
    v = quantize_activation(x, "vllm")
    t = quantize_activation(x, "trainer")
    assert v.scale_inv.item() == FLOOR
    assert v.data.float().max().item() < 448 / 4
    assert t.data.float().max().item() == 448


def test_partial_groups_and_ranks():
    x = _random_bf16(6, 300, seed=3)
    q = quantize_activation_vllm(x)
    assert q.data.shape == x.shape and q.scale_inv.shape == (6, 3)
    padded = quantize_activation_vllm(torch.nn.functional.pad(x, (0, 84)))
    assert torch.equal(q.data.view(torch.uint8), padded.data[:, :300].view(torch.uint8))
    assert torch.equal(q.scale_inv, padded.scale_inv)
    x3 = x.reshape(2, 3, 300)
    q3 = quantize_activation_vllm(x3)
    assert q3.scale_inv.shape == (2, 3, 3)
    assert torch.equal(q3.data.reshape(6, 300).view(torch.uint8), q.data.view(torch.uint8))
    q1 = quantize_activation_vllm(x[0])
    assert q1.scale_inv.shape == (3,) and torch.equal(q1.scale_inv, q.scale_inv[0])
    # trainer numerics keep the same shapes
    t3 = quantize_activation(x3, "trainer")
    assert t3.data.shape == x3.shape and t3.scale_inv.shape == (2, 3, 3)


def test_results_feed_the_emulated_gemm():
    x = _random_bf16(8, 256, seed=4)
    w = quantize_blockwise(_random_bf16(64, 256, seed=5) * 0.05, block=(128, 128))
    for name in NUMERICS:
        a = quantize_activation(x, name)
        out = fp8_gemm(a, w, out_dtype=torch.float32)
        ref = x.float() @ w.dequantize().t()
        torch.testing.assert_close(out, ref, rtol=0.1, atol=0.1)


def test_trainer_numerics_are_te_numerics():
    x = _random_bf16(16, 384, seed=6)
    for pow2 in (False, True):
        got = quantize_activation(x, "trainer", pow2_scales=pow2, eps=1e-3)
        want = quantize_blockwise(x, block=(1, 128), pow2_scales=pow2, eps=1e-3)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale_inv, want.scale_inv)


def test_requantized_weights_keep_power_of_two_values_exactly():
    """TE's power-of-2 block weights (fp8_subchannel) dequantize to the same values after
    DeepGEMM's requantization; fp32-scaled ones move by at most one code step's rounding."""
    gen = torch.Generator().manual_seed(7)
    w = (0.05 * torch.randn(384, 512, generator=gen)).bfloat16()
    pow2 = quantize_blockwise(w, block=(128, 128), pow2_scales=True)
    r = requantize_ue8m0(pow2)
    assert torch.equal(r.dequantize(), pow2.dequantize())
    assert torch.equal(torch.log2(r.scale_inv), torch.log2(r.scale_inv).round())
    fp32 = quantize_blockwise(w, block=(128, 128))
    r32 = requantize_ue8m0(fp32)
    assert torch.equal(torch.log2(r32.scale_inv), torch.log2(r32.scale_inv).round())
    assert not torch.equal(r32.dequantize(), fp32.dequantize())
    # Within half a code step of the new grid: 2^-4 relative for normal E4M3 codes, half
    # the subnormal step (2^-10 of the tile scale) below them.
    err = (r32.dequantize() - fp32.dequantize()).abs()
    tile_scale = QTensor(torch.ones_like(r32.data), r32.scale_inv, "e4m3", (128, 128))
    bound = torch.maximum(fp32.dequantize().abs() * 2**-4, tile_scale.dequantize() * 2**-10)
    assert bool((err <= bound).all())


def test_requantization_floor_and_stacks():
    w = torch.zeros(2, 256, 256)
    w[0] = torch.randn(256, 256) * 1e-7  # every tile below the 1e-4 amax floor
    w[1] = torch.randn(256, 256)
    q = quantize_blockwise(w, block=(128, 128))
    r = requantize_ue8m0(q)
    assert r.scale_inv.shape == (2, 2, 2)
    floor = 2.0 ** torch.ceil(torch.log2(torch.tensor(DEEPGEMM_AMAX_FLOOR / 448)))
    assert bool((r.scale_inv[0] == floor).all())
    per_matrix = requantize_ue8m0(QTensor(q.data[1], q.scale_inv[1], "e4m3", (128, 128)))
    assert torch.equal(r.data[1].view(torch.uint8), per_matrix.data.view(torch.uint8))
    assert torch.equal(r.scale_inv[1], per_matrix.scale_inv)
    mx = QTensor(q.data, torch.ones(2, 256, 8).to(torch.float8_e8m0fnu), "e4m3", (1, 32))
    assert requantize_ue8m0(mx) is mx  # MXFP8 is left as vLLM leaves it


# --------------------------------------------------------------------------- the floor, per release


def test_the_floor_goes_before_or_after_the_ue8m0_rounding():
    """vLLM 0.34 clamps the scale to its floor before rounding it to UE8M0, earlier releases
    after: only a group below the floor (amax < 1/512) sees it, and only with UE8M0 scales."""
    x = _random_bf16(4, 384, seed=8)
    x[0, :128] = 0.0
    x[1, 128:256] = 1e-5
    for ue8m0 in (False, True):
        after = quantize_activation_vllm(x, ue8m0=ue8m0, floor="after_rounding")
        before = quantize_activation_vllm(x, ue8m0=ue8m0, floor="before_rounding")
        same = torch.ones_like(after.scale_inv, dtype=torch.bool)
        same[0, 0] = same[1, 1] = not ue8m0
        assert torch.equal(after.scale_inv[same], before.scale_inv[same])
        if not ue8m0:
            assert torch.equal(after.data.view(torch.uint8), before.data.view(torch.uint8))
            continue
        assert after.scale_inv[0, 0].item() == after.scale_inv[1, 1].item() == FLOOR
        # 1/229376 rounded up to a power of two: 2^-17.
        assert before.scale_inv[0, 0].item() == before.scale_inv[1, 1].item() == 2.0**-17
    with pytest.raises(FP8ConfigError) as err:
        quantize_activation_vllm(x, floor="first")
    assert err.value.key == "floor"


def _release_group_quantizer(version: str):
    """vLLM ``version``'s own ``QuantFP8._quantize_group_native``, compiled from its wheel's
    ``input_quant_fp8.py`` (vLLM itself is not imported: its constants are E4M3's, as
    ``get_fp8_min_max()`` gives them on CUDA and CPU, and the module's own floor line)."""
    from vllm_source import WHEELS, SourceTree

    text = SourceTree.from_wheel(upstream_wheel(WHEELS[version])).read(
        "vllm/model_executor/layers/quantization/input_quant_fp8.py"
    )
    tree = ast.parse(text)
    namespace = {
        "torch": torch,
        "F": torch.nn.functional,
        "_FP8_DTYPE": torch.float8_e4m3fn,
        "_FP8_MIN": -448.0,
        "_FP8_MAX": 448.0,
    }
    floor_line = next(
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_FP8_MIN_SCALING_FACTOR"
    )
    exec(ast.unparse(floor_line), namespace)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QuantFP8")
    fn = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_quantize_group_native"
    )
    exec(textwrap.dedent(ast.get_source_segment(text, fn)), namespace)
    return namespace["_quantize_group_native"]


@pytest.mark.parametrize("version", ["0.17.1", "0.20.0", "0.25.1", "0.34.0"])
def test_each_release_quantizes_as_its_floor_order_says(version):
    """Each release's own ``forward_native`` group path against ``quantize_activation_vllm``
    with the floor order the stacks table gives that release: bit for bit, zero, tiny, NaN
    and infinite groups included (0.32.0 is compared with the installed vLLM in
    ``tests/hosts/vllm/test_generation_numerics.py``)."""
    from nemo_fp8_plugin import stacks

    native = _release_group_quantizer(version)
    first = stacks.lookup("vllm", "QuantFP8.forward_native:floor_before_ue8m0", version)
    floor = "before_rounding" if first.present else "after_rounding"
    assert first.tested and (floor == "before_rounding") is (version == "0.34.0")
    x = _random_bf16(6, 300, seed=9) * torch.logspace(-6, 2, 300).bfloat16()
    x[0, :128] = 0.0
    x[1, 128:256] = 3e-6
    x[2, 5] = float("nan")
    x[3, 200] = float("inf")
    for ue8m0 in (False, True):
        self = types.SimpleNamespace(group_size=128, use_ue8m0=ue8m0, column_major_scales=False)
        data, scale = native(self, x)
        ours = quantize_activation_vllm(x, ue8m0=ue8m0, floor=floor)
        torch.testing.assert_close(ours.scale_inv, scale, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8))
