"""Refit quantizer benchmark: GB/s of ``quantize_for_refit`` vs a copy.

Quantizes the linear weights of transformer layers shaped like Llama-3-8B's (hidden 4096,
8 KV heads of 128, MLP 14336; bf16) with the recipe's block FP8 layout, and clones the
same tensors in the same run as the copy baseline. Bytes moved (read + written): refit 2 B
read + 1 B written per element (+ the fp32 scales, counted), copy 2 B + 2 B. Three paths
are timed: ``refit`` (the public quantizers' own choice: the single-pass CPU kernels on a
CPU, the compiled kernels on CUDA), ``refit fused`` (torch.compile) and ``refit
reference`` (eager); each timing is the best of several interleaved rounds, and the first
call of each fast path (kernel build, compiles) is reported apart. ``--device cuda`` runs
it on a GPU against a same-run device copy (Triton kernels through the same torch.compile
code; written for the GPU check, not run on the CPU machine) and ``--check`` first
verifies, weight by weight, that the public and compiled outputs on that device are
bit-identical to the eager reference computed on the CPU. Usage::

    .venv/bin/python benchmarks/bench_refit.py [--layers 1] [--recipe fp8_blockwise]
        [--device cpu|cuda] [--check] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse

from nemo_fp8_plugin.tools.bench import bench_refit, render_refit
from nemo_fp8_plugin.tools.harness import environment, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--recipe", default="fp8_blockwise")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="quarter-width layers")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--check", action="store_true", help="verify fused == CPU eager reference first"
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    env = environment(args.device)
    result = bench_refit(args.layers, args.recipe, args.rounds, args.quick, args.device, args.check)
    print(f"# bench_refit  torch {env['torch']}  threads {env['threads']}  device {env['device']}")
    print(render_refit(result))
    if args.json:
        write_json(args.json, {"environment": env, "refit": result})


if __name__ == "__main__":
    main()
