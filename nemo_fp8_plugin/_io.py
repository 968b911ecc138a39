"""File safety, one home: atomic writes (regular files only; an output and the files beside
it as one step), the checks of an output path before any work, every read of a file a user
names (regular files of bounded size, JSON within the limits, links kept inside a checkpoint),
printed file names, and stable YAML/JSON rendering.

Longer than the package's 600-line guide on purpose: every reader and writer of user files
shares these checks, and a second module would invite a second, laxer path."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write_text",
    "atomic_write_bytes",
    "atomic_write_files",
    "dump_yaml",
    "dump_json",
    "dump_config_json",
    "check_output_file",
    "check_output_dir",
    "companion_path",
    "check_companion_file",
    "same_file",
    "shown_path",
    "regular_file",
    "read_user_bytes",
    "read_user_json",
    "inside_checkpoint",
    "safetensors_files",
    "regular_entries",
]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same directory and a rename,
    so a crash or Ctrl-C never leaves a half-written file behind.

    Only a regular file is ever replaced. A symbolic link is followed (the file it names is
    written, the link stays). A character device (``/dev/null``, a terminal) or a FIFO with
    a reader is written through, never renamed over; a FIFO nobody reads, a socket or a
    block device is refused. ``path``'s folder must exist: it is never created. Every error
    names ``path``, not the temp file.
    """
    atomic_write_files([(path, data)])
    return Path(path)


def atomic_write_files(writes: Sequence[tuple[str | os.PathLike[str], bytes]]) -> None:
    """Write several files as one step: what :func:`atomic_write_bytes` does for each, with
    every temp file written and synced before the first rename, then the renames in the
    order given (an output first, then the files it names). A failure or a signal before
    the renames (a full disk, SIGTERM) removes every temp file and changes no target; a
    character device or FIFO among the targets is written through at its turn."""
    from ._signals import interruptible, signals_held

    with interruptible():
        staged: list[_Staged] = []
        try:
            for path, data in writes:
                staged.append(_stage(Path(path), data))
            with signals_held():  # the renames run whole: no output without its companions
                for one in staged:
                    one.commit()
        finally:
            with signals_held():  # a second SIGTERM must not cut the cleanup short
                for one in staged:
                    one.discard()


class _Staged:
    """One target of :func:`atomic_write_files`: its temp file, written, synced and locked
    (``commit`` renames it over the target), or the bytes a device takes at commit."""

    def __init__(self, shown: Path, target: Path, data: bytes, mode: int | None) -> None:
        self.shown, self.target, self.data, self.mode = shown, target, data, mode
        self.tmp: str | None = None
        self.fd: int | None = None
        self.locked = False

    def commit(self) -> None:
        if self.mode is not None:  # not a regular file: written through, never replaced
            _write_through(self.target, self.mode, self.data, self.shown)
            return
        assert self.tmp is not None and self.fd is not None
        try:
            os.replace(self.tmp, self.target)  # renamed open, so the lock covers the rename
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(self.shown)) from None
        self.tmp = None
        self.discard()

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass
            self.tmp = None


def _stage(shown: Path, data: bytes) -> _Staged:
    """The temp file of a write to ``shown`` (symlinks followed), complete on disk."""
    target = Path(os.path.realpath(shown))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(shown)) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, expected a file path", str(shown))
    if st is not None and not stat.S_ISREG(st.st_mode):
        _check_write_through(st.st_mode, shown)
        return _Staged(shown, target, data, st.st_mode)
    if not target.parent.is_dir():  # never created: check_output_file's rule, at the write
        raise FileNotFoundError(
            errno.ENOENT, f"folder {target.parent} does not exist; it is not created", str(shown)
        )
    one = _Staged(shown, target, data, None)
    try:
        prefix = _temp_prefix(target)
        _remove_stale_temps(target.parent, prefix)
        one.fd, one.tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=target.parent)
        # Held until the rename: while it is, no later write takes the file for a leftover.
        one.locked = _lock(one.fd, blocking=True)
        # mkstemp creates 0600; the result should look like any file the user writes
        # (umask applied), or keep the mode of the file it replaces.
        os.fchmod(one.fd, st.st_mode & 0o7777 if st is not None else 0o666 & ~_umask())
        view = memoryview(data)
        while view:
            view = view[os.write(one.fd, view) :]
        os.fsync(one.fd)
    except BaseException as exc:
        from ._signals import signals_held

        with signals_held():
            one.discard()
        if isinstance(exc, OSError):  # disk full, quota, read-only: the user's path, not ours
            raise OSError(exc.errno, exc.strerror, str(shown)) from None
        raise
    return one


TEMP_MARK = ".nemo-fp8-write-"
"""What names the temp file of an atomic write: ``.<name>`` + TEMP_MARK + 8 random
characters + ``.tmp`` beside the target (export's directories use ``.nemo-fp8-export-``)."""

STALE_TEMP_SECONDS = 300
"""Age (since its last change) after which a temp file of a write to the same target whose
writer is gone is removed by the next write: a SIGKILL or a power cut cannot be caught, so
what it leaves is cleaned later. The age is a second guard beside the lock (a file system
whose ``flock`` is a no-op), and covers the instant between a temp file's creation and its
lock."""


def _lock(fd: int, *, blocking: bool) -> bool:
    """An exclusive ``flock`` on ``fd``: True when taken; False where there is no
    ``flock`` (not POSIX, or a file system without locks). Raises BlockingIOError when
    another open file holds it and ``blocking`` is False."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        raise
    except OSError:  # ENOLCK, EOPNOTSUPP: this file system cannot tell
        return False
    return True


def _remove_stale_temps(directory: Path, prefix: str) -> None:
    """Remove what atomic writes to this target left when they were killed: regular files
    named ``prefix`` + 8 random characters + ``.tmp``, owned by this user, unchanged for
    :data:`STALE_TEMP_SECONDS`, whose lock is free (their writer is gone: the kernel drops
    a lock when its process dies). A file whose writer lives holds its lock and is kept;
    so is every file this cannot be sure of."""
    import re
    import time

    pattern = re.compile(re.escape(prefix) + r"[A-Za-z0-9_]{8}\.tmp")
    try:
        names = [n for n in os.listdir(directory) if pattern.fullmatch(n)]
    except OSError:
        return
    for name in names:
        path = directory / name
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
        except OSError:  # gone already, a link, not readable (mode 0000): not ours to judge
            continue
        try:
            here = os.fstat(fd)
            if (
                not stat.S_ISREG(here.st_mode)
                or here.st_uid != _euid()
                or time.time() - here.st_mtime < STALE_TEMP_SECONDS
                or not _lock(fd, blocking=False)
            ):
                continue
            # The name may have moved on (its writer renamed it and a new file took the
            # name): remove only the file locked here.
            if os.path.samestat(here, os.stat(path, follow_symlinks=False)):
                os.unlink(path)
        except OSError:  # BlockingIOError: its writer holds the lock; others: leave it
            continue
        finally:
            os.close(fd)


def _euid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _temp_prefix(target: Path) -> str:
    """``.NAME`` + :data:`TEMP_MARK` for the temp file, ``NAME`` shortened so that the temp
    name fits the file system's name limit whenever ``NAME`` itself does (mkstemp adds 8
    characters and ``.tmp``)."""
    try:
        limit = os.pathconf(target.parent if target.parent.exists() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    room = max(1, limit - len(".") - len(TEMP_MARK) - 8 - len(".tmp"))
    # The name as the file system stores it (a byte that is not UTF-8 is a surrogate
    # escape in ``str``), cut at a character boundary when it is UTF-8.
    whole = os.fsencode(target.name)
    try:
        whole.decode("utf-8")
        name = whole[:room].decode("utf-8", "ignore")
    except UnicodeDecodeError:  # not UTF-8 already: keep its bytes as they are
        name = os.fsdecode(whole[:room])
    return f".{name or 'out'}{TEMP_MARK}"


def _check_write_through(mode: int, shown: Path) -> None:
    """Refuse a target that is neither a regular file nor one written through."""
    if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        kind = (
            "a socket"
            if stat.S_ISSOCK(mode)
            else ("a block device" if stat.S_ISBLK(mode) else "not a regular file")
        )
        raise OSError(
            errno.EINVAL, f"is {kind}; name a file (or - for standard output)", str(shown)
        )


def _write_through(target: Path, mode: int, data: bytes, shown: Path) -> None:
    """Write into a character device or a FIFO (a reader must be there: never block)."""
    _check_write_through(mode, shown)
    flags = os.O_WRONLY if stat.S_ISCHR(mode) else os.O_WRONLY | os.O_NONBLOCK
    held = _HELD_FIFOS.pop(os.path.realpath(target), None)
    try:
        fd = held if held is not None else os.open(target, flags)
    except OSError as err:
        if err.errno == errno.ENXIO:
            raise OSError(
                err.errno, "is a FIFO that no process is reading; nothing was written", str(shown)
            ) from None
        raise OSError(err.errno, err.strerror, str(shown)) from None
    try:
        if flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(shown)) from None
    finally:
        os.close(fd)


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
    return yaml.dump(
        data,
        Dumper=dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


def dump_config_json(data: Any) -> str:
    """A config as JSON, refusing what JSON cannot say rather than writing something else:
    two keys that become one JSON string (YAML's ``1`` and ``'1'``, ``true`` and
    ``'true'``, ``null`` and ``'null'``), a NaN or infinity (not JSON), binary data
    (``!!binary``), sets. Dates are written as their ISO strings. Each refusal is an
    :class:`FP8ConfigError` naming the key's dotted path."""
    import datetime

    from .errors import FP8ConfigError, format_value

    def name(path: tuple[str, ...]) -> str:
        return ".".join(path) or "(top level)"

    todo: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while todo:
        here, path = todo.pop()
        if isinstance(here, dict):
            seen: dict[str, Any] = {}
            for k, v in here.items():
                if isinstance(k, float) and not math.isfinite(k):
                    raise FP8ConfigError(
                        "a NaN or infinite key cannot be written as JSON",
                        key=name(path + (str(k),)),
                        hint="write YAML (an output name not ending in .json)",
                    )
                if isinstance(k, str):
                    as_json = k
                elif k is None or isinstance(k, (bool, int, float)):
                    as_json = json.dumps(k)  # what json.dumps makes of the key: 1, true, null
                else:
                    raise FP8ConfigError(
                        f"a key of type {type(k).__name__} cannot be written as JSON",
                        key=name(path),
                        hint="write YAML (an output name not ending in .json)",
                    )
                if as_json in seen:
                    raise FP8ConfigError(
                        f"keys {format_value(seen[as_json])} and {format_value(k)} would both "
                        f"be written as the JSON key {format_value(as_json)}",
                        key=name(path + (as_json,)),
                        hint="rename one, or write YAML (an output name not ending in .json)",
                    )
                seen[as_json] = k
                todo.append((v, path + (as_json,)))
        elif isinstance(here, (list, tuple)):
            todo.extend((v, path + (str(i),)) for i, v in enumerate(here))
        elif isinstance(here, float) and not math.isfinite(here):
            raise FP8ConfigError(
                f"{here} is not a JSON number",
                key=name(path),
                value=here,
                hint="write YAML (an output name not ending in .json), or a finite number",
            )
        elif isinstance(here, (bytes, bytearray, set, frozenset)):
            kind = "binary data (!!binary)" if isinstance(here, (bytes, bytearray)) else "a set"
            raise FP8ConfigError(
                f"{kind} cannot be written as JSON",
                key=name(path),
                hint="write YAML (an output name not ending in .json)",
            )
        elif not (here is None or isinstance(here, (bool, int, float, str))) and not isinstance(
            here, (datetime.date, datetime.time)
        ):
            raise FP8ConfigError(
                f"a value of type {type(here).__name__} cannot be written as JSON",
                key=name(path),
                hint="write YAML (an output name not ending in .json)",
            )

    def iso(value: Any) -> str:
        return str(value.isoformat())

    return json.dumps(data, indent=2, sort_keys=False, allow_nan=False, default=iso) + "\n"


def _check_creatable(path: Path, key: str, *, shown: Path) -> None:
    """``path``'s folder exists and is a writable directory (``shown`` names the user's
    path in the message). A folder that is not there is refused, never created: a typo in a
    folder name must not leave a new tree behind, nor put results where nobody looks."""
    from .errors import FP8ConfigError

    # the folder as the user named it, and as it is (a link to a file in a missing folder)
    for base in dict.fromkeys((Path(shown).parent, path.parent)):
        if not base.exists():
            raise FP8ConfigError(
                f"folder {base} does not exist; it is not created",
                key=key,
                value=str(shown),
                hint="create the folder first, or name a path in an existing one",
            )
    base = path.parent
    if not base.is_dir():
        raise FP8ConfigError(
            f"{base} is not a directory, so {shown} cannot be created", key=key, value=str(shown)
        )
    if not os.access(base, os.W_OK | os.X_OK):
        raise FP8ConfigError(
            f"{base} is not writable, so {shown} cannot be written", key=key, value=str(shown)
        )


def check_output_file(
    path: str | os.PathLike[str] | None,
    key: str,
    *,
    read_only_ok: bool = True,
    force_flag: str = "--force",
) -> None:
    """Refuse, before any work starts, an output file path that cannot be written (a
    directory, in a folder that does not exist, under a file, in a read-only place, a FIFO
    nobody reads): a typo in
    ``--json`` must not cost a finished run its results. With ``read_only_ok=False`` an
    existing regular file without write permission (0444) is refused too: replacing it
    (rename needs only the directory) would silently undo its owner's protection."""
    from .errors import FP8ConfigError

    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise FP8ConfigError(f"{path} is a directory; name a file", key=key, value=str(path))
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISREG(mode) and not read_only_ok and not mode & 0o222:
        raise FP8ConfigError(
            f"{path} is read-only (mode {stat.S_IMODE(mode):04o}); it was not replaced",
            key=key,
            value=str(path),
            hint=f"pass {force_flag} to replace it anyway, or make it writable",
        )
    if mode is not None and stat.S_ISFIFO(mode):
        _check_fifo_reader(path, key)
    if mode is not None and not stat.S_ISREG(mode):
        # written through, never replaced (atomic_write_bytes): it must take the bytes
        if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
            raise FP8ConfigError(
                f"{path} is not a regular file; name a file", key=key, value=str(path)
            )
        if not os.access(path, os.W_OK):
            raise FP8ConfigError(f"{path} is not writable", key=key, value=str(path))
        return
    _check_creatable(Path(os.path.realpath(path)), key, shown=path)


def companion_path(output: str | os.PathLike[str], suffix: str) -> Path | None:
    """Where a file written beside ``output`` goes: ``output``'s name + ``suffix`` in its
    folder, so two outputs (``run.yaml``, ``run.json``) never share one; None when
    ``output`` is not a regular file (a character device or FIFO is written through, and
    nothing is ever created beside ``/dev/null``)."""
    out = Path(output)
    try:
        mode = os.stat(out).st_mode
    except OSError:
        mode = None  # not there yet: a file, created by the write
    if mode is not None and not stat.S_ISREG(mode):
        return None
    return out.with_name(out.name + suffix)


def check_companion_file(
    path: str | os.PathLike[str],
    key: str,
    *,
    text: str,
    force: bool = False,
    force_flag: str = "--force",
) -> None:
    """:func:`check_output_file` for a file a command writes beside its output, a name the
    user did not type: a symbolic link there is never followed (it could point at anything),
    anything but a regular file is refused, and a file there is replaced only when it is an
    earlier one of the same kind (it starts with ``text``'s first line) or, with ``force``, a
    read-only or foreign one."""
    from .errors import FP8ConfigError

    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as err:
        raise FP8ConfigError(
            f"cannot inspect {path}: {err.strerror}", key=key, value=str(path)
        ) from None
    beside = "written beside the output"
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise FP8ConfigError(
            f"{path} ({beside}) is a symbolic link; it was not followed",
            key=key,
            value=str(path),
            hint="remove the link, or write the output elsewhere",
        )
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise FP8ConfigError(f"{path} ({beside}) is {kind}", key=key, value=str(path))
    if st is not None and not force:
        first = text.split("\n", 1)[0].encode("utf-8")
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(first))
        except OSError:
            head = b""
        if head != first:
            raise FP8ConfigError(
                f"{path} ({beside}) is a file nemo-fp8 did not write; it was not replaced",
                key=key,
                value=str(path),
                hint=f"move it away, write the output elsewhere, or pass {force_flag}",
            )
    check_output_file(path, key, read_only_ok=force, force_flag=force_flag)


def _check_fifo_reader(path: Path, key: str) -> None:
    """A FIFO is written through at the end; with no reader that write fails, so refuse it
    now. The probe's descriptor stays open (:data:`_HELD_FIFOS`) and the final write uses
    it: closing it would hand the reader an end of file before the results exist."""
    from .errors import FP8ConfigError

    real = os.path.realpath(path)
    if real in _HELD_FIFOS:
        return
    try:
        fd = os.open(real, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ENXIO:
            raise FP8ConfigError(
                f"{path} is a FIFO that no process is reading; nothing would be written",
                key=key,
                value=str(path),
                hint="start its reader first, or name a file",
            ) from None
        raise OSError(err.errno, err.strerror, str(path)) from None
    _HELD_FIFOS[real] = fd


_HELD_FIFOS: dict[str, int] = {}
"""Write descriptors of output FIFOs checked before the work, by real path."""


def shown_path(path: str | os.PathLike[str]) -> str:
    """A file name as a command prints it: one line, every character encodable. A control
    character (ESC, a newline) is escaped as ``\\x1b`` / ``\\n``, not sent to the terminal,
    and a byte that is not UTF-8 (a surrogate escape in ``str``) as ``\\xff``."""
    from .errors import one_line

    text = os.fsdecode(path)
    return one_line(text.encode("utf-8", "backslashreplace").decode("utf-8"))


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file: the same resolved path, or (hard links, bind
    mounts) the same device and inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_output_dir(path: str | os.PathLike[str] | None, key: str) -> None:
    """:func:`check_output_file` for an output folder (created later, when results exist,
    in a folder that must exist now: only the last name is created)."""
    from .errors import FP8ConfigError

    if path is None:
        return
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FP8ConfigError(f"{path} is a file; name a folder", key=key, value=str(path))
    _check_creatable(Path(os.path.abspath(path)), key, shown=path)


# --------------------------------------------------------------------------- reading safely


def regular_file(path: str | Path, *, key: str | None, what: str = "file") -> Path:
    """File safety (one home, :mod:`nemo_fp8_plugin._io`): ``path`` if it names a regular file (symlinks followed); else an
    :class:`FP8ConfigError` naming ``key``. Read nothing that is not one: a FIFO blocks its
    reader until someone writes, ``/dev/zero`` never ends."""
    from .errors import FP8ConfigError

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FP8ConfigError(f"{what} not found: {path}", key=key, value=str(path)) from None
    except OSError as exc:
        raise FP8ConfigError(
            f"cannot read {path}: {exc.strerror or exc}", key=key, value=str(path)
        ) from None
    if not stat.S_ISREG(mode):
        raise FP8ConfigError(
            f"{path} is {_kind(mode)}, not a regular {what}", key=key, value=str(path)
        )
    return path


def _kind(mode: int) -> str:
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a special file"
    )


def read_user_bytes(
    path: str | Path, *, key: str | None, what: str = "file", limit: int | None = None
) -> bytes:
    """File safety (one home): the bytes of a file a user named, read only when it is a
    regular file and at most ``limit`` bytes (default ``LIMITS.config_bytes``). It is opened
    without blocking and checked on the open descriptor (a FIFO never blocks the read,
    ``/dev/zero`` is never read, a file swapped in between is seen), and its size is checked
    before a byte is read (a 2 GB sparse file costs nothing). Every refusal is an
    :class:`FP8ConfigError` naming ``key``."""
    from .errors import LIMITS, FP8ConfigError, check_limit

    limit = LIMITS.config_bytes if limit is None else limit
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FP8ConfigError(f"{what} not found: {path}", key=key, value=str(path)) from None
    except OSError as exc:
        raise FP8ConfigError(
            f"cannot read {path}: {exc.strerror or exc}", key=key, value=str(path)
        ) from None
    # Checked on the descriptor before it becomes a file object: os.fdopen refuses a
    # directory with an error that names the descriptor number, not the path.
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise FP8ConfigError(
            f"cannot read {path}: {exc.strerror or exc}", key=key, value=str(path)
        ) from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FP8ConfigError(
            f"{path} is {_kind(st.st_mode)}, not a regular {what}", key=key, value=str(path)
        )
    with os.fdopen(fd, "rb") as fh:
        check_limit(st.st_size, limit, f"{path} is too large: bytes", key=key, value=str(path))
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise FP8ConfigError(
                f"cannot read {path}: {exc.strerror or exc}", key=key, value=str(path)
            ) from None
    check_limit(len(data), limit, f"{path} is too large: bytes", key=key, value=str(path))
    return data


def read_user_json(
    path: str | Path,
    *,
    key: str | None,
    what: str = "JSON file",
    limit: int | None = None,
    hint: str | None = None,
) -> Any:
    """:func:`read_user_bytes`, parsed as JSON within the limits: nesting deeper than
    ``LIMITS.yaml_depth``, an integer past Python's digit limit, bad UTF-8 or bad JSON is one
    :class:`FP8ConfigError` naming ``key`` (never a RecursionError or a traceback)."""
    from .errors import FP8ConfigError, check_depth, format_value

    data = read_user_bytes(path, key=key, what=what, limit=limit)
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise FP8ConfigError(
            f"{path} is nested too deeply to read",
            key=key,
            value=str(path),
            hint="limits: docs/refusals.md",
        ) from None
    except ValueError as exc:  # JSON syntax, bad UTF-8, a 5000-digit integer
        raise FP8ConfigError(
            f"{path} is not a readable {what} ({format_value(str(exc), limit=200)})",
            key=key,
            value=str(path),
            hint=hint,
        ) from None
    check_depth(value, key=key, what=str(path))
    return value


_INDEX_BYTES = 64 * 2**20
"""Largest ``model.safetensors.index.json`` read (DeepSeek-V3's, 91k tensors, is 9 MB)."""


def safetensors_files(directory: str | Path, *, key: str) -> list[Path]:
    """The safetensors shards of a Hugging Face checkpoint directory, checked before any is
    opened: with ``model.safetensors.index.json``, the files its ``weight_map`` names, each
    a plain file name of ``directory`` (``../x``, ``sub/x`` or an absolute path, which would
    read files elsewhere, is refused) and a regular file (symlinks followed); without one,
    the directory's regular ``*.safetensors`` files. Raises :class:`FP8ConfigError` naming ``key``; an empty list
    when there are none."""
    from .errors import FP8ConfigError, format_value

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if not index.exists() and not index.is_symlink():
        return [
            regular_file(f, key=key, what="safetensors file")  # a FIFO: refused
            for f in sorted(directory.glob("*.safetensors"))
            if not f.is_dir()
        ]
    document = read_user_json(index, key=key, what="safetensors index", limit=_INDEX_BYTES)
    try:
        weight_map = document["weight_map"]
    except (KeyError, TypeError) as exc:
        raise FP8ConfigError(
            f"{index} is not a readable safetensors index "
            f"({type(exc).__name__}: {format_value(str(exc))})",
            key=key,
            value=str(index),
        ) from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise FP8ConfigError(
            f"{index}: weight_map must map tensor names to file names", key=key, value=str(index)
        )
    files: list[Path] = []
    for name in dict.fromkeys(weight_map.values()):
        shard = directory / name
        # By name, not by resolved target: a Hugging Face cache snapshot links every shard
        # to a blob elsewhere, which its owner put there; the index may only name entries.
        if Path(name).name != name or name in ("", ".", "..") or "\\" in name:
            raise FP8ConfigError(
                f"{index} names {format_value(name)}, which is not a file of {directory}",
                key=key,
                value=name,
                hint="index entries are file names inside the checkpoint",
            )
        if not shard.exists():
            raise FP8ConfigError(
                f"{index} names {format_value(name)}, which is not in {directory}",
                key=key,
                value=str(shard),
            )
        files.append(regular_file(shard, key=key, what="safetensors shard"))
    return files


def inside_checkpoint(path: str | Path, directory: str | Path) -> bool:
    """Whether ``path``, symbolic links followed, stays inside the checkpoint ``directory``
    (itself followed), or, when ``directory`` is a Hugging Face cache snapshot
    (``.../snapshots/<revision>``), inside that repository's ``blobs`` folder, where the
    snapshot's relative links (``../../blobs/<hash>``) point."""
    real = os.path.realpath(path)
    top = os.path.realpath(directory)
    roots = [top]
    # the snapshot as named (a link to it) and as it is
    for snapshot in (Path(os.path.abspath(directory)), Path(top)):
        if snapshot.parent.name == "snapshots":
            roots.append(os.path.realpath(snapshot.parent.parent / "blobs"))
    return any(os.path.commonpath([real, root]) == root for root in roots)


def regular_entries(directory: str | Path, *, key: str) -> None:
    """Refuse a directory a library will read files from (transformers' ``from_pretrained``)
    when one of its entries is a FIFO, socket or device: opening one would block or never
    end, inside code that cannot be told not to."""
    for entry in Path(directory).iterdir():
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue  # a dangling link is not read either
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            regular_file(entry, key=key)
