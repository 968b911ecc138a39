"""``nemo-fp8 analyze CHECKPOINT``: per-module FP8 quantization error of a checkpoint, and the
``bf16_layers`` rules it suggests."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="measure each layer's FP8 error in a checkpoint and suggest bf16_layers",
        description="Stream the linear weights of a Hugging Face safetensors checkpoint, quantize "
        "each under every recipe with the reference quantizers, report per-module SQNR "
        "and worst-row relative error, and print a ready-to-paste bf16_layers rule set "
        "for the modules below the threshold.",
    )
    p.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a .safetensors file or a checkpoint directory"
    )
    p.add_argument(
        "--recipes",
        default=None,
        metavar="NAMES",
        help="comma-separated recipe names (default: every registered recipe)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        metavar="DB",
        help="flag modules whose weight or input SQNR (tensor or worst row) is below "
        "DB, or whose GEMM output SQNR is below DB - 3 (default by format: 25 for the "
        "E4M3 recipes, 13 for nvfp4)",
    )
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="write a module x recipe SQNR heat map (PNG, written atomically)",
    )
    p.add_argument(
        "--activations",
        action="store_true",
        help="also run the model (built by transformers from the checkpoint's "
        "config.json, on CPU) and measure each linear layer's input SQNR",
    )
    p.add_argument(
        "--samples",
        default=None,
        metavar="FILE",
        help="with --activations: a text file (one sample per line) or a JSON list of "
        "token-id lists; default: a few built-in sentences",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        metavar="N",
        help="with --activations: tokens per sample (default 128)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import check_output_file, dump_json
    from ..analyze import analyze_checkpoint, render_text, write_heatmap
    from ..errors import FP8ConfigError
    from ._args import name_list

    recipes = name_list(args.recipes, "--recipes")
    if args.samples is not None and not args.activations:
        raise FP8ConfigError(
            "samples feed the activation pass",
            key="--samples",
            value=args.samples,
            hint="add --activations",
        )
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise FP8ConfigError(
            "the heat map is a PNG file",
            key="--plot",
            value=args.plot,
            hint="name it something.png",
        )
    check_output_file(args.plot, "--plot")
    report = analyze_checkpoint(
        args.checkpoint,
        recipes=recipes,
        threshold_db=args.threshold,
        activations=args.activations,
        samples=args.samples,
        max_tokens=args.max_tokens,
        progress=False if args.no_progress else None,
    )
    if args.plot:
        path = write_heatmap(report, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    sys.stdout.write(dump_json(report) if args.json else render_text(report))
    return 0
