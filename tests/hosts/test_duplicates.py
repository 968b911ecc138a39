"""No two host adapters share a copied skeleton: pylint's duplicate-code check
over ``nemo_fp8_plugin/hosts`` at 8 lines, imports, docstrings and comments not counted.
What the adapters share lives once in ``nemo_fp8_plugin.hosts`` (``run``, ``HostAdapter``,
``apply_path``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _duplicate_report(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pylint",
            "--disable=all",
            "--enable=duplicate-code",
            "--min-similarity-lines=8",
            "--ignore-imports=yes",
            "--ignore-docstrings=yes",
            "--ignore-comments=yes",
            "--score=no",
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_host_adapters_share_no_copied_code():
    out = _duplicate_report(ROOT / "nemo_fp8_plugin" / "hosts")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "R0801" not in out.stdout, out.stdout


def test_the_check_finds_a_copy(tmp_path):
    """The check can fail: two modules sharing a ten-line function are reported."""
    body = "".join(f"    x{i} = value + {i}\n" for i in range(10)) + "    return x9\n"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("a", "b"):
        (pkg / f"{name}.py").write_text(f"def f_{name}(value):\n{body}")
    out = _duplicate_report(pkg)
    assert "R0801" in out.stdout
