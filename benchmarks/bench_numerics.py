"""Numerics benchmark (issue 3 §4): block-quantize throughput and emulated-linear overhead.

Prints, from one run on this machine:

1. Block quantization of an 8192x8192 bf16 tensor (1x128 and 128x128 tiles, and MXFP8
   1x32) in GB/s, eager reference and fused (torch.compile), next to ``torch.clone`` of
   the same tensor measured in the same run. Bytes moved: quantize 2 B read + 1 B written
   per element (scales are under 1%), clone 2 B + 2 B.
2. Forward + backward of a 4096x4096 linear layer on 4096 tokens under each recipe's FP8
   emulation (fused path), divided by the same layer run plainly in fp32 and in bf16.

Every timing is the best of several repetitions interleaved with its baseline, so a busy
machine penalises both alike. Usage::

    .venv/bin/python benchmarks/bench_numerics.py [--quick] [--json out.json]

``--quick`` shrinks the sizes for a smoke run (its numbers are not the issue's figures).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from nemo_fp8_plugin.numerics import (FP8EmulatedLinear, fused_mode, quantize_blockwise,
                                      quantize_blockwise_fused, quantize_mxfp8,
                                      quantize_mxfp8_fused)

RECIPES = ["fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"]


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def interleaved(fns: dict, reps: int) -> dict[str, list[float]]:
    """Run each callable once per round, ``reps`` rounds; returns all timings."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name] += timed(fn, 1)
    return times


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
    slow = interleaved({"clone": cases["clone"]} | {k: v for k, v in cases.items()
                                                     if k.startswith("eager")}, eager_reps)
    times = {**slow, **fast, "clone": fast["clone"] + slow["clone"]}
    clone_gbs = elems * 4 / min(times["clone"]) / 1e9
    rows = {}
    for name, ts in times.items():
        moved = 4 if name == "clone" else 3
        gbs = elems * moved / min(ts) / 1e9
        rows[name] = {"best_s": min(ts), "median_s": statistics.median(ts), "GB/s": gbs,
                      "x_clone": gbs / clone_gbs}
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
    w = torch.randn(n, n, generator=gen) / n ** 0.5
    plain32 = fwd_bwd(lambda xx, ww, b: F.linear(xx, ww), x, w, None)
    plain16 = fwd_bwd(lambda xx, ww, b: F.linear(xx, ww), x.bfloat16(), w.bfloat16(), None)
    results = {}
    layers = {}
    for recipe in RECIPES:
        layer = FP8EmulatedLinear(n, n, bias=False, recipe=recipe)
        layers[recipe] = layer

        def emulated(xx, ww, b, layer=layer):
            layer.weight = torch.nn.Parameter(ww)  # fresh leaf per run, same values
            return layer(xx)

        run = fwd_bwd(emulated, x, w, None)
        run()  # compiles this recipe's kernels; not timed
        results[recipe] = run
    plain32()
    times = interleaved({"fp32": plain32} | results, reps)
    bf16 = min(timed(plain16, bf16_reps)) if bf16_reps else float("nan")
    t32 = min(times["fp32"])
    rows = {"fp32": {"best_s": t32, "median_s": statistics.median(times["fp32"])},
            "bf16": {"best_s": bf16}}
    for recipe in RECIPES:
        t = min(times[recipe])
        rows[recipe] = {"best_s": t, "median_s": statistics.median(times[recipe]),
                        "x_fp32": t / t32, "x_bf16": t / bf16}
    return {"M=N=K": n, "tokens": tokens, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, smoke run only")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--skip-bf16", action="store_true",
                        help="skip the plain bf16 linear (minutes on CPUs without native bf16)")
    args = parser.parse_args()
    n_q, n_l, reps, bf16_reps = (1024, 512, 3, 1) if args.quick else (8192, 4096, 7, 1)
    with fused_mode(True, min_numel=0):
        quant = bench_quantize(n_q, reps)
        linear = bench_linear(n_l, n_l, max(2, reps // 2), 0 if args.skip_bf16 else bf16_reps)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "isa":
           torch.backends.cpu.get_cpu_capability()}
    print(f"# bench_numerics  torch {env['torch']}  threads {env['threads']}  isa {env['isa']}")
    print(f"\n## Block quantization, {quant['shape'][0]}x{quant['shape'][1]} {quant['dtype']}")
    print(f"{'case':<20}{'best s':>10}{'median s':>10}{'GB/s':>9}{'x clone':>9}")
    for name, r in quant["rows"].items():
        print(f"{name:<20}{r['best_s']:>10.4f}{r['median_s']:>10.4f}{r['GB/s']:>9.2f}"
              f"{r['x_clone']:>9.2f}")
    print(f"\n## Linear fwd+bwd, M=N=K={linear['M=N=K']} ({linear['tokens']} tokens)")
    print(f"{'case':<16}{'best s':>10}{'median s':>10}{'x fp32':>9}{'x bf16':>9}")
    for name, r in linear["rows"].items():
        med = f"{r['median_s']:>10.3f}" if "median_s" in r else f"{'':>10}"
        extra = (f"{r['x_fp32']:>9.2f}{r['x_bf16']:>9.3f}" if "x_fp32" in r else "")
        print(f"{name:<16}{r['best_s']:>10.3f}{med}{extra}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "quantize": quant, "linear": linear}, fh, indent=2)


if __name__ == "__main__":
    main()
