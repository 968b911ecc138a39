"""Work measured by counting, not by a clock: the same input makes the same
number of calls on any machine, so a bound on it is an honest test of "bounded work"."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any


def calls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """How many Python and C function calls ``fn(*args, **kwargs)`` makes (exceptions
    propagate after the count is taken: see :func:`calls_and_result`)."""
    return calls_and_result(fn, *args, **kwargs)[0]


def calls_and_result(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """``(calls, result)``; an exception ``fn`` raises is returned as the result."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        result: Any = fn(*args, **kwargs)
    except BaseException as exc:
        result = exc
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)  # type: ignore[arg-type]
    return count, result
