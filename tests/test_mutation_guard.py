"""The suite keeps its teeth: scripts/mutation_guard.py applies known-bad
edits to a copy of the package and requires the named tests to fail for each (and to pass
on the unmutated copy). About 2 minutes on two cores; CI budget 3 minutes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_known_bad_edit_is_caught():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "mutation_guard.py")],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 survived" in proc.stdout, proc.stdout
