"""The GPU device check behind ``scripts/gpu_check.sh`` (one H100/H200, under 6 minutes).

Parts, each reported with ``status`` ``ok``, ``failed`` or ``skipped`` (and why):

a. ``quantizers``: our quantizers on the device (eager and compiled) are bit-exact with
   the CPU reference for every registered recipe, role, input dtype and a set of edge tiles;
   so is the emulation's fake-quantization (``fake_quant_*``, listed under ``fake_quant``)
   against the CPU reference's ``dequantize(quantize(x))``, for the same cases plus the
   column-wise tiles the emulation also uses.
b. ``gemm``: FP8 GEMM throughput vs BF16 at M=N=K=4096 and 8192 through torch's own
   ``scaled_mm`` (tensor-wise, row-wise, 1x128 x 128x128 and 1x128 x 1x128 block scales where
   the installed torch and GPU support them), as ratios to the BF16 rate measured in the
   same run; each result is also checked against a dequantized reference, so a wrong scale
   layout cannot report a fast but wrong number.
c. ``refit``: the trainer-side refit quantizer on the device: GB/s next to a same-run
   device copy, and bit-exact with the CPU reference.
d. ``te_quantizers``: Transformer Engine's own quantizers vs our reference, bit-exact
   (only where TE is importable: a NeMo container).
e. ``te_linear``: TE linear-layer fwd+bwd throughput per recipe vs BF16 (TE only).
f. ``vllm_refit``: a small vLLM generation with one refit (vLLM only; see
   ``scripts/gpu_vllm_refit.py``).

Needs only torch (and Triton for the compiled path); no omegaconf, no host. Every part
runs on CPU tensors too (``--device cpu``), which is how the tests cover this file's logic.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["run_checks", "main", "PARTS"]

PARTS = ("quantizers", "gemm", "refit", "te_quantizers", "te_linear", "vllm_refit")


def _skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], Any], device: torch.device, *, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


# --------------------------------------------------------------------------- (a) quantizers


def edge_inputs(rows: int, cols: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random data plus tiles that stress the scale logic (built on CPU, deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols).unsqueeze(0)
    cases = {"random": base.clone()}
    edge = base.clone()
    edge[:, :128] = 0.0                                  # an all-zero tile
    edge[0, 130] = 3.0e4                                 # one huge value in a tile
    edge[1, 256:384] = 1e-40                             # subnormal tile (fp32)
    edge[2, 5] = float("inf")
    edge[3, 7] = float("-inf")
    edge[4, 9] = float("nan")
    edge[5, 300] = 448.0                                 # exactly E4M3 max
    edge[6, 400:410] = torch.tensor([447.9, 448.1, 240.0, 239.9, 0.0019, 0.00195, 0.00196,
                                     1.0, 0.9999, 1.0001])  # values rounding across binades
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


def check_quantizers(device: torch.device, *, quick: bool = False) -> dict[str, Any]:
    from .. import numerics
    from ..registry import list_recipes

    rows, cols = (256, 512) if quick else (512, 1024)
    results, mismatches, fake_quant = [], [], []
    for spec in list_recipes():
        for role in ("input", "weight", "grad_output"):
            block, fmt = spec.block_for(role), spec.format_for(role)
            for dtype in (torch.float32, torch.bfloat16):
                for case, x in edge_inputs(rows, cols, dtype, seed=len(results)).items():
                    ref = _quantize(numerics, spec, block, fmt, x, fused=False)
                    for fused in (False, True):
                        got = _quantize(numerics, spec, block, fmt, x.to(device), fused=fused)
                        ok = _qtensor_equal(ref, got)
                        row = {"recipe": spec.name, "role": role, "dtype": str(dtype).split(".")[-1],
                               "case": case, "fused": fused, "bit_exact": ok}
                        results.append(row)
                        if not ok:
                            mismatches.append(row)
                    for row in _check_fake_quant(numerics, spec, block, fmt, x, device):
                        row.update(recipe=spec.name, role=role, dtype=str(dtype).split(".")[-1],
                                   case=case)
                        fake_quant.append(row)
                        if not row["bit_exact"]:
                            mismatches.append(row)
    delayed = [s for s in list_recipes() if s.scaling == "delayed"]
    if delayed:
        row = _check_delayed(numerics, delayed[0], device)
        results.append(row)
        if not row["bit_exact"]:
            mismatches.append(row)
    return {"status": "ok" if not mismatches else "failed",
            "checked": len(results) + len(fake_quant), "mismatches": mismatches[:20],
            "fake_quant": fake_quant, "compile_failed": numerics.compile_failed()}


def _fake_quant_variants(numerics, spec, block, fmt, x: torch.Tensor):
    """``(function name, tile, reference on CPU, device call)`` for each way the emulation
    fake-quantizes this role. The device call takes the device tensor and returns a tuple
    of fp32 tensors (the delayed cast also returns its amax, which feeds the next scale)."""
    from ..numerics import fused
    from ..numerics.scaling import FLT_MAX, reciprocal

    if spec.scaling == "delayed":
        # A scale from a smaller (stale) amax, as delayed scaling has after a growth step,
        # so the clamp to +-fp8_max is exercised along with the rounding.
        stale = numerics.tensor_amax(x) * 0.5
        scale = numerics.scale_from_amax(stale, numerics.fp8_max(fmt), pow2=False, eps=0.0,
                                         value_for_inf=FLT_MAX)
        scale_inv = reciprocal(scale)

        def ref(t):
            q = numerics.quantize_with_scale(t, scale, fmt, scale_inv=scale_inv)
            return q.dequantize(), numerics.tensor_amax(t)

        def run(t):
            return tuple(fused.fake_quant_with_scale(t, scale.to(t.device),
                                                     scale_inv.to(t.device), fmt, force=True))
        return [("fake_quant_with_scale", None, ref, run)]
    if spec.scaling == "tensorwise":
        return [("fake_quant_per_tensor", None,
                 lambda t: (numerics.quantize_per_tensor(t, fmt=fmt, pow2_scales=spec.pow2_scales,
                                                         eps=spec.amax_epsilon).dequantize(),),
                 lambda t: (fused.fake_quant_per_tensor(t, fmt, spec.pow2_scales,
                                                        spec.amax_epsilon, force=True),))]
    # Non-square tiles are also quantized column-wise, as Nx1 tiles of the same tensor
    # (RoleQuantizer.columnwise); that is a different reduction layout for the compiler.
    tiles = [tuple(block)] + ([(block[1], block[0])] if block[0] != block[1] else [])
    out = []
    for tile in tiles:
        if spec.scaling == "block":
            out.append(("fake_quant_blockwise", tile,
                        lambda t, tile=tile: (numerics.quantize_blockwise(
                            t, block=tile, fmt=fmt, pow2_scales=spec.pow2_scales,
                            eps=spec.amax_epsilon).dequantize(),),
                        lambda t, tile=tile: (fused.fake_quant_blockwise(
                            t, tile, fmt, spec.pow2_scales, spec.amax_epsilon, force=True),)))
        else:
            out.append(("fake_quant_mxfp8", tile,
                        lambda t, tile=tile: (numerics.quantize_mxfp8(
                            t, block=tile, fmt=fmt).dequantize(),),
                        lambda t, tile=tile: (fused.fake_quant_mxfp8(t, tile, fmt, force=True),)))
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
            rows.append({"fn": name, "tile": list(tile) if tile else None, "fmt": fmt,
                         "fused": fused, "bit_exact": differing == 0, "differing": differing})
    return rows


def _quantize(numerics, spec, block, fmt, x, *, fused: bool):
    if spec.scaling in ("delayed", "tensorwise"):
        return numerics.quantize_per_tensor(x, fmt=fmt, pow2_scales=spec.pow2_scales,
                                            eps=spec.amax_epsilon)
    if spec.scaling == "block":
        fn = numerics.quantize_blockwise_fused if fused else numerics.quantize_blockwise
        return fn(x, block=block, fmt=fmt, pow2_scales=spec.pow2_scales, eps=spec.amax_epsilon)
    fn = numerics.quantize_mxfp8_fused if fused else numerics.quantize_mxfp8
    return fn(x, block=tuple(block), fmt=fmt)


def _check_delayed(numerics, spec, device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    amaxes = (torch.rand(40, generator=gen) * 100).tolist() + [0.0, float("inf"), 3.0]
    states = [numerics.DelayedScalingState(16, spec.amax_compute_algo, spec.margin, "e4m3",
                                           device=dev) for dev in (torch.device("cpu"), device)]
    same = True
    for amax in amaxes:
        for st in states:
            st.record_amax(torch.tensor(amax, device=st.amax_history.device))
            st.update()
        same &= torch.equal(states[0].scale.cpu().view(torch.int32),
                            states[1].scale.cpu().view(torch.int32))
    return {"recipe": spec.name, "role": "delayed_state", "bit_exact": bool(same)}


# --------------------------------------------------------------------------- (b) GEMMs


def _scaled_mm_variants():
    """(name, a_tile, b_tile, scaling enums) the installed torch can express."""
    import torch.nn.functional as F

    scaling = getattr(F, "ScalingType", None)
    if not hasattr(F, "scaled_mm") or scaling is None:
        return None, []
    return F, [("tensorwise", None, None, (scaling.TensorWise, scaling.TensorWise)),
               ("rowwise", "row", "row", (scaling.RowWise, scaling.RowWise)),
               ("block_1x128_128x128", (1, 128), (128, 128),
                (scaling.BlockWise1x128, scaling.BlockWise128x128)),
               ("block_1x128_1x128", (1, 128), (1, 128),
                (scaling.BlockWise1x128, scaling.BlockWise1x128))]


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


def check_gemm(device: torch.device, *, sizes=(4096, 8192)) -> dict[str, Any]:
    if device.type != "cuda":
        return _skipped("FP8 tensor-core GEMMs need a CUDA device")
    from .. import numerics

    F, variants = _scaled_mm_variants()
    if F is None:
        return _skipped(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    out: dict[str, Any] = {"status": "ok", "sizes": {}}
    for n in sizes:
        gen = torch.Generator(device=device).manual_seed(n)
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
        flops = 2.0 * n ** 3
        t_bf16 = time_op(lambda: a @ b.t(), device)
        row: dict[str, Any] = {"bf16_tflops": flops / t_bf16 / 1e12}
        reference = (a.float() @ b.float().t())
        for name, tile_a, tile_b, (sa_kind, sb_kind) in variants:
            try:
                da, sa = _operand(numerics, a, tile_a)
                db, sb = _operand(numerics, b, tile_b)
                if tile_b == "row":
                    sb = sb.t()  # one scale per column of mat_b = b.T: [1, N]

                def run():
                    return F.scaled_mm(da, db.t(), sa, sa_kind, sb, sb_kind,
                                       output_dtype=torch.bfloat16)
                result = run().float()
                rel = ((result - reference).norm() / reference.norm()).item()
                if not math.isfinite(rel) or rel > 0.1:
                    row[name] = {"status": "failed", "rel_error": rel,
                                 "reason": "result differs from the dequantized reference"}
                    out["status"] = "failed"
                    continue
                t = time_op(run, device)
                row[name] = {"tflops": flops / t / 1e12, "ratio_vs_bf16": t_bf16 / t,
                             "rel_error": rel}
            except Exception as exc:  # unsupported on this torch/GPU: say so, keep going
                row[name] = {"status": "unsupported", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        out["sizes"][str(n)] = row
    return out


# --------------------------------------------------------------------------- (c) refit


REFIT_SHAPES = {  # Llama-3.1-8B's linear weights of one layer, plus its LM-head-sized matrix
    "q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096), "up_proj": (14336, 4096), "down_proj": (4096, 14336),
}


def check_refit(device: torch.device, *, layers: int = 4, quick: bool = False) -> dict[str, Any]:
    from ..registry import get_recipe
    from ..rl import quantize_for_refit

    spec = get_recipe("fp8_blockwise")
    scale = 8 if quick else 1
    tensors = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in range(1 if quick else layers):
        for name, (n, k) in REFIT_SHAPES.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            tensors[f"model.layers.{layer}.{part}.{name}.weight"] = torch.randn(
                n // scale, k // scale, device=device, dtype=torch.bfloat16, generator=gen)
    elements = sum(t.numel() for t in tensors.values())

    def quantize_all():
        return list(quantize_for_refit(tensors.items(), spec))

    produced = dict(quantize_all())
    t_refit = time_op(quantize_all, device, warmup=2, iters=5)
    t_copy = time_op(lambda: [t.clone() for t in tensors.values()], device, warmup=2, iters=5)
    # bytes moved: refit reads 2 B and writes 1 B per element (+ scales); a copy 2 B + 2 B
    refit_gbs = 3 * elements / t_refit / 1e9
    copy_gbs = 4 * elements / t_copy / 1e9
    # bit-exact with the CPU reference on one tensor of each shape
    exact = True
    for name, t in list(tensors.items())[:len(REFIT_SHAPES)]:
        ref = dict(quantize_for_refit([(name, t.cpu())], spec))
        exact &= torch.equal(ref[name].view(torch.uint8), produced[name].cpu().view(torch.uint8))
        exact &= torch.equal(ref[name + "_scale_inv"].view(torch.int32),
                             produced[name + "_scale_inv"].cpu().view(torch.int32))
    return {"status": "ok" if exact else "failed", "elements": elements, "bit_exact": bool(exact),
            "refit_gb_s": refit_gbs, "copy_gb_s": copy_gbs, "ratio_vs_copy": refit_gbs / copy_gbs}


# --------------------------------------------------------------------------- (d, e) TE


def _import_te():
    try:
        import transformer_engine.pytorch as te  # noqa: F401
        import transformer_engine_torch as tex  # noqa: F401
    except Exception as exc:
        return None, None, f"Transformer Engine is not importable here ({type(exc).__name__}: {exc})"[:300]
    return te, tex, None


def check_te_quantizers(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return _skipped("Transformer Engine's quantizers run on CUDA only")
    te, tex, why = _import_te()
    if te is None:
        return _skipped(why)
    from .. import numerics
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    rows, cols = 512, 1024
    out, bad = [], []
    for pow2 in (False, True):
        for dim, tile in ((1, (1, 128)), (2, (128, 128))):
            for dtype in (torch.float32, torch.bfloat16):
                x = edge_inputs(rows, cols, dtype, seed=dim)["random"].to(device)
                q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                         force_pow_2_scales=pow2, block_scaling_dim=dim)
                got = q(x)
                ours = numerics.quantize_blockwise(x, block=tile, pow2_scales=pow2)
                te_scales = got._rowwise_scale_inv
                # TE pads scales for cuBLAS: 1x128 is stored transposed [K/128, roundup(M, 4)],
                # 128x128 as [M/128, roundup(K/128, 4)].
                if dim == 1:
                    te_scales = te_scales[:, :rows].t()
                else:
                    te_scales = te_scales[:, : ours.scale_inv.shape[1]]
                ok = (torch.equal(got._rowwise_data.view(torch.uint8), ours.data.view(torch.uint8))
                      and torch.equal(te_scales.contiguous().view(torch.int32),
                                      ours.scale_inv.contiguous().view(torch.int32)))
                row = {"tile": list(tile), "pow2": pow2, "dtype": str(dtype).split(".")[-1],
                       "bit_exact": bool(ok)}
                out.append(row)
                if not ok:
                    bad.append(row)
    return {"status": "ok" if not bad else "failed", "results": out}


def check_te_linear(device: torch.device, *, n: int = 4096) -> dict[str, Any]:
    if device.type != "cuda":
        return _skipped("Transformer Engine's linear layers run on CUDA only")
    te, _, why = _import_te()
    if te is None:
        return _skipped(why)
    from ..hosts.te import build_te_recipe
    from ..registry import list_recipes

    major, _ = torch.cuda.get_device_capability(device)
    layer = te.Linear(n, n, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
    autocast = getattr(te, "autocast", None) or te.fp8_autocast

    def step(recipe=None):
        if recipe is None:
            y = layer(x)
        else:
            kwargs = {"recipe": recipe} if autocast is getattr(te, "autocast", None) else {"fp8_recipe": recipe}
            with autocast(enabled=True, **kwargs):
                y = layer(x)
        y.sum().backward()

    t_bf16 = time_op(step, device)
    results: dict[str, Any] = {"bf16_ms": t_bf16 * 1e3}
    for spec in list_recipes():
        if spec.scaling == "mx" and major < 10:
            results[spec.name] = {"status": "skipped", "reason": "MXFP8 needs Blackwell"}
            continue
        try:
            recipe = build_te_recipe(spec)
            t = time_op(lambda: step(recipe), device)
            results[spec.name] = {"ms": t * 1e3, "speedup_vs_bf16": t_bf16 / t}
        except Exception as exc:
            results[spec.name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    return {"status": "ok", "results": results}


def check_vllm_refit(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return _skipped("vLLM's FP8 kernels need a CUDA device")
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return _skipped(f"vLLM is not importable here ({type(exc).__name__})")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_vllm_refit.py"
    if not script.is_file():
        return _skipped(f"{script} is missing")
    import subprocess

    proc = subprocess.run([sys.executable, str(script), "--json"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        return {"status": "failed", "reason": proc.stderr[-2000:]}
    return {"status": "ok", "result": json.loads(proc.stdout.strip().splitlines()[-1])}


# --------------------------------------------------------------------------- driver


def environment(device: torch.device) -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gb=round(props.total_memory / 2**30, 1))
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    return info


def run_checks(device: str | torch.device = "cuda", parts=PARTS, *, quick: bool = False) -> dict[str, Any]:
    """Run the named parts; a part that raises is recorded as failed, the rest still run."""
    device = torch.device(device)
    report: dict[str, Any] = {"environment": environment(device), "parts": {}}
    runners = {
        "quantizers": lambda: check_quantizers(device, quick=quick),
        "gemm": lambda: check_gemm(device, sizes=(1024,) if quick else (4096, 8192)),
        "refit": lambda: check_refit(device, quick=quick),
        "te_quantizers": lambda: check_te_quantizers(device),
        "te_linear": lambda: check_te_linear(device),
        "vllm_refit": lambda: check_vllm_refit(device),
    }
    for name in parts:
        t0 = time.perf_counter()
        try:
            result = runners[name]()
        except Exception as exc:
            result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        report["parts"][name] = result
        print(f"[gpu_check] {name}: {result['status']} ({result['seconds']} s)", file=sys.stderr,
              flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_fp8_plugin.tools.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="JSON results file")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (logic check)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes (logic check)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"gpu_check: error: unknown parts {unknown}; choose from {', '.join(PARTS)}",
              file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device here; use --device cpu for a logic check",
              file=sys.stderr)
        return 2
    report = run_checks(args.device, parts, quick=args.quick)
    from .._io import atomic_write_text

    atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    print(f"[gpu_check] wrote {args.out}", file=sys.stderr)
    failed = [n for n, r in report["parts"].items() if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
