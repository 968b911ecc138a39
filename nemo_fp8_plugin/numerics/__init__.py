"""Pure-torch FP8 numerics: Transformer Engine's quantization bit for bit, and FP8-emulated
training of any torch model on any device.

Imports only torch and :mod:`nemo_fp8_plugin.errors` (no recipe spec module, no registry, no
YAML), so it runs on a machine that has nothing but torch. Recipes come in as spec objects
(:class:`RecipeLike`, which :class:`nemo_fp8_plugin.RecipeSpec` satisfies): resolve a name
with ``nemo_fp8_plugin.get_recipe(name)`` first. See ``docs/numerics.md``.

* Quantizers (each returns a :class:`QTensor`): :func:`quantize_per_tensor` (current
  scaling), :func:`quantize_blockwise` (1x128 / 128x128 tiles, 3-D MoE stacks),
  :func:`quantize_mxfp8` (1x32 / 32x32 E8M0), :class:`DelayedScalingState` (delayed
  scaling). Each runs the fastest exact kernel for the tensor (:func:`kernel_for`: the
  single-pass C++ kernels on a CPU, :func:`cpu_kernel_status`; compiled ones on CUDA); the
  ``*_reference`` variants are the eager truth they are tested against, the ``*_fused``
  variants the ``torch.compile`` kernels.
* :func:`fp8_gemm` emulates a scaled FP8 GEMM.
* :class:`FP8EmulatedLinear`, :func:`convert_to_fp8_emulation`,
  :func:`revert_fp8_emulation`, :func:`fp8_calibration`, :func:`update_fp8_scales`:
  FP8-emulated training of any model; :func:`convert_to_bf16_emulation` gives the BF16
  baseline arm the same treatment (BF16 GEMM numerics computed in fp32).
"""

from __future__ import annotations

from ._cpu import status as cpu_kernel_status
from .convert import (
    convert_to_bf16_emulation,
    convert_to_fp8_emulation,
    default_module_filter,
    emulated_modules,
    fp8_calibration,
    fp8_states,
    is_bf16_emulated,
    is_fp8_emulated,
    reset_fp8_states,
    revert_bf16_emulation,
    revert_fp8_emulation,
    set_amax_reduction_group,
    update_fp8_scales,
)
from .delayed import DelayedScalingState
from .formats import FORMATS, check_format, fp8_dtype, fp8_max
from .fused import (
    compile_failed,
    fake_quant_blockwise,
    fake_quant_mxfp8,
    fake_quant_per_tensor,
    fused_enabled,
    fused_mode,
    quantize_blockwise_fused,
    quantize_mxfp8_fused,
)
from .gemm import fp8_gemm
from .linear import (
    BF16EmulatedLinear,
    FP8EmulatedLinear,
    LayerEmulator,
    RoleQuantizer,
    bf16_linear,
    clear_weight_cache,
    emulated_linear,
)
from .nvfp4 import (
    dequantize_nvfp4,
    fake_quant_nvfp4,
    quantize_nvfp4,
    quantize_nvfp4_reference,
)
from .quantize import (
    QTensor,
    kernel_for,
    kernel_min_numel,
    quantize_blockwise,
    quantize_blockwise_reference,
    quantize_mxfp8,
    quantize_mxfp8_reference,
    quantize_per_tensor,
    quantize_per_tensor_reference,
    quantize_with_scale,
    quantize_with_scale_reference,
    tensor_amax,
)
from .recipe import RecipeLike, RecipeTypeError, check_recipe, register_numerics
from .scaling import scale_from_amax

__all__ = [
    "FORMATS",
    "check_format",
    "fp8_dtype",
    "fp8_max",
    "QTensor",
    "quantize_per_tensor",
    "quantize_with_scale",
    "quantize_blockwise",
    "quantize_mxfp8",
    "quantize_per_tensor_reference",
    "quantize_with_scale_reference",
    "quantize_blockwise_reference",
    "quantize_mxfp8_reference",
    "kernel_for",
    "kernel_min_numel",
    "cpu_kernel_status",
    "tensor_amax",
    "scale_from_amax",
    "DelayedScalingState",
    "fp8_gemm",
    "quantize_blockwise_fused",
    "quantize_mxfp8_fused",
    "fake_quant_blockwise",
    "fake_quant_mxfp8",
    "fake_quant_per_tensor",
    "fused_enabled",
    "fused_mode",
    "compile_failed",
    "FP8EmulatedLinear",
    "LayerEmulator",
    "RoleQuantizer",
    "emulated_linear",
    "convert_to_fp8_emulation",
    "revert_fp8_emulation",
    "default_module_filter",
    "emulated_modules",
    "fp8_calibration",
    "fp8_states",
    "update_fp8_scales",
    "reset_fp8_states",
    "is_fp8_emulated",
    "set_amax_reduction_group",
    "BF16EmulatedLinear",
    "bf16_linear",
    "convert_to_bf16_emulation",
    "revert_bf16_emulation",
    "is_bf16_emulated",
    "RecipeLike",
    "RecipeTypeError",
    "check_recipe",
    "register_numerics",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "quantize_nvfp4_reference",
    "fake_quant_nvfp4",
    "clear_weight_cache",
]
