"""``nemo-fp8 recipes``: list the registered recipes."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "recipes",
        help="list the registered FP8 recipes",
        description="List every registered recipe (built-in presets and recipes "
        "installed packages declare) with a one-line description.",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of objects with name, description, source and every spec field",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ..registry import default_registry

    reg = default_registry()
    if args.json:
        rows = [{**spec.to_dict(), "source": reg.source(spec.name)} for spec in reg.specs()]
        sys.stdout.write(dump_json(rows))
        return 0
    width = max(len(n) for n in [*reg.names(), "recipe"])
    print(f"{'recipe':<{width}}  {'scaling':<10}  description")
    for spec in reg.specs():
        print(f"{spec.name:<{width}}  {spec.scaling:<10}  {spec.description}")
    return 0
