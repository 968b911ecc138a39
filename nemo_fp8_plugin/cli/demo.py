"""``nemo-fp8 demo``: the main job, on its embedded default."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a megatron-core GPT on CPU in BF16 and under each FP8 recipe",
        description="Train a small real megatron-core GPTModel on CPU (the Python standard "
        "library's source, byte-level) once in BF16 and once under each recipe's "
        "bit-exact FP8 emulation, from the same seed; print a table and write the "
        "loss curves (PNG) and numbers (JSON). Ctrl-C keeps what ran.",
    )
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="demo YAML (default: the embedded conf/examples/demo_gpt_fp8_blockwise.yaml)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per arm (default: the config's)"
    )
    p.add_argument(
        "--recipes",
        default=None,
        help="comma-separated recipes to compare with BF16 (default: every registered recipe)",
    )
    p.add_argument(
        "--out", default="nemo-fp8-demo", help="output folder (default: ./nemo-fp8-demo)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


# megatron-core warns at import and build time that it falls back from Transformer Engine,
# Apex and CUDA graphs; on a CPU that is the expected path, and a screen of it would bury
# the demo's own output. Only these messages are hidden.
_EXPECTED_CPU_WARNINGS = (
    r".*(Transformer Engine|Apex).* not installed",
    r"full scope is deprecated",
)


def run(args: argparse.Namespace) -> int:
    import warnings

    from .._io import check_output_dir
    from ..tools.demo import run_demo
    from ._args import name_list

    recipes = name_list(args.recipes, "--recipes")
    if args.steps is not None and not 1 <= args.steps <= 100_000:  # the config's own range
        from ..errors import FP8ConfigError

        raise FP8ConfigError(
            f"must be in [1, 100000], got {args.steps}", key="--steps", value=args.steps
        )
    check_output_dir(args.out, "--out")
    with warnings.catch_warnings():
        for pattern in _EXPECTED_CPU_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        report = run_demo(
            args.config,
            recipes=recipes,
            steps=args.steps,
            out_dir=args.out,
            progress=not args.no_progress,
        )
    return 130 if report.get("interrupted") else 0
