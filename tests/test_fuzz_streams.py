"""Fuzzing the promise around the command: any output file name the file
system takes (bytes that are not UTF-8 included), standard output in any encoding or closed,
and the environment variables the package and Python read. The promise and its helpers are
tests/test_fuzz.py's; budget about 15 s (the environment test, a child process per example,
is marked slow)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_fuzz import FUZZ, assert_promise, examples, run_cli

from nemo_fp8_plugin.cli import main

_BASE = "precision: fp8_blockwise\n"


@settings(max_examples=examples(40), **FUZZ)
@given(name=st.binary(min_size=1, max_size=300).filter(lambda b: b"/" not in b and b"\0" not in b))
def test_any_output_file_name_is_written_exactly_or_refused(capsys, name):
    assume(name not in (b".", b".."))
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "c.yaml").write_text(_BASE, encoding="utf-8")
        (root / "out").mkdir()
        out = os.fsdecode(os.fsencode(str(root / "out")) + b"/" + name)
        argv = ["apply", root / "c.yaml", "--host", "megatron", "-o", out]
        rc, _out, err, took = run_cli(capsys, *argv)
        assert_promise(rc, err.replace("\n", " ") if rc == 0 else _errors(err), took, argv)
        left = os.listdir(os.fsencode(str(root / "out")))
        assert left == ([name] if rc == 0 else []), (name, left)


def _errors(err: str) -> str:
    """stderr without apply's warning and note lines (the promise counts error lines)."""
    return "\n".join(
        line for line in err.splitlines() if ": warning: " not in line and ": note: " not in line
    )


@settings(max_examples=examples(40), **FUZZ)
@given(
    encoding=st.sampled_from(["ascii", "latin-1", "cp1252", "utf-8", None]),
    text=st.text(max_size=20),
    command=st.sampled_from(["apply", "explain", "recipes"]),
)
def test_any_stdout_encoding_or_a_closed_stdout(capsys, monkeypatch, encoding, text, command):
    import io
    import sys

    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "c.yaml"
        cfg.write_text(
            _BASE + "note: " + json.dumps(text, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        sink = io.BytesIO()
        stream = None if encoding is None else io.TextIOWrapper(sink, encoding=encoding)
        with monkeypatch.context() as patch:
            patch.setattr(sys, "stdout", stream)  # None: what Python sets for `>&-`
            argv = {"apply": ["apply", cfg, "--host", "megatron"], "explain": ["explain", cfg]}
            argv_ = argv.get(command, [command])
            capsys.readouterr()
            start = time.monotonic()
            rc = main([str(a) for a in argv_])
            took = time.monotonic() - start
            if stream is not None:
                with contextlib.suppress(ValueError):
                    stream.flush()
        err = capsys.readouterr().err
        assert_promise(rc, _errors(err), took, argv_)
        if encoding is None:  # every command here writes to standard output: refused
            assert rc == 2, err  # (the config's own refusal may come first)
            assert command != "recipes" or "standard output is closed" in err, err
        elif rc == 0 and command == "apply":
            assert yaml.safe_load(sink.getvalue().decode(encoding))["note"] == text


_ENV_VALUES = st.one_of(
    st.sampled_from(["", "0", "-1", "abc", "9" * 5000, "utf-8", "ascii", "/nonexistent", "1e9"]),
    st.text(
        alphabet=st.characters(blacklist_characters="\0", blacklist_categories=["Cs"]), max_size=30
    ),
)


@pytest.mark.slow
@settings(max_examples=examples(8), **FUZZ)
@given(
    name=st.sampled_from(
        [
            "NEMO_FP8_FUSED_MIN_NUMEL",
            "XDG_CACHE_HOME",
            "CXX",
            "LANG",
            "LC_ALL",
            "VLLM_PLUGINS",
            "HOME",
        ]
    ),
    value=_ENV_VALUES,
    io_encoding=st.sampled_from(["", "ascii", "latin-1", "utf-8"]),
    command=st.sampled_from(["recipes", "explain"]),
)
def test_environment_variables_keep_the_promise(name, value, io_encoding, command):
    """In a child process (the environment is read at start): exit 0, or 2 in one line."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "c.yaml"
        cfg.write_text(_BASE + "# caf\u00e9\n", encoding="utf-8")
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        env[name] = value
        if io_encoding:
            env["PYTHONIOENCODING"] = io_encoding
        argv = [command] + ([str(cfg)] if command == "explain" else [])
        proc = subprocess.run(
            [sys.executable, "-m", "nemo_fp8_plugin", *argv],
            capture_output=True,
            env=env,
            timeout=120,
        )
        err = proc.stderr.decode("utf-8", "replace")
        assert "Traceback" not in err, err
        assert proc.returncode in (0, 2), (name, value, err)
        if proc.returncode == 2:
            assert len(_errors(err).strip().splitlines()) == 1, err
