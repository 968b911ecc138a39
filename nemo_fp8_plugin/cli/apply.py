"""``nemo-fp8 apply CONFIG --host H``: rewrite a config into a host's native FP8 keys."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    from ..hosts import HOSTS

    p = sub.add_parser(
        "apply", help="rewrite a config into a host's native FP8 keys",
        description="Rewrite a config that says `precision: <recipe>` (or has an `fp8:` block) "
                    "into the host's own keys. Every other key is kept; running it on its own "
                    "output changes nothing; a config that already sets conflicting native FP8 "
                    "keys is refused. `nemo-fp8 explain` shows the same result before you write it.")
    p.add_argument("config", help="path to a YAML config")
    # `nemo_rl` is how the package and its docs spell NeMo RL; accept it next to `nemo-rl`.
    p.add_argument("--host", required=True, choices=list(HOSTS),
                   type=lambda name: name.replace("_", "-") if name.replace("_", "-") in HOSTS
                   else name, help="target host")
    p.add_argument("-o", "--output", default=None,
                   help="output file (written atomically); default: standard output")
    p.add_argument("--hardware", default=None,
                   help="target GPU (h100, h200, b200, ...) or architecture for the hardware checks")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="resolve the per-layer rules against this built-in model, overriding the "
                        "model the config names (as explain does)")
    p.add_argument("--model-config", default=None, metavar="PATH",
                   help="resolve the per-layer rules against a Hugging Face config.json (or a "
                        "checkpoint directory holding one)")
    p.add_argument("--strict", action="store_true",
                   help="treat rules the host cannot express as errors")
    p.add_argument("--validate", action="store_true",
                   help="also feed the result to the host's own code where the host is installed "
                        "(megatron-core's TransformerConfig, vLLM's EngineArgs, NeMo's plugin, "
                        "TE's recipe) and say what was checked")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import atomic_write_text, dump_json, dump_yaml
    from ..hosts import get_adapter, load_context
    from ..hosts import run as run_pipeline

    adapter = get_adapter(args.host)
    ctx = load_context(args.config, hardware=args.hardware, model=args.model,
                       model_config=args.model_config, output=args.output, strict=args.strict)
    result = run_pipeline(adapter, ctx)
    checks = adapter.validate(result, ctx) if args.validate and result.requested else []
    fmt = "json" if (args.output or "").endswith(".json") else result.fmt
    text = dump_json(result.data) if fmt == "json" else dump_yaml(result.data)
    for w in result.warnings + result.notes:
        print(f"nemo-fp8 apply: warning: {w}", file=sys.stderr)
    for line in checks:
        print(f"nemo-fp8 apply: checked: {line}", file=sys.stderr)
    if args.output:
        atomic_write_text(args.output, text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
