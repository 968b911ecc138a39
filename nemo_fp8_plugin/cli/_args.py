"""Argument helpers shared by the subcommands (stdlib only: imported before any work)."""

from __future__ import annotations


def name_list(
    text: str | None, key: str, *, noun: str = "recipe", hint: str | None = None
) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None when the flag was not given. A flag given with no
    name at all (``--recipes ""`` or ``","``) is an error, not a silent "all of them"."""
    from ..errors import FP8ConfigError

    if text is None:
        return None
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise FP8ConfigError(f"no {noun} named", key=key, value=text, hint=hint)
    return names
