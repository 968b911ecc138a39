"""The ``nemo_fp8`` linear methods: block FP8 / MXFP8 with refit-stable parameters, and
the BF16 method for the layers the rules keep in high precision."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.utils import set_weight_attrs

from .kernels import init_block_linear_kernel, init_mx_linear_kernel
from .quantizer import _Quantizer, _use_vllm_kernels, _wrap_loader

if TYPE_CHECKING:
    from vllm.model_executor.kernels.linear import Fp8BlockScaledMMLinearKernel, Mxfp8LinearKernel
    from vllm.model_executor.layers.linear import LinearBase

    from .config import NemoFp8Config

__all__ = ["NemoFp8LinearMethod", "NemoBF16LinearMethod"]


class _KernelView(torch.nn.Module):
    """What a vLLM GEMM kernel sees of a layer: parameters aliasing the layer's storage.

    vLLM kernels rewrite parameters in ``process_weights_after_loading`` (padding, scale
    layouts, repacking). Running them on this view leaves the layer's loadable parameters
    untouched, so refits keep landing in the same place.
    """

    weight: torch.nn.Parameter
    input_scale: torch.Tensor | None


class NemoFp8LinearMethod(LinearMethodBase):
    """Block FP8 / MXFP8 linear layer with refit-stable parameters."""

    def __init__(self, quant_config: NemoFp8Config, prefix: str = "") -> None:
        self.quant_config = quant_config
        self.prefix = prefix
        self.quantizer = _Quantizer(quant_config)
        self.kind = self.quantizer.kind
        # vLLM's kernels take 128x128 block weights and 1x32 MX weights; other tiles emulate.
        supported = list(quant_config.weight_block_size) == (
            [128, 128] if self.kind.is_block else [1, 32]
        )
        self.use_vllm = _use_vllm_kernels(quant_config) and supported
        self._kernel: Fp8BlockScaledMMLinearKernel | Mxfp8LinearKernel | None = None
        self._view: _KernelView | None = None
        # Where vLLM's kernels read the weight scales: block kernels take `weight_scale_inv`
        # (fp32), MXFP8 kernels `weight_scale` (the E8M0 bytes as uint8).
        self._kernel_scale = "weight_scale_inv" if self.kind.is_block else "weight_scale"

    def create_weights(
        self,
        layer: LinearBase,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import validate_fp8_block_shape
        from vllm.model_executor.parameter import (
            BlockQuantScaleParameter,
            GroupQuantScaleParameter,
            ModelWeightParameter,
        )

        n = sum(output_partition_sizes)
        k = input_size_per_partition
        # vLLM's linear layers always pass their loader.
        base_loader = cast("Callable[..., Any]", extra_weight_attrs.get("weight_loader"))
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.orig_dtype = params_dtype
        layer.weight_block_size = list(self.quant_config.weight_block_size)
        if self.kind.is_block:
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

        if self.use_vllm and self.kind.is_mx:
            self._kernel = init_mx_linear_kernel((n, k), self.prefix)
        elif self.use_vllm:
            self._kernel = init_block_linear_kernel(
                self.quant_config, layer.weight.shape, self.prefix, type(self).__name__
            )

    # -- kernel binding (vLLM backend)

    def _fresh_view(self, layer: LinearBase) -> _KernelView:
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
        assert self._kernel is not None  # use_vllm: create_weights made it
        self._kernel.process_weights_after_loading(view)
        return view

    def _bind(self, layer: LinearBase) -> None:
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

    def _aliases_layer(self, layer: LinearBase) -> bool:
        view = self._view
        return (
            view is not None
            and view.weight.data_ptr() == layer.weight.data_ptr()
            and getattr(view, self._kernel_scale).data_ptr() == layer.weight_scale_inv.data_ptr()
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.use_vllm:
            self._bind(layer)

    def after_refit(self, layer: LinearBase) -> None:
        """Bring the kernel's run-time copy up to date after ``load_weights`` (no-op when the
        kernel reads the layer's own storage, as the emulation and most Hopper kernels do)."""
        if self.use_vllm and not self._aliases_layer(layer):
            self._bind(layer)

    def apply(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.use_vllm:
            assert self._kernel is not None  # use_vllm: create_weights made it
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

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            layer.cpu_linear = torch.nn.functional.linear
            return
        super().process_weights_after_loading(layer)
