"""Convert a model's linear layers to FP8 emulation in place, and back (torchao style).

* ``torch.nn.Linear`` modules are replaced by :class:`FP8EmulatedLinear` (a subclass that
  shares the original Parameter objects, so optimizers and state-dict keys are unchanged).
* megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` (tensor-parallel size 1)
  stay the same objects; their GEMM (``_forward_impl``) is replaced on the instance, so
  their ``(output, bias)`` contract, ``skip_bias_add`` and gradient-accumulation fusion
  keep working.

Every converted module exposes ``module.fp8_states`` (role -> :class:`DelayedScalingState`,
empty unless the recipe is delayed scaling) and ``module.fp8_emulator``. For a
scale-refresh callback: run forward passes inside :func:`fp8_calibration` (high precision,
amaxes recorded) and then :func:`update_fp8_scales`.

:func:`convert_to_bf16_emulation` does the same with BF16 GEMM numerics (the baseline arm of
a precision comparison, on machines whose BF16 GEMMs are slow).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..errors import FP8ConfigError
from .delayed import DelayedScalingState
from .linear import (
    BF16EmulatedLinear,
    FP8EmulatedLinear,
    LayerEmulator,
    bf16_linear,
    emulated_linear,
)
from .recipe import RecipeLike, check_recipe

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "convert_to_fp8_emulation",
    "revert_fp8_emulation",
    "default_module_filter",
    "convert_to_bf16_emulation",
    "revert_bf16_emulation",
    "is_bf16_emulated",
    "emulated_modules",
    "fp8_calibration",
    "update_fp8_scales",
    "reset_fp8_states",
    "is_fp8_emulated",
    "fp8_states",
    "set_amax_reduction_group",
]

_MARK = "_nemo_fp8_emulated"
_BF16_MARK = "_nemo_bf16_emulated"
_ORIGINAL = "_nemo_fp8_original"

# Layers that Megatron/TE never run in FP8: the vocabulary projection.
_NEVER_FP8_NAMES = ("output_layer", "lm_head")


def default_module_filter(qualified_name: str, module: nn.Module) -> bool:
    """Convert every linear layer except the vocabulary projection (``output_layer``,
    ``lm_head``), which megatron-core keeps out of Transformer Engine and so out of FP8."""
    last = qualified_name.rsplit(".", 1)[-1]
    return last not in _NEVER_FP8_NAMES


def _megatron_linear_types() -> tuple[type[nn.Module], ...]:
    # A model holding megatron layers has imported megatron already; never import it here
    # (it takes tens of seconds and is absent on plain-torch machines).
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is None:
        return ()
    return (layers.ColumnParallelLinear, layers.RowParallelLinear)


def is_fp8_emulated(module: nn.Module) -> bool:
    """Whether ``module`` currently runs under FP8 emulation."""
    return isinstance(module, FP8EmulatedLinear) or bool(getattr(module, _MARK, False))


def is_bf16_emulated(module: nn.Module) -> bool:
    """Whether ``module`` currently runs under BF16 GEMM emulation."""
    return isinstance(module, BF16EmulatedLinear) or bool(getattr(module, _BF16_MARK, False))


def _tp_size(module: nn.Module) -> int:
    group = getattr(module, "tp_group", None)
    if group is not None:
        try:
            return group.size()
        except Exception:  # a placeholder group without size()
            pass
    out_sz = getattr(module, "output_size", None)
    out_part = getattr(module, "output_size_per_partition", None)
    if out_sz and out_part:
        return max(1, out_sz // out_part)
    in_sz = getattr(module, "input_size", None)
    in_part = getattr(module, "input_size_per_partition", None)
    if in_sz and in_part:
        return max(1, in_sz // in_part)
    return 1


def _megatron_forward_impl(
    linear: Callable[..., torch.Tensor], what: str
) -> Callable[..., torch.Tensor]:
    """Replacement for ``ColumnParallelLinear/RowParallelLinear._forward_impl`` (TP=1):
    ``linear(input, weight, bias, wgrad_into_main_grad=...)`` under the ``what`` emulation."""

    def forward_impl(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        gradient_accumulation_fusion: bool = False,
        allreduce_dgrad: bool = False,
        sequence_parallel: bool = False,
        grad_output_buffer: list[torch.Tensor] | None = None,
        wgrad_deferral_limit: int | None = None,
        tp_group: Any = None,
        **_unused: Any,
    ) -> torch.Tensor:
        if grad_output_buffer is not None:
            raise FP8ConfigError(
                "deferred embedding wgrad (defer_embedding_wgrad_compute) is "
                f"not supported by the {what} emulation",
                key="defer_embedding_wgrad_compute",
                value=True,
            )
        into_main = bool(gradient_accumulation_fusion) and hasattr(weight, "main_grad")
        return linear(input, weight, bias, wgrad_into_main_grad=into_main and weight.requires_grad)

    return forward_impl


def _check_tp(name: str, module: nn.Module, what: str) -> None:
    tp = _tp_size(module)
    if tp != 1:
        raise FP8ConfigError(
            f"{name}: tensor-parallel size {tp}; the {what} emulation converts TP=1 layers only",
            key=name,
            value=tp,
        )


def convert_to_bf16_emulation(
    model: nn.Module, module_filter: Callable[[str, nn.Module], bool] | None = None
) -> nn.Module:
    """Give ``model``'s linear layers BF16 GEMM numerics (computed in fp32), in place.

    The counterpart of :func:`convert_to_fp8_emulation` for the BF16 arm of a comparison:
    operands and outputs rounded to BF16, fp32 accumulation (:class:`BF16EmulatedLinear`).
    Same module types and rules as the FP8 converter; ``module_filter`` defaults to every
    linear layer (a BF16 run computes the output projection in BF16 too). Layers already
    under FP8 emulation are left alone. Undo with :func:`revert_bf16_emulation`.
    """
    keep = module_filter or (lambda name, module: True)
    mcore_types = _megatron_linear_types()
    if type(model) is nn.Linear:
        return BF16EmulatedLinear.from_linear(model) if keep("", model) else model
    for name, module in list(model.named_modules()):
        if is_fp8_emulated(module) or is_bf16_emulated(module):
            continue
        if type(module) is nn.Linear:
            if keep(name, module):
                parent, attr = _parent_of(model, name)
                new = BF16EmulatedLinear.from_linear(module)
                object.__setattr__(new, _ORIGINAL, module)
                setattr(parent, attr, new)
        elif mcore_types and isinstance(module, mcore_types) and keep(name, module):
            _check_tp(name, module, "BF16")
            mcore: Any = module  # a megatron-core layer: its GEMM is replaced on the instance
            mcore._forward_impl = _megatron_forward_impl(bf16_linear, "BF16")
            setattr(mcore, _BF16_MARK, True)
    return model


def revert_bf16_emulation(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_to_bf16_emulation` in place (parameters keep their identity)."""
    if isinstance(model, BF16EmulatedLinear):
        return _plain_linear(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, BF16EmulatedLinear):
            parent, attr = _parent_of(model, name)
            setattr(parent, attr, _plain_linear(module))
        elif getattr(module, _BF16_MARK, False):
            for attr in ("_forward_impl", _BF16_MARK):
                if attr in module.__dict__:
                    delattr(module, attr)
    return model


def convert_to_fp8_emulation(
    model: nn.Module,
    recipe: RecipeLike,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Swap ``model``'s linear layers for FP8-emulated ones, in place; returns ``model``.

    Args:
        model: any ``nn.Module`` (a bare ``nn.Linear`` is converted too, but then it cannot
            be swapped in its parent: use the returned module).
        recipe: a :class:`~nemo_fp8_plugin.spec.RecipeSpec` (or any
            :class:`~.recipe.RecipeLike`): ``nemo_fp8_plugin.get_recipe("fp8_blockwise")``.
            A name or mapping raises :class:`~.recipe.RecipeTypeError` (the numerics do not
            resolve names).
        module_filter: ``(qualified_name, module) -> bool``, True to convert. Default
            :func:`default_module_filter` (everything but ``output_layer`` / ``lm_head``).
            The BF16 rules supply a filter built from ``bf16_layers``.

    Converted: ``torch.nn.Linear`` (exact type) and megatron-core ``ColumnParallelLinear`` /
    ``RowParallelLinear`` with tensor-parallel size 1. Already-converted modules are left as
    they are. Raises :class:`FP8ConfigError` for a tensor-parallel layer with TP > 1.
    """
    spec = check_recipe(recipe)
    keep = module_filter or default_module_filter
    mcore_types = _megatron_linear_types()
    if type(model) is nn.Linear:
        return FP8EmulatedLinear.from_linear(model, spec) if keep("", model) else model
    for name, module in list(model.named_modules()):
        if is_fp8_emulated(module) or is_bf16_emulated(module):
            continue
        if type(module) is nn.Linear:
            if not keep(name, module):
                continue
            parent, attr = _parent_of(model, name)
            new = FP8EmulatedLinear.from_linear(module, spec)
            object.__setattr__(new, _ORIGINAL, module)  # not registered as a submodule
            setattr(parent, attr, new)
        elif mcore_types and isinstance(module, mcore_types):
            if not keep(name, module):
                continue
            _check_tp(name, module, "FP8")
            # a megatron-core layer: the emulation's attributes and GEMM set on the instance
            mcore: Any = module
            device = mcore.weight.device if getattr(mcore, "weight", None) is not None else None
            emu = LayerEmulator(spec, device)
            mcore.fp8_emulator = emu
            mcore.fp8_recipe = spec
            mcore.fp8_states = emu.states
            mcore._forward_impl = _megatron_forward_impl(partial(emulated_linear, emu=emu), "FP8")
            setattr(mcore, _MARK, True)
    return model


def _parent_of(model: nn.Module, qualified_name: str) -> tuple[nn.Module, str]:
    if "." in qualified_name:
        parent_name, attr = qualified_name.rsplit(".", 1)
        return model.get_submodule(parent_name), attr
    return model, qualified_name


def revert_fp8_emulation(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_to_fp8_emulation` in place; returns ``model``.

    ``FP8EmulatedLinear`` modules go back to ``nn.Linear`` (the original object when the
    model was converted, holding the current Parameters); megatron layers get their class's
    GEMM back. Parameters keep their identity, so an optimizer built before or during
    emulation keeps working.
    """
    if isinstance(model, FP8EmulatedLinear):
        return _plain_linear(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8EmulatedLinear):
            parent, attr = _parent_of(model, name)
            setattr(parent, attr, _plain_linear(module))
        elif getattr(module, _MARK, False):
            for attr in ("_forward_impl", "fp8_emulator", "fp8_recipe", "fp8_states", _MARK):
                if attr in module.__dict__:
                    delattr(module, attr)
    return model


def _plain_linear(module: nn.Linear) -> nn.Linear:
    original = module.__dict__.get(_ORIGINAL)
    if original is None:
        original = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
    original.weight = module.weight
    original.bias = module.bias
    original.train(module.training)
    return original


def emulated_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified_name, module)`` of every FP8-emulated module in ``model``."""
    for name, module in model.named_modules():
        if is_fp8_emulated(module):
            yield name, module


def _emulator(module: nn.Module) -> LayerEmulator:
    # set by the converters; typed by nn.Module.__getattr__ as Tensor | Module
    return cast(LayerEmulator, module.fp8_emulator)


def _emulators(model: nn.Module) -> Iterator[LayerEmulator]:
    for _, module in emulated_modules(model):
        yield _emulator(module)


@contextlib.contextmanager
def fp8_calibration(model: nn.Module) -> Iterator[nn.Module]:
    """Run forward passes in high precision while recording amaxes into the delayed-scaling
    states (TE ``fp8_autocast(enabled=False, calibrating=True)``).

    Typical scale refresh (e.g. after loading weights, or from a training callback)::

        with fp8_calibration(model):
            for batch in calibration_batches:
                model(batch)
        update_fp8_scales(model)

    Recipes without delayed scaling have no state; calibration then only runs the model
    in high precision.
    """
    emus = list(_emulators(model))
    before = [e.calibrating for e in emus]
    for e in emus:
        e.calibrating = True
    try:
        yield model
    finally:
        for e, b in zip(emus, before):
            e.calibrating = b


def fp8_states(model: nn.Module) -> dict[str, dict[str, DelayedScalingState]]:
    """``{qualified module name: {role: DelayedScalingState}}`` of every emulated layer."""
    return {name: dict(_emulator(module).states) for name, module in emulated_modules(model)}


def update_fp8_scales(model: nn.Module) -> int:
    """Apply every pending amax now (roll histories, recompute scales); returns the number
    of states updated. Without it the update happens just before each state's next cast."""
    count = 0
    for emu in _emulators(model):
        for q in emu.quantizers.values():
            if q.state is not None:
                if q.reduce_amax and q.amax_group is not None:
                    q.state.all_reduce_amax(q.amax_group)
                q.state.update()
                count += 1
    return count


def set_amax_reduction_group(model: nn.Module, group: ProcessGroup | None) -> int:
    """Share delayed-scaling amaxes across ``group`` (TE ``reduce_amax``, usually the
    data-parallel group): before each update, slot 0 of every state is MAX all-reduced over
    it. Every rank of the group must run the same emulated layers in the same order (as
    data-parallel replicas do). ``None`` turns it off (the default). Returns the number of
    roles affected; recipes with ``reduce_amax: false`` ignore the group."""
    count = 0
    for emu in _emulators(model):
        for q in emu.quantizers.values():
            if q.state is not None:
                q.amax_group = group
                count += 1
    return count


def reset_fp8_states(model: nn.Module) -> int:
    """Reset every delayed-scaling state (zero history, scale 1); returns how many."""
    count = 0
    for emu in _emulators(model):
        for state in emu.states.values():
            state.reset()
            count += 1
    return count
