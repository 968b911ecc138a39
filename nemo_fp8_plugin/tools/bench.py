"""CPU benchmarks of the numerics and RL issues, behind ``nemo-fp8 bench``.

Every figure is a ratio against a baseline measured in the same run (this machine is
shared and noisy), each timing the best of several interleaved rounds:

* the public quantizers on an 8192x8192 bf16 tensor (``quantize_blockwise`` 1x128 and
  128x128, ``quantize_mxfp8`` 1x32, ``quantize_per_tensor``; each runs the kernel
  ``kernel_for`` picks) and their compiled (``fused``) and eager (``reference``) variants,
  in GB/s next to ``torch.clone`` of the same tensor; bytes moved are read + written
  (quantize: 2 B read, 1 B of data and the scales written per element; clone 2 B + 2 B).
  First calls (the CPU kernel build, each compile) are timed apart and never in a ratio;
* forward + backward of a 4096x4096 linear layer on 4096 tokens under each recipe's FP8
  emulation, divided by the same layer run plainly in fp32 and in bf16, and by the
  BF16-emulated linear (the demo's BF16 arm) interleaved with it; the load average is
  recorded and the ratios count only at load < 1.5 (the output says which);
* the trainer-side refit quantizer (``quantize_for_refit``: public path, compiled,
  reference) on Llama-3-8B-shaped layers in GB/s next to a copy of the same weights, on the
  CPU or (``device="cuda"``) a GPU against a same-run device copy;
* checkpoint export (:mod:`.bench_export`, when present) against a same-run safetensors
  read + write of the same files.

``benchmarks/bench_numerics.py`` and ``benchmarks/bench_refit.py`` run the parts alone.
Benchmarks, not tests: CI never runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import (
    FP8EmulatedLinear,
    bf16_linear,
    clear_weight_cache,
    fused_mode,
    kernel_for,
    quantize_blockwise,
    quantize_blockwise_fused,
    quantize_blockwise_reference,
    quantize_mxfp8,
    quantize_mxfp8_fused,
    quantize_mxfp8_reference,
    quantize_per_tensor,
    quantize_per_tensor_reference,
)
from ..registry import get_recipe
from ..rl import quantize_for_refit
from .harness import Progress, Stopwatch, interleaved, timed, timing_summary

RECIPES = ["fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8", "nvfp4"]

QUIET_LOAD = 1.5
"""One-minute load average below which a run's ratios count (the machine is shared: at a
higher load the arms' time slices differ)."""


def load_average() -> float | None:
    """The one-minute load average (None where the OS has none)."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def load_verdict(loads: list[float | None]) -> str:
    """One line: the highest load seen and whether the ratios count."""
    seen = [x for x in loads if x is not None]
    if not seen:
        return f"load average unknown: ratios count only at load < {QUIET_LOAD}"
    worst = max(seen)
    verdict = "these ratios count" if worst < QUIET_LOAD else "these ratios do not count"
    return f"load average up to {worst:.2f}: ratios count only at load < {QUIET_LOAD}; {verdict}"


def _moved(x: torch.Tensor, q) -> int:
    """Bytes a quantizer moves: the input read plus the data and scales written."""
    return (
        x.numel() * x.element_size()
        + q.data.numel()
        + q.scale_inv.numel() * (q.scale_inv.element_size())
    )


def first_call_costs(device: str = "cpu") -> dict:
    """One-time costs that no ratio includes: building the CPU kernels into an empty
    directory (what a fresh machine pays once; later processes load the cached library)
    and what this process paid (0 for a cache hit)."""
    import tempfile
    from pathlib import Path

    from ..numerics import _cpu

    out: dict = {"cpu kernel status": _cpu.status()}
    if device == "cpu":
        with tempfile.TemporaryDirectory() as tmp:
            try:
                _, seconds = _cpu.build(directory=Path(tmp))
                out["cpu kernel build, empty cache (s)"] = seconds
            except RuntimeError as exc:
                out["cpu kernel build, empty cache (s)"] = None
                out["cpu kernel build error"] = str(exc)[:300]
    return out


def bench_quantize(
    n: int, reps: int, device: str = "cpu", progress: Progress | None = None
) -> dict:
    """GB/s of the public quantizers (and the compiled and reference variants) on an
    ``n x n`` bf16 tensor, against ``torch.clone`` of it in the same run; ``progress`` gets
    a line per first call and per case timed."""
    x = torch.randn(n, n, dtype=torch.bfloat16).to(device)
    public = {
        "quantize_blockwise 1x128": lambda: quantize_blockwise(x, (1, 128)),
        "quantize_blockwise 128x128": lambda: quantize_blockwise(x, (128, 128)),
        "quantize_mxfp8 1x32": lambda: quantize_mxfp8(x, 32),
        "quantize_per_tensor": lambda: quantize_per_tensor(x),
    }
    fused = {
        "fused 1x128": lambda: quantize_blockwise_fused(x, (1, 128)),
        "fused 128x128": lambda: quantize_blockwise_fused(x, (128, 128)),
        "fused mxfp8 1x32": lambda: quantize_mxfp8_fused(x, 32),
    }
    reference = {
        "reference 1x128": lambda: quantize_blockwise_reference(x, (1, 128)),
        "reference 128x128": lambda: quantize_blockwise_reference(x, (128, 128)),
        "reference mxfp8 1x32": lambda: quantize_mxfp8_reference(x, 32),
        "reference per-tensor": lambda: quantize_per_tensor_reference(x),
    }
    clone = {"clone": lambda: x.clone()}
    # first calls build the CPU kernels / compile the fused ones: timed here, not in a ratio
    first: dict[str, float] = {}
    moved: dict[str, int] = {"clone": 2 * x.numel() * x.element_size()}
    for name, fn in {**public, **fused}.items():
        with Stopwatch(device) as sw:
            q = fn()
        first[name] = sw.seconds
        moved[name] = _moved(x, q)
        if progress is not None:
            progress(f"quantizers, first call, {name}: {sw.seconds:.3f} s")
    for name, fn in reference.items():
        moved[name] = _moved(x, fn())
        if progress is not None:
            progress(f"quantizers, output size, {name}")
    fast = interleaved(clone | public | fused, reps, device, progress, "quantizers, ")
    slow = interleaved(
        clone | reference, max(2, reps // 3), device, progress, "quantizers (reference), "
    )
    times = {**fast, **slow, "clone": fast["clone"] + slow["clone"]}
    clone_gbs = moved["clone"] / min(times["clone"]) / 1e9
    rows = {}
    for name, ts in times.items():
        gbs = moved[name] / min(ts) / 1e9
        rows[name] = {**timing_summary(ts), "GB/s": gbs, "x_clone": gbs / clone_gbs}
        if name in first:
            rows[name]["first_call_s"] = first[name]
    kinds = {
        "quantize_blockwise": kernel_for(x, 128),
        "quantize_mxfp8": kernel_for(x, 32),
        "quantize_per_tensor": kernel_for(x),
    }
    return {
        "shape": [n, n],
        "dtype": "bfloat16",
        "device": device,
        "kernels": kinds,
        "first_call": first_call_costs(device),
        "rows": rows,
    }


def fwd_bwd(layer_fn, x, w, b):
    def run():
        xx = x.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        out = layer_fn(xx, ww, b)
        out.backward(torch.ones_like(out))

    return run


def bench_linear(
    n: int, tokens: int, reps: int, bf16_reps: int, progress: Progress | None = None
) -> dict:
    """Best-of-``reps`` fwd+bwd times; bf16 is timed ``bf16_reps`` times (0 skips it);
    ``progress`` gets a line per recipe's first run and per case timed.

    Each recipe's emulated layer is set against the same run's fp32 layer, plain bf16
    (``bf16_reps``) and the BF16-emulated linear (:func:`~..numerics.bf16_linear`, the
    demo's BF16 arm: operands rounded to BF16, fp32 GEMMs), interleaved with it. Every
    emulated run re-quantizes its weight (the weight cache is cleared): the cost of a
    step of one micro-batch."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, n, generator=gen)
    w = torch.randn(n, n, generator=gen) / n**0.5
    load_start = load_average()
    plain32 = fwd_bwd(lambda xx, ww, b: F.linear(xx, ww), x, w, None)
    bf16_emulated = fwd_bwd(lambda xx, ww, b: bf16_linear(xx, ww, None), x, w, None)
    plain16 = fwd_bwd(lambda xx, ww, b: F.linear(xx, ww), x.bfloat16(), w.bfloat16(), None)
    results = {}
    layers = {}
    for recipe in RECIPES:
        layer = FP8EmulatedLinear(n, n, bias=False, recipe=get_recipe(recipe))
        layers[recipe] = layer

        def emulated(xx, ww, b, layer=layer):
            layer.weight = torch.nn.Parameter(ww)  # fresh leaf per run, same values
            clear_weight_cache()  # as after an optimizer step
            return layer(xx)

        run = fwd_bwd(emulated, x, w, None)
        with Stopwatch() as sw:
            run()  # compiles this recipe's kernels: timed apart, reported as the first run
        results[recipe] = run
        if progress is not None:
            progress(f"linear, first run, {recipe}: {sw.seconds:.2f} s")
    plain32()
    bf16_emulated()
    times = interleaved(
        {"fp32": plain32, "bf16 linear": bf16_emulated} | results, reps, None, progress, "linear, "
    )
    if bf16_reps and progress is not None:
        progress(f"linear, plain bf16 ({bf16_reps} run(s); slow without native bf16)")
    bf16 = min(timed(plain16, reps=bf16_reps)) if bf16_reps else float("nan")
    t32 = min(times["fp32"])
    tb = min(times["bf16 linear"])
    rows = {
        "fp32": timing_summary(times["fp32"]),
        "bf16": {"best_s": bf16},
        "bf16 linear": {**timing_summary(times["bf16 linear"]), "x_fp32": tb / t32},
    }
    for recipe in RECIPES:
        row = timing_summary(times[recipe])
        rows[recipe] = {
            **row,
            "x_fp32": row["best_s"] / t32,
            "x_bf16": row["best_s"] / bf16,
            "x_bf16_linear": row["best_s"] / tb,
        }
    loads = {"start": load_start, "end": load_average()}
    return {
        "M=N=K": n,
        "tokens": tokens,
        "rows": rows,
        "load_average": loads,
        "quiet_load": QUIET_LOAD,
        "ratios_count": all(v is not None and v < QUIET_LOAD for v in loads.values()),
    }


def layer_weights(
    layers: int, hidden: int, kv: int, ffn: int, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    return {
        f"model.layers.{i}.{n}.weight": (torch.randn(*s, generator=gen) * 0.02)
        .bfloat16()
        .to(device)
        for i in range(layers)
        for n, s in shapes.items()
    }


def check_exact(weights: dict, spec) -> int:
    """The public path and the compiled one on the weights' device == the eager reference on
    the CPU, bit for bit; returns the number of tensors compared."""
    cpu = {n: t.cpu() for n, t in weights.items()}
    ref = dict(quantize_for_refit(cpu, spec, keep_bf16=lambda n: False, fused=False))
    for fused in (None, True):
        fast = dict(quantize_for_refit(weights, spec, keep_bf16=lambda n: False, fused=fused))
        assert fast.keys() == ref.keys()
        for name, want in ref.items():
            got = fast[name].cpu()
            assert got.dtype == want.dtype and got.shape == want.shape, name
            if got.element_size() == 1:
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(got, want), f"{name}: fused={fused} differs from the reference"
    return len(ref)


REFIT_ROWS = {"refit": None, "refit fused": True, "refit reference": False}
"""Row name -> ``quantize_for_refit(fused=...)``: the public quantizers' own choice, the
compiled kernels, the eager reference."""


def bench_refit(
    layers: int = 1,
    recipe: str = "fp8_blockwise",
    rounds: int = 4,
    quick: bool = False,
    device: str = "cpu",
    check: bool = False,
) -> dict:
    """GB/s of the refit quantizer (public, compiled and reference paths) vs a same-run
    copy (``clone``) of the same weights on ``device``; bytes are read + written."""
    dims = (1024, 256, 3584) if quick else (4096, 1024, 14336)
    weights = layer_weights(layers, *dims, device=device)
    spec = get_recipe(recipe)
    elems = sum(t.numel() for t in weights.values())
    in_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    checked = None
    if check:
        with fused_mode(True, min_numel=0):
            checked = check_exact(weights, spec)

    def copy():
        for t in weights.values():
            t.clone()

    out_bytes: dict = {}

    def refit(fused):
        def run():
            total = 0
            for _, t in quantize_for_refit(weights, spec, keep_bf16=lambda n: False, fused=fused):
                total += t.numel() * t.element_size()
            out_bytes[fused] = total

        return run

    runs = {"copy (clone)": copy} | {name: refit(f) for name, f in REFIT_ROWS.items()}
    first = {}
    with fused_mode(True, min_numel=0):
        for name in ("refit", "refit fused"):  # CPU kernel build / one compile per shape
            with Stopwatch(device) as sw:
                runs[name]()
            first[name] = sw.seconds
        best = {k: float("inf") for k in runs}
        for _ in range(rounds):
            for name, fn in runs.items():
                if name == "refit reference" and best[name] < float("inf") and rounds > 2:
                    continue  # the eager path is slow; one round is enough to place it
                best[name] = min(best[name], *timed(fn, device))
    copy_gbs = 2 * in_bytes / best["copy (clone)"] / 1e9
    rows = {}
    for name, t in best.items():
        moved = 2 * in_bytes if name.startswith("copy") else in_bytes + out_bytes[REFIT_ROWS[name]]
        gbs = moved / t / 1e9
        rows[name] = {"best_s": t, "GB/s": gbs, "x_copy": gbs / copy_gbs}
        if name in first:
            rows[name]["first_call_s"] = first[name]
    sample = next(iter(weights.values()))
    return {
        "recipe": spec.name,
        "layers": layers,
        "weights": elems,
        "device": device,
        "kernel": kernel_for(sample, tuple(spec.weight_block)[1]),
        "checked_bit_exact": checked,
        "rows": rows,
    }


def run_numerics(
    quick: bool = False,
    skip_bf16: bool = False,
    linear: bool = True,
    progress: Progress | None = None,
) -> dict:
    """The quantizer benchmark and (unless ``linear=False``) the emulated linear layer;
    ``progress`` gets their per-case lines (the full sizes run for minutes before the first
    table)."""
    n_q, n_l, reps, bf16_reps = (1024, 512, 3, 1) if quick else (8192, 4096, 7, 1)
    with fused_mode(True, min_numel=0):
        result: dict = {"quantize": bench_quantize(n_q, reps, progress=progress)}
        if linear:
            result["linear"] = bench_linear(
                n_l, n_l, max(2, reps // 2), 0 if skip_bf16 else bf16_reps, progress
            )
    return result


def _first_call_lines(first: dict) -> list[str]:
    status = first.get("cpu kernel status", {})
    build = first.get("cpu kernel build, empty cache (s)")
    lines = []
    if build is not None:
        lines.append(
            f"first-call cost (not in any ratio): CPU kernel build into an empty cache "
            f"{build:.2f} s; this process {status.get('build_s') or 0:.2f} s "
            f"(simd width {status.get('simd_width')})"
        )
    elif "cpu kernel build error" in first:
        lines.append(f"CPU kernels unavailable: {first['cpu kernel build error']}")
    return lines


def render_quantize(quant: dict) -> str:
    kinds = ", ".join(f"{k} -> {v}" for k, v in quant["kernels"].items())
    lines = [
        f"## Quantizers, {quant['shape'][0]}x{quant['shape'][1]} {quant['dtype']} "
        f"(bytes read + written; kernels: {kinds})",
        f"{'case':<28}{'best s':>9}{'median s':>10}{'GB/s':>8}{'x clone':>9}{'1st call s':>11}",
    ]
    for name, r in quant["rows"].items():
        first = f"{r['first_call_s']:>11.3f}" if "first_call_s" in r else ""
        lines.append(
            f"{name:<28}{r['best_s']:>9.4f}{r['median_s']:>10.4f}{r['GB/s']:>8.2f}"
            f"{r['x_clone']:>9.2f}{first}"
        )
    lines += _first_call_lines(quant.get("first_call", {}))
    return "\n".join(lines)


def render_numerics(result: dict) -> str:
    lines = [render_quantize(result["quantize"])]
    linear = result.get("linear")
    if linear is None:
        return lines[0]
    lines += [
        "",
        f"## Linear fwd+bwd, M=N=K={linear['M=N=K']} ({linear['tokens']} tokens)",
        f"{'case':<16}{'best s':>10}{'median s':>10}{'x fp32':>9}{'x bf16':>9}"
        f"{'x bf16 linear':>15}",
    ]
    for name, r in linear["rows"].items():
        med = f"{r['median_s']:>10.3f}" if "median_s" in r else f"{'':>10}"
        extra = f"{r['x_fp32']:>9.2f}" if "x_fp32" in r else ""
        if "x_bf16" in r:
            extra += f"{r['x_bf16']:>9.3f}{r['x_bf16_linear']:>15.2f}"
        lines.append(f"{name:<16}{r['best_s']:>10.3f}{med}{extra}")
    loads = linear.get("load_average", {})
    lines.append(load_verdict([loads.get("start"), loads.get("end")]))
    return "\n".join(lines)


def render_refit(result: dict) -> str:
    lines = [
        f"## Refit quantizer, recipe {result['recipe']}, {result['layers']} layer(s), "
        f"{result['weights'] / 1e6:.1f}M bf16 weights, device {result['device']} "
        f"(public path: {result.get('kernel')})"
    ]
    if result["checked_bit_exact"] is not None:
        lines.append(
            f"check: {result['checked_bit_exact']} tensors bit-identical to the CPU reference"
        )
    lines.append(f"{'case':<18}{'best s':>10}{'GB/s':>9}{'x copy':>9}{'1st call s':>11}")
    for name, r in result["rows"].items():
        first = f"{r['first_call_s']:>11.3f}" if "first_call_s" in r else ""
        lines.append(f"{name:<18}{r['best_s']:>10.3f}{r['GB/s']:>9.2f}{r['x_copy']:>9.2f}{first}")
    return "\n".join(lines)
