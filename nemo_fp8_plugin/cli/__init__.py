"""The ``nemo-fp8`` command line.

Each subcommand lives in its own module of this package with two functions:
``register(subparsers)`` adds its parser (cheap: no torch, no host import at module level)
and ``run(args) -> int`` does the work. User mistakes raise
:class:`~nemo_fp8_plugin.errors.FP8ConfigError` and become one line on stderr with exit
code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from importlib import import_module

from .._signals import exit_status
from ..errors import FP8ConfigError, format_value, one_line

# Subcommand modules, in the order `nemo-fp8 --help` lists them.
COMMANDS = (
    "recipes",
    "explain",
    "apply",
    "analyze",
    "export",
    "verify_refit",
    "doctor",
    "demo",
    "rl_check",
    "bench",
)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="nemo-fp8",
        description="FP8 recipes for NeMo 2, Megatron-Bridge, megatron-core, NeMo RL and vLLM, "
        "from one line of YAML.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import warnings

    # torch.cuda warns at import whenever the (NeMo-installed) pynvml package is present;
    # it is about torch's environment, not the user's command, and would top every output.
    warnings.filterwarnings(
        "ignore", message="The pynvml package is deprecated", category=FutureWarning
    )
    _guard_closed_stdout()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except FP8ConfigError as err:
        _error(args.command, str(err))
        return 2
    except BrokenPipeError:  # `nemo-fp8 recipes | head`: the reader has what it wanted
        _silence_stdout()
        return 0
    except OSError as err:
        # An unwritable or unreadable path the user named (-o pointing at a directory, a
        # read-only file system, a missing file): theirs to fix, so one line and exit 2.
        where = f"{_shown(err.filename)}: " if err.filename else ""
        _error(args.command, f"{where}{err.strerror or err}")
        return 2
    except UnicodeEncodeError as err:
        if not _is_stream_encoding(err):
            raise
        encoding = getattr(sys.stdout, "encoding", None) or "?"
        _error(
            args.command,
            f"standard output's encoding ({encoding}) cannot write "
            f"{format_value(err.object[err.start : err.end])}; nothing more was written "
            f"(set PYTHONIOENCODING=utf-8, or write to a file with -o)",
        )
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP while writing (_signals)
        _error(args.command, "interrupted", kind="")
        return exit_status(exc)


def _error(command: str, message: str, *, kind: str = "error: ") -> None:
    """One line on standard error (bounded: a message is at most a few hundred characters
    whatever the input it names)."""
    text = f"nemo-fp8 {command}: {kind}{one_line(printable_path(message))}"
    if len(text) > _MESSAGE_MAX:
        text = text[: _MESSAGE_MAX - 3] + "..."
    print(text, file=sys.stderr)


def printable_path(text: str) -> str:
    """``text`` (a file name, or a message holding one) as one printable line: the bytes of
    a name that is not UTF-8 (surrogate escapes in a ``str``) shown as ``\\xff``, control
    characters (ESC, newlines) escaped (``_io.shown_path``)."""
    from .._io import shown_path

    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return shown_path(text)


_MESSAGE_MAX = 2000
"""Longest error line printed (a 100k-character argument is shown cut, never whole)."""


def _shown(filename: object) -> str:
    """An OSError's ``filename`` as printed: a path, or whatever else the error carries
    (``os.fdopen`` puts a descriptor number there)."""
    if filename is None or filename == "":
        return ""
    text = (
        os.fsdecode(filename) if isinstance(filename, (str, bytes, os.PathLike)) else str(filename)
    )
    return format_value(text, limit=400).strip("'\"")


def _is_stream_encoding(err: UnicodeEncodeError) -> bool:
    """A character the terminal's (or PYTHONIOENCODING's) encoding has no byte for."""
    import codecs

    try:
        stream = codecs.lookup(getattr(sys.stdout, "encoding", None) or "").name
        raised = codecs.lookup(err.encoding).name if err.encoding != "charmap" else stream
    except LookupError:
        return False
    # single-byte code pages (cp1252) report their errors as "charmap"
    return raised in (stream, "ascii")


class _ClosedStream(io.TextIOBase):
    """Standard output when the shell closed it (``>&-``): a write is refused in one line;
    a command writing only to files (``-o``) runs as usual."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed; nothing was written")


def _guard_closed_stdout() -> None:
    """Python sets ``sys.stdout`` to None when descriptor 1 is closed, and the next file
    opened would get descriptor 1: hold it with /dev/null so no output file becomes
    "standard output", and refuse writes to it in one line."""
    if sys.stdout is not None:
        return
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        if fd != 1:
            os.close(fd)
    except OSError:
        pass
    sys.stdout = _ClosedStream()


def _silence_stdout() -> None:
    """After a closed pipe, the interpreter's final flush of stdout would fail again and
    print "Exception ignored": point descriptor 1 at /dev/null first."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
