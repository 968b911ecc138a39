"""No test or shipped file holds an absolute path to a checkout of this repository, the shared
test data or a download cache: the suite runs from any clone, wherever it is. Tests find the
shared test data and the download cache only through tests/conftest.py (``shared_nemo_rl``,
``SHARED_NEMO_RL``, ``UPSTREAM``, ``upstream_file``, ``upstream_wheel``), which also decides what
a missing one means (a skip here, a failure under CI=true).

Paths a user types (``-o /tmp/out.yaml`` in the docs) and a container's own paths are fine:
what is refused is where this checkout, its siblings, the shared test data and the caches
are, spelled out, on this machine (read from where the checkout is) or on any other
(the locations' shapes: ``/.../.cache/upstream``, ``/.../shared/data``, ``/home/<user>/.cache``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO, SHARED_NEMO_RL, UPSTREAM

pytestmark = pytest.mark.torch_free

ROOTS = (
    "nemo_fp8_plugin",
    "tests",
    "docs",
    "examples",
    "conf",
    "scripts",
    "benchmarks",
    ".ci",
    "README.md",
    "pyproject.toml",
    "constraints.txt",
    "constraints-oldest.txt",
)
"""What the repository ships or runs: the package, its tests, docs, examples, configs, scripts
and CI entry point."""

SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", ".cfg", ".cpp", ".json", ""}

_START = r"(?<![\w.~/-])"  # a path's first slash, not one inside a relative path or URL
SHAPES = (
    re.compile(_START + r"/(?:[\w.-]+/)+\.cache/upstream\b"),  # a checkout's download cache
    re.compile(_START + r"/(?:[\w.-]+/)*shared/(?:data\b|NUMERICS\.md|HOSTS\.md)"),
    re.compile(_START + r"/(?:root|home/[\w.-]+)/\.cache/"),  # a user's caches
)
"""Absolute locations by their shape, wherever they were written."""


def _here() -> list[str]:
    """This machine's locations: the checkout (as reached and as resolved), every sibling
    checkout next to it, the shared test data and the download cache (and where their links
    lead)."""
    places = {REPO, REPO.parent / "shared", SHARED_NEMO_RL, UPSTREAM, UPSTREAM.parent}
    if len(REPO.parent.parts) > 1:  # a clone at the file-system root has no siblings to name
        places |= {
            p
            for p in REPO.parent.iterdir()
            if p.is_dir() and ((p / ".git").exists() or (p / "pyproject.toml").is_file())
        }
    places |= {p.resolve() for p in places if p.exists()}
    return sorted({str(p) for p in places if len(p.parts) > 2}, key=len, reverse=True)


def _files() -> list[Path]:
    out = []
    for name in ROOTS:
        path = REPO / name
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += [
                p
                for p in sorted(path.rglob("*"))
                if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
            ]
    return out


def _offenders(texts: dict[str, str]) -> list[str]:
    """``name:line: text`` for every line of ``texts`` (name -> content) holding one."""
    here = re.compile(_START + "(?:" + "|".join(map(re.escape, _here())) + r")(?![\w.-])")
    return [
        f"{name}:{i}: {line.strip()}"
        for name, text in texts.items()
        for i, line in enumerate(text.splitlines(), 1)
        if here.search(line) or any(s.search(line) for s in SHAPES)
    ]


def test_no_test_or_shipped_file_holds_an_absolute_path_to_the_checkout_data_or_caches():
    files = [
        p for p in _files() if p != Path(__file__).resolve()
    ]  # this file spells what it refuses
    assert REPO / "tests" / "conftest.py" in files and len(files) > 300, len(files)
    found = _offenders({str(p.relative_to(REPO)): p.read_text(errors="replace") for p in files})
    assert not found, "use tests/conftest.py's locations instead:\n" + "\n".join(found)


BUILT_HERE = re.compile(r"""["']\.cache["']|\.parent\s*/\s*["']shared["']|["']shared/data""")
"""A test building the download cache's or the shared test data's location itself."""


def test_tests_reach_the_cache_and_the_shared_data_through_conftest():
    found = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path not in (REPO / "tests" / "conftest.py", Path(__file__).resolve())
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if BUILT_HERE.search(line)
    ]
    assert not found, "use tests/conftest.py's locations instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        'SNAPSHOT = Path("' + str(SHARED_NEMO_RL) + '")',
        'WHEEL = Path("' + str(UPSTREAM) + '") / name',
        "src = '/elsewhere/checkout/.cache/upstream/x.whl'",
        "(``/srv/ci/shared/data/nemo_rl``)",
        "HF_HOME=/home/someone/.cache/huggingface",
        "HF_HOME=/root/.cache/huggingface",
    ],
)
def test_the_guard_catches(line):
    assert _offenders({"probe.py": line})


@pytest.mark.parametrize(
    "line",
    [
        "nemo-fp8 apply conf/examples/x.yaml -o /tmp/out.yaml",
        "uv run examples/run_grpo.py --config /opt/nemo-rl/examples/configs/grpo_math_1B.yaml",
        "cache under ``~/.cache/nemo_fp8_plugin``",
        "fetch into .cache/upstream (scripts/install.sh)",
        "see ../shared/data/nemo_rl/README",
        "https://github.com/NVIDIA-NeMo/RL/blob/main/shared/data/x",
    ],
)
def test_the_guard_lets_through(line):
    assert not _offenders({"probe.md": line})


@pytest.mark.parametrize("ci", [True, False])
def test_a_missing_fixture_fails_under_ci_and_is_skipped_elsewhere(ci, monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "IN_CI", ci)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="absent-0.0.0"):
        conftest.upstream_wheel("absent-0.0.0-py3-none-any.whl")
    with pytest.raises(outcome, match="absent-0.0.0"):
        conftest.shared_nemo_rl("absent-0.0.0")
