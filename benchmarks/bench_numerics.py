"""Numerics benchmark: the public quantizers' throughput and the emulated
linear layer's overhead.

The figures of ``nemo_fp8_plugin.tools.bench`` (see its docstring): the public quantizers
(``quantize_blockwise`` 1x128 / 128x128, ``quantize_mxfp8`` 1x32, ``quantize_per_tensor``),
their compiled and reference variants, on an 8192x8192 bf16 tensor vs ``torch.clone`` of it
in the same run (bytes read + written; first calls, including the CPU kernel build, timed
apart), and a 4096x4096 linear's fwd+bwd per recipe's FP8 emulation (six recipes) vs the
same layer in fp32, bf16 and the BF16-emulated linear (the demo's BF16 arm), with the load
average: the ratios count only at load < 1.5, and the output says whether they do.
Usage::

    .venv/bin/python benchmarks/bench_numerics.py [--quick] [--skip-bf16] [--skip-linear]
        [--json out.json]

``--quick`` shrinks the sizes for a smoke run (its numbers are not the issue's figures).
``nemo-fp8 bench`` runs this together with the refit and export benchmarks.
"""

from __future__ import annotations

import argparse
import os

from nemo_fp8_plugin.tools.bench import render_numerics, run_numerics
from nemo_fp8_plugin.tools.harness import environment, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, smoke run only")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--skip-bf16",
        action="store_true",
        help="skip the plain bf16 linear (minutes on CPUs without native bf16)",
    )
    parser.add_argument(
        "--skip-linear", action="store_true", help="only the quantizers, no emulated linear"
    )
    args = parser.parse_args()
    env = environment()
    result = run_numerics(quick=args.quick, skip_bf16=args.skip_bf16, linear=not args.skip_linear)
    print(
        f"# bench_numerics  torch {env['torch']}  threads {env['threads']}  isa {env['isa']}"
        f"  load average {os.getloadavg()[0]:.2f} at the start\n"
    )
    print(render_numerics(result))
    if args.json:
        write_json(args.json, {"environment": env, **result})


if __name__ == "__main__":
    main()
