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
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ..explain import build_report, render_text

    report = build_report(args.config, hardware=args.hardware)
    sys.stdout.write(dump_json(report) if args.json else render_text(report))
    return 0
