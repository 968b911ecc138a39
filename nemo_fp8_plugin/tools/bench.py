"""CPU benchmarks of the numerics and RL issues, behind ``nemo-fp8 bench``.

Every figure is a ratio against a baseline measured in the same run (this machine is
shared and noisy), each timing the best of several interleaved rounds:

* block quantization of an 8192x8192 bf16 tensor (1x128, 128x128, MXFP8 1x32; eager
  reference and fused) in GB/s next to ``torch.clone`` of the same tensor; bytes moved:
  quantize 2 B read + 1 B written per element, clone 2 B + 2 B;
* forward + backward of a 4096x4096 linear layer on 4096 tokens under each recipe's FP8
  emulation, divided by the same layer run plainly in fp32 and in bf16;
* the trainer-side refit quantizer (``quantize_for_refit``) on Llama-3-8B-shaped layers in
  GB/s next to a copy of the same weights.

``benchmarks/bench_numerics.py`` and ``benchmarks/bench_refit.py`` run the parts alone.
Benchmarks, not tests: CI never runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import (
    FP8EmulatedLinear,
    fused_mode,
    quantize_blockwise,
    quantize_blockwise_fused,
    quantize_mxfp8,
    quantize_mxfp8_fused,
)
from ..registry import get_recipe
from ..rl import quantize_for_refit
from .harness import interleaved, timed, timing_summary

RECIPES = ["fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"]


def bench_quantize(n: int, reps: int) -> dict:
    x = torch.randn(n, n, dtype=torch.bfloat16)
    elems = x.numel()
    cases = {
        "clone": lambda: x.clone(),
        "eager 1x128": lambda: quantize_blockwise(x, (1, 128)),
        "eager 128x128": lambda: quantize_blockwise(x, (128, 128)),
        "eager mxfp8 1x32": lambda: quantize_mxfp8(x, 32),
        "fused 1x128": lambda: quantize_blockwise_fused(x, (1, 128)),
        "fused 128x128": lambda: quantize_blockwise_fused(x, (128, 128)),
        "fused mxfp8 1x32": lambda: quantize_mxfp8_fused(x, 32),
    }
    # first calls compile the fused kernels; not timed
    for name, fn in cases.items():
        if name.startswith("fused"):
            fn()
    eager_reps = max(2, reps // 3)
    fast = interleaved({k: v for k, v in cases.items() if not k.startswith("eager")}, reps)
    slow = interleaved(
        {"clone": cases["clone"]} | {k: v for k, v in cases.items() if k.startswith("eager")},
        eager_reps,
    )
    times = {**slow, **fast, "clone": fast["clone"] + slow["clone"]}
    clone_gbs = elems * 4 / min(times["clone"]) / 1e9
    rows = {}
    for name, ts in times.items():
        moved = 4 if name == "clone" else 3
        gbs = elems * moved / min(ts) / 1e9
        rows[name] = {**timing_summary(ts), "GB/s": gbs, "x_clone": gbs / clone_gbs}
    return {"shape": [n, n], "dtype": "bfloat16", "rows": rows}


def fwd_bwd(layer_fn, x, w, b):
    def run():
        xx = x.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        out = layer_fn(xx, ww, b)
        out.backward(torch.ones_like(out))

    return run


def bench_linear(n: int, tokens: int, reps: int, bf16_reps: int) -> dict:
    """Best-of-``reps`` fwd+bwd times; bf16 is timed ``bf16_reps`` times (0 skips it)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, n, generator=gen)
    w = torch.randn(n, n, generator=gen) / n**0.5
    plain32 = fwd_bwd(lambda xx, ww, b: F.linear(xx, ww), x, w, None)
    plain16 = fwd_bwd(lambda xx, ww, b: F.linear(xx, ww), x.bfloat16(), w.bfloat16(), None)
    results = {}
    layers = {}
    for recipe in RECIPES:
        layer = FP8EmulatedLinear(n, n, bias=False, recipe=get_recipe(recipe))
        layers[recipe] = layer

        def emulated(xx, ww, b, layer=layer):
            layer.weight = torch.nn.Parameter(ww)  # fresh leaf per run, same values
            return layer(xx)

        run = fwd_bwd(emulated, x, w, None)
        run()  # compiles this recipe's kernels; not timed
        results[recipe] = run
    plain32()
    times = interleaved({"fp32": plain32} | results, reps)
    bf16 = min(timed(plain16, reps=bf16_reps)) if bf16_reps else float("nan")
    t32 = min(times["fp32"])
    rows = {"fp32": timing_summary(times["fp32"]), "bf16": {"best_s": bf16}}
    for recipe in RECIPES:
        row = timing_summary(times[recipe])
        rows[recipe] = {**row, "x_fp32": row["best_s"] / t32, "x_bf16": row["best_s"] / bf16}
    return {"M=N=K": n, "tokens": tokens, "rows": rows}


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
    """Fused output on the weights' device == eager reference on the CPU, bit for bit."""
    cpu = {n: t.cpu() for n, t in weights.items()}
    fast = dict(quantize_for_refit(weights, spec, keep_bf16=lambda n: False, fused=True))
    ref = dict(quantize_for_refit(cpu, spec, keep_bf16=lambda n: False, fused=False))
    assert fast.keys() == ref.keys()
    for name, want in ref.items():
        got = fast[name].cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if got.element_size() == 1:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want), f"{name}: fused output differs from the CPU reference"
    return len(ref)


def bench_refit(
    layers: int = 1,
    recipe: str = "fp8_blockwise",
    rounds: int = 4,
    quick: bool = False,
    device: str = "cpu",
    check: bool = False,
) -> dict:
    """GB/s of the refit quantizer (eager and fused) vs a copy of the same weights."""
    dims = (1024, 256, 3584) if quick else (4096, 1024, 14336)
    weights = layer_weights(layers, *dims, device=device)
    spec = get_recipe(recipe)
    elems = sum(t.numel() for t in weights.values())
    checked = None
    if check:
        with fused_mode(True, min_numel=0):
            checked = check_exact(weights, spec)

    def copy():
        for t in weights.values():
            t.clone()

    out_bytes = {}

    def refit(fused: bool):
        def run():
            total = 0
            for _, t in quantize_for_refit(weights, spec, keep_bf16=lambda n: False, fused=fused):
                total += t.numel() * t.element_size()
            out_bytes[fused] = total

        return run

    runs = {"copy (clone)": copy, "refit eager": refit(False), "refit fused": refit(True)}
    with fused_mode(True, min_numel=0):
        runs["refit fused"]()  # compiles one kernel per weight shape; not timed
        best = {k: float("inf") for k in runs}
        for _ in range(rounds):
            for name, fn in runs.items():
                if name == "refit eager" and best[name] < float("inf") and rounds > 2:
                    continue  # the eager path is slow; one round is enough to place it
                best[name] = min(best[name], *timed(fn, device))
    copy_gbs = elems * 4 / best["copy (clone)"] / 1e9
    rows = {}
    for name, t in best.items():
        moved = (
            elems * 4 if name.startswith("copy") else elems * 2 + out_bytes[name.endswith("fused")]
        )
        gbs = moved / t / 1e9
        rows[name] = {"best_s": t, "GB/s": gbs, "x_copy": gbs / copy_gbs}
    return {
        "recipe": spec.name,
        "layers": layers,
        "weights": elems,
        "device": device,
        "checked_bit_exact": checked,
        "rows": rows,
    }


def run_numerics(quick: bool = False, skip_bf16: bool = False) -> dict:
    n_q, n_l, reps, bf16_reps = (1024, 512, 3, 1) if quick else (8192, 4096, 7, 1)
    with fused_mode(True, min_numel=0):
        quant = bench_quantize(n_q, reps)
        linear = bench_linear(n_l, n_l, max(2, reps // 2), 0 if skip_bf16 else bf16_reps)
    return {"quantize": quant, "linear": linear}


def render_numerics(result: dict) -> str:
    quant, linear = result["quantize"], result["linear"]
    lines = [
        f"## Block quantization, {quant['shape'][0]}x{quant['shape'][1]} {quant['dtype']}",
        f"{'case':<20}{'best s':>10}{'median s':>10}{'GB/s':>9}{'x clone':>9}",
    ]
    for name, r in quant["rows"].items():
        lines.append(
            f"{name:<20}{r['best_s']:>10.4f}{r['median_s']:>10.4f}{r['GB/s']:>9.2f}"
            f"{r['x_clone']:>9.2f}"
        )
    lines += [
        "",
        f"## Linear fwd+bwd, M=N=K={linear['M=N=K']} ({linear['tokens']} tokens)",
        f"{'case':<16}{'best s':>10}{'median s':>10}{'x fp32':>9}{'x bf16':>9}",
    ]
    for name, r in linear["rows"].items():
        med = f"{r['median_s']:>10.3f}" if "median_s" in r else f"{'':>10}"
        extra = f"{r['x_fp32']:>9.2f}{r['x_bf16']:>9.3f}" if "x_fp32" in r else ""
        lines.append(f"{name:<16}{r['best_s']:>10.3f}{med}{extra}")
    return "\n".join(lines)


def render_refit(result: dict) -> str:
    lines = [
        f"## Refit quantizer, recipe {result['recipe']}, {result['layers']} layer(s), "
        f"{result['weights'] / 1e6:.1f}M bf16 weights, device {result['device']}"
    ]
    if result["checked_bit_exact"] is not None:
        lines.append(
            f"check: {result['checked_bit_exact']} tensors bit-identical to the CPU reference"
        )
    lines.append(f"{'case':<16}{'best s':>10}{'GB/s':>9}{'x copy':>9}")
    for name, r in result["rows"].items():
        lines.append(f"{name:<16}{r['best_s']:>10.3f}{r['GB/s']:>9.2f}{r['x_copy']:>9.2f}")
    return "\n".join(lines)
