"""The ``nemo-fp8`` command line.

Each subcommand lives in its own module of this package with two functions:
``register(subparsers)`` adds its parser (cheap: no torch, no host import at module level)
and ``run(args) -> int`` does the work. User mistakes raise
:class:`~nemo_fp8_plugin.errors.FP8ConfigError` and become one line on stderr with exit
code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from ..errors import FP8ConfigError

# Subcommand modules, in the order `nemo-fp8 --help` lists them.
COMMANDS = (
    "recipes",
    "explain",
    "apply",
    "analyze",
    "export",
    "doctor",
    "demo",
    "rl_check",
    "bench",
)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="nemo-fp8",
        description="FP8 recipes for NeMo 2, Megatron-Bridge, megatron-core, NeMo RL and vLLM, "
        "from one line of YAML.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import warnings

    # torch.cuda warns at import whenever the (NeMo-installed) pynvml package is present;
    # it is about torch's environment, not the user's command, and would top every output.
    warnings.filterwarnings(
        "ignore", message="The pynvml package is deprecated", category=FutureWarning
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except FP8ConfigError as err:
        print(f"nemo-fp8 {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        # An unwritable or unreadable path the user named (-o pointing at a directory, a
        # read-only file system, a missing file): theirs to fix, so one line and exit 2.
        where = f"{err.filename}: " if err.filename else ""
        print(f"nemo-fp8 {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nemo-fp8 {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nemo-fp8 recipes | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
