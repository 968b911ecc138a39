#!/usr/bin/env python3
"""A guard that the test suite keeps its teeth.

Each mutation below is a known-bad edit (a flipped E4M3 cast, a dropped refusal, a broken
round trip, a dropped alignment factor, a lexical path where a physical one is needed, a
quadratic scan put back). For each, a temporary copy of the package gets the edit and the
named tests run against it: they must fail. A mutation whose tests pass means the suite
stopped looking there. A mutation whose text is no longer in the source is reported as
stale (the guard must be updated with the code), which also fails.

    python scripts/mutation_guard.py [--only NAME] [--python PYTHON]

Exit 0 when every mutation is caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids or -k expressions (with "::")


MUTATIONS = (
    Mutation(
        "e4m3-cast-without-saturation",
        "nemo_fp8_plugin/numerics/scaling.py",
        "return xf.clamp(-fmt_max, fmt_max).to(dtype)",
        "return xf.to(dtype)",
        ("tests/numerics/test_numerics_quantize.py",),
    ),
    Mutation(
        "json-output-accepts-colliding-keys",
        "nemo_fp8_plugin/_io.py",
        "                if as_json in seen:",
        "                if False:",
        ("tests/test_hostile.py::test_json_output_refuses_what_json_cannot_say",),
    ),
    Mutation(
        "round-trip-drops-the-document-header",
        "nemo_fp8_plugin/roundtrip.py",
        "    header = _header(source)\n    if not header:",
        "    header = _header(source)\n    if True:",
        ("tests/test_hostile.py::test_round_trip_keeps_the_lines_before_the_document",),
    ),
    Mutation(
        "round-trip-drops-the-lines-before-the-first-change",
        "nemo_fp8_plugin/roundtrip.py",
        "            out.extend(mine[pos : touched[0]])  # lines only the source has, before the change\n",
        "",
        (
            "tests/cli/test_roundtrip.py::"
            "test_a_block_mapping_keeps_its_header_when_the_request_line_below_it_goes",
        ),
    ),
    Mutation(
        "sequence-parallel-alignment-factor-dropped",
        "nemo_fp8_plugin/capabilities.py",
        "        need *= tensor_parallel\n",
        "        need *= 1\n",
        ("tests/hosts/test_alignment.py::test_token_alignment_with_parallelism",),
    ),
    Mutation(
        "defaults-rewritten-lexically",
        "nemo_fp8_plugin/hosts/nemo_rl/adapter.py",
        "        target = os.path.realpath(source.parent / item)",
        "        target = os.path.abspath(source.parent / item)",
        (
            "tests/test_hostile.py::"
            "test_defaults_through_a_symlinked_directory_name_the_parent_nemo_rl_loads",
        ),
    ),
    Mutation(
        "explain-scans-every-unmatched-label",
        "nemo_fp8_plugin/explain.py",
        "            if prefix is None or not w.startswith(prefix):",
        "            if not any(w.startswith(p) for p in by_index.values()):",
        ("tests/test_hostile.py::test_explain_is_linear_in_unmatched_patterns",),
    ),
    Mutation(
        "read-only-output-replaced",
        "nemo_fp8_plugin/_io.py",
        "and not read_only_ok and not mode & 0o222:",
        "and not read_only_ok and False:",
        ("tests/test_hostile.py::test_a_read_only_output_is_refused_unless_forced",),
    ),
    Mutation(
        "live-writers-temp-file-removed",
        "nemo_fp8_plugin/_io.py",
        "                or not _lock(fd, blocking=False)\n",
        "                or False\n",
        ("tests/test_write_signals.py::test_a_live_writers_temp_file_is_never_removed",),
    ),
)


def _copy(dest: Path) -> None:
    if (REPO / ".cache").exists():  # the upstream wheels some tests read (never edited)
        (dest / ".cache").symlink_to(REPO / ".cache")
    for part in ("nemo_fp8_plugin", "conf", "tests", "scripts", "pyproject.toml"):
        src = REPO / part
        if src.is_dir():
            shutil.copytree(
                src, dest / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        elif src.exists():
            shutil.copy2(src, dest / part)


def _pytest(root: Path, tests, python: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def baseline(python: str, mutations) -> tuple[bool, str]:
    """Every named test passes on the unmutated copy (else "caught" would mean nothing)."""
    with tempfile.TemporaryDirectory(prefix="nemo-fp8-mutant-") as d:
        root = Path(d)
        _copy(root)
        tests = list(dict.fromkeys(t for m in mutations for t in m.tests))
        proc = _pytest(root, tests, python)
        last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        return proc.returncode == 0, last


def check(mutation: Mutation, python: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="nemo-fp8-mutant-") as d:
        root = Path(d)
        _copy(root)
        target = root / mutation.file
        text = target.read_text(encoding="utf-8")
        if text.count(mutation.old) != 1:
            return False, f"stale: the text to mutate occurs {text.count(mutation.old)} times"
        target.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
        proc = _pytest(root, mutation.tests, python)
        last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        if proc.returncode == 1:  # tests ran and failed: caught
            return True, last
        return False, f"pytest exit {proc.returncode}: {last}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="run the mutations whose name has this")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    todo = [m for m in MUTATIONS if args.only is None or args.only in m.name]
    ok, detail = baseline(args.python, todo)
    print(f"{'baseline' if ok else 'BROKEN':8}  unmutated copy: {detail}", flush=True)
    if not ok:
        return 1
    survived = 0
    for mutation in todo:
        caught, detail = check(mutation, args.python)
        survived += not caught
        print(f"{'caught' if caught else 'SURVIVED':8}  {mutation.name}: {detail}", flush=True)
    print(f"\n{len(todo)} mutations, {len(todo) - survived} caught, {survived} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
