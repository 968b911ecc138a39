"""A part's result record and the check's time budget."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["skipped", "failed", "Deadline"]


def skipped(reason: str) -> dict[str, Any]:
    """A part that did not run here, and why (a missing host, no CUDA, no time left)."""
    return {"status": "skipped", "reason": reason}


def failed(reason: str, **extra: Any) -> dict[str, Any]:
    """A part that ran and found something wrong (or could not finish)."""
    return {"status": "failed", "reason": reason, **extra}


class Deadline:
    """A point in time the check must end by: the whole check is promised to fit in
    ``--budget`` seconds (10 minutes on one H100/H200), and a part whose cost depends on
    the machine (the quantizers' first compilation, a vLLM engine start) stops or is skipped
    rather than overrun it."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        """The budget this deadline was set from."""
        self.at = time.monotonic() + self.seconds
        """``time.monotonic()`` value of the deadline."""

    def left(self) -> float:
        """Seconds left (negative once passed)."""
        return self.at - time.monotonic()

    def passed(self) -> bool:
        return self.left() <= 0

    def share(self, fraction: float) -> Deadline:
        """A deadline ``fraction`` of the remaining time from now (never after this one)."""
        return Deadline(max(0.0, self.left()) * fraction)
