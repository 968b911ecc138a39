"""The one signal handler of the commands that write (``nemo_fp8_plugin._signals``), as
``apply``'s atomic writes use it, and the cleanup of what a SIGKILL leaves.

Each writer is a real child ``nemo-fp8 apply`` process; the signal lands mid-write through a
hook on ``os.fsync`` (after the temp file's data is on disk, before its rename)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_fp8_plugin import _io
from nemo_fp8_plugin._signals import Interrupted, exit_status, interruptible
from nemo_fp8_plugin.cli import main

REPO = Path(__file__).resolve().parents[1]

BASE = "precision: fp8_blockwise\n"

# argv[1]: what the hook does once the temp file is written: a signal's name (sent to the
# process itself) or "wait" (say so on stdout, then block until stdin closes).
# The dispositions a terminal's foreground process has (a background job or nohup inherits
# SIGINT or SIGHUP ignored, and a program leaves an ignored signal alone).
_CHILD = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
how = sys.argv[1]
real = os.fsync
def fsync(fd):
    real(fd)
    if how == "wait":
        print("written", flush=True)
        sys.stdin.read()
    else:
        os.kill(os.getpid(), getattr(signal, how))
os.fsync = fsync
from nemo_fp8_plugin.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _apply(how: str, cfg: Path, out: Path, **kwargs):
    cmd = [sys.executable, "-c", _CHILD, how, "apply", str(cfg), "--host", "megatron"]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        [*cmd, "-o", str(out)], env=env, stderr=subprocess.PIPE, text=True, **kwargs
    )


def _temps(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if _io.TEMP_MARK in p.name)


def _age(path: Path, seconds: float) -> None:
    """As if ``path`` were last changed ``seconds`` ago (the test cannot wait minutes)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def setup(tmp_path):
    cfg, out = tmp_path / "c.yaml", tmp_path / "out" / "r.yaml"
    cfg.write_text(BASE)
    out.parent.mkdir()
    out.write_text("the old output\n")
    return cfg, out


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_mid_write_keeps_the_old_output_and_no_temp_file(setup, sig):
    cfg, out = setup
    proc = _apply(sig, cfg, out)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, sig), err  # the shell's 130, 143, 129
    assert err.strip().endswith("nemo-fp8 apply: interrupted"), err
    assert out.read_text() == "the old output\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.yaml"]


def test_what_a_sigkill_leaves_is_removed_by_the_next_write(setup, capsys):
    cfg, out = setup
    proc = _apply("SIGKILL", cfg, out)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    [left] = _temps(out.parent)
    assert left.name.startswith(".r.yaml" + _io.TEMP_MARK) and left.name.endswith(".tmp")
    assert "fp8" in left.read_text()  # the whole new file, never renamed
    assert out.read_text() == "the old output\n"

    assert main(["apply", str(cfg), "--host", "megatron", "-o", str(out)]) == 0
    assert left.exists()  # minutes old at the least: a fresh one may be a writer's
    _age(left, _io.STALE_TEMP_SECONDS + 60)
    assert main(["apply", str(cfg), "--host", "megatron", "-o", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.yaml"]
    assert "fp8" in out.read_text()
    capsys.readouterr()


def test_a_live_writers_temp_file_is_never_removed(setup, capsys):
    """Another process is between its temp file's fsync and its rename (for longer than
    the age limit, as far as the file's time says): its lock keeps the file."""
    cfg, out = setup
    proc = _apply("wait", cfg, out, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "written\n", proc.stderr
        [theirs] = _temps(out.parent)
        _age(theirs, _io.STALE_TEMP_SECONDS + 60)
        assert main(["apply", str(cfg), "--host", "megatron", "-o", str(out)]) == 0
        assert _temps(out.parent) == [theirs]
    finally:
        _, err = proc.communicate(input="", timeout=120)  # closes its stdin: it renames
    assert proc.returncode == 0, err
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.yaml"]  # theirs renamed
    assert "fp8" in out.read_text()
    capsys.readouterr()


def test_only_this_targets_temp_files_are_removed(tmp_path):
    """Another target's temp file, a name that only looks like one, a directory: kept."""
    kept = [
        tmp_path / f".other.yaml{_io.TEMP_MARK}abcd1234.tmp",
        tmp_path / f".r.yaml{_io.TEMP_MARK}abcd1234.tmp.bak",
        tmp_path / f".r.yaml{_io.TEMP_MARK}abc.tmp",
        tmp_path / "r.yaml.tmp",
    ]
    for path in kept:
        path.write_text("x")
    folder = tmp_path / f".r.yaml{_io.TEMP_MARK}dir12345.tmp"
    folder.mkdir()
    stale = tmp_path / f".r.yaml{_io.TEMP_MARK}abcd1234.tmp"
    stale.write_text("x")
    for path in [*kept, folder, stale]:
        _age(path, _io.STALE_TEMP_SECONDS + 60)
    _io.atomic_write_text(tmp_path / "r.yaml", "new\n")
    assert not stale.exists()
    assert all(p.exists() for p in kept) and folder.is_dir()
    assert (tmp_path / "r.yaml").read_text() == "new\n"


def test_a_long_name_keeps_its_temp_name_within_the_limit(tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    prefix = _io._temp_prefix(tmp_path / ("n" * limit))
    assert prefix.endswith(_io.TEMP_MARK) and len(prefix) + 8 + len(".tmp") <= limit
    _io.atomic_write_text(tmp_path / ("n" * limit), "x")
    assert os.listdir(tmp_path) == ["n" * limit]


def test_sigterm_in_the_library_raises_interrupted_and_removes_the_temp_file(tmp_path, monkeypatch):
    real = os.fsync

    def fsync(fd):
        real(fd)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "fsync", fsync)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as err:
        _io.atomic_write_text(tmp_path / "r.yaml", "x")
    assert exit_status(err.value) == 143
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_outer_handler_is_left_in_place(tmp_path):
    """Inside ``export`` (already ``interruptible``) or a program's own handler: the write
    neither replaces nor removes it."""
    seen: list[int] = []

    def mine(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with interruptible():
            assert signal.getsignal(signal.SIGTERM) is mine
            _io.atomic_write_text(tmp_path / "r.yaml", "x")
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_status(KeyboardInterrupt()) == 130


def test_a_signal_between_the_output_and_its_companion_leaves_neither(
    tmp_path, monkeypatch, capsys
):
    """The output and the TE precision file beside it are one write: a SIGTERM once the first
    temp file is on disk used to leave the companion written (it came first, whole) beside the
    old output; now every temp file is synced before the first rename, and none survives."""
    cfg, out = tmp_path / "lm.yaml", tmp_path / "out" / "r.yaml"
    cfg.write_text(
        "fp8: {recipe: fp8_blockwise, model: llama3.1-8b, bf16_layers: {modules: ['*.linear_fc2']}}\n"
        "language_model: {num_layers: 32}\n"
    )
    out.parent.mkdir()
    out.write_text("the old output\n")
    real, synced = os.fsync, []

    def fsync(fd):
        real(fd)
        synced.append(fd)
        if len(synced) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "fsync", fsync)
    rc = main(["apply", str(cfg), "--host", "megatron", "-o", str(out)])
    assert rc == 143, capsys.readouterr().err
    assert out.read_text() == "the old output\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.yaml"]
    capsys.readouterr()
