"""Hostile and careless input, third pass (issue 26): no hang, no silent loss, no traceback.

Work is bounded by counting (Python calls made, through :func:`sys.setprofile`), never by
a clock: the same input gives the same count on any machine. Each test failed before its fix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def calls(fn, *args, **kwargs) -> int:
    """How many Python and C function calls ``fn(*args, **kwargs)`` makes."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return count


def _unmatched_patterns(tmp_path: Path, n: int, word: str = "nomatch") -> Path:
    pats = "\n".join(f"    - '{word}{i}.*'" for i in range(n))
    path = tmp_path / f"{word}{n}.yaml"
    path.write_text(
        f"precision: fp8_blockwise\nfp8:\n  bf16_layers:\n    modules:\n{pats}\n", encoding="utf-8"
    )
    return path


# --------------------------------------------------------------------------- bounded work


def test_explain_is_linear_in_unmatched_patterns(tmp_path):
    """Each side's warning scanned every unmatched label: 8,000 patterns took 72 s and
    120,000 (within LIMITS) never finished. The calls one more pattern costs must not grow
    with the number of patterns (quadratic: the marginal cost at 200-400 was 1.29x that at
    50-100; linear: 1.06x, the rest Python's regex cache)."""
    from nemo_fp8_plugin.explain import build_report

    # warm what is loaded once per process (imports, the model), on another file
    build_report(_unmatched_patterns(tmp_path, 60, "warm"), model="llama3.1-8b")
    cost = {
        n: calls(build_report, _unmatched_patterns(tmp_path, n), model="llama3.1-8b")
        for n in (50, 100, 200, 400)
    }
    early = (cost[100] - cost[50]) / 50
    late = (cost[400] - cost[200]) / 200
    assert late / early < 1.15, cost
