"""What every ``nemo_fp8`` layer method shares: the recipe's quantizer, the loader that
quantizes high-precision refit payloads on arrival, the backend choice, and the in-place
copy that keeps a kernel's run-time tensors at their addresses across refits."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from .config import NemoFp8Config

__all__ = ["FP8_DTYPES", "_Quantizer", "_use_vllm_kernels", "_wrap_loader", "_copy_into"]

FP8_DTYPES = (torch.float8_e4m3fn,)
"""Dtypes a refit payload may carry already quantized (anything else is quantized on arrival)."""


def _numerics() -> ModuleType:
    from ... import numerics

    return numerics


def _running_floor_order() -> str:
    """Where the running vLLM's ``QuantFP8`` puts its scale floor relative to the UE8M0
    rounding (:data:`nemo_fp8_plugin.numerics.vllm_numerics.FLOOR_ORDER`): a tested release's
    row of the stacks table; an untested release is asked itself (its ``forward_native`` on a
    zero group: the floor's place shows in the scale, ``1/229376`` after rounding, ``2^-17``
    before)."""
    import vllm

    from ...stacks import lookup

    version = str(getattr(vllm, "__version__", "0"))
    answer = lookup("vllm", "QuantFP8.forward_native:floor_before_ue8m0", version)
    if answer.tested:
        return "before_rounding" if answer.present else "after_rounding"
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from ...numerics.vllm_numerics import VLLM_MIN_SCALE

    quant = QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=True)
    _, scale = quant.forward_native(torch.zeros(1, 128, dtype=torch.bfloat16))
    floor = torch.tensor(VLLM_MIN_SCALE, dtype=torch.float32)
    return (
        "after_rounding"
        if torch.equal(scale.reshape(-1)[:1], floor.reshape(1))
        else ("before_rounding")
    )


class _Quantizer:
    """The method's quantization recipe, expressed through the numerics reference."""

    def __init__(self, config: NemoFp8Config) -> None:
        from ...capabilities import capability

        self.scheme = config.scheme
        self.kind = capability(config.scheme)
        # [rows, cols] pairs: NemoFp8Config's `_as_block` checked both.
        self.weight_block = cast("tuple[int, int]", tuple(config.weight_block_size))
        self.activation_block = cast("tuple[int, int]", tuple(config.activation_block_size))
        self.pow2 = config.pow2_scales
        self.eps = float(getattr(config, "amax_epsilon", 0.0) or 0.0)
        self.numerics = str(getattr(config, "generation_numerics", "vllm"))
        self.floor = _running_floor_order()

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.kind.is_block else torch.float8_e8m0fnu

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        br, bc = self.weight_block
        return (rows + br - 1) // br, (cols + bc - 1) // bc

    def weight(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8 data, scale_inv) of a high-precision weight (2-D, or 3-D per expert)."""
        nx = _numerics()
        # Large GPU tensors take the compiled quantizer (bit-identical to the reference).
        fused = w.is_cuda and w.numel() >= (1 << 20)
        if self.kind.is_block:
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
        if self.kind.is_block:
            from ...numerics import vllm_numerics

            a = vllm_numerics.quantize_activation(
                x,
                self.numerics,
                self.activation_block,
                pow2_scales=self.pow2,
                eps=self.eps,
                floor=self.floor,
            )
            if requant_weights and self.numerics == "vllm_deepgemm_ue8m0":
                b = vllm_numerics.requantize_ue8m0(b)
        else:
            a = nx.quantize_mxfp8(x, block=self.activation_block, fmt="e4m3")
        return nx.fp8_gemm(a, b, out_dtype=out_dtype, bias=bias)


def _use_vllm_kernels(config: NemoFp8Config) -> bool:
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
    base_loader: Callable[..., Any],
    scale_attr: str,
    quantizer: _Quantizer,
    layer: torch.nn.Module,
    scale_name: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]
    | None = None,
) -> Callable[..., Any]:
    """A weight loader that quantizes high-precision payloads on arrival.

    FP8 payloads pass straight to vLLM's loader. Anything else is quantized on the
    parameter's device, its data loaded through vLLM's loader and its scales through the
    scale parameter's loader with the same shard arguments.
    """
    layer_ref = weakref.ref(layer)

    def load(
        param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
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

    # Marks the wrapper (tests and debugging); mypy has no attributes on a function.
    load.nemo_fp8_online = True  # type: ignore[attr-defined]
    return load


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
