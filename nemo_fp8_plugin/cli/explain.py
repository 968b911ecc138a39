"""``nemo-fp8 explain CONFIG``: show what a config resolves to before the run."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("explain", help="show the resolved recipe of a config",
                       description="Resolve the FP8 request of a YAML config (NeMo 2, "
                                   "Megatron-Bridge, megatron-core or NeMo RL) and print the "
                                   "recipe it runs with.")
    p.add_argument("config", help="path to a YAML config")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--hardware", default=None,
                   help="target GPU (h100, h200, b200, ...) or architecture for the hardware checks")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="resolve the per-layer rules against this built-in model (HF id or short "
                        "name such as llama3.1-8b), overriding the model the config names")
    p.add_argument("--model-config", default=None, metavar="PATH",
                   help="resolve the per-layer rules against a Hugging Face config.json (or a "
                        "checkpoint directory holding one); nothing is downloaded")
    p.add_argument("--host", default=None,
                   help="the host the config is for (default: detected from its shape); its "
                        "refusals are explain's")
    p.add_argument("--strict", action="store_true",
                   help="treat unmatched or shadowed rules, and rules a host cannot express, as errors")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ..explain import build_report, render_text

    report = build_report(args.config, hardware=args.hardware, model=args.model,
                          model_config=args.model_config, strict=args.strict,
                          host=args.host)
    sys.stdout.write(dump_json(report) if args.json else render_text(report))
    return 0
