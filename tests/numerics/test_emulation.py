"""FP8-emulated linear layer and the model converter (plain torch models).

The GEMM tests rebuild every operand of fprop, dgrad and wgrad from the independent numpy
reference quantizer (``test_numerics_reference``), with the tile, format and orientation
NUMERICS.md gives each role, and compare the layer's outputs and gradients with fp32 GEMMs
of those operands.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_numerics_reference import decode, ref_block_quantize, ref_mx_quantize, ref_tensor_quantize
from torch import nn

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import (
    BF16EmulatedLinear,
    FP8EmulatedLinear,
    convert_to_bf16_emulation,
    convert_to_fp8_emulation,
    emulated_modules,
    fp8_calibration,
    fp8_states,
    fused_mode,
    is_bf16_emulated,
    is_fp8_emulated,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_per_tensor,
    reset_fp8_states,
    revert_bf16_emulation,
    revert_fp8_emulation,
    set_amax_reduction_group,
    update_fp8_scales,
)
from presets import FP8_PRESETS

RECIPES = FP8_PRESETS


@pytest.fixture(autouse=True)
def seeded():
    """Every random tensor and layer initialisation of a test is reproducible."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def eager_numerics():
    # small tensors run eagerly anyway; this also keeps the tests free of compile time
    with fused_mode(False):
        yield


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - got).pow(2).mean()))


def ref_fake_quant(t: torch.Tensor, spec, role: str, scale=None) -> torch.Tensor:
    """Dequantized operand from the numpy reference, tiles along the last dim of ``t``."""
    fmt, block = spec.format_for(role), spec.block_for(role)
    x = t.detach().float().numpy()
    if spec.scaling == "mx":
        data, e = ref_mx_quantize(x, block, fmt)
        bm, bn = block
        s = np.exp2(e.astype(np.float64) - 127).astype(np.float32)
        s = np.repeat(np.repeat(s, bm, 0), bn, 1)[: x.shape[0], : x.shape[1]]
    elif spec.scaling == "block":
        vinf = float(torch.finfo(t.dtype).max)
        data, sinv = ref_block_quantize(x, block, fmt, spec.pow2_scales, 0.0, vinf)
        bm, bn = block
        s = np.repeat(np.repeat(sinv, bm, 0), bn, 1)[: x.shape[0], : x.shape[1]]
    else:
        data, s = ref_tensor_quantize(x, fmt, spec.pow2_scales, 0.0, scale=scale)
    deq = decode(data, fmt).astype(np.float32).reshape(x.shape) * s
    return torch.from_numpy(deq.astype(np.float32))


@pytest.mark.parametrize("recipe", RECIPES)
def test_three_gemms_follow_the_recipe(recipe):
    spec = get_recipe(recipe)
    gen = torch.Generator().manual_seed(0)
    m, k, n = 128, 256, 384
    x = (torch.randn(m, k, generator=gen) * 2).requires_grad_()
    layer = FP8EmulatedLinear(k, n, bias=True, recipe=spec)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    dy = torch.randn(m, n, generator=gen)
    y = layer(x)
    y.backward(dy)
    one = np.float32(1.0)  # delayed scaling: the first step casts with scale 1
    scale = one if spec.scaling == "delayed" else None
    xq = ref_fake_quant(x, spec, "input", scale)
    wq = ref_fake_quant(layer.weight, spec, "weight", scale)
    want_y = xq @ wq.t() + layer.bias.detach()
    dyq = ref_fake_quant(dy, spec, "grad_output", scale)
    if spec.block_for("weight") in (None, (128, 128), (32, 32)):
        w_col = wq.t()  # transposed data and scales
    else:
        w_col = ref_fake_quant(layer.weight.t(), spec, "weight", scale)
    want_dx = dyq @ w_col.t()
    grad_block = spec.block_for("grad_output")
    rowwise_grad = grad_block is not None and grad_block[0] == 1
    dy_col = ref_fake_quant(dy.t(), spec, "grad_output", scale) if rowwise_grad else dyq.t()
    rowwise_in = spec.block_for("input") is not None and spec.block_for("input")[0] == 1
    x_col = ref_fake_quant(x.t(), spec, "input", scale) if rowwise_in else xq.t()
    want_dw = dy_col @ x_col.t()
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.detach(), want_y, **tol)
    torch.testing.assert_close(x.grad, want_dx, **tol)
    torch.testing.assert_close(layer.weight.grad, want_dw, **tol)
    torch.testing.assert_close(layer.bias.grad, dy.sum(0), **tol)


def test_hybrid_gradients_are_e5m2():
    spec = get_recipe("fp8_subchannel")  # hybrid: E5M2 grad_output
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 128, generator=gen).requires_grad_()
    layer = FP8EmulatedLinear(128, 128, bias=False, recipe=spec)
    dy = torch.randn(128, 128, generator=gen) * 1e3
    layer(x).backward(dy)
    e5 = ref_fake_quant(dy, spec, "grad_output")
    w_col = ref_fake_quant(layer.weight.detach(), spec, "weight").t()
    torch.testing.assert_close(x.grad, e5 @ w_col.t(), rtol=1e-5, atol=1e-3)
    e4 = ref_fake_quant(dy, get_recipe("fp8_blockwise"), "grad_output")
    assert not torch.allclose(e4, e5)


def test_fp8_wgrad_false_keeps_wgrad_in_high_precision():
    spec = get_recipe("fp8_current").replace(fp8_wgrad=False)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=gen).requires_grad_()
    layer = FP8EmulatedLinear(128, 256, bias=False, recipe=spec)
    dy = torch.randn(64, 256, generator=gen)
    layer(x).backward(dy)
    torch.testing.assert_close(layer.weight.grad, dy.t() @ x.detach(), rtol=1e-6, atol=1e-5)


def plugin_cast(t, spec, role):
    fmt, block = spec.format_for(role), spec.block_for(role)
    if spec.scaling == "mx":
        return quantize_mxfp8(t, block, fmt).dequantize()
    if spec.scaling == "block":
        return quantize_blockwise(t, block, fmt, spec.pow2_scales).dequantize()
    return quantize_per_tensor(t, fmt, spec.pow2_scales).dequantize()  # delayed: a fresh scale


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sqnr_floors(recipe, dtype):
    """Cast >= 25 dB (E4M3) and linear output >= 18 dB vs fp32, every recipe."""
    spec = get_recipe(recipe)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 512, generator=gen)
    w = torch.randn(384, 512, generator=gen) / 512**0.5
    layer = FP8EmulatedLinear(512, 384, bias=False, recipe=spec, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    for role, t in (("input", x), ("weight", w)):
        assert sqnr(t, plugin_cast(t, spec, role)) >= 25.0
    layer(x.to(dtype))  # delayed scaling: the first step records the amaxes
    y = layer(x.to(dtype))
    assert y.dtype == dtype
    ref = x.to(dtype).float() @ layer.weight.float().t()
    assert sqnr(ref, y.float()) >= 18.0, recipe


def test_autocast_uses_the_autocast_dtype():
    layer = FP8EmulatedLinear(128, 128, recipe=get_recipe("fp8_blockwise"))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(5), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


def test_leading_dims_and_empty_batch():
    layer = FP8EmulatedLinear(64, 32, recipe=get_recipe("fp8_current"))
    assert layer(torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6))).shape == (
        2,
        3,
        32,
    )
    assert layer(torch.randn(0, 64)).shape == (0, 32)


# --------------------------------------------------------------------------- converter


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 128)
        self.block = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
        self.norm = nn.LayerNorm(128)
        self.lm_head = nn.Linear(128, 50, bias=False)

    def forward(self, tokens):
        return self.lm_head(self.norm(self.block(self.embed(tokens))))


def test_convert_and_revert_keep_parameters_and_state_dict():
    torch.manual_seed(0)
    model = TinyLM()
    plain = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_fp8_emulation(model, get_recipe("fp8_blockwise"))
    assert isinstance(model.block[0], FP8EmulatedLinear)
    assert isinstance(model.block[2], FP8EmulatedLinear)
    assert type(model.lm_head) is nn.Linear  # vocabulary projection stays high precision
    assert [n for n, _ in emulated_modules(model)] == ["block.0", "block.2"]
    assert {n: p for n, p in model.named_parameters()} == params
    assert list(model.state_dict()) == keys
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(7))
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    opt.step()  # the optimizer built before conversion
    assert not torch.equal(model.block[0].weight, plain.block[0].weight)
    out_fp8 = model(tokens)
    revert_fp8_emulation(model)
    assert type(model.block[0]) is nn.Linear and not is_fp8_emulated(model.block[0])
    assert {n: p for n, p in model.named_parameters()} == params
    assert not torch.equal(model(tokens), out_fp8)  # plain GEMMs again


def test_module_filter_and_idempotence():
    model = TinyLM()
    convert_to_fp8_emulation(
        model, get_recipe("fp8_current"), module_filter=lambda name, m: name != "block.2"
    )
    assert isinstance(model.block[0], FP8EmulatedLinear) and type(model.block[2]) is nn.Linear
    first = model.block[0]
    convert_to_fp8_emulation(model, get_recipe("fp8_current"))  # block.2; block.0 stays as is
    assert model.block[0] is first and isinstance(model.block[2], FP8EmulatedLinear)


def test_bare_linear_and_bad_recipe():
    lin = nn.Linear(32, 32)
    new = convert_to_fp8_emulation(lin, get_recipe("mxfp8"))
    assert isinstance(new, FP8EmulatedLinear) and new.weight is lin.weight
    assert type(revert_fp8_emulation(new)) is nn.Linear


NOT_A_SPEC = [
    ("fp8_blockwise", "str"),
    ('{"recipe": "mxfp8"}', "str"),
    ({"recipe": "fp8_current"}, "dict"),
    (3, "int"),
    (None, "NoneType"),
]


@pytest.mark.parametrize("bad,kind", NOT_A_SPEC, ids=[k for _, k in NOT_A_SPEC])
@pytest.mark.parametrize("entry", ["convert", "layer", "emulator", "role"])
def test_numerics_take_a_spec_not_a_name(entry, bad, kind):
    """The numerics do not resolve recipe names (that is nemo_fp8_plugin.get_recipe's job):
    a name, a mapping or another object is refused before anything is touched, naming the
    argument, as an FP8ConfigError that is also a TypeError."""
    from nemo_fp8_plugin.numerics import LayerEmulator, RecipeTypeError, RoleQuantizer

    model = nn.Sequential(nn.Linear(4, 4))
    build = {
        "convert": lambda: convert_to_fp8_emulation(model, bad),
        "layer": lambda: FP8EmulatedLinear(4, 4, recipe=bad),
        "emulator": lambda: LayerEmulator(bad),
        "role": lambda: RoleQuantizer(bad, "input"),
    }[entry]
    with pytest.raises(RecipeTypeError) as err:
        build()
    assert isinstance(err.value, FP8ConfigError) and isinstance(err.value, TypeError)
    assert err.value.key == ("recipe" if entry in ("convert", "layer") else "spec")
    assert kind in str(err.value)
    if isinstance(bad, (str, dict)):
        assert "nemo_fp8_plugin.get_recipe(name)" in str(err.value)
    assert type(model[0]) is nn.Linear  # nothing was converted


def test_unknown_scaling_kind_is_refused():
    odd = get_recipe("fp8_current").replace(name="odd")
    object.__setattr__(odd, "scaling", "rowwise")  # a spec the registry would never build
    with pytest.raises(FP8ConfigError) as err:
        convert_to_fp8_emulation(nn.Sequential(nn.Linear(4, 4)), odd)
    assert err.value.key == "recipe.scaling" and err.value.value == "rowwise"


class DuckRecipe:
    """Not a RecipeSpec: only the fields the numerics read (numerics.RecipeLike)."""

    def __init__(self, spec):
        for f in (
            "name",
            "scaling",
            "pow2_scales",
            "amax_epsilon",
            "amax_history_len",
            "amax_compute_algo",
            "margin",
            "reduce_amax",
            "fp8_wgrad",
        ):
            setattr(self, f, getattr(spec, f))
        self._spec = spec

    def format_for(self, role):
        return self._spec.format_for(role)

    def block_for(self, role):
        return self._spec.block_for(role)


@pytest.mark.parametrize("recipe", RECIPES)
def test_any_object_with_the_recipe_fields_is_a_recipe(recipe):
    """Duck typing: an object with RecipeLike's fields runs exactly as the RecipeSpec does."""
    from nemo_fp8_plugin.numerics import RecipeLike

    spec = get_recipe(recipe)
    duck = DuckRecipe(spec)
    assert isinstance(spec, RecipeLike) and isinstance(duck, RecipeLike)
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(64, 128, generator=gen)
    x = torch.randn(128, 128, generator=gen)
    dy = torch.randn(128, 64, generator=gen)
    results = []
    for r in (spec, duck):
        layer = FP8EmulatedLinear(128, 64, bias=False, recipe=r)
        with torch.no_grad():
            layer.weight.copy_(w)
        xx = x.clone().requires_grad_()
        for _ in range(2):  # delayed scaling: the second step uses the recorded amaxes
            xx.grad = None
            y = layer(xx)
            y.backward(dy)
        results.append((y.detach(), xx.grad, layer.weight.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_delayed_states_calibration_and_refresh():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    convert_to_fp8_emulation(model, get_recipe("fp8_delayed"))
    states = fp8_states(model)
    assert set(states) == {"0", "2"} and set(states["0"]) == {"input", "weight", "grad_output"}
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(8)) * 3
    with fp8_calibration(model):
        y_cal = model(x)
    # calibration ran in high precision: outputs equal the plain model's
    plain = copy.deepcopy(model)
    revert_fp8_emulation(plain)
    assert torch.equal(y_cal, plain(x))
    assert update_fp8_scales(model) == 6
    w_state = model[0].fp8_states["weight"]
    w_amax = model[0].weight.abs().max().item()
    assert float(w_state.scale) == pytest.approx(448.0 / w_amax, rel=1e-6)
    assert float(model[0].fp8_states["grad_output"].scale) == 1.0  # no backward ran
    assert reset_fp8_states(model) == 6 and float(w_state.scale) == 1.0
    assert set_amax_reduction_group(model, None) == 6  # amaxes stay local (the default)


def test_delayed_scale_lags_one_step():
    layer = FP8EmulatedLinear(128, 128, bias=False, recipe=get_recipe("fp8_delayed"))
    x1 = torch.full((4, 128), 2.0)
    layer(x1)
    st = layer.fp8_states["input"]
    assert float(st.scale) == 1.0 and float(st.amax_history[0]) == 2.0
    layer(torch.full((4, 128), 8.0))  # uses 448 / 2, records 8
    assert float(st.scale) == 224.0 and float(st.amax_history[0]) == 8.0


# --------------------------------------------------------------------------- BF16 arm


def test_bf16_emulation_matches_a_real_bf16_gemm():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=gen, requires_grad=True)
    layer = BF16EmulatedLinear.from_linear(nn.Linear(64, 48))
    y = layer(x)
    real = F.linear(
        x.detach().bfloat16(), layer.weight.detach().bfloat16(), layer.bias.detach().bfloat16()
    )
    assert y.dtype == torch.float32
    assert torch.equal(y.detach(), y.detach().bfloat16().float())  # BF16 values
    torch.testing.assert_close(y.detach().bfloat16(), real, rtol=2**-7, atol=1e-6)
    dy = torch.randn(32, 48, generator=gen)
    y.backward(dy)
    want_dx = (dy.bfloat16().float() @ layer.weight.detach().bfloat16().float()).bfloat16().float()
    want_dw = dy.bfloat16().float().t() @ x.detach().bfloat16().float()
    assert torch.equal(x.grad, want_dx)
    torch.testing.assert_close(layer.weight.grad, want_dw, rtol=1e-6, atol=1e-6)


def test_bf16_converter_covers_what_fp8_leaves():
    model = TinyLM()
    params = {n: p for n, p in model.named_parameters()}
    convert_to_fp8_emulation(model, get_recipe("fp8_blockwise"))  # block.0, block.2
    convert_to_bf16_emulation(model)  # the rest: lm_head
    assert isinstance(model.block[0], FP8EmulatedLinear) and is_bf16_emulated(model.lm_head)
    assert not is_fp8_emulated(model.lm_head)
    assert [n for n, _ in emulated_modules(model)] == ["block.0", "block.2"]
    assert {n: p for n, p in model.named_parameters()} == params
    model(torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(9))).sum().backward()
    revert_bf16_emulation(model)
    assert type(model.lm_head) is nn.Linear and isinstance(model.block[0], FP8EmulatedLinear)


# --------------------------------------------------------------------------- NVFP4


def test_nvfp4_roles_follow_tes_layout():
    """NVFP4 emulation (TE NVFP4BlockScaling): 16x16 weights, 1x16 inputs and gradients,
    the wgrad operands (column-wise copies) re-quantized from t.T with the random Hadamard
    transform, stochastic rounding on gradients only; each equal to quantize_nvfp4's own
    round trip bit for bit (the quantizer is checked against TE's reference elsewhere)."""
    from nemo_fp8_plugin.numerics import dequantize_nvfp4, quantize_nvfp4
    from nemo_fp8_plugin.numerics.linear import RoleQuantizer

    spec = get_recipe("nvfp4")
    g = torch.Generator().manual_seed(3)
    t = torch.randn(48, 64, generator=g)
    weight = RoleQuantizer(spec, "weight")
    assert torch.equal(weight.rowwise(t), dequantize_nvfp4(quantize_nvfp4(t, (16, 16))))
    assert weight.columnwise_reuses_rowwise
    inp = RoleQuantizer(spec, "input")
    assert torch.equal(inp.rowwise(t), dequantize_nvfp4(quantize_nvfp4(t, (1, 16))))
    col = inp.columnwise(t, None)
    want = dequantize_nvfp4(quantize_nvfp4(t.t().contiguous(), (1, 16), rht=True), undo_rht=True)
    assert col.shape == (64, 48) and torch.equal(col, want)
    grad = RoleQuantizer(spec, "grad_output")
    draws = torch.stack([grad.rowwise(t) for _ in range(64)])
    assert not torch.equal(draws[0], draws[1])  # stochastic: two draws differ
    nearest = dequantize_nvfp4(quantize_nvfp4(t, (1, 16)))
    # unbiased: the mean of the draws is closer to t than round-to-nearest is
    assert (draws.mean(0) - t).norm() < (nearest - t).norm()


def test_nvfp4_emulated_linear_trains_with_an_sqnr_floor():
    spec = get_recipe("nvfp4")
    torch.manual_seed(0)
    lin = FP8EmulatedLinear(64, 32, recipe=spec)
    x = torch.randn(48, 64, requires_grad=True)
    y = lin(x)
    ref = torch.nn.functional.linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (y.detach() - ref).pow(2).sum())
    assert sqnr > 15.0  # two E2M1 operands: ~17 dB measured
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(lin.weight.grad).all()
