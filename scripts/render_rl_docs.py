"""Rewrite the rl-check blocks of docs/rl.md and docs/performance.md, and docs/analyze.md's
example of ``analyze --attribution``, from an rl-check JSON, in place and atomically.

    python scripts/render_rl_docs.py docs/data/rl_check.json            # rewrite both pages
    python scripts/render_rl_docs.py docs/data/rl_check.json --check    # exit 1 if one would change

The blocks are those :mod:`nemo_fp8_plugin.tools.rl_check_docs` renders (the command, the
tables, the findings, the cost); ``tests/tools/test_rl_check_docs.py`` checks that the shipped
page is what this script makes of the shipped JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="the rl-check --json file the page cites")
    p.add_argument(
        "--doc",
        action="append",
        default=None,
        help="a page to rewrite (repeatable; default docs/rl.md and docs/performance.md)",
    )
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from nemo_fp8_plugin.tools import rl_check_docs

    docs = args.doc or [str(REPO / "docs" / "rl.md"), str(REPO / "docs" / "performance.md")]
    stale = False
    for doc in docs:
        changed = rl_check_docs.render_file(args.json, doc, write=not args.check)
        if args.check and changed:
            print(f"{doc} is stale against {args.json}", file=sys.stderr)
        elif not args.check:
            print(f"{doc}: {'rewritten' if changed else 'already current'}")
        stale |= changed
    if not args.doc:  # and docs/analyze.md's example of analyze --attribution on the JSON
        doc = str(REPO / "docs" / "analyze.md")
        changed = rl_check_docs.render_analyze_file(args.json, doc, write=not args.check)
        if args.check and changed:
            print(f"{doc} is stale against {args.json}", file=sys.stderr)
        elif not args.check:
            print(f"{doc}: {'rewritten' if changed else 'already current'}")
        stale |= changed
    if args.check and stale:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
