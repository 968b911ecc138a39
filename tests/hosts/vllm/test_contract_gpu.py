"""Contract tests, GPU branches on CPU, one kernel variable at a time.

vLLM's real kernel selection (``init_fp8_linear_kernel``, ``init_mxfp8_linear_kernel``, the
fused-MoE oracle and quant config), reached through real vLLM layers
(``MergedColumnParallelLinear``, Mixtral's ``MixtralMoE``) built with the ``nemo_fp8``
config, on a GPU of capability SM90 / SM100 / SM120 (``fake_gpu.py``: a stock install
unless a test states otherwise) with the kernel variables stated. Each test asserts which
kernel vLLM picks for each recipe, that the plugin refuses (one line naming the key and the
vLLM version) or sets what would otherwise change the numerics, and, where the chosen
kernel's weight processing is plain torch, that the loadable parameters and the plugin's
scales survive it. The stock install per GPU, with and without ``engine_env``, is
``test_contract_stock.py``. No GPU kernel runs.
"""

from __future__ import annotations

import pytest
import torch
import vllm.utils.deep_gemm as deep_gemm
from fake_gpu import GPU_PARAMS, assert_refusal, building, linear, moe, qcfg

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import engine_env
from nemo_fp8_plugin.registry import get_recipe
from presets import BLOCK_PRESETS

pytestmark = pytest.mark.vllm


def kernel_env(*, e8m0: bool = True, flashinfer_block: bool = False) -> dict[str, str]:
    """The kernel variables a test is about (DeepGEMM stays on, vLLM's default)."""
    return {
        "VLLM_USE_DEEP_GEMM_E8M0": "1" if e8m0 else "0",
        "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "1" if flashinfer_block else "0",
    }


# --------------------------------------------------------------------------- block linear


@pytest.mark.parametrize("sm", GPU_PARAMS)
@pytest.mark.parametrize(
    "deep_gemm_installed,e8m0",
    [(True, True), (True, False), (False, True)],
    ids=["deepgemm-e8m0", "deepgemm-fp32", "no-deepgemm"],
)
@pytest.mark.parametrize("recipe", BLOCK_PRESETS)
def test_block_kernel_selection(vllm_env, fake_gpu, sm, deep_gemm_installed, e8m0, recipe):
    """vLLM's choice for each recipe, and what the method does with it."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed, env=kernel_env(e8m0=e8m0))
    expected = (
        "DeepGemmFp8BlockScaledMMKernel" if deep_gemm_installed else "CutlassFp8BlockScaledMMKernel"
    )
    pow2 = get_recipe(recipe).pow2_scales
    refusal = None
    if deep_gemm_installed and sm >= 100 and not pow2:
        # DeepGEMM's Blackwell kernels take UE8M0 scale factors only (fp32 ones are cast).
        refusal = ("VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM=0")
    elif deep_gemm_installed and sm >= 100 and not e8m0:
        refusal = ("VLLM_USE_DEEP_GEMM_E8M0", "VLLM_USE_DEEP_GEMM_E8M0=1")
    elif deep_gemm_installed and e8m0 and not pow2:
        # DeepGEMM E8M0 would requantize the fp32 block scales to powers of two.
        refusal = ("VLLM_USE_DEEP_GEMM_E8M0", "VLLM_USE_DEEP_GEMM_E8M0=0")
        assert engine_env(recipe) == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}  # what avoids it
    if refusal:
        with pytest.raises(FP8ConfigError) as err:
            linear(vllm_env, recipe)
        assert_refusal(err, refusal[0], expected, f"SM{sm}", refusal[1])
        return
    layer = linear(vllm_env, recipe)
    kernel = layer.quant_method._kernel
    assert layer.quant_method.use_vllm and type(kernel).__name__ == expected
    quant = kernel.quant_fp8
    # The activation scales the kernel will compute are the recipe's: pow2 or fp32.
    assert quant.use_ue8m0 is bool(pow2)
    ue8m0 = bool(pow2 and deep_gemm_installed and e8m0)
    assert getattr(kernel, "use_deep_gemm_e8m0", False) is ue8m0


def test_pow2_activation_scales_are_those_of_the_recipe(vllm_env, fake_gpu):
    """vLLM's own activation quantizer (``QuantFP8``, its torch path) in
    the kernel vLLM picked for ``fp8_subchannel`` produces the trainer's power-of-2 1x128
    scales and codes, bit for bit (vLLM builds it with ``use_ue8m0=False``: fp32 scales)."""
    from nemo_fp8_plugin.numerics import quantize_blockwise

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(33, 256, generator=gen) * torch.logspace(-3, 2, 256)).bfloat16()
    want = quantize_blockwise(x, block=(1, 128), pow2_scales=True)
    for deep_gemm_installed, e8m0 in ((False, True), (True, False)):  # CUTLASS; DeepGEMM fp32 mode
        fake_gpu(90, deep_gemm_installed=deep_gemm_installed, env=kernel_env(e8m0=e8m0))
        kernel = linear(vllm_env, "fp8_subchannel").quant_method._kernel
        data, scale = kernel.quant_fp8.forward_native(x)
        assert torch.equal(scale.float(), want.scale_inv), type(kernel).__name__
        assert torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
    # fp8_blockwise keeps vLLM's fp32 scales (amax / 448: the last bit may differ from TE's
    # 1 / (448 / amax), see ../shared/NUMERICS.md), never powers of two.
    fake_gpu(90, deep_gemm_installed=False, env=kernel_env())
    kernel = linear(vllm_env, "fp8_blockwise").quant_method._kernel
    _, scale = kernel.quant_fp8.forward_native(x)
    ref = quantize_blockwise(x, block=(1, 128)).scale_inv
    torch.testing.assert_close(scale.float(), ref, rtol=2e-7, atol=0)
    assert not torch.equal(torch.log2(scale), torch.log2(scale).round())


def test_flashinfer_block_kernel(vllm_env, fake_gpu):
    """FlashInfer's block kernel quantizes activations itself (fp32 scales; its DeepGEMM
    branch follows VLLM_USE_DEEP_GEMM_E8M0): pow2 activation scales are refused there."""
    name = "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
    fake_gpu(90, env=kernel_env(e8m0=False, flashinfer_block=True))
    layer = linear(vllm_env, "fp8_blockwise")
    assert type(layer.quant_method._kernel).__name__ == name
    with pytest.raises(FP8ConfigError) as err:
        linear(vllm_env, "fp8_subchannel")
    assert_refusal(err, "pow2_scales", name, "SM90", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER")
    fake_gpu(90, env=kernel_env(e8m0=True, flashinfer_block=True))
    with pytest.raises(FP8ConfigError) as err:
        linear(vllm_env, "fp8_blockwise")
    assert_refusal(err, "VLLM_USE_DEEP_GEMM_E8M0", name)
    # vLLM's probe (has_flashinfer_fp8_blockscale_gemm) offers the kernel on SM90 only: on
    # Blackwell the variable changes nothing and DeepGEMM (UE8M0 scales only) is picked.
    for sm in (100, 120):
        fake_gpu(sm, env=kernel_env(e8m0=False, flashinfer_block=True))
        with pytest.raises(FP8ConfigError) as err:
            linear(vllm_env, "fp8_blockwise")
        assert_refusal(err, "VLLM_USE_DEEP_GEMM", "DeepGemmFp8BlockScaledMMKernel", f"SM{sm}")


def test_amax_epsilon_is_refused_on_vllm_kernels(vllm_env, fake_gpu):
    """vLLM's activation quantizers have a fixed amax floor."""
    fake_gpu(90, deep_gemm_installed=False, env=kernel_env())
    with pytest.raises(FP8ConfigError) as err:
        linear(vllm_env, "fp8_blockwise", amax_epsilon=1e-4)
    assert_refusal(err, "amax_epsilon", "CutlassFp8BlockScaledMMKernel", "emulate")
    with pytest.raises(FP8ConfigError) as err:
        moe(vllm_env, "fp8_blockwise", amax_epsilon=1e-4)
    assert_refusal(err, "amax_epsilon", "emulate")


@pytest.mark.parametrize("recipe", BLOCK_PRESETS)
@pytest.mark.parametrize(
    "sm,deep_gemm_installed,e8m0",
    [(90, False, True), (90, True, False), (90, True, True), (100, True, True)],
    ids=["sm90-cutlass", "sm90-deepgemm-fp32", "sm90-deepgemm-e8m0", "sm100-deepgemm-e8m0"],
)
def test_generation_numerics_on_vllm_kernels(
    vllm_env, fake_gpu, recipe, sm, deep_gemm_installed, e8m0
):
    """On vLLM's kernels the method checks that the kernel vLLM picked computes
    the ``generation_numerics`` asked for. ``trainer`` (TE's numerics) is computed by none of
    them: refused. ``vllm_deepgemm_ue8m0`` needs DeepGEMM in E8M0 mode, and with it is
    accepted whatever the recipe's scales (the fp32 recipe's refusal under ``vllm`` is what
    the user has now asked for); elsewhere refused. The same for the fused-MoE kernel, whose
    activation quantizer follows DeepGEMM's E8M0 mode."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed, env=kernel_env(e8m0=e8m0))
    kernel = (
        "DeepGemmFp8BlockScaledMMKernel" if deep_gemm_installed else "CutlassFp8BlockScaledMMKernel"
    )
    with pytest.raises(FP8ConfigError) as err:
        linear(vllm_env, recipe, generation_numerics="trainer")
    assert_refusal(err, "generation_numerics", kernel, "emulate", "generation_numerics: vllm")
    with pytest.raises(FP8ConfigError) as err:
        moe(vllm_env, recipe, generation_numerics="trainer")
    assert_refusal(err, "generation_numerics", "fused-MoE", "emulate")
    ue8m0_mode = deep_gemm_installed and e8m0
    if ue8m0_mode:
        layer = linear(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")
        assert layer.quant_method.use_vllm
        kern = layer.quant_method._kernel
        assert type(kern).__name__ == kernel and kern.use_deep_gemm_e8m0
        assert kern.quant_fp8.use_ue8m0
        moe(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")  # accepted
    else:
        with pytest.raises(FP8ConfigError) as err:
            linear(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")
        assert_refusal(err, "generation_numerics", kernel, "VLLM_USE_DEEP_GEMM_E8M0=1")
        with pytest.raises(FP8ConfigError) as err:
            moe(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")
        assert_refusal(err, "generation_numerics", "fused-MoE", "VLLM_USE_DEEP_GEMM_E8M0=1")


@pytest.mark.parametrize("recipe", BLOCK_PRESETS)
def test_cutlass_weight_processing_keeps_parameters_and_scales(vllm_env, fake_gpu, recipe):
    """The CUTLASS block kernel's weight processing is plain torch: run it (vLLM's own
    ``process_weights_after_loading``) and check that the loadable parameters keep their
    identity and storage, that the plugin's quantization survives bit for bit, that the
    kernel's view aliases them, and that a refit lands where the kernel reads."""
    from nemo_fp8_plugin.numerics import quantize_blockwise

    fake_gpu(90, deep_gemm_installed=False, env=kernel_env())
    spec = get_recipe(recipe)
    layer = linear(vllm_env, recipe)
    gen = torch.Generator().manual_seed(5)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    layer.weight.weight_loader(layer.weight, gate, 0)  # BF16: quantized on arrival
    layer.weight.weight_loader(layer.weight, up, 1)
    ids = {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()}
    ref = quantize_blockwise(torch.cat([gate, up]), block=(128, 128), pow2_scales=spec.pow2_scales)

    method = layer.quant_method
    method.process_weights_after_loading(layer)
    assert {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()} == ids
    assert torch.equal(layer.weight.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.data, ref.scale_inv)
    view = method._view
    assert view.weight.data_ptr() == layer.weight.data_ptr()
    assert view.weight_scale_inv.data_ptr() == layer.weight_scale_inv.data_ptr()

    new = (0.08 * torch.randn(256, 256, generator=gen)).bfloat16()
    layer.weight.weight_loader(layer.weight, new, 1)  # a refit of the `up` shard
    method.after_refit(layer)
    ref2 = quantize_blockwise(
        torch.cat([gate, new]), block=(128, 128), pow2_scales=spec.pow2_scales
    )
    assert {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()} == ids
    assert method._view is view and torch.equal(view.weight_scale_inv.data, ref2.scale_inv)
    assert torch.equal(view.weight.data.view(torch.uint8), ref2.data.view(torch.uint8))


def test_deep_gemm_e8m0_requantization_is_why_fp32_recipes_are_refused(monkeypatch):
    """With vLLM's own code: the in-place requantization DeepGEMM's weight processing
    runs with E8M0 on (``requant_weight_ue8m0_inplace``, plain torch) changes fp8_blockwise's
    fp32 block scales and dequantized weights, but leaves fp8_subchannel's power-of-2 weights
    dequantizing to the same values."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace

    from nemo_fp8_plugin.numerics import quantize_blockwise
    from nemo_fp8_plugin.numerics.quantize import dequantize_fp32

    # vLLM compiles this helper for the GPU; its Python body is the same code.
    monkeypatch.setattr(
        deep_gemm,
        "per_block_cast_to_fp8",
        deep_gemm.per_block_cast_to_fp8._torchdynamo_orig_callable,
    )
    gen = torch.Generator().manual_seed(9)
    w = (0.05 * torch.randn(256, 384, generator=gen)).bfloat16()
    for pow2 in (False, True):
        q = quantize_blockwise(w, block=(128, 128), pow2_scales=pow2)
        data, scale = q.data.clone(), q.scale_inv.clone()
        requant_weight_ue8m0_inplace(data, scale, (128, 128))
        before = dequantize_fp32(q.data, q.scale_inv, (128, 128))
        after = dequantize_fp32(data, scale, (128, 128))
        if pow2:
            assert torch.equal(after, before)
        else:
            assert not torch.equal(scale, q.scale_inv) and not torch.equal(after, before)
            assert torch.equal(torch.log2(scale), torch.log2(scale).round())


# --------------------------------------------------------------------------- MXFP8 linear


@pytest.mark.parametrize(
    "sm,flashinfer,expected,accepted",
    [
        (90, False, "MarlinMxfp8LinearKernel", False),
        (90, True, "MarlinMxfp8LinearKernel", False),
        (100, False, "MarlinMxfp8LinearKernel", False),
        (100, True, "FlashInferCutedslMxfp8LinearKernel", True),
        (120, False, "MarlinMxfp8LinearKernel", False),
        (120, True, "FlashInferCutlassMxfp8LinearKernel", True),
    ],
)
def test_mx_kernel_selection(vllm_env, fake_gpu, sm, flashinfer, expected, accepted):
    """MXFP8 on a GPU without an MXFP8 GEMM is refused at load time from the
    platform's capability (no ``hardware:`` needed); vLLM would silently run weight-only."""
    fake_gpu(sm, flashinfer=flashinfer)
    if not accepted:
        with pytest.raises(FP8ConfigError) as err:
            linear(vllm_env, "mxfp8")
        assert_refusal(err, "scheme", expected, f"SM{sm}", "fp8_blockwise")
        return
    layer = linear(vllm_env, "mxfp8")
    method = layer.quant_method
    assert type(method._kernel).__name__ == expected
    # Its weight processing (scale swizzle) is plain torch: run it; the layer's parameters
    # and E8M0 scales stay as loaded, the swizzled copy lives in the kernel's view.
    from nemo_fp8_plugin.numerics import quantize_mxfp8

    gen = torch.Generator().manual_seed(6)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    ids = {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()}
    method.process_weights_after_loading(layer)
    ref = quantize_mxfp8(torch.cat([gate, up]), block=(1, 32))
    assert {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()} == ids
    assert torch.equal(layer.weight.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(
        layer.weight_scale_inv.data.view(torch.uint8), ref.scale_inv.view(torch.uint8)
    )
    assert method._view.weight.data_ptr() == layer.weight.data_ptr()
    assert method._view.weight_scale.numel() >= ref.scale_inv.numel()  # swizzled, padded


# --------------------------------------------------------------------------- fused MoE


@pytest.mark.parametrize("sm", GPU_PARAMS)
@pytest.mark.parametrize(
    "deep_gemm_installed,e8m0",
    [(True, True), (True, False), (False, True)],
    ids=["deepgemm-e8m0", "deepgemm-fp32", "no-deepgemm"],
)
@pytest.mark.parametrize("recipe", BLOCK_PRESETS)
def test_block_moe_quant_config(vllm_env, fake_gpu, sm, deep_gemm_installed, e8m0, recipe):
    """vLLM's Triton fused-MoE kernel quantizes activations with UE8M0 scales exactly when
    DeepGEMM's E8M0 mode is on: the recipe must agree, or the method refuses."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed, env=kernel_env(e8m0=e8m0))
    ue8m0 = deep_gemm_installed and e8m0
    pow2 = bool(get_recipe(recipe).pow2_scales)
    if ue8m0 != pow2:
        with pytest.raises(FP8ConfigError) as err:
            moe(vllm_env, recipe)
        assert_refusal(err, "VLLM_USE_DEEP_GEMM_E8M0" if ue8m0 else "pow2_scales", f"SM{sm}")
        return
    layer = moe(vllm_env, recipe)
    method = layer.quant_method
    assert type(method).__name__ == "NemoFp8MoEMethod" and method.use_vllm
    qc = method.get_fused_moe_quant_config(layer)  # what vLLM's runner asks for
    assert qc.use_fp8_w8a8 and qc.block_shape == [128, 128]
    assert qc.w1_scale is layer.w13_weight_scale_inv and qc.w2_scale is layer.w2_weight_scale_inv


@pytest.mark.parametrize(
    "sm,deep_gemm_installed,accepted",
    [
        (90, True, False),
        (90, False, False),
        (100, False, False),
        (100, True, True),
        (120, True, False),
    ],
)
def test_mx_moe_backend_selection(vllm_env, fake_gpu, sm, deep_gemm_installed, accepted):
    """GPU side: MXFP8 experts take the backend vLLM's own MXFP8 MoE oracle picks;
    one that keeps activations in BF16 (Marlin, emulation) is refused."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed, flashinfer=False)
    if not accepted:
        with pytest.raises(FP8ConfigError) as err:
            moe(vllm_env, "mxfp8")
        assert_refusal(err, "scheme", f"SM{sm}", "fp8_blockwise")
        return
    layer = moe(vllm_env, "mxfp8")
    method = layer.quant_method
    assert method._mx_backend.name == "DEEPGEMM"
    assert method.experts_cls.__name__ == "DeepGemmExperts"
    assert layer.w13_weight_scale_inv.dtype == torch.float8_e8m0fnu
    assert tuple(layer.w13_weight_scale_inv.shape) == (4, 512, 8)


# --------------------------------------------------------------------------- attention


def test_mla_attention_gets_the_kv_cache_method(vllm_env):
    """vLLM's own KV-cache set-up (``_init_kv_cache_quant``, which MLAAttention calls
    like Attention) attaches NemoFp8KVCacheMethod to an MLA layer, and its scales survive
    vLLM's post-load step, so refreshed KV scales have somewhere to land."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.attention.attention import _init_kv_cache_quant

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config
    from nemo_fp8_plugin.hosts.vllm.methods import NemoFp8KVCacheMethod

    config = {**qcfg({"recipe": "fp8_blockwise", "kv_cache": "fp8"}), "kv_cache_dtype": "fp8_e4m3"}
    layer = MLAAttention.__new__(MLAAttention)  # the real class; its GPU backends stay unbuilt
    torch.nn.Module.__init__(layer)
    layer.kv_cache_dtype = "fp8_e4m3"
    with building(vllm_env):
        _init_kv_cache_quant(
            layer, NemoFp8Config.from_config(config), "model.layers.0.self_attn.mla_attn"
        )
    assert isinstance(layer.quant_method, NemoFp8KVCacheMethod)
    k_scale = layer.k_scale
    k_scale.data.fill_(0.25)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.k_scale is k_scale and layer._k_scale_float == 0.25
