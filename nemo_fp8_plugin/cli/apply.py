"""``nemo-fp8 apply CONFIG --host H``: rewrite a config into a host's native FP8 keys."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path


def register(sub) -> None:
    from ..hosts import HOSTS

    p = sub.add_parser(
        "apply", help="rewrite a config into a host's native FP8 keys",
        description="Rewrite a config that says `precision: <recipe>` (or has an `fp8:` block) "
                    "into the host's own keys. Every other key is kept; running it on its own "
                    "output changes nothing; a config that already sets conflicting native FP8 "
                    "keys is refused.")
    p.add_argument("config", help="path to a YAML config")
    # `nemo_rl` is how the package and its docs spell NeMo RL; accept it next to `nemo-rl`.
    p.add_argument("--host", required=True, choices=list(HOSTS),
                   type=lambda name: name.replace("_", "-") if name.replace("_", "-") in HOSTS
                   else name, help="target host")
    p.add_argument("-o", "--output", default=None,
                   help="output file (written atomically); default: standard output")
    p.add_argument("--hardware", default=None,
                   help="target GPU (h100, h200, b200, ...) or architecture for the hardware checks")
    p.add_argument("--strict", action="store_true",
                   help="treat rules the host cannot express as errors")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import atomic_write_text, dump_json, dump_yaml
    from ..errors import FP8ConfigError
    from ..hosts import host_module

    adapter = host_module(args.host)
    extra = {}
    # Adapters that write relative references (NeMo RL's `defaults:`) need the destination.
    if "output" in inspect.signature(adapter.apply_file).parameters:
        extra["output"] = Path(args.output) if args.output else None
    result = adapter.apply_file(Path(args.config), hardware=args.hardware, strict=args.strict,
                                **extra)
    if args.strict and result.warnings:
        raise FP8ConfigError(result.warnings[0], key="--strict")
    fmt = result.fmt
    if args.output and args.output.endswith(".json"):
        fmt = "json"
    text = dump_json(result.data) if fmt == "json" else dump_yaml(result.data)
    for w in result.warnings:
        print(f"nemo-fp8 apply: warning: {w}", file=sys.stderr)
    if args.output:
        atomic_write_text(args.output, text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
