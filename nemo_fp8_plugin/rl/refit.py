"""Trainer-side refit quantizer: FP8 weights for the generation engine, computed where the
weights live (GPU or CPU), so a refit ships half the bytes of BF16.

:func:`quantize_for_refit` streams ``(name, tensor)`` pairs. Every linear weight the recipe
runs in FP8 on the generation side becomes two entries, in the layout of vLLM's block-FP8
checkpoints (DeepSeek-V3 / NeMo RL; HF ``quantization_config`` ``{quant_method: fp8, fmt:
e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}``)::

    model.layers.0.mlp.down_proj.weight            float8_e4m3fn  [N, K]
    model.layers.0.mlp.down_proj.weight_scale_inv  float32        [ceil(N/128), ceil(K/128)]

(``scale_inv = 1 / scale``, exactly as Transformer Engine stores it, so generation and
training dequantize identically.) MoE expert stacks ``[E, N, K]`` are quantized per expert
with scales ``[E, ceil(N/128), ceil(K/128)]``. MXFP8 recipes give float8 data plus E8M0
scales (``[N, K/32]`` for 1x32 weights) under the same ``_scale_inv`` name, which is what
the plugin's ``nemo_fp8`` vLLM method loads; ``mx_scale_layout="compressed_tensors"`` names
them ``<name>_scale`` as uint8 ``[N, K/32]``, vLLM's own MXFP8 checkpoint layout. Every other
tensor passes through untouched (the same tensor object).

The numerics are :func:`nemo_fp8_plugin.numerics.quantize_blockwise` /
:func:`~nemo_fp8_plugin.numerics.quantize_mxfp8` (TE-exact), which run the fastest exact
kernel for each tensor (on a CPU the single-pass C++ kernels; ``fused=`` picks another).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from ..capabilities import capability
from ..errors import FP8ConfigError, format_value

if TYPE_CHECKING:
    from ..numerics import QTensor
    from ..spec import RecipeSpec

ShardDim: TypeAlias = "int | Mapping[str, int] | Callable[[str, torch.Tensor], int] | None"
"""A weight's tensor-parallel split dim: one int, per name, per ``(name, tensor)``, or the
default (:func:`row_parallel_shard_dim`)."""

__all__ = [
    "quantize_for_refit",
    "RefitLayoutError",
    "default_is_linear_weight",
    "row_parallel_shard_dim",
    "scale_name",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Name pieces of 2-D weights that are not GEMM weights of linear layers.
_NOT_LINEAR = re.compile(
    r"(^|[._])(embed\w*|embedding\w*|wte|wpe|lm_head|output_layer|"
    r"\w*norm\w*|ln_\w+|rotary\w*|pos_emb\w*|position\w*)([._]|$)"
)

# Megatron-LM / HF / vLLM names of row-parallel (input-dim sharded) linear layers.
_ROW_PARALLEL = re.compile(
    r"(^|\.)(o_proj|down_proj|linear_proj|linear_fc2|dense_4h_to_h|"
    r"out_proj|wo|w2|w2_weight|c_proj|fc2|proj)(\.|_weight|$)"
)


def _quantizers() -> tuple[
    dict[bool | None, Callable[..., QTensor]], dict[bool | None, Callable[..., QTensor]]
]:
    from .. import numerics

    block = {
        None: numerics.quantize_blockwise,
        True: numerics.quantize_blockwise_fused,
        False: numerics.quantize_blockwise_reference,
    }
    mx = {
        None: numerics.quantize_mxfp8,
        True: numerics.quantize_mxfp8_fused,
        False: numerics.quantize_mxfp8_reference,
    }
    return block, mx


class RefitLayoutError(FP8ConfigError):
    """A tensor-parallel shard whose boundaries do not fall on quantization-block
    boundaries: quantizing it alone would not give the blocks of the gathered tensor."""


def default_is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """Which tensors are GEMM weights of linear layers (candidates for FP8).

    True for floating-point 2-D tensors (and 3-D MoE expert stacks ``[E, N, K]``) whose name
    ends in ``weight`` (``...proj.weight``, vLLM's fused-MoE ``w13_weight``), except
    embeddings (``embed*``, ``wte``, ``wpe``), the output head (``lm_head``,
    ``output_layer``), norms (``*norm*``, ``ln_*``) and position tables. Pass your own
    ``is_linear_weight`` to :func:`quantize_for_refit` to override.
    """
    if tensor.dtype not in _FLOAT_DTYPES or tensor.dim() not in (2, 3):
        return False
    if not (name.endswith(".weight") or name.endswith("_weight") or name == "weight"):
        return False
    module = name[: -len("weight")].rstrip("._")
    return _NOT_LINEAR.search(module) is None


def row_parallel_shard_dim(name: str, tensor: torch.Tensor) -> int:
    """Default tensor-parallel split of a weight ``[N, K]``: 1 (the input dim) for
    row-parallel layers (``o_proj``, ``down_proj``, ``linear_proj``, ``linear_fc2``, ...),
    0 (the output dim) for everything else (column-parallel)."""
    return 1 if _ROW_PARALLEL.search(name) else 0


def scale_name(
    name: str, spec: RecipeSpec | None = None, *, mx_scale_layout: str = "nemo_fp8"
) -> str:
    """The name of a quantized weight's scale tensor: ``<name>_scale_inv`` (block scaling,
    and MXFP8 for the plugin's ``nemo_fp8`` method), or ``<name>_scale`` (MXFP8 in vLLM's
    compressed-tensors layout)."""
    if (
        spec is not None
        and capability(spec.scaling).is_mx
        and mx_scale_layout == "compressed_tensors"
    ):
        return f"{name}_scale"
    return f"{name}_scale_inv"


def _items(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    seen: set[str] = set()  # names only: the tensors are not kept
    for i, item in enumerate(pairs):
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            what = (
                f"{format_value(item[0])}: {type(item[1]).__name__}"
                if isinstance(item, tuple) and len(item) == 2
                else format_value(item)
            )
            raise FP8ConfigError(
                f"item {i} is not a (name, torch.Tensor) pair: {what}", key="named_tensors"
            )
        if item[0] in seen:
            # The engine's load_weights keeps the last of two; which one wins is not ours
            # to guess, and a stream naming one weight twice is a caller's bug.
            raise FP8ConfigError(
                f"item {i} names {format_value(item[0])} a second time",
                key="named_tensors",
                value=item[0],
                hint="each weight name once",
            )
        seen.add(item[0])
        yield item


def _answer(value: object, key: str) -> bool:
    """A callback's yes/no; a string (``"false"``) is a mistake, not True."""
    if isinstance(value, (str, bytes)) or value is None:
        raise FP8ConfigError(
            f"returned {format_value(value)}, expected True or False", key=key, value=value
        )
    return bool(value)


def _check_args(
    named_tensors: object,
    keep_bf16: object,
    num_layers: object,
    tp_rank: object,
    tp_size: object,
    shard_dim: object,
    is_linear_weight: object,
    mx_scale_layout: object,
    fused: object,
) -> None:
    """Every argument of :func:`quantize_for_refit` by type and range, named when wrong
    (``fused="false"`` is a mistake, not True)."""
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not (
        isinstance(named_tensors, Mapping) or hasattr(named_tensors, "__iter__")
    ):
        raise FP8ConfigError(
            f"expected (name, tensor) pairs or a mapping, got {format_value(named_tensors)}",
            key="named_tensors",
        )
    for key, fn in (("keep_bf16", keep_bf16), ("is_linear_weight", is_linear_weight)):
        if fn is not None and not callable(fn):
            raise FP8ConfigError(
                f"expected a function or None, got {format_value(fn)}", key=key, value=fn
            )
    for key, value, low in (
        ("num_layers", num_layers, 1),
        ("tp_rank", tp_rank, 0),
        ("tp_size", tp_size, 1),
    ):
        if value is not None and (type(value) is not int or value < low):
            raise FP8ConfigError(
                f"expected an integer >= {low} or None, got {format_value(value)}",
                key=key,
                value=value,
            )
    if not (
        shard_dim is None
        or callable(shard_dim)
        or isinstance(shard_dim, Mapping)
        or (type(shard_dim) is int and shard_dim in (0, 1))
    ):
        raise FP8ConfigError(
            f"expected 0, 1, a mapping, a function or None, got {format_value(shard_dim)}",
            key="shard_dim",
            value=shard_dim,
        )
    if not isinstance(mx_scale_layout, str) or mx_scale_layout not in (
        "nemo_fp8",
        "compressed_tensors",
    ):
        raise FP8ConfigError(
            f"expected 'nemo_fp8' or 'compressed_tensors', got {format_value(mx_scale_layout)}",
            key="mx_scale_layout",
            value=mx_scale_layout,
        )
    if fused is not None and not isinstance(fused, bool):
        raise FP8ConfigError(
            f"expected True, False or None, got {format_value(fused)}", key="fused", value=fused
        )


def _keep_bf16_from_rules(spec: RecipeSpec, num_layers: int | None) -> Callable[[str], bool]:
    from ..rules import keeps_bf16

    def keep(name: str) -> bool:
        return keeps_bf16(spec, name, side="generation", num_layers=num_layers) is not None

    return keep


def _resolve_shard_dim(shard_dim: ShardDim, name: str, tensor: torch.Tensor) -> int:
    if shard_dim is None:
        return row_parallel_shard_dim(name, tensor)
    if callable(shard_dim):
        dim = shard_dim(name, tensor)
    elif isinstance(shard_dim, Mapping):
        if name not in shard_dim:
            return row_parallel_shard_dim(name, tensor)
        dim = shard_dim[name]
    else:
        dim = shard_dim
    if type(dim) is not int:  # "1" or 1.0 is a mistake to name, not a dim to guess
        raise RefitLayoutError(
            f"{name}: shard_dim must be 0 or 1, got {format_value(dim)}", key="shard_dim", value=dim
        )
    return dim


def _check_shard(
    name: str,
    tensor: torch.Tensor,
    block: tuple[int, int],
    tp_rank: int | None,
    tp_size: int | None,
    shard_dim: ShardDim,
) -> None:
    """A shard's blocks are the gathered tensor's blocks iff its length along the split
    dim is a multiple of the block there (shards are equal-sized, as Megatron and vLLM
    split them), so that every shard boundary is a block boundary."""
    dim = _resolve_shard_dim(shard_dim, name, tensor)
    if dim not in (0, 1):
        raise RefitLayoutError(
            f"{name}: shard_dim must be 0 (output dim) or 1 (input dim), got {dim}",
            key=name,
            value=dim,
        )
    size = tensor.shape[-2 + dim]
    need = block[dim]
    if size % need:
        where = "output" if dim == 0 else "input"
        raise RefitLayoutError(
            f"{name}: tensor-parallel shard {tp_rank} of {tp_size} has {size} rows along the "
            f"{where} dim (dim {dim}), not a multiple of the {need}-element quantization block; "
            f"its blocks would straddle shard boundaries and differ from the gathered "
            f"weight's",
            key=name,
            value=tuple(tensor.shape),
            hint=f"use a tensor-parallel size that splits dim {dim} into multiples of {need}, "
            f"or gather before quantizing",
        )


def quantize_for_refit(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    spec: RecipeSpec | str | Mapping[str, Any],
    *,
    keep_bf16: Callable[[str], bool] | None = None,
    num_layers: int | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    shard_dim: ShardDim = None,
    is_linear_weight: Callable[[str, torch.Tensor], bool] | None = None,
    mx_scale_layout: str = "nemo_fp8",
    fused: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Quantize a stream of named weights for the generation engine (a generator).

    Args:
        named_tensors: ``(name, tensor)`` pairs or a mapping (e.g. ``model.state_dict()``,
            ``model.named_parameters()``, a converted HF state dict). Consumed lazily: one
            tensor is quantized and yielded before the next is read, so memory stays at
            about one weight.
        spec: a :class:`~nemo_fp8_plugin.spec.RecipeSpec` or recipe name (block or mx scaling; its
            ``weight_block``, ``pow2_scales`` and generation-side BF16 rules apply). With
            ``generation: bf16`` everything passes through.
        keep_bf16: ``name -> bool``, True to leave a weight in high precision. Default: the
            recipe's BF16 rules on the generation side
            (:func:`nemo_fp8_plugin.rules.keeps_bf16`, which also keeps the output head and
            MoE routers in high precision).
        num_layers: number of transformer layers, needed by ``bf16_layers.last``.
        tp_rank, tp_size: this rank's tensor-parallel coordinates when the tensors are
            shards; each shard is checked to split on block boundaries.
        shard_dim: split dim of each weight ``[N, K]`` (0 output, 1 input): an int, a
            mapping name -> dim, or ``(name, tensor) -> dim``. Default
            :func:`row_parallel_shard_dim` (1 for row-parallel layers by name, else 0).
        is_linear_weight: ``(name, tensor) -> bool`` selecting FP8 candidates. Default
            :func:`default_is_linear_weight`.
        mx_scale_layout: MXFP8 only. ``"nemo_fp8"`` (default): ``<name>_scale_inv``,
            ``float8_e8m0fnu``, the recipe's tile layout. ``"compressed_tensors"``:
            ``<name>_scale``, ``uint8`` ``[N, K/32]`` (32x32 tiles are repeated per row).
        fused: which kernel quantizes: None (default) the public quantizers, which pick the
            fastest exact one for the tensor (the single-pass C++ kernels on a CPU, compiled
            ones on CUDA; :func:`nemo_fp8_plugin.numerics.kernel_for`); True the compiled
            (``torch.compile``) ones; False the eager reference. All give the same bits.

    Yields:
        ``(name, float8 weight)`` then ``(scale_name, scales)`` for each FP8 weight, and
        ``(name, tensor)`` unchanged for everything else, in input order.

    Raises:
        FP8ConfigError: per-tensor recipes (vLLM's refit path is block or MX), bad
            arguments. RefitLayoutError: a shard that does not split on block boundaries.
    """
    from ..numerics.reference import check_block
    from ..registry import get_recipe

    _check_args(
        named_tensors,
        keep_bf16,
        num_layers,
        tp_rank,
        tp_size,
        shard_dim,
        is_linear_weight,
        mx_scale_layout,
        fused,
    )
    try:
        spec = get_recipe(spec)
    except FP8ConfigError as err:  # the argument is `spec`
        key = "spec" if err.key in (None, "recipe") else f"spec.{err.key}"
        raise FP8ConfigError(err.bare_message, key=key, value=err.value, hint=err.hint) from None
    if spec.generation != "fp8":
        yield from _items(named_tensors)
        return
    row = capability(spec.scaling)
    if not row.vllm_generation:  # the layouts the nemo_fp8 vLLM method loads
        raise FP8ConfigError(
            f"refit quantization needs block or mx scaling, not "
            f"{spec.scaling!r} (recipe {spec.name}): vLLM's FP8 refit "
            f"path stores per-block scales",
            key="scaling",
            value=spec.scaling,
            hint="use fp8_blockwise (or mxfp8 on Blackwell) for generation",
        )
    if mx_scale_layout not in ("nemo_fp8", "compressed_tensors"):
        raise FP8ConfigError(
            f"expected 'nemo_fp8' or 'compressed_tensors', got {mx_scale_layout!r}",
            key="mx_scale_layout",
            value=mx_scale_layout,
        )
    if (tp_rank is None) != (tp_size is None):
        raise FP8ConfigError("pass tp_rank and tp_size together", key="tp_size", value=tp_size)
    sharded = tp_size is not None and tp_size > 1
    # tp_rank is set exactly when tp_size is (checked above)
    if tp_size is not None and tp_rank is not None and (tp_size < 1 or not 0 <= tp_rank < tp_size):
        raise FP8ConfigError(
            f"tp_rank {tp_rank} is not in [0, {tp_size})", key="tp_rank", value=tp_rank
        )
    block_quantizers, mx_quantizers = _quantizers()
    keep = keep_bf16 if keep_bf16 is not None else _keep_bf16_from_rules(spec, num_layers)
    is_linear = is_linear_weight or default_is_linear_weight
    block = check_block(spec.weight_block, key="weight_block")  # the tuple a tiled kind has
    fmt = spec.format_for("weight")

    for name, tensor in _items(named_tensors):
        if (
            tensor.dtype in _FP8_DTYPES
            or not _answer(is_linear(name, tensor), "is_linear_weight")
            or _answer(keep(name), "keep_bf16")
        ):
            yield name, tensor
            continue
        if sharded:
            _check_shard(name, tensor, block, tp_rank, tp_size, shard_dim)
        w = tensor.detach()
        if row.is_block:
            quantize = block_quantizers[fused]
            q = quantize(w, block, fmt, pow2_scales=spec.pow2_scales, eps=spec.amax_epsilon)
            scales = q.scale_inv
        else:
            q = mx_quantizers[fused](w, block, fmt)
            scales = q.scale_inv
            if mx_scale_layout == "compressed_tensors":
                scales = scales.view(torch.uint8)
                if block[0] != 1:  # the same scale for each of the tile's rows
                    scales = scales.repeat_interleave(block[0], dim=-2)[..., : w.shape[-2], :]
        yield name, q.data
        yield scale_name(name, spec, mx_scale_layout=mx_scale_layout), scales
        del q, scales
