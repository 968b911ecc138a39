"""NeMo RL's vLLM-side refit quantizer, bit for bit, in eager torch.

NeMo RL does not quantize weights on the trainer. Its vLLM worker receives BF16 weights at
every refit and quantizes them itself, per 128x128 tile, in
``cast_tensor_to_fp8_blockwise`` (``nemo_rl/models/generation/vllm/quantization/fp8.py``,
called from its patched ``load_weights`` with ``v.to(torch.float)``). That function is not
Transformer Engine's block quantizer (:func:`.quantize.quantize_blockwise`), so an engine fed
by NeMo RL holds weights that differ from the trainer's FP8 weights in some codes and scales.
:func:`quantize_weight_nemo_rl` computes what NeMo RL's function computes:

* input: a 2-D tensor, upcast to fp32 (NeMo RL's caller passes ``weight.to(torch.float)``);
* a partial tile is padded, not with zeros but with the tensor's **last element**
  ``w[-1, -1]`` (``F.pad(..., value=data_hp[-1, -1])``), so the padding can raise the amax of
  the last row and column of tiles;
* ``amax`` per tile in fp32 (``torch.amax``: a NaN propagates, so a NaN element makes the tile's
  amax, scale and every code NaN);
* ``scale = 448 / amax`` written as a Python float over a tensor, which torch evaluates as
  ``reciprocal(amax) * 448`` (not correctly rounded; TE divides); ``scale = 1`` where
  ``amax == 0`` or ``amax == inf``. A subnormal amax gives ``reciprocal = inf``, a scale of
  inf and a stored scale of 0;
* codes ``cast(clamp(w * scale, -448, 448))`` (saturating, round to nearest even);
* stored: ``scale_inv = reciprocal(scale)`` (fp32), shape ``[ceil(N/128), ceil(K/128)]``
  (NeMo RL squeezes its trailing 1).

With ``pow2_scales`` (NeMo RL's ``use_weight_pow2_scale``): ``e = ceil(log2(amax / 448))``
clamped to ``[-127, 127]``, biased by 127 into a uint8, ``scale = 2^(127 - biased)`` except
``scale = 1`` where the biased exponent is 0; a NaN amax goes through the uint8 cast as torch
casts it on the host (the tests compare with NeMo RL's own code on the same machine).

Imports only torch and :mod:`nemo_fp8_plugin.errors`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import FP8ConfigError

__all__ = ["NEMO_RL_WEIGHT_BLOCK", "quantize_weight_nemo_rl"]

NEMO_RL_WEIGHT_BLOCK = (128, 128)
"""NeMo RL's ``FP8_BLOCK_QUANT_KWARGS["weight_block_size"]``."""

_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max, what NeMo RL reads


def _tiles(w: torch.Tensor, bm: int, bk: int) -> tuple[torch.Tensor, int, int]:
    """``w`` padded with its last element to whole tiles, as ``[tiles_m, tiles_k, bm * bk]``."""
    m, k = w.shape
    pm, pk = (-m) % bm, (-k) % bk
    if pm or pk:
        w = F.pad(w, (0, pk, 0, pm), mode="constant", value=float(w[-1, -1]))
    tm, tk = w.shape[0] // bm, w.shape[1] // bk
    return w.reshape(tm, bm, tk, bk).permute(0, 2, 1, 3).reshape(tm, tk, bm * bk), tm, tk


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    biased = (torch.ceil(torch.log2(amax / _E4M3_MAX)).clamp(-127, 127) + 127).to(torch.uint8)
    return torch.where(biased == 0, 1.0, torch.exp2(127 - biased.to(torch.float32)))


def quantize_weight_nemo_rl(
    weight: torch.Tensor,
    block: tuple[int, int] = NEMO_RL_WEIGHT_BLOCK,
    *,
    pow2_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[N, K]`` as NeMo RL's vLLM worker quantizes it at refit.

    Args:
        weight: a 2-D floating tensor (bf16 as the trainer sends it, or fp32).
        block: square tile shape (NeMo RL asserts the two sides are equal).
        pow2_scales: NeMo RL's ``use_weight_pow2_scale``.

    Returns:
        ``(data, scale_inv)``: float8_e4m3fn codes of ``weight``'s shape and fp32 stored scales
        ``[ceil(N / block[0]), ceil(K / block[1])]``, vLLM's ``weight`` / ``weight_scale_inv``.
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise FP8ConfigError("expected a floating-point tensor", key="weight")
    if weight.dim() != 2:
        raise FP8ConfigError(
            f"NeMo RL quantizes 2-D weights, got shape {tuple(weight.shape)}",
            key="weight",
            value=tuple(weight.shape),
        )
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)
        or block[0] != block[1]
    ):
        raise FP8ConfigError(
            f"NeMo RL's weight tiles are square (n, n), got {block!r}", key="block", value=block
        )
    bm, bk = int(block[0]), int(block[1])
    m, k = weight.shape
    tiles, tm, tk = _tiles(weight.to(torch.float32), bm, bk)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    if pow2_scales:
        scale = _pow2_scale(amax)
    else:
        # the Python-float-over-tensor form NeMo RL writes: torch's reciprocal, then * 448
        scale = _E4M3_MAX / amax
        scale = torch.where((amax == 0) | (amax == torch.inf), 1.0, scale)
    scale_inv = torch.reciprocal(scale)
    codes = (tiles * scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    data = codes.reshape(tm, tk, bm, bk).permute(0, 2, 1, 3).reshape(tm * bm, tk * bk)
    return data[:m, :k].contiguous(), scale_inv.reshape(tm, tk)
