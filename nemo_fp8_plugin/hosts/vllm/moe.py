"""The ``nemo_fp8`` fused-MoE method: block-FP8 / MXFP8 experts that refit in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from .kernels import select_mx_moe_backend, vet_block_moe
from .quantizer import _copy_into, _Quantizer, _use_vllm_kernels, _wrap_loader

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import FusedMoEQuantConfig, RoutedExperts
    from vllm.model_executor.layers.fused_moe.moe_output import UnfinalizedMoEOutput
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

    from .config import NemoFp8Config

__all__ = ["NemoFp8MoEMethod"]


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

    def __init__(self, quant_config: NemoFp8Config, layer: RoutedExperts, prefix: str = "") -> None:
        super().__init__(layer.moe_config)
        self.quant_config = quant_config
        self.prefix = prefix
        self.quantizer = _Quantizer(quant_config)
        self.kind = self.quantizer.kind
        self.use_vllm = _use_vllm_kernels(quant_config)
        self.weight_block_size = list(quant_config.weight_block_size)
        if self.kind.is_mx and self.weight_block_size != [1, 32]:
            raise ValueError(
                f"nemo_fp8: {prefix}: MXFP8 MoE experts take 1x32 weight groups, got "
                f"weight_block_size {self.weight_block_size}"
            )
        self._mx_backend: Fp8MoeBackend | None = None
        self._mx_tensors: dict[str, torch.Tensor] | None = None
        if self.use_vllm and self.kind.is_mx:
            self._mx_backend, self.experts_cls = select_mx_moe_backend(self.moe, prefix)
        elif self.use_vllm:
            vet_block_moe(quant_config, prefix)

    def create_weights(
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            validate_fp8_block_shape_moe,
        )

        inter = intermediate_size_per_partition
        shards = self.moe.w13_num_shards
        if self.kind.is_mx:
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

        def scale_name(
            args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            # RoutedExperts.weight_loader(param, w, weight_name, shard_id, expert_id): the
            # scale goes through the same loader under the scale's name.
            positional = list(args)
            if positional:
                positional[0] = f"{positional[0]}_scale_inv"
            elif "weight_name" in kwargs:
                kwargs = {**kwargs, "weight_name": f"{kwargs['weight_name']}_scale_inv"}
            return tuple(positional), kwargs

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

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig:
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

    def _mx_layout(self, layer: RoutedExperts) -> dict[str, torch.Tensor]:
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

    def _bind_mx(self, layer: RoutedExperts) -> None:
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

    def _mx_aliases_layer(self, layer: RoutedExperts) -> bool:
        t = self._mx_tensors
        return (
            t is not None
            and t["w13"].data_ptr() == layer.w13_weight.data_ptr()
            and t["w2"].data_ptr() == layer.w2_weight.data_ptr()
            and t["w13_scale"].data_ptr() == layer.w13_weight_scale_inv.data_ptr()
            and t["w2_scale"].data_ptr() == layer.w2_weight_scale_inv.data_ptr()
        )

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if self._mx_backend is not None:
            self._bind_mx(layer)

    def after_refit(self, layer: RoutedExperts) -> None:
        """Block and emulation read the loadable parameters directly; the MXFP8 kernel
        layout, when it is not the parameters themselves, is rebuilt and copied in place."""
        if self._mx_backend is not None and not self._mx_aliases_layer(layer):
            self._bind_mx(layer)

    def apply_monolithic(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | UnfinalizedMoEOutput:
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
        layer: RoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: SharedExperts | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor | UnfinalizedMoEOutput:
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

    def _emulated_experts(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
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


def _moe_activation(layer: RoutedExperts) -> Callable[[torch.Tensor], torch.Tensor]:
    name = getattr(layer.activation, "value", layer.activation)
    is_gated = bool(getattr(layer.moe_config, "is_act_and_mul", True))
    activations: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu,
        "relu": torch.relu,
    }
    base = activations.get(str(name).lower())
    if base is None:
        raise NotImplementedError(f"nemo_fp8 emulation: MoE activation {name!r} is not implemented")
    if not is_gated:
        return base

    def gated(h: torch.Tensor) -> torch.Tensor:
        half = h.shape[-1] // 2
        return base(h[..., :half]) * h[..., half:]

    return gated
