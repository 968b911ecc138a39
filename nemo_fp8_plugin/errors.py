"""Error types of the plugin.

Every mistake a user can make in a config or on the command line surfaces as an
:class:`FP8ConfigError` (or a subclass) that names the offending key and value. The CLI
turns these into a one-line message and exit code 2; anything else is a bug.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["FP8ConfigError", "RecipeRegistryError", "HostUnavailableError", "ConflictingKeyError",
           "format_value", "suggest"]


def format_value(value: Any, limit: int = 80) -> str:
    """A short, quoted rendering of a config value for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def suggest(word: Any, choices: Iterable[Any]) -> str | None:
    """The choice a misspelt ``word`` most likely meant, or None.

    Edit distance catches typos (``pow2_scale``); a prefix match catches truncations
    (``pow2`` for ``pow2_scales``) that edit distance scores too low.
    """
    import difflib

    choices = [c for c in choices if isinstance(c, str)]
    word = str(word)
    found: list[str] = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if found:
        return found[0]
    prefixed: list[str] = [c for c in choices if len(word) >= 3 and c.startswith(word)]
    if len(prefixed) == 1:
        return prefixed[0]
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return found[0] if found else None


class FP8ConfigError(ValueError):
    """A config, recipe or input the plugin refuses.

    Attributes:
        key: dotted path of the offending config key (``"fp8.pow2_scales"``), or ``None``
            when the problem is not tied to one key (a missing file, say).
        value: the offending value, when there is one.
        hint: an actionable suggestion appended to the message, or ``None``.
    """

    def __init__(self, message: str, *, key: str | None = None, value: Any = None,
                 hint: str | None = None):
        self.key = key
        self.value = value
        self.hint = hint
        self.bare_message = message
        super().__init__(self._render())

    def _render(self) -> str:
        text = f"{self.key}: {self.bare_message}" if self.key else self.bare_message
        if self.hint:
            text += f" ({self.hint})"
        return text

    def with_prefix(self, prefix: str) -> FP8ConfigError:
        """The same error re-keyed under ``prefix`` (``"fp8"`` turns ``margin`` into
        ``fp8.margin``)."""
        key = f"{prefix}.{self.key}" if self.key else prefix
        err = type(self)(self.bare_message, key=key, value=self.value, hint=self.hint)
        return err


class RecipeRegistryError(FP8ConfigError):
    """Two recipes claim the same name, or a recipe plugin cannot be loaded."""


class HostUnavailableError(FP8ConfigError):
    """A host package (megatron-core, NeMo, vLLM, Transformer Engine) is needed but absent."""


class ConflictingKeyError(FP8ConfigError):
    """A host's native FP8 key, already in the config, contradicts the requested recipe
    (``trainer.plugins.fp8: hybrid`` next to ``precision: fp8_blockwise``). ``apply`` raises
    it while writing; ``explain`` asks every host's ``apply`` and reports it up front."""
