"""No shipped file cites a path outside the repository: a user or contributor
who clones the project must be able to read every source a file points to. The stated
numerics live in docs/numerics.md. Tests may still read the shared test data."""

from __future__ import annotations

import re

import pytest

from conftest import REPO

pytestmark = pytest.mark.torch_free

SHIPPED = ["nemo_fp8_plugin", "docs", "examples", "conf", "scripts", "README.md", "pyproject.toml"]
OUTSIDE = re.compile(r"\.\./shared|shared/(NUMERICS|HOSTS)\.md|\b(NUMERICS|HOSTS)\.md\b")
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", ".cfg", ".cpp"}


def _shipped_files():
    for name in SHIPPED:
        path = REPO / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.suffix in SUFFIXES and p.is_file())


def test_no_shipped_file_cites_a_path_outside_the_repository():
    found = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for path in _shipped_files()
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_stated_semantics_are_in_the_repository():
    text = (REPO / "docs" / "numerics.md").read_text()
    assert "## The rules and where they come from" in text
    # Each rule table row names an upstream file with its version.
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| rule")]
    sourced = [
        ln for ln in rows if re.search(r"(TE|vLLM|megatron-core|torch|torchao|NeMo RL) \d", ln)
    ]
    assert len(sourced) >= 25, len(sourced)
