"""``nemo-fp8 bench``: the CPU benchmarks of the numerics and RL paths, in one run."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="run the CPU benchmarks (quantizers, emulated linear, refit quantizer, export)",
        description="The public quantizers' throughput vs torch.clone (bytes read + written), "
        "emulated FP8 linear fwd+bwd vs plain fp32/bf16, the refit quantizer vs a copy, and "
        "checkpoint export vs a safetensors copy, each as a ratio against a baseline measured "
        "in the same run; first-call costs (building the CPU kernels, compiling) are printed "
        "apart, never inside a ratio. The full sizes take 15-20 minutes on two CPU cores "
        "(most of it the plain bf16 linear: --skip-bf16); --quick is a smoke run whose "
        "numbers are not the reference figures.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    p.add_argument(
        "--skip-bf16",
        action="store_true",
        help="skip the plain bf16 linear baseline (slow on CPUs without native bf16)",
    )
    p.add_argument(
        "--skip-linear", action="store_true", help="skip the emulated linear layer entirely"
    )
    p.add_argument(
        "--skip-export", action="store_true", help="skip the checkpoint export benchmark"
    )
    p.add_argument(
        "--json", metavar="FILE", default=None, help="also write the results as JSON to FILE"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import check_output_file
    from ..tools.bench import bench_refit, render_numerics, render_refit, run_numerics
    from ..tools.bench_export import bench_export, render_export
    from ..tools.harness import environment, stderr_progress, write_json

    check_output_file(args.json, "--json")
    env = environment()
    print(
        f"# nemo-fp8 bench  torch {env['torch']}  threads {env['threads']}  isa {env['isa']}\n",
        flush=True,
    )
    numerics = run_numerics(
        quick=args.quick,
        skip_bf16=args.skip_bf16,
        linear=not args.skip_linear,
        progress=stderr_progress("bench"),  # the first table comes after minutes of work
    )
    print(render_numerics(numerics) + "\n", flush=True)
    refit = bench_refit(quick=args.quick, rounds=2 if args.quick else 4)
    print(render_refit(refit) + "\n", flush=True)
    result = {"environment": env, **numerics, "refit": refit}
    if not args.skip_export:
        export = bench_export(quick=args.quick)
        print(render_export(export), flush=True)
        result["export"] = export
    if args.json:
        write_json(args.json, result)
        from . import printable_path

        print(f"wrote {printable_path(str(args.json))}", file=sys.stderr)
    return 0
