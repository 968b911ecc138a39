"""Part c, ``refit``: the trainer-side refit quantizer (``quantize_for_refit``) on the device:
GB/s next to a device copy of the same weights measured in the same run, and bit-exact with
the CPU reference on one tensor of each shape."""

from __future__ import annotations

from typing import Any

import torch

from ..harness import median, ratio, timed

__all__ = ["check_refit", "REFIT_SHAPES"]


REFIT_SHAPES = {  # the linear weights of one Llama-3.1-8B layer, [out, in]
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}


def check_refit(device: torch.device, *, layers: int = 4, quick: bool = False) -> dict[str, Any]:
    """``layers`` Llama-3.1-8B layers (``quick``: one, at 1/8 of each dimension) quantized
    with ``fp8_blockwise`` on ``device``."""
    from ...rl import quantize_for_refit
    from .presets import check_recipe

    spec = check_recipe("fp8_blockwise")
    scale = 8 if quick else 1
    tensors = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in range(1 if quick else layers):
        for name, (n, k) in REFIT_SHAPES.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            tensors[f"model.layers.{layer}.{part}.{name}.weight"] = torch.randn(
                n // scale, k // scale, device=device, dtype=torch.bfloat16, generator=gen
            )
    elements = sum(t.numel() for t in tensors.values())

    def quantize_all():
        return list(quantize_for_refit(tensors.items(), spec))

    produced = dict(quantize_all())
    t_refit = median(timed(quantize_all, device, reps=5, warmup=2))
    t_copy = median(timed(lambda: [t.clone() for t in tensors.values()], device, reps=5, warmup=2))
    # bytes moved: refit reads 2 B and writes 1 B per element (+ scales); a copy 2 B + 2 B
    refit_gbs = 3 * elements / t_refit / 1e9
    copy_gbs = 4 * elements / t_copy / 1e9
    # bit-exact with the CPU reference on one tensor of each shape
    exact = True
    for name, t in list(tensors.items())[: len(REFIT_SHAPES)]:
        ref = dict(quantize_for_refit([(name, t.cpu())], spec))
        exact &= torch.equal(ref[name].view(torch.uint8), produced[name].cpu().view(torch.uint8))
        exact &= torch.equal(
            ref[name + "_scale_inv"].view(torch.int32),
            produced[name + "_scale_inv"].cpu().view(torch.int32),
        )
    return {
        "status": "ok" if exact else "failed",
        "elements": elements,
        "bit_exact": bool(exact),
        "refit_gb_s": refit_gbs,
        "copy_gb_s": copy_gbs,
        "ratio_vs_copy": ratio(refit_gbs, copy_gbs),
    }
