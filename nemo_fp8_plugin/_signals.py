"""Signals for the commands that write: SIGTERM and SIGINT become an exception, so the
``except``/``finally`` that removes temporary files and restores the old output runs, and a
step that must not be cut in two (a directory swap: two renames) holds them until it is done.

Python already turns SIGINT into :class:`KeyboardInterrupt`; SIGTERM (what ``kill``,
``timeout`` and job schedulers send) and SIGHUP (the terminal closed) kill the process by
default, with no cleanup. A SIGKILL cannot be caught: what it leaves is named so that the next
run recognises and removes it (see :mod:`nemo_fp8_plugin.rl.export` for ``export``'s
directories, :mod:`nemo_fp8_plugin._io` for the temp files of every other write).

The one handler of every command that writes (``export``, and ``apply``/``-o``/``--json``
through :func:`nemo_fp8_plugin._io.atomic_write_bytes`). The CLI exits with
:func:`exit_status`: 128 + the signal, as a shell reports a process the signal ended (130
for SIGINT, 143 for SIGTERM, 129 for SIGHUP).

Both context managers act only in the main thread (the only one Python delivers signals to)
and leave a handler the program installed itself alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Interrupted", "exit_status", "interruptible", "signals_held"]

_CAUGHT = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)
"""The signals :func:`interruptible` turns into :class:`Interrupted` (SIGINT is Python's own)."""

_SIGNALS = (*_CAUGHT, *((signal.SIGINT,) if hasattr(signal, "SIGINT") else ()))


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM or SIGHUP inside :func:`interruptible` (a
    KeyboardInterrupt, so code that handles Ctrl-C handles it too).

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise(signum, frame) -> None:
    raise Interrupted(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def exit_status(exc: KeyboardInterrupt) -> int:
    """The exit status of a command stopped by ``exc``: 128 + its signal (the shell's
    convention), 130 for a plain KeyboardInterrupt (SIGINT)."""
    return 128 + (exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT))


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise :class:`Interrupted` (each where its
    handler is still the default one: a handler the program set, or an outer
    ``interruptible``, is left alone); SIGINT raises KeyboardInterrupt as Python's default
    handler does."""
    if not _main_thread():
        yield
        return
    taken = [s for s in _CAUGHT if signal.getsignal(s) is signal.SIG_DFL]
    for s in taken:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        for s in taken:
            signal.signal(s, signal.SIG_DFL)


@contextlib.contextmanager
def signals_held() -> Iterator[list[int]]:
    """SIGTERM, SIGHUP and SIGINT that arrive inside the block are held and delivered (to the
    handlers in force before it) when it ends, so the block runs whole or not at all. Yields
    the list of held signal numbers (the block may look at it to undo its work)."""
    if not _main_thread():
        yield []
        return
    pending: list[int] = []
    # getsignal gives None for a handler installed outside Python: leave that one alone
    previous = {s: h for s in _SIGNALS if (h := signal.getsignal(s)) is not None}
    for s in previous:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield pending
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)
