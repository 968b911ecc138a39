"""``nemo-fp8 explain CONFIG``: show what a config resolves to before the run."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    from ._args import add_model_options

    p = sub.add_parser(
        "explain",
        help="show the resolved recipe of a config",
        description="Resolve the FP8 request of a config (NeMo 2, Megatron-Bridge, "
        "megatron-core, NeMo RL or vLLM) and show, warnings first, the "
        "recipe, which layer runs in which precision, and what "
        "`nemo-fp8 apply` writes for the config's own host (detected "
        "from its shape, or --host). --json has every host.",
    )
    p.add_argument("config", help="path to a YAML (or JSON) config")
    add_model_options(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print the whole report as JSON (every host, every module)",
    )
    p.add_argument(
        "--host",
        default=None,
        help="the host the config is for (default: detected from its shape): its keys "
        "are shown, and its refusals are explain's",
    )
    p.add_argument(
        "--stack",
        default=None,
        metavar="NAME",
        help="assume this named stack's host versions (nemo-rl-0.6.0, nemo-rl-0.7.0, "
        "nemo-rl-main-2026-08-22, nemo-2.7, latest; default: the installed versions, and for "
        "NeMo RL the release they identify, else v0.7.0); the report's first lines name it",
    )
    p.add_argument(
        "--all-hosts",
        action="store_true",
        help="show what apply writes for every host, not only the config's own",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="every detail: each recipe field on its own line, long values whole, every host",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="treat unmatched or shadowed rules, and rules a host cannot express, as errors",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ..explain import build_report, render_text

    report = build_report(
        args.config,
        hardware=args.hardware,
        model=args.model,
        model_config=args.model_config,
        strict=args.strict,
        host=args.host,
        stack=args.stack,
    )
    if args.json:
        sys.stdout.write(dump_json(report))
    else:
        if report.get("host") == "nemo-rl" and "stack" in report:
            # The first line: which NeMo RL release the keys below are written for.
            print(report["stack"]["nemo_rl"]["line"])
        sys.stdout.write(
            render_text(
                report, all_hosts=args.all_hosts, full=args.full, host_given=args.host is not None
            )
        )
    return 0
