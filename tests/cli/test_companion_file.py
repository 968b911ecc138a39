"""The TE precision file ``apply -o OUT`` writes beside its output is held to ``-o``'s rules:
checked before any write, never through a symbolic link, never over the input, a
``defaults:`` parent, a read-only file (without ``--force``) or a file of the user's, named so
two outputs cannot share it, written only with the output (a full disk leaves neither), and
never created beside a device.

Megatron-LM's ``--yaml-cfg`` layout with a module rule makes the file (the route of
:func:`nemo_fp8_plugin.hosts.megatron.precision_file.megatron_lm_precision_file`); no host
package is imported. Each test failed before the change."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml

from nemo_fp8_plugin import _io
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.hosts import get_adapter, load_context, run
from nemo_fp8_plugin.hosts.megatron.precision_file import FILE_SUFFIX, precision_file_path

LM = (
    "fp8: {recipe: fp8_blockwise, model: llama3.1-8b, bf16_layers: {modules: ['*.linear_fc2']}}\n"
    "language_model: {num_layers: 32}\n"
)


def _apply(capsys, src: Path, out: Path, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["apply", str(src), "--host", "megatron", "-o", str(out), *extra])
    return rc, capsys.readouterr().err


def _error(rc: int, err: str, *needles: str) -> None:
    errors = [ln for ln in err.splitlines() if ": error: " in ln]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "lm.yaml"
    path.write_text(LM)
    return path


def test_the_file_is_named_after_the_whole_output_name(tmp_path, src, capsys):
    """``-o run.yaml`` and ``-o run.json`` used to share ``run.te_precision.yaml``: the second
    run's rules replaced the first's under the first output's key."""
    other = tmp_path / "other.yaml"
    other.write_text(LM.replace("*.linear_fc2", "*.linear_qkv"))
    assert _apply(capsys, src, tmp_path / "run.yaml")[0] == 0
    assert _apply(capsys, other, tmp_path / "run.json")[0] == 0
    first, second = tmp_path / "run.yaml.te_precision.yaml", tmp_path / "run.json.te_precision.yaml"
    assert precision_file_path(tmp_path / "run.yaml") == first
    assert "linear_fc2" in first.read_text() and "linear_qkv" not in first.read_text()
    assert "linear_qkv" in second.read_text()


def test_the_input_is_never_the_file(tmp_path, capsys):
    """``apply lm.te_precision.yaml -o lm.yaml`` replaced the input with the TE file."""
    src = tmp_path / ("lm.yaml" + FILE_SUFFIX)
    src.write_text(LM)
    for extra in ((), ("--force",)):
        rc, err = _apply(capsys, src, tmp_path / "lm.yaml", *extra)
        _error(rc, err, "--output", src.name)
        assert src.read_text() == LM
    assert "is the input config" in err


def test_a_defaults_parent_is_never_the_file(tmp_path, capsys):
    parent = tmp_path / ("base.yaml" + FILE_SUFFIX)
    parent.write_text(LM)
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {parent.name}\n" + LM)
    rc, err = _apply(capsys, child, tmp_path / "base.yaml", "--force")
    _error(rc, err, "a parent of", parent.name)
    assert parent.read_text() == LM and not (tmp_path / "base.yaml").exists()


@pytest.mark.parametrize(
    ("points_to", "said"),
    [("lm.yaml", "is the input config"), ("elsewhere.txt", "link"), ("missing/dir/f", "link")],
)
def test_a_symbolic_link_there_is_never_followed(tmp_path, src, capsys, points_to, said):
    """A link to the input, to another file, or dangling (which created its folders) was
    written through."""
    (tmp_path / "elsewhere.txt").write_text("keep\n")
    side = tmp_path / ("out.yaml" + FILE_SUFFIX)
    side.symlink_to(points_to)
    rc, err = _apply(capsys, src, tmp_path / "out.yaml", "--force")
    _error(rc, err, said)
    assert src.read_text() == LM and (tmp_path / "elsewhere.txt").read_text() == "keep\n"
    assert not (tmp_path / "missing").exists() and not (tmp_path / "out.yaml").exists()


def test_a_read_only_earlier_file_needs_force(tmp_path, src, capsys):
    out = tmp_path / "out.yaml"
    assert _apply(capsys, src, out)[0] == 0
    side = precision_file_path(out)
    before = side.read_text()
    side.write_text(before + "# mine\n")
    side.chmod(0o444)
    rc, err = _apply(capsys, src, out)
    _error(rc, err, "read-only", "--force")
    assert side.read_text().endswith("# mine\n")
    assert _apply(capsys, src, out, "--force")[0] == 0
    assert side.read_text() == before


def test_a_file_of_the_users_there_is_not_replaced(tmp_path, src, capsys):
    side = tmp_path / ("out.yaml" + FILE_SUFFIX)
    side.write_text("my notes\n")
    rc, err = _apply(capsys, src, tmp_path / "out.yaml")
    _error(rc, err, "did not write", "--force")
    assert side.read_text() == "my notes\n" and not (tmp_path / "out.yaml").exists()


def test_an_earlier_file_is_replaced(tmp_path, src, capsys):
    out = tmp_path / "out.yaml"
    assert _apply(capsys, src, out)[0] == 0
    src.write_text(LM.replace("*.linear_fc2", "*.linear_qkv"))
    assert _apply(capsys, src, out)[0] == 0
    assert "linear_qkv" in precision_file_path(out).read_text()


@pytest.mark.parametrize("failing", [1, 2])
def test_a_full_disk_leaves_neither_file(tmp_path, src, capsys, monkeypatch, failing):
    """On ENOSPC the TE file used to be written already, beside an unchanged output."""
    out = tmp_path / "out.yaml"
    out.write_text("old output\n")
    real, seen = os.fsync, []

    def fsync(fd):
        seen.append(fd)
        if len(seen) == failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    rc, err = _apply(capsys, src, out)
    assert rc != 0 and "No space left" in err, err
    assert out.read_text() == "old output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm.yaml", "out.yaml"]


def test_nothing_is_written_beside_a_device(tmp_path, src):
    """``-o /dev/null`` created ``/dev/null.te_precision.yaml`` (as root, inside /dev)."""
    ctx = load_context(str(src), output=Path(os.devnull))
    result = run(get_adapter("megatron"), ctx)
    assert result.files == {} and precision_file_path(os.devnull) is None
    assert any("apply -o OUT (a file)" in w for w in map(str, result.warnings))


def test_the_output_names_the_file_it_is_written_with(tmp_path, src, capsys):
    out = tmp_path / "o" / "out.yaml"
    out.parent.mkdir()
    rc, err = _apply(capsys, src, out)
    assert rc == 0
    side = precision_file_path(out)
    assert f"--te-precision-config-file {side.resolve()}" in err
    assert yaml.safe_load(side.read_text())["matchers"]
    assert not [p for p in out.parent.iterdir() if _io.TEMP_MARK in p.name]
