"""Output helpers: atomic file writes and stable YAML/JSON rendering."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_text", "atomic_write_bytes", "dump_yaml", "dump_json",
           "check_output_file", "check_output_dir"]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same directory and a rename,
    so a crash or Ctrl-C never leaves a half-written file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, expected a file path", str(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; the result should look like any file the user writes
        # (umask applied), or keep the mode of the file it replaces.
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def dump_yaml(data: Any) -> str:
    """YAML in the input's key order, block style, safe types only."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(data, Dumper=dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=100)


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


def _nearest_existing(path: Path) -> Path:
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    return here


def _check_creatable(path: Path, key: str, *, shown: Path) -> None:
    """``path``'s nearest existing ancestor is a writable directory (``shown`` names the
    user's path in the message)."""
    from .errors import FP8ConfigError

    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise FP8ConfigError(f"{base} is not a directory, so {shown} cannot be created",
                             key=key, value=str(shown))
    if not os.access(base, os.W_OK | os.X_OK):
        raise FP8ConfigError(f"{base} is not writable, so {shown} cannot be written",
                             key=key, value=str(shown))


def check_output_file(path: str | os.PathLike[str] | None, key: str) -> None:
    """Refuse, before any work starts, an output file path that cannot be written (a
    directory, under a file, in a read-only place): a typo in ``--json`` must not cost a
    finished run its results."""
    from .errors import FP8ConfigError

    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise FP8ConfigError(f"{path} is a directory; name a file", key=key, value=str(path))
    _check_creatable(path, key, shown=path)


def check_output_dir(path: str | os.PathLike[str] | None, key: str) -> None:
    """:func:`check_output_file` for an output folder (created later, when results exist)."""
    from .errors import FP8ConfigError

    if path is None:
        return
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FP8ConfigError(f"{path} is a file; name a folder", key=key, value=str(path))
    _check_creatable(path / "x", key, shown=path)
