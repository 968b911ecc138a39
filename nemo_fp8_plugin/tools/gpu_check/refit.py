"""Part c, ``refit``: the trainer-side refit quantizer (``quantize_for_refit``) on the device:
GB/s next to a device copy of the same weights measured in the same run, and bit-exact with
the CPU reference on one tensor of each shape; and the public quantizers' GB/s next to a
same-run clone (:func:`quantize_bandwidth`)."""

from __future__ import annotations

from typing import Any

import torch

from ..harness import median, ratio, timed

__all__ = ["check_refit", "quantize_bandwidth", "REFIT_SHAPES"]


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
        "quantizers": quantize_bandwidth(device, n=1024 if quick else 8192),
    }


def quantize_bandwidth(device: torch.device, *, n: int = 8192) -> dict[str, Any]:
    """The public quantizers on one ``n x n`` bf16 tensor on ``device`` (whatever kernel
    :func:`nemo_fp8_plugin.numerics.kernel_for` picks there), each in GB/s and as a ratio
    against a clone of the same tensor timed in the same run. Bytes: quantizers read 2 B and
    write 1 B per element, the clone 2 B + 2 B (scales are not counted)."""
    from ...numerics import kernel_for, quantize_blockwise, quantize_mxfp8, quantize_per_tensor

    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    cases = {
        "quantize_blockwise 1x128": lambda: quantize_blockwise(x, (1, 128)),
        "quantize_blockwise 128x128": lambda: quantize_blockwise(x, (128, 128)),
        "quantize_mxfp8 1x32": lambda: quantize_mxfp8(x, 32),
        "quantize_per_tensor": lambda: quantize_per_tensor(x),
    }
    t_clone = median(timed(x.clone, device, reps=5, warmup=2))
    clone_gbs = 4 * x.numel() / t_clone / 1e9
    out: dict[str, Any] = {"shape": [n, n], "kernel": kernel_for(x, 128), "clone_gb_s": clone_gbs}
    for name, fn in cases.items():
        t = median(timed(fn, device, reps=5, warmup=2))  # warm-up calls absorb any compile
        gbs = 3 * x.numel() / t / 1e9
        out[name] = {"gb_s": gbs, "ratio_vs_clone": ratio(gbs, clone_gbs)}
    return out
