"""Signals for the commands that write: SIGTERM and SIGINT become an exception, so the
``except``/``finally`` that removes temporary files and restores the old output runs, and a
step that must not be cut in two (a directory swap: two renames) holds them until it is done.

Python already turns SIGINT into :class:`KeyboardInterrupt`; SIGTERM (what ``kill``,
``timeout`` and job schedulers send) kills the process by default, with no cleanup. A SIGKILL
cannot be caught: what it leaves is named so that the next run recognises and removes it
(see :mod:`nemo_fp8_plugin.rl.export`).

Both context managers act only in the main thread (the only one Python delivers signals to)
and leave a handler the program installed itself alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Interrupted", "interruptible", "signals_held"]

_SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None)) if s
)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM inside :func:`interruptible` (a KeyboardInterrupt,
    so code that handles Ctrl-C handles it too).

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


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Interrupted` (where its handler is still
    the default one); SIGINT raises KeyboardInterrupt as Python's default handler does."""
    term = getattr(signal, "SIGTERM", None)
    if term is None or not _main_thread() or signal.getsignal(term) is not signal.SIG_DFL:
        yield
        return
    signal.signal(term, _raise)
    try:
        yield
    finally:
        signal.signal(term, signal.SIG_DFL)


@contextlib.contextmanager
def signals_held() -> Iterator[list[int]]:
    """SIGTERM and SIGINT that arrive inside the block are held and delivered (to the
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
