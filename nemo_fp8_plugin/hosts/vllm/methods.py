"""Layer methods of the ``nemo_fp8`` quantization: linear, fused MoE, attention (KV scales).

Design rules, all for RL refit (weights replaced every step):

* **Parameters are created once and never replaced.** ``weight`` (float8_e4m3fn, ``[N, K]``)
  and ``weight_scale_inv`` (fp32, one per weight tile) keep their identity and their
  ``weight_loader`` for the life of the engine, so ``model.load_weights(...)`` after any
  number of steps writes into the same storage (vLLM issue 28425 is what happens when a
  method swaps its parameters after loading). Run-time layouts a kernel wants are built
  beside them, never in their place.
* **Two payloads.** A float8 tensor is copied as is (with its ``<name>_scale_inv``, the
  trainer-side quantizer's output, half the bytes of BF16). A BF16/FP16/FP32 tensor is
  quantized on arrival with the same numerics, and its scales are loaded through the scale
  parameter's own loader with the same shard id, so fused and tensor-parallel layouts
  follow vLLM's rules.
* **Two backends.** ``vllm``: vLLM's own block-FP8 GEMM kernels (CUDA). ``emulate``: the
  numerics emulation of :mod:`nemo_fp8_plugin.numerics` (activations per 1x128 group,
  weights per 128x128 tile, products in fp32), which runs anywhere vLLM runs, CPU included.

After a refit call :func:`finish_refit` (the worker extension does) so that backends that
keep a run-time copy of the weights, and the attention layers' KV scales, catch up.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.utils import set_weight_attrs

logger = logging.getLogger(__name__)

__all__ = [
    "NemoFp8LinearMethod",
    "NemoBF16LinearMethod",
    "NemoFp8MoEMethod",
    "NemoFp8KVCacheMethod",
    "finish_refit",
    "FP8_DTYPES",
]

FP8_DTYPES = (torch.float8_e4m3fn,)
"""Dtypes a refit payload may carry already quantized (anything else is quantized on arrival)."""


# --------------------------------------------------------------------------- numerics glue


def _numerics():
    from ... import numerics

    return numerics


class _Quantizer:
    """The method's quantization recipe, expressed through the numerics reference."""

    def __init__(self, config) -> None:
        self.scheme = config.scheme
        self.weight_block = tuple(config.weight_block_size)
        self.activation_block = tuple(config.activation_block_size)
        self.pow2 = config.pow2_scales
        self.eps = float(getattr(config, "amax_epsilon", 0.0) or 0.0)
        self.numerics = str(getattr(config, "generation_numerics", "vllm"))

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.scheme == "block" else torch.float8_e8m0fnu

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        br, bc = self.weight_block
        return (rows + br - 1) // br, (cols + bc - 1) // bc

    def weight(self, w: torch.Tensor):
        """(float8 data, scale_inv) of a high-precision weight (2-D, or 3-D per expert)."""
        nx = _numerics()
        # Large GPU tensors take the compiled quantizer (bit-identical to the reference).
        fused = w.is_cuda and w.numel() >= (1 << 20)
        if self.scheme == "block":
            fn = nx.quantize_blockwise_fused if fused else nx.quantize_blockwise
            q = fn(w, self.weight_block, "e4m3", pow2_scales=self.pow2, eps=self.eps)
        else:
            fn = nx.quantize_mxfp8_fused if fused else nx.quantize_mxfp8
            q = fn(w, self.weight_block, "e4m3")
        return q.data, q.scale_inv

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        *,
        requant_weights: bool = True,
    ) -> torch.Tensor:
        """x @ dequant(weight).T (+ bias) with x quantized per activation group, emulated in
        fp32; the bias is added in fp32 before the cast to ``out_dtype``, as the trainer's
        emulated GEMM (:func:`nemo_fp8_plugin.numerics.fp8_gemm`) and a GEMM epilogue do.

        Block scheme: activations as ``generation_numerics`` says
        (:func:`nemo_fp8_plugin.numerics.vllm_numerics.quantize_activation`: vLLM's
        ``QuantFP8`` by default, TE's numerics for ``trainer``). Under
        ``vllm_deepgemm_ue8m0`` the weight is also requantized to power-of-2 block scales
        as DeepGEMM holds it (``requant_weights=False`` for fused-MoE experts, which vLLM's
        Triton kernel reads as loaded); the stored parameters are never changed, so a refit
        needs no extra step. MXFP8 keeps the OCP/TE numerics."""
        nx = _numerics()
        b = nx.QTensor(data=weight, scale_inv=scale_inv, fmt="e4m3", block=self.weight_block)
        if self.scheme == "block":
            from ...numerics import vllm_numerics

            a = vllm_numerics.quantize_activation(
                x, self.numerics, self.activation_block, pow2_scales=self.pow2, eps=self.eps
            )
            if requant_weights and self.numerics == "vllm_deepgemm_ue8m0":
                b = vllm_numerics.requantize_ue8m0(b)
        else:
            a = nx.quantize_mxfp8(x, block=self.activation_block, fmt="e4m3")
        return nx.fp8_gemm(a, b, out_dtype=out_dtype, bias=bias)


def _use_vllm_kernels(config) -> bool:
    if config.backend == "emulate":
        return False
    from vllm.platforms import current_platform

    cuda = current_platform.is_cuda_alike()
    if config.backend == "vllm" and not cuda:
        raise ValueError(
            "nemo_fp8 backend 'vllm' needs a CUDA/ROCm device; use 'auto' or 'emulate'"
        )
    return cuda


def _wrap_loader(
    base_loader: Callable,
    scale_attr: str,
    quantizer: _Quantizer,
    layer: torch.nn.Module,
    scale_name: Callable[[tuple, dict], tuple] | None = None,
):
    """A weight loader that quantizes high-precision payloads on arrival.

    FP8 payloads pass straight to vLLM's loader. Anything else is quantized on the
    parameter's device, its data loaded through vLLM's loader and its scales through the
    scale parameter's loader with the same shard arguments.
    """
    layer_ref = weakref.ref(layer)

    def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any):
        if loaded_weight.dtype in FP8_DTYPES:
            return base_loader(param, loaded_weight, *args, **kwargs)
        if not loaded_weight.is_floating_point():
            raise ValueError(
                f"nemo_fp8: cannot load a {loaded_weight.dtype} tensor into an FP8 weight"
            )
        owner = layer_ref()
        data, scale_inv = quantizer.weight(loaded_weight.to(param.device))
        scale = getattr(owner, scale_attr)
        scale_args, scale_kwargs = (
            (args, kwargs) if scale_name is None else scale_name(args, kwargs)
        )
        scale.weight_loader(scale, scale_inv, *scale_args, **scale_kwargs)
        return base_loader(param, data, *args, **kwargs)

    load.nemo_fp8_online = True  # marks the wrapper (tests and debugging)
    return load


# --------------------------------------------------------------------------- kernel vetting
#
# vLLM picks its GPU kernels from the device and its environment variables. Some of those
# choices change the numerics the recipe promises (power-of-2 instead of fp32 scales, BF16
# instead of FP8 activations); the method looks at the kernel vLLM picked, at load time,
# and either makes the recipe's numerics real or refuses with one line naming the key, the
# vLLM version and what to do instead. The CPU tests run this selection with the platform's
# capability patched (tests/vllm/test_contract.py).

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


def _refuse(prefix: str, message: str, *, key: str, value: Any, hint: str) -> None:
    from ...errors import FP8ConfigError

    raise FP8ConfigError(f"{prefix}: {_host()}: {message}", key=key, value=value, hint=hint)


def _deep_gemm_part(kernel):
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


def _kernel_uses_ue8m0(kernel) -> bool:
    """Whether vLLM's block kernel turns the scales into UE8M0 (DeepGEMM with
    ``VLLM_USE_DEEP_GEMM_E8M0=1``: weights requantized in place, activations UE8M0)."""
    deep = _deep_gemm_part(kernel)
    if deep is not None and deep.use_deep_gemm_e8m0:
        return True
    quant = getattr(kernel, "quant_fp8", None)
    return bool(
        getattr(kernel, "apply_input_quant", True) and quant is not None and quant.use_ue8m0
    )


def _pow2_activation_quantizer(quant, *, deep_gemm: bool):
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


def _refuse_trainer_numerics(prefix: str, what: str) -> None:
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


def _refuse_missing_deepgemm_ue8m0(prefix: str, what: str) -> None:
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


def _vet_block_kernel(kernel, config, prefix: str):
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
        return kernel
    if deep is not None and _blackwell_class():
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
                hint="unset VLLM_USE_DEEP_GEMM_E8M0 (vLLM's default is 1), or set "
                "VLLM_USE_DEEP_GEMM=0",
            )
    if not config.pow2_scales:
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
        return kernel
    quant = getattr(kernel, "quant_fp8", None)
    if not getattr(kernel, "apply_input_quant", True) or quant is None:
        _refuse(
            prefix,
            f"{name} quantizes activations inside its GEMM with fp32 scales, so the "
            f"recipe's power-of-2 activation scales cannot be applied",
            key="pow2_scales",
            value=True,
            hint="unset VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER, use fp8_blockwise (fp32 "
            "scales), or quantization_config.backend: emulate",
        )
    if not quant.use_ue8m0:
        # vLLM's block kernels build QuantFP8(..., use_ue8m0=False): fp32 activation scales.
        kernel.quant_fp8 = _pow2_activation_quantizer(quant, deep_gemm=deep is kernel)
    return kernel


def _vet_mx_kernel(kernel, prefix: str):
    name = type(kernel).__name__
    if name not in _MX_W8A8_LINEAR_KERNELS:
        _refuse(
            prefix,
            f"no MXFP8 tensor-core GEMM for this layer: vLLM picked {name}, which "
            f"keeps activations in BF16 (weight-only or emulated), so generation would not "
            f"run the recipe's MXFP8 GEMMs",
            key="scheme",
            value="mx",
            hint="MXFP8 generation needs Blackwell (SM100) with FlashInfer; on Hopper use "
            "fp8_blockwise, or quantization_config.backend: emulate to preview MXFP8",
        )
    return kernel


def _vet_block_moe(config, prefix: str) -> None:
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


def _select_mx_moe_backend(moe, prefix: str):
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
            hint="MXFP8 MoE generation needs Blackwell (SM100) with FlashInfer or DeepGEMM; "
            "on Hopper use fp8_blockwise, or quantization_config.backend: emulate",
        )
    return backend, experts_cls


def _copy_into(
    current: dict[str, torch.Tensor] | None, fresh: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Refit: copy ``fresh`` into the tensors a kernel already holds (captured CUDA graphs
    keep their addresses); a tensor whose shape or dtype changed is replaced."""
    if current is None:
        return dict(fresh)
    for name, tensor in fresh.items():
        old = current.get(name)
        if old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype:
            if old.data_ptr() != tensor.data_ptr():
                old.copy_(tensor)
        else:
            current[name] = tensor
    return current


# --------------------------------------------------------------------------- linear


class _KernelView(torch.nn.Module):
    """What a vLLM GEMM kernel sees of a layer: parameters aliasing the layer's storage.

    vLLM kernels rewrite parameters in ``process_weights_after_loading`` (padding, scale
    layouts, repacking). Running them on this view leaves the layer's loadable parameters
    untouched, so refits keep landing in the same place.
    """


class NemoFp8LinearMethod(LinearMethodBase):
    """Block FP8 / MXFP8 linear layer with refit-stable parameters."""

    def __init__(self, quant_config, prefix: str = "") -> None:
        self.quant_config = quant_config
        self.prefix = prefix
        self.quantizer = _Quantizer(quant_config)
        # vLLM's kernels take 128x128 block weights and 1x32 MX weights; other tiles emulate.
        supported = (
            list(quant_config.weight_block_size) == [128, 128]
            if quant_config.scheme == "block"
            else list(quant_config.weight_block_size) == [1, 32]
        )
        self.use_vllm = _use_vllm_kernels(quant_config) and supported
        self._kernel = None
        self._view: _KernelView | None = None
        # Where vLLM's kernels read the weight scales: block kernels take `weight_scale_inv`
        # (fp32), MXFP8 kernels `weight_scale` (the E8M0 bytes as uint8).
        self._kernel_scale = (
            "weight_scale_inv" if quant_config.scheme == "block" else "weight_scale"
        )

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import validate_fp8_block_shape
        from vllm.model_executor.parameter import (
            BlockQuantScaleParameter,
            GroupQuantScaleParameter,
            ModelWeightParameter,
        )

        n = sum(output_partition_sizes)
        k = input_size_per_partition
        base_loader = extra_weight_attrs.get("weight_loader")
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.orig_dtype = params_dtype
        layer.weight_block_size = list(self.quant_config.weight_block_size)
        if self.quant_config.scheme == "block":
            validate_fp8_block_shape(
                layer, input_size, output_size, k, output_partition_sizes, layer.weight_block_size
            )
        elif k % 32:
            raise ValueError(
                f"nemo_fp8 (mx): {self.prefix} has an input size of {k}, not a multiple of 32"
            )

        weight = ModelWeightParameter(
            data=torch.empty(n, k, dtype=torch.float8_e4m3fn),
            input_dim=1,
            output_dim=0,
            weight_loader=_wrap_loader(base_loader, "weight_scale_inv", self.quantizer, layer),
        )
        layer.register_parameter("weight", weight)

        rows, cols = self.quantizer.scale_shape(n, k)
        scale_cls = (
            GroupQuantScaleParameter
            if self.quantizer.weight_block[0] == 1
            else BlockQuantScaleParameter
        )
        scale = scale_cls(
            data=torch.ones(rows, cols, dtype=self.quantizer.scale_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=base_loader,
        )
        set_weight_attrs(scale, {"scale_type": "weight_scale"})
        layer.register_parameter("weight_scale_inv", scale)

        if self.use_vllm and self.quant_config.scheme == "mx":
            from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel

            self._kernel = _vet_mx_kernel(
                init_mxfp8_linear_kernel(weight_shape=(n, k)), self.prefix
            )
        elif self.use_vllm:
            from vllm.config import get_current_vllm_config
            from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
            from vllm.model_executor.layers.quantization.utils.quant_utils import (
                GroupShape,
                create_fp8_quant_key,
            )

            block = self.quant_config.weight_block_size
            self._kernel = init_fp8_linear_kernel(
                activation_quant_key=create_fp8_quant_key(
                    static=False, group_shape=GroupShape(1, block[1])
                ),
                weight_quant_key=create_fp8_quant_key(static=True, group_shape=GroupShape(*block)),
                weight_shape=layer.weight.shape,
                input_dtype=get_current_vllm_config().model_config.dtype,
                out_dtype=torch.get_default_dtype(),
                module_name=type(self).__name__,
            )
            self._kernel = _vet_block_kernel(self._kernel, self.quant_config, self.prefix)

    # -- kernel binding (vLLM backend)

    def _fresh_view(self, layer: torch.nn.Module) -> _KernelView:
        view = _KernelView()
        view.weight = torch.nn.Parameter(layer.weight.data, requires_grad=False)
        scale = layer.weight_scale_inv.data
        if scale.dtype == torch.float8_e8m0fnu:
            scale = scale.view(torch.uint8)
        setattr(view, self._kernel_scale, torch.nn.Parameter(scale, requires_grad=False))
        view.input_scale = None
        for attr in (
            "weight_block_size",
            "logical_widths",
            "input_size_per_partition",
            "output_size_per_partition",
            "orig_dtype",
        ):
            setattr(view, attr, getattr(layer, attr))
        self._kernel.process_weights_after_loading(view)
        return view

    def _bind(self, layer: torch.nn.Module) -> None:
        fresh = self._fresh_view(layer)
        if self._view is None:
            self._view = fresh
            return
        # Refit: copy into the tensors the kernel already holds (captured CUDA graphs keep
        # their addresses); a kernel that changed a shape gets the new tensor instead.
        for name, tensor in list(fresh.named_parameters(recurse=False)):
            old = getattr(self._view, name, None)
            if old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype:
                if old.data_ptr() != tensor.data_ptr():
                    old.data.copy_(tensor.data)
            else:
                setattr(self._view, name, tensor)

    def _aliases_layer(self, layer: torch.nn.Module) -> bool:
        view = self._view
        return (
            view is not None
            and view.weight.data_ptr() == layer.weight.data_ptr()
            and getattr(view, self._kernel_scale).data_ptr() == layer.weight_scale_inv.data_ptr()
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.use_vllm:
            self._bind(layer)

    def after_refit(self, layer: torch.nn.Module) -> None:
        """Bring the kernel's run-time copy up to date after ``load_weights`` (no-op when the
        kernel reads the layer's own storage, as the emulation and most Hopper kernels do)."""
        if self.use_vllm and not self._aliases_layer(layer):
            self._bind(layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.use_vllm:
            return self._kernel.apply_weights(self._view, x, bias)
        shape = x.shape
        out = self.quantizer.linear(
            x.reshape(-1, shape[-1]),
            layer.weight,
            layer.weight_scale_inv,
            out_dtype=x.dtype,
            bias=bias,
        )
        return out.reshape(*shape[:-1], out.shape[-1])


class NemoBF16LinearMethod(UnquantizedLinearMethod):
    """A linear layer the BF16 rules keep in high precision, refit-stable on every backend.

    vLLM's CPU backend packs an unquantized weight into a oneDNN handle after loading and
    deletes the parameter, so a later ``load_weights`` finds nothing to write into. Here the
    parameter stays and the GEMM is a plain ``F.linear``; other platforms behave as vLLM's
    own unquantized method.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            layer.cpu_linear = torch.nn.functional.linear
            return
        super().process_weights_after_loading(layer)


# --------------------------------------------------------------------------- fused MoE


class NemoFp8MoEMethod(FusedMoEMethodBase):
    """Fused-MoE experts in block FP8 or MXFP8, per expert: ``w13_weight`` ``[E, 2I, H]`` and
    ``w2_weight`` ``[E, H, I]`` float8 with per-expert ``*_weight_scale_inv``: fp32 per
    128x128 tile (block) or E8M0 per 1x32 group (mx, ``[E, rows, cols/32]``).

    vLLM backend, block: vLLM's Triton fused-MoE kernel with block-FP8 weights, which reads
    the checkpoint layout directly (nothing to rebuild after a refit). vLLM backend, mx: the
    MXFP8 MoE backend vLLM's own oracle picks (``select_mxfp8_moe_backend``, as its online
    ``mxfp8`` method), its run-time layout built beside the loadable parameters and copied in
    place after each refit; backends that keep activations in BF16 are refused. Emulation: a
    loop over the experts that receive tokens, each GEMM through the numerics emulation.
    """

    def __init__(self, quant_config, layer, prefix: str = "") -> None:
        super().__init__(layer.moe_config)
        self.quant_config = quant_config
        self.prefix = prefix
        self.quantizer = _Quantizer(quant_config)
        self.use_vllm = _use_vllm_kernels(quant_config)
        self.weight_block_size = list(quant_config.weight_block_size)
        if quant_config.scheme == "mx" and self.weight_block_size != [1, 32]:
            raise ValueError(
                f"nemo_fp8: {prefix}: MXFP8 MoE experts take 1x32 weight groups, got "
                f"weight_block_size {self.weight_block_size}"
            )
        self._mx_backend = None
        self._mx_tensors: dict[str, torch.Tensor] | None = None
        if self.use_vllm and quant_config.scheme == "mx":
            self._mx_backend, self.experts_cls = _select_mx_moe_backend(self.moe, prefix)
        elif self.use_vllm:
            _vet_block_moe(quant_config, prefix)

    def create_weights(
        self,
        layer,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            validate_fp8_block_shape_moe,
        )

        inter = intermediate_size_per_partition
        shards = self.moe.w13_num_shards
        if self.quant_config.scheme == "mx":
            if hidden_size % 32 or inter % 32:
                raise ValueError(
                    f"nemo_fp8 (mx): {self.prefix}: hidden size {hidden_size} and "
                    f"intermediate size {inter} must be multiples of 32"
                )
        else:
            validate_fp8_block_shape_moe(inter, self.weight_block_size)
        layer.num_experts = num_experts
        layer.orig_dtype = params_dtype
        layer.weight_block_size = self.weight_block_size
        base_loader = extra_weight_attrs["weight_loader"]

        def scale_name(args: tuple, kwargs: dict) -> tuple:
            # RoutedExperts.weight_loader(param, w, weight_name, shard_id, expert_id): the
            # scale goes through the same loader under the scale's name.
            args = list(args)
            if args:
                args[0] = f"{args[0]}_scale_inv"
            elif "weight_name" in kwargs:
                kwargs = {**kwargs, "weight_name": f"{kwargs['weight_name']}_scale_inv"}
            return tuple(args), kwargs

        for stem, rows, cols in (("w13", shards * inter, hidden_size), ("w2", hidden_size, inter)):
            weight = torch.nn.Parameter(
                torch.empty(num_experts, rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False
            )
            layer.register_parameter(f"{stem}_weight", weight)
            attrs = dict(extra_weight_attrs)
            attrs["weight_loader"] = _wrap_loader(
                base_loader, f"{stem}_weight_scale_inv", self.quantizer, layer, scale_name
            )
            set_weight_attrs(weight, attrs)
            srows, scols = self.quantizer.scale_shape(rows, cols)
            if stem == "w13":
                # Each of the fused w1/w3 halves has its own tile rows.
                srows = shards * self.quantizer.scale_shape(inter, cols)[0]
            scale = torch.nn.Parameter(
                torch.ones(num_experts, srows, scols, dtype=self.quantizer.scale_dtype),
                requires_grad=False,
            )
            layer.register_parameter(f"{stem}_weight_scale_inv", scale)
            set_weight_attrs(
                scale,
                {**extra_weight_attrs, "quant_method": FusedMoeWeightScaleSupported.BLOCK.value},
            )
        if self.moe.has_bias:
            for stem, rows in (("w13", shards * inter), ("w2", hidden_size)):
                bias = torch.nn.Parameter(
                    torch.zeros(num_experts, rows, dtype=params_dtype), requires_grad=False
                )
                layer.register_parameter(f"{stem}_bias", bias)
                set_weight_attrs(bias, extra_weight_attrs)
        layer.w13_input_scale = None
        layer.w2_input_scale = None

    def get_fused_moe_quant_config(self, layer):
        if self._mx_backend is not None:
            from vllm.model_executor.layers.fused_moe.oracle.fp8 import make_fp8_moe_quant_config

            t = self._mx_tensors if self._mx_tensors is not None else self._mx_layout(layer)
            return make_fp8_moe_quant_config(
                fp8_backend=self._mx_backend,
                w1_scale=t["w13_scale"],
                w2_scale=t["w2_scale"],
                a1_scale=None,
                a2_scale=None,
                w1_bias=getattr(layer, "w13_bias", None),
                w2_bias=getattr(layer, "w2_bias", None),
                block_shape=self.weight_block_size,
                layer=layer,
            )
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        return fp8_w8a8_moe_quant_config(
            w1_scale=layer.w13_weight_scale_inv,
            w2_scale=layer.w2_weight_scale_inv,
            w1_bias=getattr(layer, "w13_bias", None),
            w2_bias=getattr(layer, "w2_bias", None),
            block_shape=self.weight_block_size,
        )

    # -- MXFP8 on vLLM's kernels: a run-time layout beside the loadable parameters

    def _mx_layout(self, layer) -> dict[str, torch.Tensor]:
        """vLLM's kernel format of the layer's MXFP8 experts (E8M0 scales as uint8, the
        layout ``convert_to_fp8_moe_kernel_format`` makes for the chosen backend). The
        layer's own parameters are read, never replaced."""
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import (
            convert_to_fp8_moe_kernel_format,
        )

        w13, w2, s13, s2 = convert_to_fp8_moe_kernel_format(
            fp8_backend=self._mx_backend,
            layer=layer,
            w13=layer.w13_weight.data,
            w2=layer.w2_weight.data,
            w13_scale=layer.w13_weight_scale_inv.data.view(torch.uint8),
            w2_scale=layer.w2_weight_scale_inv.data.view(torch.uint8),
            w13_input_scale=None,
            w2_input_scale=None,
        )
        return {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}

    def _bind_mx(self, layer) -> None:
        first = self._mx_tensors is None
        self._mx_tensors = _copy_into(self._mx_tensors, self._mx_layout(layer))
        if first:
            from vllm.model_executor.layers.fused_moe.oracle.fp8 import make_fp8_moe_kernel

            self.moe_quant_config = self.get_fused_moe_quant_config(layer)
            self.moe_kernel = make_fp8_moe_kernel(
                moe_quant_config=self.moe_quant_config,
                moe_config=self.moe,
                fp8_backend=self._mx_backend,
                experts_cls=self.experts_cls,
                routing_tables=layer._expert_routing_tables(),
            )

    def _mx_aliases_layer(self, layer) -> bool:
        t = self._mx_tensors
        return (
            t is not None
            and t["w13"].data_ptr() == layer.w13_weight.data_ptr()
            and t["w2"].data_ptr() == layer.w2_weight.data_ptr()
            and t["w13_scale"].data_ptr() == layer.w13_weight_scale_inv.data_ptr()
            and t["w2_scale"].data_ptr() == layer.w2_weight_scale_inv.data_ptr()
        )

    def process_weights_after_loading(self, layer) -> None:
        if self._mx_backend is not None:
            self._bind_mx(layer)

    def after_refit(self, layer) -> None:
        """Block and emulation read the loadable parameters directly; the MXFP8 kernel
        layout, when it is not the parameters themselves, is rebuilt and copied in place."""
        if self._mx_backend is not None and not self._mx_aliases_layer(layer):
            self._bind_mx(layer)

    def apply_monolithic(
        self,
        layer,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ):
        assert self.moe_kernel is not None and self._mx_tensors is not None
        return self.moe_kernel.apply_monolithic(
            x,
            self._mx_tensors["w13"],
            self._mx_tensors["w2"],
            router_logits,
            activation=layer.activation,
            global_num_experts=layer.global_num_experts,
            expert_map=layer.expert_map,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            num_expert_group=layer.num_expert_group,
            topk_group=layer.topk_group,
            e_score_correction_bias=layer.e_score_correction_bias,
            routed_scaling_factor=layer.routed_scaling_factor,
            routing_sink=layer.routing_sink,
        )

    def apply(
        self,
        layer,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts=None,
        shared_experts_input=None,
    ) -> torch.Tensor:
        if self._mx_backend is not None:
            assert self.moe_kernel is not None and self._mx_tensors is not None
            return self.moe_kernel.apply(
                x,
                self._mx_tensors["w13"],
                self._mx_tensors["w2"],
                topk_weights,
                topk_ids,
                activation=layer.activation,
                global_num_experts=layer.global_num_experts,
                expert_map=layer.expert_map,
                apply_router_weight_on_input=layer.apply_router_weight_on_input,
                shared_experts=shared_experts,
                shared_experts_input=shared_experts_input,
            )
        if self.use_vllm:
            from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

            return fused_experts(
                x,
                layer.w13_weight,
                layer.w2_weight,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                activation=layer.activation,
                apply_router_weight_on_input=layer.apply_router_weight_on_input,
                global_num_experts=layer.global_num_experts,
                expert_map=layer.expert_map,
                quant_config=self.moe_quant_config or self.get_fused_moe_quant_config(layer),
            )
        return self._emulated_experts(layer, x, topk_weights, topk_ids)

    def _emulated_experts(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        act = _moe_activation(layer)
        out = torch.zeros(
            x.shape[0], layer.w2_weight.shape[1], dtype=torch.float32, device=x.device
        )
        ids = topk_ids.long()
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:
            ids = expert_map.long()[ids]  # global -> local expert, -1 = another rank's
        on_input = bool(getattr(layer, "apply_router_weight_on_input", False))
        b13 = getattr(layer, "w13_bias", None)
        b2 = getattr(layer, "w2_bias", None)
        for e in torch.unique(ids).tolist():
            if e < 0:
                continue
            rows, slots = (ids == e).nonzero(as_tuple=True)
            gate = topk_weights[rows, slots].to(torch.float32).unsqueeze(1)
            xe = x[rows]
            if on_input:
                xe = (xe.to(torch.float32) * gate).to(x.dtype)
            # Biases are added in fp32 before the cast, as in the dense layers.
            h = self.quantizer.linear(
                xe,
                layer.w13_weight[e],
                layer.w13_weight_scale_inv[e],
                x.dtype,
                bias=None if b13 is None else b13[e],
                requant_weights=False,
            )
            h = act(h)
            y = self.quantizer.linear(
                h,
                layer.w2_weight[e],
                layer.w2_weight_scale_inv[e],
                x.dtype,
                bias=None if b2 is None else b2[e],
                requant_weights=False,
            )
            y = y.to(torch.float32)
            out.index_add_(0, rows, y if on_input else y * gate)
        return out.to(x.dtype)


def _moe_activation(layer) -> Callable[[torch.Tensor], torch.Tensor]:
    name = getattr(layer.activation, "value", layer.activation)
    is_gated = bool(getattr(layer.moe_config, "is_act_and_mul", True))
    base = {
        "silu": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu,
        "relu": torch.relu,
    }.get(str(name).lower())
    if base is None:
        raise NotImplementedError(f"nemo_fp8 emulation: MoE activation {name!r} is not implemented")
    if not is_gated:
        return base

    def gated(h: torch.Tensor) -> torch.Tensor:
        half = h.shape[-1] // 2
        return base(h[..., :half]) * h[..., half:]

    return gated


# --------------------------------------------------------------------------- attention (KV scales)


_KV_PARAMS = ("k_scale", "v_scale", "q_scale", "prob_scale")


class NemoFp8KVCacheMethod(BaseKVCacheMethod):
    """KV-cache scales that can be refreshed every RL step.

    vLLM's own method copies ``k_scale`` / ``v_scale`` / ``q_scale`` into the attention
    layer's run-time scales once and then deletes the parameters, so a later
    ``load_weights`` has nowhere to write. This method runs the same copy and puts the same
    parameter objects back, so each refit can load fresh scales (names
    ``<layer>.self_attn.attn.{k,v,q}_scale``, as :func:`nemo_fp8_plugin.rl.refresh_scales` returns
    them) and :func:`finish_refit` re-applies them.
    """

    def __init__(self, quant_config, prefix: str = "") -> None:
        super().__init__(quant_config)
        self.prefix = prefix
        self._checked = False

    def _check_dtype(self, layer) -> None:
        if self._checked:
            return
        self._checked = True
        asked = getattr(self.quant_config, "kv_cache_dtype", "auto")
        running = getattr(layer, "kv_cache_dtype", "auto")
        if (
            asked not in ("auto", None)
            and running != asked
            and not (asked == "fp8_e4m3" and running == "fp8")
        ):
            logger.warning(
                "nemo_fp8: %s: the recipe asked for a %s KV cache but the engine runs %s "
                "(vLLM's CPU backend stores FP8 caches as E5M2); rollouts will not match "
                "an E4M3 GPU cache",
                self.prefix,
                asked,
                running,
            )

    def process_weights_after_loading(self, layer) -> None:
        self._check_dtype(layer)
        kept = {name: getattr(layer, name) for name in _KV_PARAMS if hasattr(layer, name)}
        super().process_weights_after_loading(layer)
        for name, param in kept.items():
            if not hasattr(layer, name):
                setattr(layer, name, param)

    def after_refit(self, layer) -> None:
        """Apply the scales loaded by the last refit to the attention layer."""
        self.process_weights_after_loading(layer)


def finish_refit(model: torch.nn.Module) -> int:
    """Run every ``nemo_fp8`` method's post-refit step; returns the number of layers touched.

    Call after ``model.load_weights(...)`` (the worker extension does). Layers without a
    ``nemo_fp8`` method are left alone.
    """
    touched = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (NemoFp8LinearMethod, NemoFp8MoEMethod, NemoFp8KVCacheMethod)):
            method.after_refit(module)
            touched += 1
    return touched
