"""Pattern lint: a ``bf16_layers.modules`` glob that matches more than its words say.

A ``*`` next to a word character lets the word run on into a longer name: ``*mlp.gate*`` is
meant for the MoE router (``mlp.gate``) but also matches ``mlp.gate_proj`` and
``mlp.gate_up_proj`` (the dense FFN), ``*experts.1*`` matches ``experts.10`` ... ``experts.19``.
:func:`overreaching_rules` lists, per rule, the module names (of the model, under either naming)
it matches only because a ``*`` continued a name component, grouped across layers, so
``explain`` can show them. Such a match may be intended (``*a_proj*`` for MLA's ``q_a_proj``
and ``kv_a_proj_with_mqa``): the lint informs, it never refuses.

Standard library only.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ..spec import BF16Rules, RecipeSpec
from .models import ModelDescription
from .resolve import check_rule_work, rule_label, template

__all__ = ["OverreachingRule", "overreaching_rules", "strict_glob"]

_WORD = re.compile(r"[A-Za-z0-9]")
"""A character a ``*`` beside it would continue. ``_`` is not one: a literal that starts or
ends with ``_`` (``*_proj``, ``q_*``) puts the boundary there on purpose."""
_TOKENS = re.compile(r"(\*|\?|\[[^\]]*\])")


@dataclass(frozen=True)
class OverreachingRule:
    """A rule matching names it reaches only by running a word on.

    Attributes:
        label: the rule's label (``bf16_layers.modules[0]='*mlp.gate*'``).
        modules: the names hit that way, grouped across layers (``model.layers.*.mlp.gate_proj``),
            in model order.
        count: how many module names (all layers) that is.
    """

    label: str
    modules: tuple[str, ...]
    count: int

    @property
    def line(self) -> str:
        """One line for ``explain``."""
        shown = ", ".join(self.modules[:4]) + (", ..." if len(self.modules) > 4 else "")
        return (
            f"{self.label} also matches inside longer names ({self.count} module(s)): {shown}; "
            f"a '*' next to a name character continues the name (end the word with '.' or drop that "
            f"'*' if these are not meant)"
        )


def strict_glob(pattern: str) -> re.Pattern[str]:
    """``pattern`` as a regex in which a ``*`` touching a word character (a letter or digit)
    may not continue that word: it matches nothing there, or starts (ends) at a character
    that is not a letter, digit or ``_``."""
    parts = [p for p in _TOKENS.split(pattern) if p]
    out = []
    for i, part in enumerate(parts):
        if part != "*":
            out.append(
                fnmatch.translate(part)[4:-3] if part.startswith(("?", "[")) else re.escape(part)
            )
            continue
        before = parts[i - 1][-1] if i > 0 and parts[i - 1] not in ("*", "?") else ""
        after = parts[i + 1][0] if i + 1 < len(parts) and parts[i + 1] not in ("*", "?") else ""
        left_word, right_word = bool(_WORD.match(before)), bool(_WORD.match(after))
        if left_word and right_word:
            out.append(r"(?:[^A-Za-z0-9_](?:.*[^A-Za-z0-9_])?)?")
        elif left_word:
            out.append(r"(?:[^A-Za-z0-9_].*)?")
        elif right_word:
            out.append(r"(?:.*[^A-Za-z0-9_])?")
        else:
            out.append(".*")
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def overreaching_rules(
    spec: RecipeSpec | BF16Rules, model: ModelDescription
) -> list[OverreachingRule]:
    """Each ``modules`` rule that matches some of ``model``'s module names (Megatron or Hugging
    Face) only through a ``*`` continuing a word, with those names."""
    rules = spec.bf16_layers if isinstance(spec, RecipeSpec) else spec
    names = list(dict.fromkeys((*model.megatron_linear_modules, *model.hf_linear_modules)))
    check_rule_work(rules, len(names), model.name)
    out = []
    for i, pattern in enumerate(rules.modules):
        if "*" not in pattern:
            continue
        # The loose regex is the one resolve compiled (re's cache); the strict one is built
        # only for a rule that matches something, so unmatched rules cost no compile.
        loose = re.compile(fnmatch.translate(pattern))
        matched = [n for n in names if loose.match(n)]
        if not matched:
            continue
        strict = strict_glob(pattern)
        hits = [n for n in matched if not strict.match(n)]
        if hits:
            groups = tuple(dict.fromkeys(template(n) for n in hits))
            out.append(OverreachingRule(rule_label(i, pattern), groups, len(hits)))
    return out
