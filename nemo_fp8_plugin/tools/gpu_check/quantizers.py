"""Part a, ``quantizers``: the plugin's quantizers on the device, eager and compiled, bit for
bit against the CPU reference, for every recipe, role, input dtype and a set of edge tiles;
and the emulation's fake-quantization (``fake_quant_*``) against the CPU reference's
``dequantize(quantize(x))``, for the same cases plus the column-wise tiles the emulation uses.

Runs on any device: on the CPU it checks the plumbing, the edge inputs and the report
(``tests/tools/test_gpu_check.py``); on a GPU it is the check.
"""

from __future__ import annotations

from typing import Any

import torch

from ...capabilities import capability
from .result import Deadline

__all__ = ["edge_inputs", "check_quantizers"]


def edge_inputs(rows: int, cols: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random data plus tiles that stress the scale logic (built on CPU, deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols).unsqueeze(0)
    cases = {"random": base.clone()}
    edge = base.clone()
    edge[:, :128] = 0.0  # an all-zero tile
    edge[0, 130] = 3.0e4  # one huge value in a tile
    edge[1, 256:384] = 1e-40  # subnormal tile (fp32)
    edge[2, 5] = float("inf")
    edge[3, 7] = float("-inf")
    edge[4, 9] = float("nan")
    edge[5, 300] = 448.0  # exactly E4M3 max
    edge[6, 400:410] = torch.tensor(
        [447.9, 448.1, 240.0, 239.9, 0.0019, 0.00195, 0.00196, 1.0, 0.9999, 1.0001]
    )  # values rounding across binades
    cases["edges"] = edge
    return {k: v.to(dtype) for k, v in cases.items()}


def _qtensor_equal(a, b) -> bool:
    same_data = torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8).cpu())
    sa, sb = a.scale_inv.cpu(), b.scale_inv.cpu()
    if sa.dtype != torch.float32:
        sa, sb = sa.view(torch.uint8), sb.view(torch.uint8)
    else:
        sa, sb = sa.view(torch.int32), sb.view(torch.int32)  # bitwise, NaN-safe
    return same_data and torch.equal(sa, sb)


def _fp32_differing(want: torch.Tensor, got: torch.Tensor) -> int:
    """How many elements of two fp32 tensors differ bitwise (all of them if shape or dtype
    differ). NaN matches any NaN: GPUs return a canonical NaN from arithmetic, so a
    dequantized NaN's payload is not part of the contract."""
    want, got = want.cpu(), got.cpu()
    if want.shape != got.shape or want.dtype != got.dtype or got.dtype != torch.float32:
        return max(want.numel(), 1)
    both_nan = torch.isnan(want) & torch.isnan(got)
    return int(((want.view(torch.int32) != got.view(torch.int32)) & ~both_nan).sum())


def check_quantizers(
    device: torch.device, *, quick: bool = False, recipes=None, deadline: Deadline | None = None
) -> dict[str, Any]:
    """Every recipe's quantizers on ``device`` against the CPU reference (see the module
    docstring). ``recipes``: the specs to check (default: :func:`.presets.check_recipes`).
    ``deadline``: stop between recipes and roles once it has passed; the result then says
    what was left out under ``incomplete`` (the first compilation of the fused kernels is
    the cost no one can predict for a new GPU)."""
    from ... import numerics
    from .presets import check_recipes

    specs = check_recipes()[0] if recipes is None else list(recipes)
    rows, cols = (256, 512) if quick else (512, 1024)
    results, mismatches, fake_quant = [], [], []
    left_out: list[str] = []
    for spec in specs:
        for role in ("input", "weight", "grad_output"):
            if deadline is not None and deadline.passed():
                left_out.append(f"{spec.name}/{role}")
                continue
            block, fmt = spec.block_for(role), spec.format_for(role)
            for dtype in (torch.float32, torch.bfloat16):
                for case, x in edge_inputs(rows, cols, dtype, seed=len(results)).items():
                    if capability(spec.scaling).is_nvfp4:  # FP4: quantize_nvfp4, dequantize
                        row, fq = _check_nvfp4(numerics, spec, role, x, device)
                        row.update(case=case, dtype=str(dtype).split(".")[-1])
                        results.append(row)
                        for r in fq:
                            r.update(case=case, dtype=str(dtype).split(".")[-1])
                        fake_quant.extend(fq)
                        mismatches += [r for r in [row, *fq] if not r["bit_exact"]]
                        continue
                    ref = _quantize(numerics, spec, block, fmt, x, fused=False)
                    for fused in (False, True):
                        got = _quantize(numerics, spec, block, fmt, x.to(device), fused=fused)
                        ok = _qtensor_equal(ref, got)
                        row = {
                            "recipe": spec.name,
                            "role": role,
                            "dtype": str(dtype).split(".")[-1],
                            "case": case,
                            "fused": fused,
                            "bit_exact": ok,
                        }
                        results.append(row)
                        if not ok:
                            mismatches.append(row)
                    for row in _check_fake_quant(numerics, spec, block, fmt, x, device):
                        row.update(
                            recipe=spec.name, role=role, dtype=str(dtype).split(".")[-1], case=case
                        )
                        fake_quant.append(row)
                        if not row["bit_exact"]:
                            mismatches.append(row)
    delayed = [s for s in specs if capability(s.scaling).is_delayed]
    if delayed:
        row = _check_delayed(numerics, delayed[0], device)
        results.append(row)
        if not row["bit_exact"]:
            mismatches.append(row)
    out = {
        "status": "ok" if not mismatches else "failed",
        "checked": len(results) + len(fake_quant),
        "mismatches": mismatches[:20],
        "fake_quant": fake_quant,
        "compile_failed": numerics.compile_failed(),
    }
    if left_out:
        out["incomplete"] = (
            f"the part's share of the time budget ran out: {', '.join(left_out)} not checked"
        )
    return out


def _fake_quant_variants(numerics, spec, block, fmt, x: torch.Tensor):
    """``(function name, tile, reference on CPU, device call)`` for each way the emulation
    fake-quantizes this role. The device call takes the device tensor and returns a tuple
    of fp32 tensors (the delayed cast also returns its amax, which feeds the next scale)."""
    from ...numerics import fused
    from ...numerics.scaling import FLT_MAX, reciprocal

    row = capability(spec.scaling)
    if row.is_delayed:
        # A scale from a smaller (stale) amax, as delayed scaling has after a growth step,
        # so the clamp to +-fp8_max is exercised along with the rounding.
        stale = numerics.tensor_amax(x) * 0.5
        scale = numerics.scale_from_amax(
            stale, numerics.fp8_max(fmt), pow2=False, eps=0.0, value_for_inf=FLT_MAX
        )
        scale_inv = reciprocal(scale)

        def ref(t):
            q = numerics.quantize_with_scale(t, scale, fmt, scale_inv=scale_inv)
            return q.dequantize(), numerics.tensor_amax(t)

        def run(t):
            return tuple(
                fused.fake_quant_with_scale(
                    t, scale.to(t.device), scale_inv.to(t.device), fmt, force=True
                )
            )

        return [("fake_quant_with_scale", None, ref, run)]
    if row.is_current:
        return [
            (
                "fake_quant_per_tensor",
                None,
                lambda t: (
                    numerics.quantize_per_tensor(
                        t, fmt=fmt, pow2_scales=spec.pow2_scales, eps=spec.amax_epsilon
                    ).dequantize(),
                ),
                lambda t: (
                    fused.fake_quant_per_tensor(
                        t, fmt, spec.pow2_scales, spec.amax_epsilon, force=True
                    ),
                ),
            )
        ]
    # Non-square tiles are also quantized column-wise, as Nx1 tiles of the same tensor
    # (RoleQuantizer.columnwise); that is a different reduction layout for the compiler.
    tiles = [tuple(block)] + ([(block[1], block[0])] if block[0] != block[1] else [])
    out = []
    for tile in tiles:
        if row.is_block:
            out.append(
                (
                    "fake_quant_blockwise",
                    tile,
                    lambda t, tile=tile: (
                        numerics.quantize_blockwise(
                            t,
                            block=tile,
                            fmt=fmt,
                            pow2_scales=spec.pow2_scales,
                            eps=spec.amax_epsilon,
                        ).dequantize(),
                    ),
                    lambda t, tile=tile: (
                        fused.fake_quant_blockwise(
                            t, tile, fmt, spec.pow2_scales, spec.amax_epsilon, force=True
                        ),
                    ),
                )
            )
        else:
            out.append(
                (
                    "fake_quant_mxfp8",
                    tile,
                    lambda t, tile=tile: (
                        numerics.quantize_mxfp8(t, block=tile, fmt=fmt).dequantize(),
                    ),
                    lambda t, tile=tile: (fused.fake_quant_mxfp8(t, tile, fmt, force=True),),
                )
            )
    return out


def _check_fake_quant(numerics, spec, block, fmt, x: torch.Tensor, device) -> list[dict]:
    """The emulation's fake-quantization on the device vs the CPU reference's
    ``dequantize(quantize(x))``: its rounding is float arithmetic (a Veltkamp split), whose
    exactness a compiler's FMA contraction or reassociation would break."""
    rows = []
    xd = x.to(device)
    for name, tile, ref_fn, run_fn in _fake_quant_variants(numerics, spec, block, fmt, x):
        want = ref_fn(x)
        for fused in (False, True):
            if fused:
                got = run_fn(xd)
            else:
                with numerics.fused_mode(False):
                    got = run_fn(xd)
            differing = sum(_fp32_differing(w, g) for w, g in zip(want, got))
            rows.append(
                {
                    "fn": name,
                    "tile": list(tile) if tile else None,
                    "fmt": fmt,
                    "fused": fused,
                    "bit_exact": differing == 0,
                    "differing": differing,
                }
            )
    return rows


def _nvfp4_equal(a, b) -> bool:
    return (
        torch.equal(a.data.cpu(), b.data.cpu())
        and torch.equal(a.scale_inv.cpu().view(torch.uint8), b.scale_inv.cpu().view(torch.uint8))
        and torch.equal(
            a.global_amax.cpu().view(torch.int32), b.global_amax.cpu().view(torch.int32)
        )
    )


def _check_nvfp4(numerics, spec, role: str, x: torch.Tensor, device) -> tuple[dict, list[dict]]:
    """``quantize_nvfp4`` on the device vs the CPU (data, E4M3 scales, global amax bytes), and
    its ``dequantize`` (the emulation's fake-quantization), with TE's layout: the role's tile,
    and the Hadamard transform on the wgrad operands (inputs, gradients)."""
    block, rht = tuple(spec.block_for(role)), role != "weight"
    ref = numerics.quantize_nvfp4(x, block, rht=rht)
    got = numerics.quantize_nvfp4(x.to(device), block, rht=rht)
    row = {"recipe": spec.name, "role": role, "fused": False, "bit_exact": _nvfp4_equal(ref, got)}
    differing = _fp32_differing(numerics.dequantize_nvfp4(ref), numerics.dequantize_nvfp4(got))
    fq = {
        "recipe": spec.name,
        "role": role,
        "fn": "dequantize_nvfp4",
        "tile": list(block),
        "fmt": "e2m1",
        "fused": False,
        "bit_exact": differing == 0,
        "differing": differing,
    }
    return row, [fq]


def _quantize(numerics, spec, block, fmt, x, *, fused: bool):
    row = capability(spec.scaling)
    if row.per_tensor:
        return numerics.quantize_per_tensor(
            x, fmt=fmt, pow2_scales=spec.pow2_scales, eps=spec.amax_epsilon
        )
    if row.is_block:
        fn = numerics.quantize_blockwise_fused if fused else numerics.quantize_blockwise
        return fn(x, block=block, fmt=fmt, pow2_scales=spec.pow2_scales, eps=spec.amax_epsilon)
    fn = numerics.quantize_mxfp8_fused if fused else numerics.quantize_mxfp8
    return fn(x, block=tuple(block), fmt=fmt)


def _check_delayed(numerics, spec, device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    amaxes = (torch.rand(40, generator=gen) * 100).tolist() + [0.0, float("inf"), 3.0]
    states = [
        numerics.DelayedScalingState(16, spec.amax_compute_algo, spec.margin, "e4m3", device=dev)
        for dev in (torch.device("cpu"), device)
    ]
    same = True
    for amax in amaxes:
        for st in states:
            st.record_amax(torch.tensor(amax, device=st.amax_history.device))
            st.update()
        same &= torch.equal(
            states[0].scale.cpu().view(torch.int32), states[1].scale.cpu().view(torch.int32)
        )
    return {"recipe": spec.name, "role": "delayed_state", "bit_exact": bool(same)}
