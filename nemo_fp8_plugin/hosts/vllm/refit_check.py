"""What a ``nemo_fp8`` vLLM engine holds, by the trainer's weight names, and the opt-in check
after each refit.

:func:`engine_weights` reads the method's parameters back as the Hugging Face weights they
were loaded from: a fused ``qkv_proj`` / ``gate_up_proj`` is cut into its parts along the
layer's ``logical_widths`` in the order of the model's ``packed_modules_mapping`` (the
order vLLM loads them in), its ``weight_scale_inv`` rows with them; a fused-MoE layer's
``w13_weight`` / ``w2_weight`` into each expert's ``w1`` / ``w3`` / ``w2`` (vLLM's shard names:
gate, up, down). ``nemo-fp8 verify-refit`` and :func:`nemo_fp8_plugin.rl.verify.verify_refit`
compare these with the trainer's weights; :func:`nemo_fp8_plugin.rl.verify.dump_engine_weights`
writes them to disk.

The check after each refit (:class:`RefitCheck`), opt-in with ``NEMO_FP8_VERIFY_REFIT``:
the worker keeps the payload tensors of a few sampled decoder layers as they stream by,
and once ``load_weights`` and the post-refit step are done, compares what those layers hold
with the payload: an FP8 payload bit for bit, a high-precision one quantized by the layer's
own quantizer (the method's numerics, those it quantizes on arrival with), also bit for bit:
a tile ``within_ulp`` of the payload fails here. Whole 3-D expert stacks are cut per expert
as vLLM's loader cuts them (:func:`expert_stack`). A layer that differs raises
:class:`RefitMismatch` naming the weight and its worst tile, and so does an FP8 weight of a
sampled layer the refit sent but with no tensor the check can match to it (one call of
:func:`~.worker.load_refit_payload` must then carry the layer whole). Its cost:
``docs/performance.md``.

Tensor and expert parallelism are not covered: a sharded layer is refused by name.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase

    from .moe import NemoFp8MoEMethod
    from .quantizer import _Quantizer

__all__ = [
    "ENV",
    "RefitCheck",
    "RefitMismatch",
    "canonical_name",
    "engine_weights",
    "expert_stack",
    "refit_check_from_env",
]

ENV = "NEMO_FP8_VERIFY_REFIT"
"""The opt-in: unset, empty or ``0`` for no check; a number ``n`` to check ``n`` decoder
layers after each refit (a different sample each time, so every layer is checked over
``layers / n`` refits); ``all`` for every layer."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)(\.)")
_EXPERT_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# a whole expert stack, [E, 2I, H] gate then up (vLLM's fused names for checkpoints that name
# experts gate/up/down or w1/w3/w2) or [E, H, I] down: RoutedExperts.load_weights in vLLM
_STACK = re.compile(r"^(.*\.experts)\.(gate_up_proj|w13|down_proj|w2)(\.weight)?(_scale_inv)?$")
_STACK_SHARDS = {"gate_up_proj": ("w1", "w3"), "w13": ("w1", "w3"), "down_proj": ("w2",)}
_STACK_SHARDS["w2"] = _STACK_SHARDS["down_proj"]

_Entry = tuple[str, torch.Tensor, "torch.Tensor | None", "_Quantizer | None"]
"""(weight name, data, scale_inv or None, the method's quantizer or None for BF16)."""


def layer_index(name: str) -> int | None:
    """The decoder layer a module or weight belongs to (``...layers.<i>....``), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def canonical_name(name: str) -> str:
    """A weight name as :func:`engine_weights` spells it: a routed expert's
    ``gate_proj`` / ``up_proj`` / ``down_proj`` become vLLM's ``w1`` / ``w3`` / ``w2`` (as
    vLLM's own ``hf_to_vllm_mapper`` for Mixtral maps them); everything else as it is."""
    return _EXPERT.sub(lambda m: m.group(1) + _EXPERT_SHARD[m.group(2)] + m.group(3), name)


def expert_stack(
    name: str, tensor: torch.Tensor, *, transposed: bool = False
) -> list[tuple[str, torch.Tensor]] | None:
    """A whole 3-D expert stack cut into each expert's weights as :func:`engine_weights`
    names them, or None for any other tensor.

    ``...experts.gate_up_proj`` (or ``experts.w13``) ``[E, 2I, H]`` gives each expert's ``w1``
    (the first half of its rows: gate) and ``w3`` (up), ``...experts.down_proj`` (or
    ``experts.w2``) ``[E, H, I]`` each expert's ``w2``: the cut vLLM's
    ``RoutedExperts.load_weights`` makes of a fused stack (``chunk(2, dim=1)``).
    ``transposed``: the stack comes ``[E, H, 2I]`` / ``[E, I, H]``, as models that set vLLM's
    ``is_fused_checkpoint_transposed`` send it. A ``_scale_inv`` stack (block scales, laid
    out as the weight's tiles) is cut the same way.
    """
    match = _STACK.match(name)
    if match is None or tensor.dim() != 3:
        return None
    experts, proj, _, scale = match.groups()
    if transposed:
        tensor = tensor.transpose(-1, -2)
    shards = _STACK_SHARDS[proj]
    parts = tensor.chunk(len(shards), dim=1) if len(shards) > 1 else (tensor,)
    suffix = ".weight" + (scale or "")
    return [
        (f"{experts}.{e}.{shard}{suffix}", part[e].contiguous() if transposed else part[e])
        for shard, part in zip(shards, parts)
        for e in range(tensor.shape[0])
    ]


def _experts_name(prefix: str) -> str:
    """The checkpoint's name of a fused-MoE layer: vLLM 0.25.1 and the newer releases read keep the experts'
    parameters in a ``routed_experts`` child of the ``experts`` module (its ``MoERunner``),
    under names the checkpoint does not have (``experts.routed_experts.w13_weight``)."""
    return prefix.removesuffix(".routed_experts")


class RefitMismatch(RuntimeError):
    """The engine does not hold what the refit sent (raised by the check after a refit)."""

    def __init__(self, message: str, checks: list) -> None:
        super().__init__(message)
        self.checks = checks
        """Every :class:`~nemo_fp8_plugin.numerics.refit_diff.WeightCheck` of the refit."""


def _unsharded(prefix: str, tp: int, ep: int = 1) -> None:
    if tp != 1 or ep != 1:
        raise ValueError(
            f"nemo_fp8 refit verification: {prefix} is sharded (tensor-parallel size {tp}, "
            f"expert-parallel size {ep}); the check compares whole layers, so run it with "
            f"one rank per layer, or compare a dump of each rank against its shard"
        )


def _split(total: int, widths: list[int] | None, names: list[str], prefix: str) -> list[int]:
    if widths is None or len(widths) != len(names) or sum(widths) != total:
        raise ValueError(
            f"nemo_fp8 refit verification: {prefix} fuses {names} but its output widths "
            f"{widths} do not add up to its {total} rows"
        )
    return list(widths)


def _linear(
    prefix: str, module: LinearBase, packed: Mapping[str, list[str]], fp8: bool
) -> Iterator[_Entry]:
    _unsharded(prefix, int(getattr(module, "tp_size", 1) or 1))
    quantizer = getattr(module.quant_method, "quantizer", None)
    parent, _, leaf = prefix.rpartition(".")
    parts = packed.get(leaf) or [leaf]
    names = [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in parts]
    weight = module.weight.detach()
    scale = module.weight_scale_inv.detach() if fp8 else None
    if len(names) == 1:
        yield names[0], weight, scale, quantizer
        return
    widths = getattr(module, "logical_widths", None) or getattr(module, "output_sizes", None)
    widths = _split(weight.shape[0], widths, parts, prefix)
    rows = 0
    for name, width in zip(names, widths):
        part_scale = None
        if scale is not None:
            block_rows = -(-weight.shape[0] // scale.shape[0])
            if rows % block_rows or (width % block_rows and rows + width != weight.shape[0]):
                raise ValueError(
                    f"nemo_fp8 refit verification: {prefix}: part {name} (rows {rows}-"
                    f"{rows + width - 1}) does not start on a {block_rows}-row scale tile"
                )
            first = rows // block_rows
            part_scale = scale[first : first + -(-width // block_rows)]
        yield name, weight[rows : rows + width], part_scale, quantizer
        rows += width


def _experts(prefix: str, module: RoutedExperts, method: NemoFp8MoEMethod) -> Iterator[_Entry]:
    moe = getattr(method, "moe", None)
    _unsharded(prefix, int(getattr(moe, "tp_size", 1) or 1), int(getattr(moe, "ep_size", 1) or 1))
    w13, w2 = module.w13_weight.detach(), module.w2_weight.detach()
    s13, s2 = module.w13_weight_scale_inv.detach(), module.w2_weight_scale_inv.detach()
    inter, srows = w13.shape[1] // 2, s13.shape[1] // 2
    q = method.quantizer
    prefix = _experts_name(prefix)
    for e in range(w13.shape[0]):
        yield f"{prefix}.{e}.w1.weight", w13[e, :inter], s13[e, :srows], q
        yield f"{prefix}.{e}.w3.weight", w13[e, inter:], s13[e, srows:], q
        yield f"{prefix}.{e}.w2.weight", w2[e], s2[e], q


def engine_weights(
    model: torch.nn.Module, *, layers: Iterable[int] | None = None
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``(weight name, data, scale_inv or None)`` for every linear weight of a ``nemo_fp8``
    engine's model (``worker.model_runner.get_model()``), as views of its parameters.

    FP8 layers give their codes and ``scale_inv`` (fp32 per tile, or E8M0); the layers the
    recipe keeps in high precision their weight and None. Names are the checkpoint's, with
    routed experts as :func:`canonical_name` spells them. ``layers``: only these decoder
    layers. A layer sharded by tensor or expert parallelism, or a linear layer of another
    quantization method (vLLM's own ``fp8``, as NeMo RL's engines run), raises ValueError.
    """
    for name, data, scale, _ in _entries(model, layers):
        yield name, data, scale


def _entries(model: torch.nn.Module, layers: Iterable[int] | None) -> Iterator[_Entry]:
    """:func:`engine_weights` with each weight's quantizer (the method's; None for BF16)."""
    from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

    from .linear import NemoFp8LinearMethod
    from .moe import NemoFp8MoEMethod

    wanted = None if layers is None else set(layers)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or (wanted is not None and layer_index(prefix) not in wanted):
            continue
        if isinstance(method, NemoFp8MoEMethod):
            yield from _experts(prefix, module, method)
        elif isinstance(method, NemoFp8LinearMethod):
            yield from _linear(prefix, module, packed, fp8=True)
        elif isinstance(method, UnquantizedLinearMethod):
            if isinstance(getattr(module, "weight", None), torch.Tensor):  # CPU may pack it away
                yield from _linear(prefix, module, packed, fp8=False)
        elif isinstance(method, LinearMethodBase):
            # another quantization method's layer (a NeMo RL engine runs vLLM's own fp8
            # method): its kernels re-lay weights and scales after loading, kernel by kernel,
            # so its parameters are not the checkpoint's tensors; refused, not misread
            raise ValueError(
                f"nemo_fp8 refit verification: {prefix} runs {type(method).__name__}, not "
                f"the nemo_fp8 method; what the engine holds is read back from nemo_fp8 "
                f"engines only: verify an exported checkpoint, or the FP8 tensors the "
                f"engine was sent, saved in the export layout (docs/hosts/vllm.md)"
            )


# --------------------------------------------------------------------------- after a refit


def refit_check_from_env(environ: Mapping[str, str] | None = None) -> RefitCheck | None:
    """The check :data:`ENV` asks for, or None. A value that is neither a number nor ``all``
    raises ValueError (a typo must not turn the check off)."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if value in ("", "0"):
        return None
    if value == "all":
        return RefitCheck(None)
    if value.isdigit():
        return RefitCheck(int(value))
    raise ValueError(f"{ENV}={value!r}: expected a number of layers per refit, 'all' or 0")


class RefitCheck:
    """Checks sampled layers of one refit: :meth:`watch` the payload, :meth:`verify` after.

    Args:
        layers: decoder layers checked per refit (None: all). The sample moves on at every
            refit (``refit`` below), so consecutive refits check different layers.
        refit: the refit's number (chooses the sample).
    """

    _refits = 0  # refits seen in this process, so that each picks another sample

    def __init__(self, layers: int | None, refit: int | None = None) -> None:
        if layers is not None and (type(layers) is not int or layers < 1):
            raise ValueError(f"layers must be a positive int or None, got {layers!r}")
        self.layers = layers
        if refit is None:
            refit = RefitCheck._refits
            RefitCheck._refits += 1
        self.refit = refit
        self.sampled: list[int] = []
        self._kept: dict[str, torch.Tensor] = {}
        self._sent_layers: set[int] = set()
        self.seconds = 0.0
        """Time spent choosing, keeping and comparing (the check's whole cost)."""

    def _sample(self, model: torch.nn.Module) -> list[int]:
        found = sorted(
            {
                i
                for prefix, module in model.named_modules()
                if getattr(module, "quant_method", None) is not None
                and (i := layer_index(prefix)) is not None
            }
        )
        if self.layers is None or self.layers >= len(found):
            return found
        # evenly spread, shifted by one layer per refit
        step = len(found) / self.layers
        return sorted(
            {found[(int(k * step) + self.refit) % len(found)] for k in range(self.layers)}
        )

    def watch(
        self, model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the payload through, keeping (a reference to) each tensor of the sampled
        layers, a whole expert stack as each expert's weights (:func:`expert_stack`); every
        other tensor streams on untouched."""
        start = time.perf_counter()
        self.sampled = self._sample(model)
        wanted = set(self.sampled)
        transposed = {
            _experts_name(prefix): bool(getattr(module, "is_fused_checkpoint_transposed", False))
            for prefix, module in model.named_modules()
            if hasattr(module, "w13_weight") and layer_index(prefix) in wanted
        }
        self.seconds += time.perf_counter() - start
        for name, tensor in named_tensors:
            if (i := layer_index(name)) is not None and i in wanted:
                stack_of = _STACK.match(name)
                parts = expert_stack(
                    name,
                    tensor,
                    transposed=stack_of is not None and transposed.get(stack_of.group(1), False),
                )
                if parts is not None or name.endswith("weight"):
                    self._sent_layers.add(i)  # a weight of it: KV scales alone do not count
                self._kept.update(parts or [(canonical_name(name), tensor)])
            yield name, tensor

    def verify(self, model: torch.nn.Module) -> list:
        """Compare the sampled layers with the kept payload. Returns the
        :class:`~nemo_fp8_plugin.numerics.refit_diff.WeightCheck` list; raises
        :class:`RefitMismatch` when a weight differs."""
        from ...numerics.refit_diff import (
            compare_high_precision,
            compare_quantized,
            missing_weight,
        )

        start = time.perf_counter()
        checks = []
        for name, data, scale, quantizer in _entries(model, self.sampled):
            sent = self._kept.get(name)
            if sent is None:
                if scale is not None and layer_index(name) in self._sent_layers:
                    # the refit sent this layer, but nothing the check can match to this
                    # weight: a name it does not know would leave the weight unchecked
                    checks.append(
                        missing_weight(
                            name, "fp8", "the refit sent its layer but no tensor of this name"
                        )
                    )
                continue  # a layer this refit did not send (a partial refit)
            if scale is None:
                checks.append(compare_high_precision(name, data, sent))
                continue
            assert quantizer is not None  # a weight with a scale has a nemo_fp8 method
            sent_scale = self._kept.get(f"{name}_scale_inv")
            if sent.dtype == data.dtype and sent_scale is not None:
                want, want_scale = sent, sent_scale
            elif sent.is_floating_point() and sent.dtype.itemsize > 1:
                want, want_scale = quantizer.weight(sent.to(data.device))
            else:
                checks.append(
                    missing_weight(name, "fp8", "the payload sent FP8 codes without scales")
                )
                continue
            checks.append(
                compare_quantized(name, data, scale, want, want_scale, quantizer.weight_block)
            )
        self._kept.clear()
        self._sent_layers.clear()
        self.seconds += time.perf_counter() - start
        # exact: the engine holds what this refit sent, or what its own quantizer made of it,
        # so any difference, a within-ulp one too, is a loading fault
        bad = [c for c in checks if c.status != "bit_equal"]
        if bad:
            first = bad[0]
            raise RefitMismatch(
                f"nemo_fp8: after refit {self.refit}, {len(bad)} of {len(checks)} checked "
                f"weights differ from the payload (layers {self.sampled}); {first.name}: "
                f"{first.status}, {first.detail}",
                checks,
            )
        return checks
