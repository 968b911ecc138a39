"""Error types of the plugin.

Every mistake a user can make in a config or on the command line surfaces as an
:class:`FP8ConfigError` (or a subclass) that names the offending key and value. The CLI
turns these into a one-line message and exit code 2; anything else is a bug.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "FP8ConfigError",
    "RecipeRegistryError",
    "HostUnavailableError",
    "ConflictingKeyError",
    "format_value",
    "suggest",
    "LIMITS",
    "Limits",
    "check_limit",
    "one_line",
]


class Limits:
    """Ceilings on every size a user's input controls that drives work (docs/refusals.md).

    Each is far above any real config or model (the largest ones the plugin knows have 126
    layers, 384 experts, a few thousand YAML nodes and defaults chains three files deep), so
    only a mistake or a hostile file reaches one; past it, the command refuses with one line
    naming the key instead of running for hours or exhausting memory. Tests lower them with
    ``monkeypatch.setattr(LIMITS, name, n)``.
    """

    config_bytes: int = 16 * 2**20
    """Largest config file read (YAML or JSON), in bytes."""
    yaml_depth: int = 64
    """Deepest nesting of mappings and lists in a config."""
    yaml_nodes: int = 50_000
    """Most values in a config once its aliases are expanded (what every later step walks)."""
    yaml_aliases: int = 1_000
    """Most alias references (``*name``) in a config."""
    defaults_depth: int = 16
    """Longest NeMo RL ``defaults:`` chain (a file, its parent, the parent's parent...)."""
    defaults_files: int = 64
    """Most files a ``defaults:`` chain may name in all."""
    layers: int = 4_096
    """Most transformer layers of a model description."""
    experts: int = 4_096
    """Most MoE experts per layer of a model description."""
    modules: int = 250_000
    """Most per-module decisions a model description may need (layers x linear modules; the
    largest real MoE models, DeepSeek-V3 and Kimi K2, need 47,000 and 70,000)."""
    bf16_rules: int = 1_000
    """Most ``bf16_layers.modules`` rules (each is matched against every module name and
    explained on its own)."""
    rule_checks: int = 500_000
    """Most (``bf16_layers.modules`` rule, module name) pairs matched for one model and side
    (rules x linear module names: 7 rules on Kimi K2's 70,000, 10 on DeepSeek-V3's 46,000)."""
    interpolations: int = 4_096
    """Most evaluations resolving one NeMo RL ``${...}`` value may take, each reference counted
    as often as it is reached (OmegaConf re-evaluates it each time: ``k0: ${k1}${k1}``,
    ``k1: ${k2}${k2}``... doubles per line), with the values handed to OmegaConf."""
    interpolation_depth: int = 32
    """Longest chain of ``${...}`` references, and deepest nesting inside one value
    (``${add:1,${add:1,...}}``)."""
    interpolated_chars: int = 2**20
    """Longest value (characters, or list items) a ``${...}`` may resolve to
    (``${mul:'abc',100000000}``)."""
    roundtrip_bytes: int = 512 * 2**10
    """Largest YAML file ``apply`` edits in place (ruamel.yaml's round trip is pure Python);
    a larger one is refused with the hint to write JSON (``-o OUT.json``)."""
    roundtrip_nodes: int = 5_000
    """Most values (keys, list items, scalars) a YAML file ``apply`` edits in place may hold
    (NVIDIA's largest NeMo RL config holds under 800)."""
    tensor_elements: int = 2**36
    """Most elements a numerics quantizer takes, counted after padding to whole tiles (the
    largest real weight, a 256k x 16k embedding, has 2^32): a huge ``block`` or a zero-stride
    view of 2^40 elements is refused before anything is allocated."""


LIMITS = Limits()
"""The ceilings in force (:class:`Limits`)."""


def check_limit(
    count: int,
    limit: int,
    what: str,
    *,
    key: str | None,
    hint: str | None = None,
    value: Any = None,
) -> None:
    """Refuse ``count`` above ``limit`` with one line naming ``key`` and the limit."""
    if count > limit:
        raise FP8ConfigError(
            f"{what}: {count} is more than the limit of {limit}",
            key=key,
            value=value if value is not None else count,
            hint=hint or "limits: docs/refusals.md",
        )


def check_depth(value: Any, *, key: str | None, what: str, limit: int | None = None) -> None:
    """Refuse ``value`` (parsed JSON or YAML) nested deeper than ``limit`` levels
    (default ``LIMITS.yaml_depth``), walking it without recursion: code that recurses over
    a value (merging, copying, printing) would otherwise reach Python's recursion limit."""
    limit = LIMITS.yaml_depth if limit is None else limit
    todo = [(value, 1)]
    seen = 0
    while todo:
        here, depth = todo.pop()
        if not isinstance(here, (dict, list, tuple)):
            continue
        seen += 1
        if depth > limit:
            raise FP8ConfigError(
                f"{what} is nested more than {limit} levels deep",
                key=key,
                hint="limits: docs/refusals.md",
            )
        children = here.values() if isinstance(here, dict) else here
        todo.extend((child, depth + 1) for child in children)


def format_value(value: Any, limit: int = 80) -> str:
    """A short, quoted rendering of a config value for error messages.

    Bounded in time and memory whatever the value: containers are shown a few items and
    levels deep (``reprlib``), never rendered whole and then cut, so a value YAML aliases
    blew up to millions of items (or a string of megabytes) costs no more than a small one.
    """
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, limit, limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = short.maxfrozenset = 6
    try:
        text = short.repr(value)
    except Exception:  # a user object whose __repr__ fails: say what it is
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SUGGEST_MAX_LEN = 200


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (newlines, and the separators
    ``str.splitlines`` also breaks on, such as ``\x1e`` or ``\u2028``) escaped: an error is
    one line whatever the key or value a user wrote into it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def suggest(word: Any, choices: Iterable[Any]) -> str | None:
    """The choice a misspelt ``word`` most likely meant, or None.

    Edit distance catches typos (``pow2_scale``); a prefix match catches truncations
    (``pow2`` for ``pow2_scales``) that edit distance scores too low.
    """
    import difflib

    choices = [c for c in choices if isinstance(c, str)]
    if not isinstance(word, str) or len(word) > _SUGGEST_MAX_LEN:
        return None  # a list or a page of text is no misspelling (and str() of it is unbounded)
    same_but_case: list[str] = [c for c in choices if c.lower() == word.lower()]
    if len(same_but_case) == 1:  # FP8_BLOCKWISE: no edit-distance match, but plainly meant
        return same_but_case[0]
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

    def __init__(
        self, message: str, *, key: str | None = None, value: Any = None, hint: str | None = None
    ):
        self.key = one_line(key) if isinstance(key, str) else key  # printed as is
        self.value = value
        self.hint = hint
        self.bare_message = message
        super().__init__(self._render())

    def _render(self) -> str:
        text = f"{self.key}: {self.bare_message}" if self.key else self.bare_message
        if self.hint:
            text += f" ({self.hint})"
        return one_line(text)

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
