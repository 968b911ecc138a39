"""Kernel vetting: the GPU kernel vLLM picks, checked against the recipe at load time.

vLLM picks its GPU kernels from the device and its environment variables. Some of those
choices change the numerics the recipe promises (power-of-2 instead of fp32 scales, BF16
instead of FP8 activations); the layer methods (``linear.py``, ``moe.py``) ask vLLM's own
selection code for the kernel here, then either make the recipe's numerics real or refuse
with one line naming the key, the vLLM version and what to do instead. The CPU tests run
this selection with the platform's capability patched (``tests/hosts/vllm/test_contract.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:
    from vllm.model_executor.kernels.linear import Fp8BlockScaledMMLinearKernel, Mxfp8LinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import (
        DeepGemmFp8BlockScaledMMKernel,
    )
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

    from .config import NemoFp8Config

__all__ = [
    "init_block_linear_kernel",
    "init_mx_linear_kernel",
    "vet_block_moe",
    "select_mx_moe_backend",
]

_MX_W8A8_LINEAR_KERNELS = frozenset(
    {
        "FlashInferCutlassMxfp8LinearKernel",
        "FlashInferCutedslMxfp8LinearKernel",
        "FlashInferTrtllmMxfp8LinearKernel",
        "B12xMxfp8LinearKernel",
    }
)
"""vLLM MXFP8 linear kernels that quantize activations to MXFP8 (W8A8), as training does.
The others (Marlin: weight-only; Emulation: BF16 GEMM on dequantized weights; Humming:
weight-only) keep activations in BF16 and are refused."""

_MX_W8A8_MOE_BACKENDS = frozenset({"FLASHINFER_TRTLLM", "DEEPGEMM", "TRITON_MXFP8", "AITER_MXFP8"})
"""vLLM MXFP8 fused-MoE backends (``Fp8MoeBackend`` names) with MXFP8 activations."""


def _host() -> str:
    """``vLLM <version> on SM<xy>`` for messages."""
    try:
        import vllm

        version = str(vllm.__version__)
    except Exception:  # only for a message
        version = "?"
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    where = current_platform.device_name if cap is None else f"SM{cap.major}{cap.minor}"
    return f"vLLM {version} on {where}"


def _refuse(prefix: str, message: str, *, key: str, value: Any, hint: str) -> NoReturn:
    from ...errors import FP8ConfigError

    raise FP8ConfigError(f"{prefix}: {_host()}: {message}", key=key, value=value, hint=hint)


def _deep_gemm_part(
    kernel: Fp8BlockScaledMMLinearKernel,
) -> DeepGemmFp8BlockScaledMMKernel | None:
    """The DeepGEMM kernel inside vLLM's block kernel (itself, or the DeepGEMM branch of
    FlashInfer's dynamic kernel), or None."""
    for part in (kernel, getattr(kernel, "fallback", None), getattr(kernel, "base", None)):
        if part is not None and hasattr(part, "use_deep_gemm_e8m0"):
            return part
    return None


def _blackwell_class() -> bool:
    """SM100 and later: DeepGEMM's FP8 GEMMs there take UE8M0 scale factors only (its
    layout step casts fp32 ones; vLLM's ``fp8_gemm_nt`` with E8M0 off asks it not to cast,
    which its host check refuses)."""
    from vllm.platforms import current_platform

    return current_platform.has_device_capability(100)


def _kernel_uses_ue8m0(kernel: Fp8BlockScaledMMLinearKernel) -> bool:
    """Whether vLLM's block kernel turns the scales into UE8M0 (DeepGEMM with
    ``VLLM_USE_DEEP_GEMM_E8M0=1``: weights requantized in place, activations UE8M0)."""
    deep = _deep_gemm_part(kernel)
    if deep is not None and deep.use_deep_gemm_e8m0:
        return True
    quant = getattr(kernel, "quant_fp8", None)
    return bool(
        getattr(kernel, "apply_input_quant", True) and quant is not None and quant.use_ue8m0
    )


def _pow2_activation_quantizer(quant: QuantFP8, *, deep_gemm: bool) -> QuantFP8:
    """vLLM's own activation quantizer (``QuantFP8``) with ``use_ue8m0=True``: the same
    group shape and scale layout, scales rounded to powers of two (TE's pow2 recipe)."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

    new = QuantFP8(
        static=quant.static,
        group_shape=quant.group_shape,
        num_token_padding=quant.num_token_padding,
        column_major_scales=quant.column_major_scales,
        tma_aligned_scales=quant.tma_aligned_scales,
        use_ue8m0=True,
    )
    if not deep_gemm:
        # DeepGEMM's packed int32 UE8M0 layout is for DeepGEMM only; other kernels read fp32
        # scales (here: fp32 values that are powers of two).
        new.use_deep_gemm_supported = False
    return new


def _refuse_trainer_numerics(prefix: str, what: str) -> NoReturn:
    """``generation_numerics: trainer`` asks for Transformer Engine's activation numerics,
    which none of vLLM's kernels computes (they quantize as ``x / (amax / 448)``)."""
    _refuse(
        prefix,
        f"{what} quantizes activations as vLLM does (x / (amax/448)), not with the "
        f"trainer's numerics (x * (448/amax)) that generation_numerics: trainer asks for",
        key="generation_numerics",
        value="trainer",
        hint="use generation_numerics: vllm (what vLLM's kernels compute), or "
        "quantization_config.backend: emulate",
    )


def _refuse_missing_deepgemm_ue8m0(prefix: str, what: str) -> NoReturn:
    _refuse(
        prefix,
        f"{what} is not DeepGEMM with VLLM_USE_DEEP_GEMM_E8M0=1, so activations are not "
        f"quantized with UE8M0 scales (nor weights requantized to them) as "
        f"generation_numerics: vllm_deepgemm_ue8m0 says",
        key="generation_numerics",
        value="vllm_deepgemm_ue8m0",
        hint="run where DeepGEMM is installed (SM90/SM100) with VLLM_USE_DEEP_GEMM=1 and "
        "VLLM_USE_DEEP_GEMM_E8M0=1, or use generation_numerics: vllm",
    )


def _vet_block_kernel(
    kernel: Fp8BlockScaledMMLinearKernel, config: NemoFp8Config, prefix: str
) -> Fp8BlockScaledMMLinearKernel:
    """Make vLLM's block-FP8 linear kernel keep the recipe's scales and
    ``generation_numerics``, or refuse."""
    name = type(kernel).__name__
    numerics = getattr(config, "generation_numerics", "vllm")
    if numerics == "trainer":
        _refuse_trainer_numerics(prefix, name)
    if config.amax_epsilon:
        _refuse(
            prefix,
            f"{name} quantizes activations with vLLM's fixed amax floor, so "
            f"amax_epsilon={config.amax_epsilon!r} applies on the emulation backend only",
            key="amax_epsilon",
            value=config.amax_epsilon,
            hint="use amax_epsilon: 0, or quantization_config.backend: emulate",
        )
    deep = _deep_gemm_part(kernel)
    if numerics == "vllm_deepgemm_ue8m0":
        # The user asked for DeepGEMM's power-of-2 numerics, whatever the recipe's scales.
        if deep is None or not deep.use_deep_gemm_e8m0:
            _refuse_missing_deepgemm_ue8m0(prefix, name)
        if not getattr(kernel, "apply_input_quant", True):
            # FlashInfer's SM90 kernel: below 32 tokens its own GEMM quantizes activations
            # with fp32 scales; only its DeepGEMM branch (32 tokens and more) is UE8M0.
            _refuse(
                prefix,
                f"{name} quantizes activations of batches under 32 tokens inside "
                f"FlashInfer's GEMM with fp32 scales, not DeepGEMM's UE8M0 scales that "
                f"generation_numerics: vllm_deepgemm_ue8m0 says",
                key="generation_numerics",
                value="vllm_deepgemm_ue8m0",
                hint="set VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0 before vLLM starts "
                "(nemo_fp8_plugin.hosts.vllm.engine_env), or use generation_numerics: vllm",
            )
        return kernel
    if deep is not None and _blackwell_class():
        _vet_blackwell_deep_gemm(deep, config, name, prefix)
    if not config.pow2_scales:
        _vet_fp32_scales(kernel, name, prefix)
        return kernel
    _keep_pow2_activation_scales(kernel, deep, name, prefix)
    return kernel


def _vet_blackwell_deep_gemm(
    deep: DeepGemmFp8BlockScaledMMKernel, config: NemoFp8Config, name: str, prefix: str
) -> None:
    """DeepGEMM on SM100+: UE8M0 scale factors only, so fp32 recipes and E8M0 off refuse."""
    if not config.pow2_scales:
        _refuse(
            prefix,
            f"{name} runs DeepGEMM, whose Blackwell kernels take power-of-2 "
            f"(UE8M0) scale factors only, but this recipe's scales are fp32 "
            f"(pow2_scales: false)",
            key="VLLM_USE_DEEP_GEMM",
            value="1",
            hint="use fp8_subchannel (Blackwell training needs power-of-2 block "
            "scales too), or set VLLM_USE_DEEP_GEMM=0 before vLLM starts (CUTLASS "
            "keeps fp32 block scales)",
        )
    if not deep.use_deep_gemm_e8m0:
        _refuse(
            prefix,
            f"{name} runs DeepGEMM, whose Blackwell kernels take UE8M0 scale "
            f"factors only, but VLLM_USE_DEEP_GEMM_E8M0=0 asks it for fp32 ones",
            key="VLLM_USE_DEEP_GEMM_E8M0",
            value="0",
            hint="set VLLM_USE_DEEP_GEMM_E8M0=1 (vLLM's default) before vLLM starts, or "
            "VLLM_USE_DEEP_GEMM=0",
        )


def _vet_fp32_scales(kernel: Fp8BlockScaledMMLinearKernel, name: str, prefix: str) -> None:
    """An fp32-scale recipe refuses a kernel that turns its scales into UE8M0."""
    if _kernel_uses_ue8m0(kernel):
        _refuse(
            prefix,
            f"{name} with VLLM_USE_DEEP_GEMM_E8M0=1 requantizes the weights to "
            f"power-of-2 (UE8M0) scales and quantizes activations with UE8M0 scales, but "
            f"this recipe's scales are fp32 (pow2_scales: false)",
            key="VLLM_USE_DEEP_GEMM_E8M0",
            value="1",
            hint="set VLLM_USE_DEEP_GEMM_E8M0=0 before vLLM starts, as NeMo RL does "
            "(nemo_fp8_plugin.hosts.vllm.engine_env), or use fp8_subchannel",
        )


def _keep_pow2_activation_scales(
    kernel: Fp8BlockScaledMMLinearKernel,
    deep: DeepGemmFp8BlockScaledMMKernel | None,
    name: str,
    prefix: str,
) -> None:
    """A power-of-2 recipe: the kernel's activation quantizer rounds scales to powers of
    two (vLLM's own ``QuantFP8`` with ``use_ue8m0=True``), or the kernel is refused when
    it quantizes activations inside its GEMM (FlashInfer's block kernel, fp32 scales)."""
    quant = getattr(kernel, "quant_fp8", None)
    if not getattr(kernel, "apply_input_quant", True) or quant is None:
        _refuse(
            prefix,
            f"{name} quantizes activations inside its GEMM with fp32 scales, so the "
            f"recipe's power-of-2 activation scales cannot be applied",
            key="pow2_scales",
            value=True,
            hint="set VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0 before vLLM starts (vLLM's "
            "default is 1; nemo_fp8_plugin.hosts.vllm.engine_env), use fp8_blockwise "
            "(fp32 scales), or quantization_config.backend: emulate",
        )
    if not quant.use_ue8m0:
        # vLLM's block kernels build QuantFP8(..., use_ue8m0=False): fp32 activation scales.
        kernel.quant_fp8 = _pow2_activation_quantizer(quant, deep_gemm=deep is kernel)


def _vet_mx_kernel(kernel: Mxfp8LinearKernel, prefix: str) -> Mxfp8LinearKernel:
    name = type(kernel).__name__
    if name not in _MX_W8A8_LINEAR_KERNELS:
        _refuse(
            prefix,
            f"no MXFP8 tensor-core GEMM for this layer: vLLM picked {name}, which "
            f"keeps activations in BF16 (weight-only or emulated), so generation would not "
            f"run the recipe's MXFP8 GEMMs",
            key="scheme",
            value="mx",
            hint="MXFP8 generation needs Blackwell (SM100/SM103, or SM12x) with FlashInfer; on "
            "Hopper use fp8_blockwise, or quantization_config.backend: emulate to preview "
            "MXFP8",
        )
    return kernel


def vet_block_moe(config: NemoFp8Config, prefix: str) -> None:
    """vLLM's Triton fused-MoE kernel quantizes activations with
    ``per_token_group_quant_fp8(use_ue8m0=None)``, i.e. UE8M0 exactly when
    ``is_deep_gemm_e8m0_used()``: the recipe's scales must agree with that."""
    from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

    if config.amax_epsilon:
        _refuse(
            prefix,
            f"the fused-MoE kernel quantizes activations with vLLM's fixed amax "
            f"floor, so amax_epsilon={config.amax_epsilon!r} applies on the emulation backend "
            f"only",
            key="amax_epsilon",
            value=config.amax_epsilon,
            hint="use amax_epsilon: 0, or quantization_config.backend: emulate",
        )
    ue8m0 = is_deep_gemm_e8m0_used()
    numerics = getattr(config, "generation_numerics", "vllm")
    if numerics == "trainer":
        _refuse_trainer_numerics(prefix, "the fused-MoE kernel")
    if numerics == "vllm_deepgemm_ue8m0":
        if not ue8m0:
            _refuse_missing_deepgemm_ue8m0(prefix, "the fused-MoE kernel's quantizer")
        return
    if ue8m0 and not config.pow2_scales:
        _refuse(
            prefix,
            "with VLLM_USE_DEEP_GEMM_E8M0=1 the fused-MoE kernel quantizes "
            "activations with UE8M0 (power-of-2) scales, but this recipe's scales are fp32 "
            "(pow2_scales: false)",
            key="VLLM_USE_DEEP_GEMM_E8M0",
            value="1",
            hint="set VLLM_USE_DEEP_GEMM_E8M0=0 before vLLM starts, as NeMo RL does "
            "(nemo_fp8_plugin.hosts.vllm.engine_env), or use fp8_subchannel",
        )
    if config.pow2_scales and not ue8m0:
        _refuse(
            prefix,
            "the fused-MoE kernel quantizes activations with fp32 scales unless "
            "DeepGEMM's E8M0 mode is active, so the recipe's power-of-2 activation scales "
            "cannot be applied",
            key="pow2_scales",
            value=True,
            hint="run where DeepGEMM is installed with VLLM_USE_DEEP_GEMM=1 and "
            "VLLM_USE_DEEP_GEMM_E8M0=1 (SM90/SM100), use fp8_blockwise, or "
            "quantization_config.backend: emulate",
        )


def select_mx_moe_backend(
    moe: FusedMoEConfig, prefix: str
) -> tuple[Fp8MoeBackend, type[FusedMoEExperts]]:
    """vLLM's own MXFP8 MoE backend choice (``select_mxfp8_moe_backend``), refused when its
    experts keep activations in BF16."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp8 import select_mxfp8_moe_backend

    try:
        backend, experts_cls = select_mxfp8_moe_backend(config=moe)
    except ValueError as exc:
        _refuse(
            prefix,
            f"no MXFP8 fused-MoE backend ({exc})",
            key="scheme",
            value="mx",
            hint="use fp8_blockwise, or quantization_config.backend: emulate",
        )
    if backend.name not in _MX_W8A8_MOE_BACKENDS:
        _refuse(
            prefix,
            f"no MXFP8 fused-MoE kernel with MXFP8 activations: vLLM picked "
            f"{backend.value} ({experts_cls.__name__}), which keeps activations in BF16",
            key="scheme",
            value="mx",
            hint="MXFP8 MoE generation needs data-center Blackwell (SM100) with FlashInfer or "
            "DeepGEMM; "
            "on Hopper use fp8_blockwise, or quantization_config.backend: emulate",
        )
    return backend, experts_cls


def init_block_linear_kernel(
    config: NemoFp8Config, weight_shape: torch.Size, prefix: str, module_name: str
) -> Fp8BlockScaledMMLinearKernel:
    """vLLM's block-FP8 linear kernel for a ``weight_shape`` weight (vLLM's own
    ``init_fp8_linear_kernel``), vetted against the recipe."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        create_fp8_quant_key,
    )

    block = config.weight_block_size
    kernel = init_fp8_linear_kernel(
        activation_quant_key=create_fp8_quant_key(
            static=False, group_shape=GroupShape(1, block[1])
        ),
        weight_quant_key=create_fp8_quant_key(static=True, group_shape=GroupShape(*block)),
        weight_shape=weight_shape,
        input_dtype=get_current_vllm_config().model_config.dtype,
        out_dtype=torch.get_default_dtype(),
        module_name=module_name,
    )
    return _vet_block_kernel(kernel, config, prefix)


def init_mx_linear_kernel(weight_shape: tuple[int, int], prefix: str) -> Mxfp8LinearKernel:
    """vLLM's MXFP8 linear kernel (``init_mxfp8_linear_kernel``), refused when it keeps
    activations in BF16."""
    from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel

    return _vet_mx_kernel(init_mxfp8_linear_kernel(weight_shape=weight_shape), prefix)
