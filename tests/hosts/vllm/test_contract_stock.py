"""Contract tests, GPU branches on a **stock vLLM CUDA install**, per GPU.

Users run vLLM's CUDA wheel as it comes: DeepGEMM vendored, FlashInfer installed, and
vLLM 0.32's defaults (``VLLM_USE_DEEP_GEMM=1``, ``VLLM_USE_DEEP_GEMM_E8M0=1``,
``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=1``, ``vllm/envs.py``). For each GPU class (H100/H200
SM90, B200/GB200 SM100, RTX PRO 6000 SM120) vLLM's own kernel selection runs with the
platform patched (``fake_gpu.py``), for each recipe, with and without the variables
:func:`~nemo_fp8_plugin.hosts.vllm.engine_env` asks for. No GPU kernel runs.
"""

from __future__ import annotations

import pytest
import vllm.utils.deep_gemm as deep_gemm
import vllm.utils.flashinfer as flashinfer_utils
from fake_gpu import GPU_PARAMS, assert_refusal, linear, moe
from vllm import envs

from nemo_fp8_plugin.capabilities import CAPABILITIES, arch_of_capability, capability
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import engine_env
from nemo_fp8_plugin.registry import get_recipe
from presets import BLOCK_PRESETS, preset_names

pytestmark = pytest.mark.vllm

RECIPES = preset_names(lambda row: row.vllm_generation)
"""The presets vLLM generates in (block FP8 and MXFP8); the others train only."""
FLASHINFER_BLOCK = "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
DEEP_GEMM_BLOCK = "DeepGemmFp8BlockScaledMMKernel"
MX_CUTLASS = "FlashInferCutlassMxfp8LinearKernel"


@pytest.mark.parametrize("sm", GPU_PARAMS)
def test_the_default_fixture_is_a_stock_install(fake_gpu, sm):
    """vLLM's own defaults decide (nothing set), DeepGEMM is usable on every GPU class of
    the table, and FlashInfer's block-scale GEMM is available exactly on SM90 (vLLM's
    ``has_flashinfer_fp8_blockscale_gemm``)."""
    fake_gpu(sm)
    assert envs.VLLM_USE_DEEP_GEMM and envs.VLLM_USE_DEEP_GEMM_E8M0
    assert envs.VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER
    assert deep_gemm.is_deep_gemm_supported() and deep_gemm.is_deep_gemm_e8m0_used()
    assert flashinfer_utils.is_flashinfer_fp8_blockscale_gemm_supported() is (sm == 90)


def _linear_outcome(sm: int, recipe: str, with_env: bool) -> tuple[str | None, str | None]:
    """(kernel vLLM picks, refused key or None) on a stock install, from vLLM 0.32's
    selection rules: FlashInfer's block kernel first on SM90 unless switched off, DeepGEMM
    next (SM90, SM100, SM120 families), which on SM100+ takes UE8M0 scales only; MXFP8 W8A8
    through FlashInfer's CuTe-DSL (SM100) or CUTLASS kernel (SM12x), weight-only Marlin on
    SM90."""
    spec = get_recipe(recipe)
    if capability(spec.scaling).is_mx:
        if sm < 100:
            return "MarlinMxfp8LinearKernel", "scheme"
        # CuTe-DSL is SM100-family only; FlashInfer's CUTLASS kernel covers SM12x.
        return ("FlashInferCutedslMxfp8LinearKernel" if sm < 120 else MX_CUTLASS), None
    pow2 = bool(spec.pow2_scales)
    if sm == 90 and not (with_env and pow2):
        # FlashInfer's kernel: its DeepGEMM branch follows E8M0; it quantizes activations
        # itself with fp32 scales.
        if pow2:
            return FLASHINFER_BLOCK, "pow2_scales"
        return FLASHINFER_BLOCK, None if with_env else "VLLM_USE_DEEP_GEMM_E8M0"
    if pow2:
        return DEEP_GEMM_BLOCK, None
    if sm >= 100:
        return DEEP_GEMM_BLOCK, "VLLM_USE_DEEP_GEMM"
    return DEEP_GEMM_BLOCK, None if with_env else "VLLM_USE_DEEP_GEMM_E8M0"


@pytest.mark.parametrize("with_env", [False, True], ids=["stock", "engine_env"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sm", GPU_PARAMS)
def test_linear_on_a_stock_install(vllm_env, fake_gpu, sm, recipe, with_env):
    """What vLLM picks for each recipe, and that ``engine_env(spec)`` is what turns the
    stock install's refusals into accepted kernels with the recipe's numerics (the
    remaining refusals are the hardware's: MXFP8 has no W8A8 GEMM on SM90; DeepGEMM on
    Blackwell takes power-of-2 scales only, and fp8_blockwise's are fp32)."""
    env = engine_env(recipe) if with_env else {}
    fake_gpu(sm, env=env)
    kernel, refused = _linear_outcome(sm, recipe, with_env)
    if refused:
        with pytest.raises(FP8ConfigError) as err:
            linear(vllm_env, recipe)
        assert_refusal(err, refused, kernel, f"SM{sm}")
        return
    layer = linear(vllm_env, recipe)
    method = layer.quant_method
    assert method.use_vllm and type(method._kernel).__name__ == kernel
    if capability(get_recipe(recipe).scaling).is_block:
        # The activation scales the kernel computes are the recipe's: pow2 or fp32.
        quant = getattr(method._kernel, "quant_fp8", None)
        if quant is not None:
            assert quant.use_ue8m0 is bool(get_recipe(recipe).pow2_scales)


def test_the_subchannel_refusal_says_set_it_to_zero(vllm_env, fake_gpu):
    """ "Unset VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER" means 1 (vLLM's default), the value that
    picks the kernel: the hint says 0, and engine_env sets 0."""
    fake_gpu(90)
    with pytest.raises(FP8ConfigError) as err:
        linear(vllm_env, "fp8_subchannel")
    assert_refusal(err, "pow2_scales", FLASHINFER_BLOCK, "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0")
    assert "unset VLLM_BLOCKSCALE" not in str(err.value).lower()
    assert engine_env("fp8_subchannel") == {"VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}
    assert engine_env({"recipe": "fp8_subchannel", "hardware": "hopper"}) == {
        "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"
    }


@pytest.mark.parametrize("with_env", [False, True], ids=["stock", "engine_env"])
@pytest.mark.parametrize("recipe", BLOCK_PRESETS)
@pytest.mark.parametrize("sm", GPU_PARAMS)
def test_block_moe_on_a_stock_install(vllm_env, fake_gpu, sm, recipe, with_env):
    """vLLM's fused-MoE kernel quantizes activations with UE8M0 scales exactly when
    DeepGEMM's E8M0 mode is on (the stock default): fp8_blockwise needs engine_env's
    ``VLLM_USE_DEEP_GEMM_E8M0=0``; fp8_subchannel runs as installed."""
    fake_gpu(sm, env=engine_env(recipe) if with_env else {})
    if recipe == "fp8_blockwise" and not with_env:
        with pytest.raises(FP8ConfigError) as err:
            moe(vllm_env, recipe)
        assert_refusal(err, "VLLM_USE_DEEP_GEMM_E8M0", f"SM{sm}", "engine_env")
        return
    layer = moe(vllm_env, recipe)
    qc = layer.quant_method.get_fused_moe_quant_config(layer)
    assert layer.quant_method.use_vllm and qc.use_fp8_w8a8 and qc.block_shape == [128, 128]


@pytest.mark.parametrize("sm", GPU_PARAMS)
def test_mx_moe_on_a_stock_install(vllm_env, fake_gpu, sm):
    """MXFP8 experts: vLLM's own MXFP8 MoE oracle (``select_mxfp8_moe_backend``, order
    FlashInfer TRT-LLM, DeepGEMM, Marlin, ...) picks DeepGEMM's W8A8 experts on SM100; on
    SM90 and SM12x its first supported backend is Marlin, weight-only: refused (dense MXFP8
    layers do run W8A8 on SM12x, see test_linear_on_a_stock_install).

    FlashInfer is modelled absent here: its MoE probes look its submodules up with
    ``importlib.util.find_spec``, which cannot be answered without the package."""
    fake_gpu(sm, flashinfer=False, env=engine_env("mxfp8"))
    if sm != 100:
        with pytest.raises(FP8ConfigError) as err:
            moe(vllm_env, "mxfp8")
        assert_refusal(err, "scheme", f"SM{sm}", "MARLIN")
        return
    layer = moe(vllm_env, "mxfp8")
    assert layer.quant_method._mx_backend.name == "DEEPGEMM"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sm", GPU_PARAMS)
def test_the_capability_table_agrees_with_vllm(vllm_env, fake_gpu, sm, recipe):
    """``generation_archs`` (the table explain and apply read) says a recipe generates in
    FP8 on a GPU exactly when vLLM's own selection, on a stock install with engine_env
    applied, gives the ``nemo_fp8`` method a kernel that keeps the recipe's numerics (for
    fp8_blockwise on Blackwell, the recipe itself refuses: pow2 scales are needed there)."""
    spec = get_recipe(recipe)
    arch = arch_of_capability(sm // 10, sm % 10).name
    fake_gpu(sm, env=engine_env(spec))
    try:
        linear(vllm_env, recipe)
        accepted = True
    except FP8ConfigError:
        accepted = False
    in_table = arch in CAPABILITIES[spec.scaling].generation_archs
    if capability(spec.scaling).is_block and not spec.pow2_scales and sm >= 100:
        assert in_table and not accepted  # the kind runs there; this recipe's fp32 scales not
        return
    assert accepted is in_table, (arch, recipe)
