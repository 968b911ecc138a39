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
        "for the modules below the threshold. With --attribution instead of a checkpoint: "
        "the bf16_layers rules of the layers or module kinds whose BF16 keeping lowers "
        "rl-check's token_mult_prob_error most (its per-layer mismatch attribution).",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        nargs="?",
        default=None,
        help="a .safetensors file or a checkpoint directory (not with --attribution)",
    )
    p.add_argument(
        "--attribution",
        default=None,
        metavar="RL_CHECK.json",
        help="read the mismatch attribution of `nemo-fp8 rl-check --json` instead of a "
        "checkpoint and suggest bf16_layers for its best-ranked candidates",
    )
    p.add_argument(
        "--attribution-arm",
        default=None,
        metavar="ARM",
        help="with --attribution: the arm whose ranking is read (default fp8-e2e-is, "
        "NVIDIA's end-to-end recipe, else the first arm with a ranking)",
    )
    p.add_argument(
        "--top",
        default=None,
        metavar="N",
        help="with --attribution: keep the N best-ranked candidates that lower the mismatch "
        "in BF16 (default 1)",
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


def _run_attribution(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ..analyze.attribution import attribution_report, render_attribution
    from ..errors import FP8ConfigError

    if args.checkpoint is not None:
        raise FP8ConfigError(
            "reads rl-check's JSON, not a checkpoint",
            key="--attribution",
            value=args.checkpoint,
            hint="give either CHECKPOINT or --attribution",
        )
    for flag, value in (
        ("--recipes", args.recipes),
        ("--threshold", args.threshold),
        ("--plot", args.plot),
        ("--activations", args.activations or None),
        ("--samples", args.samples),
    ):
        if value is not None:
            raise FP8ConfigError(
                "measures a checkpoint; --attribution reads rl-check's ranking",
                key=flag,
                value=value,
                hint="drop it or analyze a checkpoint instead",
            )
    top = 1
    if args.top is not None:
        try:
            top = int(args.top, 10)
        except ValueError:
            top = 0
        if top < 1:
            raise FP8ConfigError("must be a positive integer", key="--top", value=args.top)
    report = attribution_report(args.attribution, arm=args.attribution_arm, top=top)
    sys.stdout.write(dump_json(report) if args.json else render_attribution(report))
    return 0


def run(args: argparse.Namespace) -> int:
    from .._io import check_output_file, dump_json
    from ..analyze import analyze_checkpoint, render_text, write_heatmap
    from ..errors import FP8ConfigError
    from ._args import name_list

    if args.attribution is not None:
        return _run_attribution(args)
    for flag, value in (("--attribution-arm", args.attribution_arm), ("--top", args.top)):
        if value is not None:
            raise FP8ConfigError(
                "belongs to --attribution", key=flag, value=value, hint="add --attribution FILE"
            )
    if args.checkpoint is None:
        raise FP8ConfigError(
            "give a checkpoint to analyze", key="CHECKPOINT", hint="or --attribution RL_CHECK.json"
        )
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
        from . import printable_path

        print(f"wrote {printable_path(str(path))}", file=sys.stderr)
    sys.stdout.write(dump_json(report) if args.json else render_text(report))
    return 0
