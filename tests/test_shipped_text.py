"""Shipped text speaks to users: no file names an issue of this project (``issue 25``, an anchor
``#...-issue-25``), and none tells how the project itself was run (its own machines, sessions,
branches). Citations of upstream issues stay, written with their repository
(``NVIDIA-NeMo/RL issue 1164``, ``NVIDIA-NeMo/RL#3280``); so do pull requests (this project
cites none of its own). A test says what it checks, not which issue asked for it.

Scanned: everything the repository ships or runs (tests/test_no_absolute_paths.py's roots),
NVIDIA's and slime's files under tests/fixtures excepted (third-party text, kept unchanged).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_no_absolute_paths import _files

from conftest import REPO

pytestmark = pytest.mark.torch_free

ISSUE = re.compile(r"\b[Ii]ssues?\s+#?\d+|[#(-][\w-]*\bissue-\d+")
"""A numbered issue, or a Markdown anchor named after one."""

UPSTREAM = re.compile(r"[\w.-]+/[\w.-]+\s*$")
"""What precedes an upstream citation: its ``owner/repo``."""

CIRCUMSTANCES = re.compile(
    r"\bthis session\b|\b(?:earlier|previous|later|other|whole) sessions?\b|\bthis task\b"
    r"|\bthis branch\b|\bthe team'?s\b|\bborrowed\b|\blent to\b|\bproject machine"
    r"|\bproject'?s (?:own )?(?:[\w-]+ )?(?:machine|sessions?|box)\b"
    r"|\bno GPU was (?:available|lent)\b|\bhelpers shared the\b",
    re.IGNORECASE,
)
"""Phrases about how the project was built rather than what it does."""


def offenders(texts: dict[str, str]) -> list[str]:
    """``name:line: text`` for every line of ``texts`` (name -> content) that names an issue of
    this project or the project's circumstances."""
    found = []
    for name, text in texts.items():
        for i, line in enumerate(text.splitlines(), 1):
            issue = any(not UPSTREAM.search(line[: m.start()]) for m in ISSUE.finditer(line))
            if issue or CIRCUMSTANCES.search(line):
                found.append(f"{name}:{i}: {line.strip()}")
    return found


def _shipped() -> list[Path]:
    fixtures = REPO / "tests" / "fixtures"
    return [p for p in _files() if fixtures not in p.parents and p != Path(__file__).resolve()]


def test_no_shipped_file_names_an_issue_of_this_project_or_its_circumstances():
    files = _shipped()
    assert REPO / "README.md" in files and len(files) > 300, len(files)
    found = offenders({str(p.relative_to(REPO)): p.read_text(errors="replace") for p in files})
    assert not found, "say what it is, not where it came from:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "## Emulation at memory speed (issue 25)",
        '"""Parity across entry points (issue 22 item 2): every recipe"""',
        "    # refuses only under --strict (issue 13 item 4)",
        "Issue 12, item 1, for Transformer Engine",
        "(Step costs: [Emulation](#emulation-at-memory-speed-issue-25).)",
        "fixed in issues 3 and 14",
        "measured on this project's CPU machine",
        "not measurable in this session.",
        "the team's borrowed GPU box has no vLLM",
        "GPU check, not run: no GPU was lent to this task.",
        "before this branch the demo took 5 min",
    ],
)
def test_the_guard_catches(line):
    assert offenders({"probe.md": line})


@pytest.mark.parametrize(
    "line",
    [
        "NeMo RL warns (NVIDIA-NeMo/RL issue 1164: reported with block scaling)",
        "what happens without them (vllm-project/vllm issue 28425)",
        "NVIDIA-NeMo/RL#3280 and NVIDIA/Megatron-LM PR #2359",
        "`nemo-fp8 doctor` checks this machine against the recipe",
        "Argument helpers shared by the subcommands",
    ],
)
def test_the_guard_lets_upstream_citations_and_user_facing_text_through(line):
    assert not offenders({"probe.md": line})
