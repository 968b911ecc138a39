"""Every command in the README and docs/ runs, as written (doc examples that rot are defects).

A fenced ``bash`` block's lines are commands. ``nemo-fp8`` and ``nemo`` resolve to this
environment's console scripts, ``python`` to its interpreter; paths under ``/tmp/`` are
moved into the test's temp dir. A block preceded by ``<!-- doc-test: nemo-rl-checkout
RELEASE -->`` runs in a NeMo RL checkout of that release (NVIDIA's configs from the shared test
data, read-only) with this repository's ``examples/nemo_rl`` overlays put where their headers
say, as the page tells the user to. Long commands get their quick flags (``nemo-fp8 demo
--steps 3``, ``nemo-fp8 rl-check --quick --steps 2 --seeds 1``, :data:`QUICK`). Each command is
a test of its own (``--durations`` times it); the slow ones carry the marker
(:data:`SLOW_COMMANDS`). A block that cannot run here
(a GPU, a host's own launcher, the network) is preceded by
``<!-- doc-test: skip REASON -->``; the test checks the reason is given. The README's
set-up commands are what CI itself runs (.ci/run), so they are checked for shape only.

What a page shows a command producing is checked against what it produces: a block after a
``bash`` block, preceded by ``<!-- doc-test: output FILE -->``, is YAML that must be
contained, key for key, in the FILE the command before it wrote (``/tmp/...`` or relative to
where it ran); preceded by ``<!-- doc-test: output -->``, each of its lines (``...`` lines
aside; ``/tmp/`` moved as in the command) must occur in the command's standard output or
error. Only the last command of a block has its output shown. Other pages' shown output is checked by their own tests
(docs/analyze.md's block by tests/analyze/test_analyze.py, docs/rl.md's rendered blocks by
tests/tools/test_rl_check_docs.py).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_shipped_examples import NEMO_RL_OVERLAYS, header_command

from conftest import REPO, nemo_rl_checkout

BIN = Path(sys.executable).parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\s+(?P<reason>[^>]*?)\s*-->")
OUTPUT = re.compile(r"<!--\s*doc-test:\s*output(?:\s+(?P<file>\S+))?\s*-->")
CHECKOUT = re.compile(r"<!--\s*doc-test:\s*nemo-rl-checkout\s+(?P<release>\S+)\s*-->")
QUICK = {
    "demo": ["--steps", "3", "--recipes", "fp8_blockwise", "--no-progress"],
    # the smoke run cut to one seed of two steps (18 s instead of 100 s here): the page's own
    # flags are still parsed and its arms still run; a later flag wins, so `--seeds 2` -> 1
    "rl-check": ["--quick", "--steps", "2", "--seeds", "1"],
}


@dataclass
class DocCommand:
    page: Path
    line: int
    text: str
    skip_reason: str | None
    shown: str | None = None
    """The output the page shows for this command (a marked block after its own), or None."""
    shown_file: str | None = None
    """Where the shown output is: the file the command writes (``/tmp/...``, or relative to
    where it ran), or None for its standard output and error."""
    checkout: str | None = None
    """The NeMo RL release whose checkout the command runs in, or None (the repository)."""


def doc_commands() -> list[DocCommand]:
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        in_block, skip, pending_skip = False, None, None
        checkout, pending_checkout = None, None
        expect, shown = None, None  # a pending output marker; the block it marks
        last: DocCommand | None = None  # the last command of the latest bash block
        for i, line in enumerate(lines, 1):
            m, o, c = SKIP.search(line), OUTPUT.search(line), CHECKOUT.search(line)
            if m:
                pending_skip = m.group("reason") or ""
                continue
            if c:
                pending_checkout = c.group("release")
                continue
            if o:
                expect = (o.group("file"),)
                continue
            if line.startswith("```"):
                if shown is not None:  # the end of a marked output block
                    assert last is not None, f"{page.name}:{i}: an output block with no command"
                    last.shown, last.shown_file, shown = "\n".join(shown), expect[0], None
                    expect = None
                elif not in_block and expect is not None:
                    shown = []
                elif not in_block and line[3:].strip() in ("bash", "sh", "shell", "console"):
                    in_block, skip, pending_skip = True, pending_skip, None
                    checkout, pending_checkout = pending_checkout, None
                elif in_block:
                    in_block = False
                continue
            if shown is not None:
                shown.append(line)
            elif in_block:
                text = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
                if text:
                    last = DocCommand(page, i, text, skip, checkout=checkout)
                    out.append(last)
    return out


COMMANDS = doc_commands()
README_SETUP = [c for c in COMMANDS if c.page.name == "README.md"]
RUNNABLE = [c for c in COMMANDS if c.page.name != "README.md" and c.skip_reason is None]
SKIPPED = [c for c in COMMANDS if c.skip_reason is not None]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second():
    assert len(README_SETUP) == 2, [c.text for c in README_SETUP]
    main, tests = (c.text for c in README_SETUP)
    assert main.startswith("bash scripts/install.sh main && .venv/bin/nemo-fp8 ")
    assert tests == "bash scripts/test.sh"
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci and "CI=true" in ci


def test_skipped_blocks_say_why():
    for c in SKIPPED:
        assert len(c.skip_reason) >= 10, (
            f"{c.page.name}:{c.line}: give the reason a block cannot run"
        )


def _argv(text: str, tmp: Path) -> list[str]:
    argv = [a.replace("/tmp/", f"{tmp}/") for a in shlex.split(text)]
    head = argv[0]
    if head in ("nemo-fp8", "nemo"):
        argv[0] = str(BIN / head)
        if head == "nemo-fp8" and len(argv) > 1 and argv[1] in QUICK:
            argv += QUICK[argv[1]]
            if argv[1] == "demo":
                argv += ["--out", str(tmp / "demo")]
    elif head == "python":
        argv[0] = sys.executable
    else:
        raise AssertionError(
            f"doc command {text!r} runs neither nemo-fp8, nemo nor python; "
            "mark its block with <!-- doc-test: skip REASON -->"
        )
    return argv


def _run(cmd: DocCommand, tmp: Path):
    # Run from a scratch folder that sees the repository's top-level folders, so relative
    # paths in the docs resolve and whatever a command writes stays out of the checkout.
    tmp.mkdir(parents=True, exist_ok=True)
    if cmd.checkout is not None:
        nemo_rl_checkout(cmd.checkout, tmp)
        for overlay in NEMO_RL_OVERLAYS:  # where its header says it goes
            (tmp / header_command(overlay, "nemo-fp8 apply")[2]).write_text(overlay.read_text())
    for entry in ("conf", "examples", "scripts", "benchmarks", "docs"):
        if (REPO / entry).exists() and not (tmp / entry).exists():
            (tmp / entry).symlink_to(REPO / entry)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    proc = subprocess.run(
        _argv(cmd.text, tmp), cwd=tmp, env=env, capture_output=True, text=True, timeout=900
    )
    return cmd, proc


SLOW_COMMANDS = {
    # command prefix: what makes its blocks slow (over ~5 s, the marker's meaning in
    # pyproject.toml). Seconds per block measured with `pytest tests/test_docs.py --durations=0`
    # on two cores at load 5-7 (2026-12-06); CI runs them like every test (scripts/test.sh
    # selects no marker), the fast subset not.
    "nemo llm finetune": "imports NeMo 2 and NeMo-Run and builds the recipe: 34-66 s",
    "nemo-fp8 rl-check": "the tiny GRPO model's warm-up and 2 steps, each arm: 19-31 s",
    "nemo-fp8 demo": "trains a megatron-core GPT, BF16 and one recipe, 3 steps: 16 s",
    "python examples/megatron/": "imports megatron-core and builds its config: 12 s",
}
"""Doc commands run under the ``slow`` marker."""


def _marks(cmd: DocCommand) -> list:
    return [pytest.mark.slow] if cmd.text.startswith(tuple(SLOW_COMMANDS)) else []


@pytest.mark.parametrize(
    "cmd",
    [pytest.param(c, marks=_marks(c), id=f"{c.page.name}:{c.line}") for c in RUNNABLE],
)
def test_doc_command_runs(cmd, tmp_path):
    """Each command block line on its own, so ``--durations`` times each and the slow ones
    carry the marker (:data:`SLOW_COMMANDS`)."""
    _, proc = _run(cmd, tmp_path / "c")
    assert proc.returncode == 0, (
        f"{cmd.page.relative_to(REPO)}:{cmd.line}: `{cmd.text}` exited {proc.returncode}\n"
        f"{proc.stderr[-1500:]}"
    )
    if cmd.shown is not None:
        _check_shown(cmd, proc, tmp_path / "c")


def _contained(shown, written, where: str) -> None:
    """Every key of ``shown`` is in ``written`` with the same value (recursively)."""
    if isinstance(shown, dict):
        assert isinstance(written, dict), f"{where}: the page shows a mapping, got {written!r}"
        for key, value in shown.items():
            assert key in written, f"{where}.{key}: shown on the page, not written"
            _contained(value, written[key], f"{where}.{key}")
    else:
        assert shown == written, f"{where}: the page shows {shown!r}, the command wrote {written!r}"


def _check_shown(cmd: DocCommand, proc, tmp: Path) -> None:
    where = f"{cmd.page.relative_to(REPO)}:{cmd.line}"
    if cmd.shown_file is not None:
        import yaml

        written = tmp / cmd.shown_file.removeprefix("/tmp/")
        _contained(yaml.safe_load(cmd.shown), yaml.safe_load(written.read_text()), where)
        return
    said = proc.stdout + proc.stderr
    for line in cmd.shown.splitlines():
        if line.strip() and line.strip() != "...":
            expected = line.strip().replace("/tmp/", f"{tmp}/")  # where the command wrote
            assert expected in said, f"{where}: the page shows {line.strip()!r}; got\n{said}"


def test_shown_output_is_checked_against_the_command():
    """The marker is used, and a wrong shown value fails the check (the check can fail)."""
    marked = [c for c in COMMANDS if c.shown is not None]
    assert len(marked) >= 2, [c.text for c in COMMANDS if c.shown]
    with pytest.raises(AssertionError, match="the page shows 1"):
        _contained({"a": {"b": 1}}, {"a": {"b": 2}}, "x")
    with pytest.raises(AssertionError, match="not written"):
        _contained({"a": {"c": 1}}, {"a": {"b": 1}}, "x")


def test_there_are_runnable_doc_commands_and_the_slow_ones_are_known():
    assert RUNNABLE, "no runnable doc commands found"
    for prefix in SLOW_COMMANDS:  # a prefix no page uses any more is stale
        assert any(c.text.startswith(prefix) for c in RUNNABLE), prefix


@pytest.mark.parametrize("cmd", SKIPPED, ids=lambda c: f"{c.page.name}:{c.line}")
def test_skipped_commands_name_a_real_file_or_tool(cmd):
    """A skipped command still must not rot: a script of ours it runs exists and parses its
    flags (``--help``)."""
    argv = shlex.split(cmd.text)
    if argv[0] != "python" or not (REPO / argv[1]).parent.is_dir():
        return  # another project's launcher (vllm serve, uv run in a NeMo RL checkout)
    script = REPO / argv[1]
    assert script.is_file(), f"{cmd.page.name}:{cmd.line}: {argv[1]} does not exist"
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-1000:]
    for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
        assert flag in proc.stdout, f"{cmd.page.name}:{cmd.line}: {script.name} has no {flag}"


# --------------------------------------------------------------------------- python snippets
# A ```python block runs as written, in a fresh interpreter. A block that is a fragment of
# the user's own code (it uses `model`, `train_logprobs`, ...) or needs a GPU is preceded by
# ``<!-- doc-test: fragment REASON -->`` or ``<!-- doc-test: skip REASON -->``; its
# ``nemo_fp8_plugin`` imports still run, so a documented import path cannot rot.
MARK = re.compile(r"<!--\s*doc-test:\s*(?P<kind>skip|fragment)\s+(?P<reason>[^>]*?)\s*-->")
OWN_IMPORT = re.compile(r"^\s*(from nemo_fp8_plugin[\w.]* import [^#(]+|import nemo_fp8_plugin\S*)")


@dataclass
class DocSnippet:
    page: Path
    line: int
    code: str
    mark: str | None  # "skip" / "fragment" with its reason, or None: runs whole

    @property
    def own_imports(self) -> str:
        return "\n".join(
            m.group(1).strip() for m in map(OWN_IMPORT.match, self.code.splitlines()) if m
        )


def doc_snippets() -> list[DocSnippet]:
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        mark, i = None, 0
        while i < len(lines):
            m = MARK.search(lines[i])
            if m:
                mark = f"{m.group('kind')}: {m.group('reason')}"
            elif lines[i].strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                out.append(DocSnippet(page, i + 1, "\n".join(lines[i + 1 : end]), mark))
                mark, i = None, end
            elif lines[i].strip():
                mark = None if not lines[i].startswith("<!--") else mark
            i += 1
    return out


SNIPPETS = doc_snippets()


def _python(code: str, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_docs_have_python_snippets_and_marked_ones_say_why():
    assert len(SNIPPETS) >= 10, [f"{s.page.name}:{s.line}" for s in SNIPPETS]
    for s in SNIPPETS:
        assert s.mark is None or len(s.mark) >= 20, f"{s.page.name}:{s.line}: give the reason"


SLOW_SNIPPET_WORD = "megatron"
"""A snippet whose code names it imports megatron-core (and Transformer Engine's recipe
module) in a fresh interpreter: 16-18 s per snippet at load 8, 33-39 s at load 9 (2026-12-02),
so it runs under the ``slow`` marker; the others take 0.3-10 s."""


@pytest.mark.parametrize(
    "snippet",
    [
        pytest.param(
            s,
            marks=[pytest.mark.slow] if SLOW_SNIPPET_WORD in s.code else [],
            id=f"{s.page.name}:{s.line}",
        )
        for s in SNIPPETS
    ],
)
def test_every_python_snippet_runs_or_at_least_imports(snippet, tmp_path):
    code = snippet.code if snippet.mark is None else snippet.own_imports
    if not code:
        return  # quoted upstream source or pseudo-code: nothing of ours to import
    proc = _python(code, tmp_path)
    where = f"{snippet.page.relative_to(REPO)}:{snippet.line}"
    assert proc.returncode == 0, (
        f"{where} ({snippet.mark or 'whole block'}):\n{proc.stderr[-1500:]}"
    )


# --------------------------------------------------------------------------- links, figures
LINK = re.compile(r"\]\(([^)\s]+)\)")
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:x|%)")


def _prose(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def _dead_links(pages: list[Path]) -> list[str]:
    anchors = {
        p.resolve(): {_anchor(h) for h in re.findall(r"^#+ (.+)$", _prose(p), re.M)} for p in pages
    }
    dead = []
    for page in pages:
        for link in LINK.findall(_prose(page)):
            path, _, anchor = link.partition("#")
            if link.startswith(("http://", "https://")):
                continue
            target = (page.parent / path).resolve() if path else page.resolve()
            if not target.exists() or (anchor and anchor not in anchors.get(target, ())):
                dead.append(f"{page.name}: {link}")
    return dead


def test_links_between_pages_resolve(tmp_path):
    """Every relative link of the README and docs/ names a file that exists and, with
    ``#anchor``, a heading of that page (pages move sections; a dead link is a defect)."""
    assert not _dead_links(PAGES), _dead_links(PAGES)
    probe = tmp_path / "p.md"
    probe.write_text("## `nemo-fp8 bench`: A / B\n[x](#nemo-fp8-bench-a--b) [y](#gone) [z](q.md)\n")
    assert _dead_links([probe]) == ["p.md: #gone", "p.md: q.md"]


def test_the_readmes_own_figures_come_from_performance_md():
    """The README's measured figures (its "What to expect" bullets that cite no outside
    source) are the ones docs/performance.md's Demo section holds: one place, no drift."""
    expect = _prose(REPO / "README.md").split("## What to expect", 1)[1].split("\n## ", 1)[0]
    ours = [b for b in expect.split("\n- ") if "http" not in b]
    demo = _prose(REPO / "docs" / "performance.md").split("## Demo", 1)[1].split("\n## ", 1)[0]
    figures = [f for bullet in ours for f in FIGURE.findall(bullet)]
    assert len(figures) >= 4, figures
    missing = [f for f in figures if f not in demo]
    assert not missing, f"README figures not in performance.md's Demo section: {missing}"
