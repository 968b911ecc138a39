"""Part b, ``gemm``: FP8 GEMM throughput vs BF16 through torch's own ``scaled_mm``.

At M=N=K=4096 and 8192: tensor-wise, row-wise, 1x128 x 128x128 and 1x128 x 1x128 block
scales, where the installed torch and GPU support them, each as a ratio to the BF16 rate
measured in the same run. Every result is first checked against the fp32 product of the
BF16 operands, so a wrong scale layout cannot report a fast but wrong number.

``require_cuda=False`` runs the same code on the CPU (torch's CPU ``scaled_mm`` has the
tensor-wise and row-wise forms): that is how the tests reach it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..harness import median, ratio, timed
from .result import skipped

__all__ = ["check_gemm", "MAX_REL_ERROR"]

MAX_REL_ERROR = 0.1
"""Largest relative Frobenius error of an FP8 GEMM against the fp32 product of the BF16
operands: E4M3 rounding gives a few percent on Gaussian data; a scale in the wrong layout
gives order one."""


def _time(fn, device) -> float:
    return median(timed(fn, device, reps=10, warmup=3))


def _scaled_mm_variants():
    """(name, a_tile, b_tile, scaling enums) the installed torch can express."""
    import torch.nn.functional as F

    scaling = getattr(F, "ScalingType", None)
    if not hasattr(F, "scaled_mm") or scaling is None:
        return None, []
    return F, [
        ("tensorwise", None, None, (scaling.TensorWise, scaling.TensorWise)),
        ("rowwise", "row", "row", (scaling.RowWise, scaling.RowWise)),
        (
            "block_1x128_128x128",
            (1, 128),
            (128, 128),
            (scaling.BlockWise1x128, scaling.BlockWise128x128),
        ),
        ("block_1x128_1x128", (1, 128), (1, 128), (scaling.BlockWise1x128, scaling.BlockWise1x128)),
    ]


def _scaled_mm_call(F, da, db, sa, sb, kinds):
    """One variant's GEMM ``a @ b.T`` as a zero-argument callable."""

    def run():
        return F.scaled_mm(da, db.t(), sa, kinds[0], sb, kinds[1], output_dtype=torch.bfloat16)

    return run


def _operand(numerics, x: torch.Tensor, tile):
    """FP8 data and its decode scales in the layout cuBLAS wants for ``tile``."""
    if tile is None:
        q = numerics.quantize_per_tensor(x)
        return q.data, q.scale_inv.reshape(())
    if tile == "row":
        amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        scale = 448.0 / amax
        data = (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return data, (1.0 / scale).float()
    q = numerics.quantize_blockwise(x, block=tile)
    scale_inv = q.scale_inv
    if tile == (1, 128):
        # cuBLAS reads 1x128 scales "outer-dim major": [M, K/128] with stride (1, M).
        scale_inv = scale_inv.t().contiguous().t()
    return q.data, scale_inv


def check_gemm(
    device: torch.device, *, sizes=(4096, 8192), require_cuda: bool = True
) -> dict[str, Any]:
    """FP8 ``scaled_mm`` variants against BF16 on ``device`` (see the module docstring). A
    variant torch refuses is ``unsupported`` with torch's reason, not a failure: read it, as
    torch refuses a scale layout it does not accept with the same error as a GEMM the build or
    GPU lacks. A wrong result fails the part."""
    if require_cuda and device.type != "cuda":
        return skipped("FP8 tensor-core GEMMs need a CUDA device")
    from ... import numerics

    F, variants = _scaled_mm_variants()
    if F is None:
        return skipped(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    out: dict[str, Any] = {"status": "ok", "sizes": {}}
    for n in sizes:
        gen = torch.Generator(device=device).manual_seed(n)
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
        flops = 2.0 * n**3
        t_bf16 = _time(functools.partial(torch.matmul, a, b.t()), device)
        row: dict[str, Any] = {"bf16_tflops": flops / t_bf16 / 1e12}
        reference = a.float() @ b.float().t()
        for name, tile_a, tile_b, kinds in variants:
            da, sa = _operand(numerics, a, tile_a)
            db, sb = _operand(numerics, b, tile_b)
            if tile_b == "row":
                sb = sb.t()  # one scale per column of mat_b = b.T: [1, N]
            run = _scaled_mm_call(F, da, db, sa, sb, kinds)
            try:
                result = run().float()
            except Exception as exc:  # this torch build or GPU lacks the variant: say so
                row[name] = {
                    "status": "unsupported",
                    "reason": f"{type(exc).__name__}: {exc}"[:300],
                }
                continue
            rel = ((result - reference).norm() / reference.norm()).item()
            if not math.isfinite(rel) or rel > MAX_REL_ERROR:
                row[name] = {
                    "status": "failed",
                    "rel_error": rel,
                    "reason": f"relative error {rel:.3g} against the high-precision "
                    f"product (FP8 rounding gives < {MAX_REL_ERROR:g}): "
                    f"a scale in the wrong layout",
                }
                out["status"] = "failed"
                continue
            t = _time(run, device)
            row[name] = {
                "tflops": flops / t / 1e12,
                "ratio_vs_bf16": ratio(t_bf16, t),
                "rel_error": rel,
            }
        out["sizes"][str(n)] = row
    if out["status"] == "failed":
        out["reason"] = "an FP8 GEMM result is wrong (see sizes)"
    return out
