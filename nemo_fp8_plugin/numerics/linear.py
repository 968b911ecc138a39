"""FP8-emulated linear layer: the three GEMMs of a linear layer run the way a recipe runs them.

Forward ``y = x @ W.T`` (fprop), backward ``dx = dy @ W`` (dgrad) and ``dW = dy.T @ x``
(wgrad). Each GEMM operand is quantized with its role's tile and format, dequantized in
fp32, and multiplied in fp32 (products of FP8 values are exact in fp32); results come back
in the activation dtype. Operand roles, as in Transformer Engine:

============  =========================  ===========================================
GEMM          left operand               right operand
============  =========================  ===========================================
fprop         input, along K             weight, along K
dgrad         grad_output, along N       weight, along N (column-wise copy)
wgrad         grad_output, along M       input, along M (column-wise copies)
============  =========================  ===========================================

A column-wise copy of a 1xN-tiled tensor (block 1x128, MXFP8 1x32) is quantized again from
the transposed high-precision tensor; per-tensor scaling and square tiles (128x128, 32x32)
reuse the row-wise result transposed (same scales), as TE does. ``fp8_wgrad=False`` keeps
the wgrad GEMM in high precision. Delayed scaling keeps one :class:`DelayedScalingState`
per role per layer and updates it lazily, just before the role's next cast, which gives
TE's order (a step's scale comes from earlier steps' amaxes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import FP8ConfigError
from .delayed import DelayedScalingState
from .fused import (
    fake_quant_blockwise,
    fake_quant_mxfp8,
    fake_quant_per_tensor,
    fake_quant_with_scale,
)
from .nvfp4 import fake_quant_nvfp4
from .quantize import tensor_amax
from .recipe import RecipeLike, check_recipe
from .reference import check_block

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "FP8EmulatedLinear",
    "LayerEmulator",
    "RoleQuantizer",
    "emulated_linear",
    "ROLES",
    "BF16EmulatedLinear",
    "bf16_linear",
    "weight_key",
    "clear_weight_cache",
]

ROLES = ("input", "weight", "grad_output")


class RoleQuantizer:
    """Quantizes (and dequantizes to fp32) one operand role of one layer per a recipe.

    Args:
        spec: the recipe (a :class:`~nemo_fp8_plugin.spec.RecipeSpec` or any
            :class:`~.recipe.RecipeLike`; names are resolved by ``nemo_fp8_plugin.get_recipe``).
        role: ``input``, ``weight`` or ``grad_output``.

    Attributes:
        scaling: the recipe's scaling kind (``delayed``, ``tensorwise``, ``block``, ``mx``).
        fmt: element format of this role (``e4m3``; ``e5m2`` for gradients under hybrid).
        block: tile of this role (None per tensor).
        state: the role's :class:`DelayedScalingState` under delayed scaling, else None.
    """

    def __init__(
        self, spec: RecipeLike, role: str, device: torch.device | str | None = None
    ) -> None:
        spec = check_recipe(spec, "spec")
        if role not in ROLES:
            raise FP8ConfigError(
                f"role must be one of {', '.join(ROLES)}, got {role!r}", key="role", value=role
            )
        self.role = role
        self.scaling = spec.scaling
        self.fmt = spec.format_for(role)
        self.block = spec.block_for(role)
        self.pow2 = bool(spec.pow2_scales)
        self.eps = float(spec.amax_epsilon)
        self.reduce_amax = bool(spec.reduce_amax)
        self.amax_group: ProcessGroup | None = None
        """Process group whose ranks share this role's amax (TE ``reduce_amax``); None
        keeps it local. Set with :func:`~nemo_fp8_plugin.numerics.set_amax_reduction_group`:
        the ranks of a group must run the same layers in the same order."""
        self._cache: dict[str, tuple] = {}
        self.state: DelayedScalingState | None = None
        if self.scaling == "delayed":
            self.state = DelayedScalingState(
                spec.amax_history_len, spec.amax_compute_algo, spec.margin, self.fmt, device=device
            )

    @property
    def columnwise_reuses_rowwise(self) -> bool:
        """True when the column-wise copy is the row-wise one transposed (per-tensor scales
        or square tiles); False when it is quantized again from the high-precision tensor."""
        return self.block is None or self.block[0] == self.block[1]

    def _before_cast(self) -> DelayedScalingState:
        # Delayed scaling: fold the previous step's amax into the scale (TE updates after
        # each autocast region; doing it just before the next cast gives the same order).
        state = self.state
        assert state is not None  # set in __init__ for delayed scaling, the only caller
        if self.reduce_amax and self.amax_group is not None:
            state.all_reduce_amax(self.amax_group)
        state.update()
        return state

    def record(self, t: torch.Tensor) -> None:
        """Calibration: update then record ``t``'s amax without quantizing (TE
        ``fp8_autocast(enabled=False, calibrating=True)``)."""
        if self.state is not None:
            self._before_cast().record_amax(tensor_amax(t.detach()))

    def rowwise(self, t: torch.Tensor) -> torch.Tensor:
        """fp32 ``dequantize(quantize(t))`` with tiles along the last dim of a 2-D ``t``."""
        if self.scaling == "delayed":
            state = self._before_cast()
            deq, amax = fake_quant_with_scale(t, state.scale, state.scale_inv, self.fmt)
            state.record_amax(amax)
            return deq
        if self.scaling == "tensorwise":
            return fake_quant_per_tensor(t, self.fmt, self.pow2, self.eps)
        if self.scaling == "block":
            return fake_quant_blockwise(t, self._tile, self.fmt, self.pow2, self.eps)
        if self.scaling == "nvfp4":
            return self._nvfp4(t, self._tile, rht=False)
        return fake_quant_mxfp8(t, self._tile, self.fmt)

    @property
    def _tile(self) -> tuple[int, int]:
        # The tile of a tiled kind (block, mx, nvfp4): a recipe whose block_for gives None
        # for one is refused here, naming ``block``, as the quantizers refuse it.
        return check_block(self.block)

    def _nvfp4(self, t: torch.Tensor, block: tuple[int, int], *, rht: bool) -> torch.Tensor:
        # TE's NVFP4BlockScaling: stochastic rounding on gradients, the random Hadamard
        # transform on both operands of the weight-gradient GEMM (the column-wise copies of
        # the input and the gradient). The transform is undone after dequantizing: the two
        # operands' H^T H cancels in the GEMM, so this is that GEMM's product exactly.
        stochastic = self.role == "grad_output"
        return fake_quant_nvfp4(t, block, rht=rht, stochastic=stochastic)

    def cached(
        self, key: tuple | None, which: str, compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """``compute()``, reused while ``key`` (:func:`weight_key`: the weight's storage,
        version counter and the optimizer-step count) is unchanged, so that a weight is
        fake-quantized once per optimizer step, not once per micro-batch. ``which`` names
        the copy (``row``, ``col``); ``key`` None: no caching. Not for delayed scaling,
        whose casts depend on the scaling state (:meth:`rowwise_weight`)."""
        if key is None:
            return compute()
        entry = self._cache.get(which)
        if entry is not None and entry[0] == key:
            return entry[1]
        value = compute()
        self._cache[which] = (key, value)
        return value

    def rowwise_weight(self, w: torch.Tensor, key: tuple | None) -> torch.Tensor:
        """:meth:`rowwise` of a weight, cached per :meth:`cached`.

        Delayed scaling: every call still folds the history into the scale and records the
        weight's amax (the amax of an unchanged weight is the cached one), and the cached
        values are reused only while the scale is the one they were cast with; so the
        scaling state and the bits evolve exactly as without the cache."""
        if self.state is None:
            return self.cached(key, "row", lambda: self.rowwise(w))
        if key is None:
            return self.rowwise(w)
        state = self._before_cast()
        entry = self._cache.get("row")
        if entry is not None and entry[0] == key:
            _, deq, scale, amax = entry
            if bool(torch.equal(state.scale, scale)):
                state.record_amax(amax)
                return deq
        deq, amax = fake_quant_with_scale(w, state.scale, state.scale_inv, self.fmt)
        state.record_amax(amax)
        self._cache["row"] = (key, deq, state.scale.clone(), amax)
        return deq

    def columnwise(self, t: torch.Tensor, rowwise_result: torch.Tensor | None) -> torch.Tensor:
        """fp32 fake-quantized ``t.T`` (tiles along the first dim of ``t``), ``[C, R]``.

        Returned as a transposed view: quantizing ``t.T`` with 1xN tiles is quantizing ``t``
        with Nx1 tiles (the same groups of elements, the same bits), which reads ``t`` in
        its own memory order; the GEMM takes the transposed view without a copy."""
        if self.columnwise_reuses_rowwise:
            if rowwise_result is None:
                raise RuntimeError("column-wise copy needs the row-wise result")
            return rowwise_result.t()
        transposed_tile = (self._tile[1], self._tile[0])
        if self.scaling == "nvfp4":  # quantized again from t.T with 1x16 groups, RHT on
            return self._nvfp4(t.t().contiguous(), self._tile, rht=True)
        if self.scaling == "block":
            return fake_quant_blockwise(t, transposed_tile, self.fmt, self.pow2, self.eps).t()
        return fake_quant_mxfp8(t, transposed_tile, self.fmt).t()


class LayerEmulator:
    """The FP8 emulation state of one linear layer: a :class:`RoleQuantizer` per role.

    Args:
        spec: the recipe (a :class:`~nemo_fp8_plugin.spec.RecipeSpec` or any
            :class:`~.recipe.RecipeLike`; a name raises, see ``nemo_fp8_plugin.get_recipe``).

    Attributes:
        spec: the recipe.
        quantizers: role -> :class:`RoleQuantizer`.
        calibrating: when True the layer runs in high precision and only records amaxes
            (delayed scaling), like TE's ``fp8_autocast(enabled=False, calibrating=True)``.
        enabled: when False the layer runs plainly in high precision.
    """

    def __init__(self, spec: RecipeLike, device: torch.device | str | None = None) -> None:
        spec = check_recipe(spec, "spec")
        self.spec = spec
        self.quantizers = {role: RoleQuantizer(spec, role, device) for role in ROLES}
        self.calibrating = False
        self.enabled = True
        self.weight_key: tuple | None = None
        """Set by :func:`emulated_linear` before each call: the weight's cache key
        (:func:`weight_key`), or None when the weight cache is off."""

    @property
    def states(self) -> dict[str, DelayedScalingState]:
        """role -> delayed-scaling state (empty unless the recipe uses delayed scaling)."""
        return {r: q.state for r, q in self.quantizers.items() if q.state is not None}

    def to(self, device: torch.device | str) -> LayerEmulator:
        for state in self.states.values():
            state.to(device)
        return self


class _EmulatedLinearFn(torch.autograd.Function):
    """fprop/dgrad/wgrad with quantized operands. ``x`` is 2-D ``[M, K]``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        emu: LayerEmulator,
        wgrad_into_main_grad: bool,
    ) -> torch.Tensor:
        qin, qw = emu.quantizers["input"], emu.quantizers["weight"]
        xq = qin.rowwise(x)
        key = emu.weight_key
        wq = qw.rowwise_weight(weight, key)
        out = torch.matmul(xq, wq.t())
        if bias is not None:
            out = out + bias.float()
        ctx.emu = emu
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.wgrad_into_main_grad = wgrad_into_main_grad
        fp8_wgrad = emu.spec.fp8_wgrad
        ctx.fp8_wgrad = fp8_wgrad
        # Keep what backward needs: the fp32 fake-quantized tensor when its column-wise
        # copy is the row-wise one transposed, else the high-precision tensor.
        x_keep = xq if (fp8_wgrad and qin.columnwise_reuses_rowwise) else x
        w_keep = wq if qw.columnwise_reuses_rowwise else weight
        ctx.save_for_backward(x_keep, w_keep, weight)
        ctx.x_dtype = x.dtype
        ctx.weight_key = key
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        emu = ctx.emu
        x_keep, w_keep, weight = ctx.saved_tensors
        qin, qw, qg = (emu.quantizers[r] for r in ROLES)
        dy = grad_out.contiguous()
        dyq = qg.rowwise(dy)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if qw.columnwise_reuses_rowwise:
                w_col = qw.columnwise(w_keep, w_keep)
            else:  # quantized again from the weight: once per optimizer step
                w_col = qw.cached(ctx.weight_key, "col", lambda: qw.columnwise(w_keep, None))
            grad_x = torch.matmul(dyq, w_col.t()).to(ctx.x_dtype)
        if ctx.needs_input_grad[1] or ctx.wgrad_into_main_grad:
            if ctx.fp8_wgrad:
                dy_col = qg.columnwise(dy, dyq)
                x_col = qin.columnwise(x_keep, x_keep if qin.columnwise_reuses_rowwise else None)
                dw = torch.matmul(dy_col, x_col.t())
            else:
                dw = torch.matmul(dy.float().t(), x_keep.float())
            if ctx.wgrad_into_main_grad:
                grad_w = _accumulate_main_grad(weight, dw)
            else:
                grad_w = dw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


def _accumulate_main_grad(weight: torch.Tensor, dw: torch.Tensor) -> torch.Tensor | None:
    """megatron-core's gradient-accumulation fusion: add into ``weight.main_grad`` and hand
    autograd the placeholder megatron expects."""
    main_grad: torch.Tensor = weight.main_grad  # type: ignore[attr-defined]  # megatron's
    main_grad.add_(dw.to(main_grad.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        maker = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return maker(main_grad.shape, dtype=weight.dtype, device=weight.device)
    return None


_steps = {"count": 0, "hooked": False}


def _count_step(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    _steps["count"] += 1


def weight_cache_enabled() -> bool:
    """False when ``NEMO_FP8_WEIGHT_CACHE`` is ``0``/``false``/``no``/``off``."""
    value = os.environ.get("NEMO_FP8_WEIGHT_CACHE", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def clear_weight_cache() -> None:
    """Invalidate every cached fake-quantized weight (after writing weights in place through
    ``.data`` outside an optimizer step, which bumps no version counter)."""
    _steps["count"] += 1


def weight_key(weight: torch.Tensor, dtype: torch.dtype) -> tuple | None:
    """What a cached fake-quantized weight is valid for: the parameter's storage
    (``data_ptr``), shape, strides, dtypes and version counter (``_version``, which every
    in-place write through autograd's view of it bumps) and the count of optimizer steps
    taken in this process (a post-step hook on every ``torch.optim.Optimizer``, which
    catches optimizers that write through ``.data``). None (no caching) when
    ``NEMO_FP8_WEIGHT_CACHE=0``."""
    if not weight_cache_enabled():
        return None
    if not _steps["hooked"]:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_count_step)
        _steps["hooked"] = True
    return (
        weight.data_ptr(),
        tuple(weight.shape),
        tuple(weight.stride()),
        weight.dtype,
        dtype,
        weight.device,
        weight._version,
        _steps["count"],
    )


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (AttributeError, TypeError, RuntimeError):  # device types without autocast
        pass
    return x.dtype


def emulated_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    emu: LayerEmulator,
    *,
    wgrad_into_main_grad: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the recipe's FP8 GEMMs (any leading dims of ``x``).

    Under autocast the activation dtype is the autocast dtype and the weight is cast to it
    before quantization, as TE does; otherwise the input's dtype is used.
    """
    dtype = _compute_dtype(x)
    if not emu.enabled or emu.calibrating:
        if emu.calibrating:
            emu.quantizers["input"].record(x)
            emu.quantizers["weight"].record(weight)
        return torch.nn.functional.linear(x, weight, bias)
    lead = x.shape[:-1]
    emu.weight_key = weight_key(weight, dtype)
    with torch.autocast(device_type=x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        out = _EmulatedLinearFn.apply(x2, w, b, emu, wgrad_into_main_grad)
    return out.reshape(*lead, out.shape[-1])


class FP8EmulatedLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs run under an FP8 recipe's numerics (emulated in fp32).

    A drop-in ``nn.Linear`` (subclass; same parameters and state-dict keys). Build one from
    an existing layer with :meth:`from_linear` (the parameters are shared, not copied) or
    convert a whole model with :func:`~nemo_fp8_plugin.numerics.convert_to_fp8_emulation`.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        recipe: the recipe, keyword only: a :class:`~nemo_fp8_plugin.spec.RecipeSpec`
            (``recipe=nemo_fp8_plugin.get_recipe("fp8_blockwise")``) or any
            :class:`~.recipe.RecipeLike`. A recipe name raises :class:`~.recipe.RecipeTypeError`.

    Attributes:
        fp8_recipe: the recipe.
        fp8_emulator: the layer's :class:`LayerEmulator`.
        fp8_states: role -> :class:`DelayedScalingState` (delayed scaling only).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: RecipeLike,
    ) -> None:
        recipe = check_recipe(recipe)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_recipe = recipe
        state_device = None if device is None or torch.device(device).type == "meta" else device
        self.fp8_emulator = LayerEmulator(self.fp8_recipe, state_device)

    @property
    def fp8_states(self) -> dict[str, DelayedScalingState]:
        return self.fp8_emulator.states

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: RecipeLike) -> FP8EmulatedLinear:
        """A new module sharing ``linear``'s weight and bias Parameters (same objects)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            recipe=recipe,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.fp8_emulator.to(linear.weight.device)
        new.train(linear.training)
        return new

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> FP8EmulatedLinear:
        out = super()._apply(fn, recurse)
        # keep the delayed-scaling state on the parameters' device
        self.fp8_emulator.to(self.weight.device)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return emulated_linear(x, self.weight, self.bias, self.fp8_emulator)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.fp8_recipe.name}"


# --------------------------------------------------------------------------- BF16 GEMMs


class _BF16LinearFn(torch.autograd.Function):
    """A BF16 GEMM as tensor cores compute it: operands rounded to BF16, exact products,
    fp32 accumulation (and bias), output rounded to BF16. ``x`` is 2-D ``[M, K]``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        wgrad_into_main_grad: bool,
    ) -> torch.Tensor:
        xb, wb = x.bfloat16().float(), weight.bfloat16().float()
        out = torch.matmul(xb, wb.t())
        if bias is not None:
            out = out + bias.bfloat16().float()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.wgrad_into_main_grad = wgrad_into_main_grad
        return out.bfloat16().to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dyb = grad_out.bfloat16().float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(dyb, weight.bfloat16().float()).bfloat16().to(x.dtype)
        if ctx.needs_input_grad[1] or ctx.wgrad_into_main_grad:
            # fp32 result: megatron accumulates wgrad into an fp32 main_grad
            dw = torch.matmul(dyb.t(), x.bfloat16().float())
            grad_w = (
                _accumulate_main_grad(weight, dw)
                if ctx.wgrad_into_main_grad
                else dw.to(weight.dtype)
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


def bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    wgrad_into_main_grad: bool = False,
) -> torch.Tensor:
    """``F.linear`` with BF16 GEMM numerics computed in fp32 (see :class:`BF16EmulatedLinear`);
    the result has ``x``'s dtype, any leading dims."""
    lead = x.shape[:-1]
    with torch.autocast(device_type=x.device.type, enabled=False):
        out = _BF16LinearFn.apply(x.reshape(-1, x.shape[-1]), weight, bias, wgrad_into_main_grad)
    return out.reshape(*lead, out.shape[-1])


class BF16EmulatedLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs have BF16 numerics (operands and outputs rounded to BF16,
    fp32 accumulation), computed with fp32 GEMMs.

    The baseline arm of a precision comparison on machines without fast BF16 GEMMs (on CPUs
    without native BF16, ``torch.matmul`` on bf16 tensors is two orders of magnitude slower
    than fp32). Weight gradients stay fp32-accumulated, as megatron's ``main_grad`` is.
    """

    bf16_emulated = True

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BF16EmulatedLinear:
        """A new module sharing ``linear``'s weight and bias Parameters (same objects)."""
        new = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta"
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_linear(x, self.weight, self.bias)
