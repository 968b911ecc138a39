"""``apply``'s output as the user's own file with only the keys it must change.

Users keep configs under review; a rewrite that drops every comment, reorders keys and
respells numbers turns five changed keys into a diff of hundreds of lines. So ``apply`` edits
the file it read instead of printing a fresh rendering of the result:

1. The file has already been parsed and accepted by the safe loader
   (:func:`nemo_fp8_plugin.registry.load_yaml_file`: no tags, duplicate keys refused, its
   limits). Only then is it parsed a second time, by ruamel.yaml's round-trip mode, and only
   for writing. What ruamel reads must mean what the safe loader read (YAML 1.1 ``yes``,
   ``0777`` and the like differ between the two); anything else is refused, naming the key.
2. The pipeline's result says what changes: ``written`` (nested keys set or changed) and
   ``removed`` (dotted keys dropped). They are applied to the round-trip document: a changed
   value in place (keeping its quoting, flow style and end-of-line comment), a new key at the
   end of its existing parent mapping, a new parent at the end of the file. Comments that
   followed an edited or removed entry (they introduce the next key) move with the edit so
   they still precede what they described.
3. ruamel normalises a few things it cannot keep on every line it re-emits (trailing blanks,
   blank lines holding spaces, a missing final newline, the spacing before a comment, the
   last digit of some floats). The edited document is therefore
   carried back onto the file as written, a three-way merge whose base is ruamel's own
   emission of the unedited file: every line the edit did not touch comes from the input byte
   for byte.
4. The text produced is read back with the safe loader and must equal the result's ``data``
   exactly; otherwise nothing is written.

A file the pipeline does not change is returned as it is, so ``apply`` on its own output is a
no-op byte for byte. JSON stays JSON (rendered with :func:`nemo_fp8_plugin._io.dump_config_json`
when it changes). The work is bounded by the file's bytes and values (``LIMITS.roundtrip_bytes``,
``roundtrip_nodes``): a fixed number of ruamel passes at the limits, line diffs that are never
quadratic.

Longer than the package's 600-line guide: the edit, the merge and the comparison share
ruamel's round-trip types and the merge's invariants, and change together.

Over 600 lines on purpose: the comment- and order-keeping YAML editor and its comparison are
one algorithm over ruamel's node model.
"""

from __future__ import annotations

import datetime
import difflib
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import FP8ConfigError

__all__ = ["render", "edit_yaml", "unified_diff", "same_data"]

_INDENTS = ((2, 2, 0), (2, 4, 2), (4, 4, 0), (4, 6, 2), (4, 4, 2), (3, 3, 0))
"""(mapping, sequence, offset) indentations tried, in order, for the one ruamel re-emits the
file with (ruamel keeps one global setting, not each node's own)."""

_PASSES_AT_THE_LIMIT = 3
"""ruamel.yaml passes (a load or a dump) an edit of a file at ``LIMITS.roundtrip_bytes`` or
``roundtrip_nodes`` may take: its load, the emission of the unedited file and of the edited
one. A smaller file may take proportionally more (other indentations tried for a file that
mixes them), so the work of an edit never exceeds that of three passes over the largest file
admitted."""

_EXACT_DIFF_CELLS = 4_000_000
"""Line diffs of up to this many (lines x lines) cells are difflib's own (quadratic where lines
repeat); larger ones anchor on the lines unique to both sides first (:func:`_opcodes`)."""

_JSON_HINT = "write the result as JSON with -o OUT.json"

_FLOW_LIST_WIDTH = 60
"""A new list of scalars is written in flow style (``[128, 128]``) when it fits this."""

_FLOW_MAPPING_WIDTH = 100
"""A flow mapping (``{a: 1}``) that keys were added to turns block style past this width."""


def render(
    source: str,
    *,
    raw: Any,
    data: Any,
    written: Mapping[str, Any] | None,
    removed: Sequence[str],
    source_fmt: str,
    fmt: str,
    edit: bool,
    where: str,
) -> str:
    """The text ``apply`` writes.

    Args:
        source: the input file as read (newlines untouched).
        raw: what the safe loader read from ``source``.
        data: the pipeline result's output mapping.
        written, removed: the result's ``written`` and ``removed``.
        source_fmt, fmt: the input's and the output's format (``"yaml"`` or ``"json"``).
        edit: whether ``data`` is ``raw`` edited (False: a new document, Transformer Engine's).
        where: the input's name for messages.
    """
    from ._io import dump_config_json, dump_yaml

    unchanged = edit and not written and not removed
    if fmt == "json":
        return source if unchanged and source_fmt == "json" else dump_config_json(data)
    if not edit:
        return dump_yaml(data)
    if unchanged and source_fmt == "yaml":
        return source
    if source_fmt == "json":  # JSON read, YAML asked for: nothing to keep but the data
        return dump_yaml(data)
    return edit_yaml(
        source, raw=raw, data=data, written=written or {}, removed=removed, where=where
    )


def unified_diff(before: str, after: str, *, name: str, label: str) -> str:
    """``diff -u`` of the input and what ``apply`` would write (empty when they are equal)."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=name,
        tofile=f"{name} ({label})",
    )
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


# --------------------------------------------------------------------------- YAML editing


def edit_yaml(
    source: str,
    *,
    raw: Any,
    data: Any,
    written: Mapping[str, Any],
    removed: Sequence[str],
    where: str,
) -> str:
    """``source`` with ``written`` set and ``removed`` dropped, every other line kept."""
    try:
        return _edit_yaml(source, raw, data, written, removed, where)
    except RecursionError:
        raise FP8ConfigError(
            f"{where} is nested too deeply to be edited in place",
            hint=_JSON_HINT,
        ) from None


def _edit_yaml(
    source: str, raw: Any, data: Any, written: Mapping[str, Any], removed: Sequence[str], where: str
) -> str:
    budget = _Budget(source, raw, where)
    doc = _rt_load(source, where)
    plain = _plain(doc)
    differs = _first_difference(plain, raw)
    if differs is not None:
        raise FP8ConfigError(
            "ruamel.yaml (which apply edits the file with) reads this value differently from "
            "the safe loader, so the file cannot be edited in place",
            key=differs or None,
            value=where,
            hint="quote the value, or spell a boolean true/false (not yes/no/on/"
            "off), so both read it alike; or write -o OUT.json",
        )
    indent, base = _best_indent(doc, source, budget)
    newline = "\r\n" if source.count("\r\n") * 2 > source.count("\n") else "\n"
    fallback = None
    # A file that mixes indentations (ruamel re-emits with one) is tried with the others too,
    # so the lines the edit touches are emitted in the indentation they have there, while
    # the budget lasts (three passes each: load, and both emissions).
    for attempt in (indent, *(i for i in _INDENTS if i != indent)):
        if attempt != indent:
            if not budget.take(3):
                break
            doc = _rt_load(source, where)
            base = _dump(doc, attempt)
        _edit(doc, written, removed, data, where)
        edited = _dump(doc, attempt)
        for ruamel_tail in (False, True) if not source.endswith("\n") else (False,):
            merged = _carry_over(source, base, edited, newline, ruamel_tail=ruamel_tail)
            if merged is not None and _reads_as(merged, data):
                return merged
        if fallback is None:
            # ruamel's own rendering: every line's meaning, not its spelling; the lines
            # before the document (``%YAML``/``%TAG`` directives, ``---``, comments above
            # it), which ruamel does not re-emit, are put back as written.
            candidate = _with_header(source, edited)
            if _reads_as(candidate, data):
                fallback = candidate
    if fallback is not None:
        return fallback
    raise FP8ConfigError(
        f"apply could not edit {where} in place without changing what it means",
        hint=f"{_JSON_HINT}, and report this file",
    )


def _edit(
    doc: Any, written: Mapping[str, Any], removed: Sequence[str], data: Any, where: str
) -> None:
    for dotted in removed:
        path = _resolve(doc, dotted)
        if path is None:
            raise FP8ConfigError(
                "apply cannot find this key in the file to remove it", key=dotted, value=where
            )
        _delete(doc, path)
    _apply_written(doc, written, data)


_KINDS: dict[str, Any] = {}


def _kinds() -> tuple[type, type]:
    """ruamel's round-trip constructor and representer, also keeping how a null (``null``,
    ``~``, nothing) and a boolean (``True``, ``false``) were spelled."""
    if not _KINDS:
        from ruamel.yaml.constructor import RoundTripConstructor
        from ruamel.yaml.representer import RoundTripRepresenter
        from ruamel.yaml.scalarbool import ScalarBoolean

        class SpelledNull:
            __slots__ = ("text",)

            def __init__(self, text: str) -> None:
                self.text = text

        class SpelledBool(ScalarBoolean):
            text = ""

        class Constructor(RoundTripConstructor):
            def construct_spelled_null(self, node: Any) -> Any:
                return None if node.anchor else SpelledNull(node.value)

            def construct_spelled_bool(self, node: Any) -> Any:
                value = self.construct_yaml_sbool(node)
                if node.anchor:
                    return value
                out = SpelledBool(bool(value))
                out.text = node.value
                return out

        class Representer(RoundTripRepresenter):
            def represent_spelled(self, data: Any) -> Any:
                tag = "null" if isinstance(data, SpelledNull) else "bool"
                return self.represent_scalar(f"tag:yaml.org,2002:{tag}", data.text)

        Constructor.add_constructor("tag:yaml.org,2002:null", Constructor.construct_spelled_null)
        Constructor.add_constructor("tag:yaml.org,2002:bool", Constructor.construct_spelled_bool)
        Representer.add_representer(SpelledNull, Representer.represent_spelled)
        # a null apply writes reads as one (ruamel's default is an empty value)
        Representer.add_representer(
            type(None), lambda self, data: self.represent_scalar("tag:yaml.org,2002:null", "null")
        )
        Representer.add_representer(SpelledBool, Representer.represent_spelled)
        _KINDS.update(
            constructor=Constructor, representer=Representer, null=SpelledNull, bool=SpelledBool
        )
    return _KINDS["constructor"], _KINDS["representer"]


def _yaml(indent: tuple[int, int, int]):
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt", pure=True)
    yaml.Constructor, yaml.Representer = _kinds()
    yaml.preserve_quotes = True
    yaml.allow_duplicate_keys = False
    yaml.width = 1 << 20  # never fold a line the user wrote on one line
    mapping, sequence, offset = indent
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    return yaml


def _rt_load(source: str, where: str) -> Any:
    from ruamel.yaml.comments import CommentedMap

    try:
        doc = _yaml(_INDENTS[0]).load(source)
    except RecursionError:
        raise
    except Exception as exc:  # ruamel's own errors; the safe loader accepted the file
        msg = " ".join(str(exc).split())[:300]
        raise FP8ConfigError(
            f"ruamel.yaml (which apply edits the file with) cannot read {where}: {msg}",
            hint=_JSON_HINT,
        ) from None
    if doc is None:
        doc = CommentedMap()
    if not isinstance(doc, CommentedMap):
        raise FP8ConfigError(f"{where} must hold a mapping at the top level")
    return doc


def _dump(doc: Any, indent: tuple[int, int, int]) -> str:
    buf = io.StringIO()
    _yaml(indent).dump(doc, buf)
    return buf.getvalue()


class _Budget:
    """The ruamel.yaml passes an edit may still take (:data:`_PASSES_AT_THE_LIMIT` over the
    largest file admitted); refuses, before any, a file past ``LIMITS.roundtrip_bytes`` or
    ``roundtrip_nodes``."""

    def __init__(self, source: str, raw: Any, where: str) -> None:
        from .errors import LIMITS, check_limit

        size, nodes = len(source.encode("utf-8", "surrogatepass")), _count_values(raw)
        for count, limit, what in (
            (size, LIMITS.roundtrip_bytes, "bytes"),
            (nodes, LIMITS.roundtrip_nodes, "values"),
        ):
            check_limit(
                count,
                limit,
                f"{where} is too large to edit in place: {what}",
                key=None,
                hint=f"{_JSON_HINT}; limits: docs/refusals.md",
            )
        share = max(size / LIMITS.roundtrip_bytes, nodes / LIMITS.roundtrip_nodes, 1e-9)
        # the load and the two emissions every edit takes are spent already
        self.left = max(0, int(_PASSES_AT_THE_LIMIT / share) - _PASSES_AT_THE_LIMIT)

    def take(self, passes: int) -> bool:
        if passes > self.left:
            return False
        self.left -= passes
        return True


def _count_values(data: Any) -> int:
    """Keys, items and scalars of a parsed document, a shared (aliased) container once."""
    count, seen, todo = 0, set(), [data]
    while todo:
        here = todo.pop()
        count += 1
        if isinstance(here, (dict, list)):
            if id(here) in seen:
                continue
            seen.add(id(here))
            if isinstance(here, dict):
                count += len(here)
                todo.extend(here.values())
            else:
                todo.extend(here)
    return count


def _best_indent(doc: Any, source: str, budget: _Budget) -> tuple[tuple[int, int, int], str]:
    """The indentation whose re-emission of the unedited ``doc`` is closest to ``source``,
    and that emission (the base of the three-way merge). The one the file's own lines
    suggest is tried first; the others only while none re-emits the file line for line (and
    the budget lasts)."""
    from collections import Counter

    want = Counter(line.rstrip() for line in source.splitlines())
    enough = sum(want.values()) // 100  # a few respelled lines are not an indentation's fault
    best: tuple[int, tuple[int, int, int], str] | None = None
    guess = _guess_indent(source)
    for indent in sorted(_INDENTS, key=lambda i: i != guess):
        if best is not None and not budget.take(1):
            break
        text = _dump(doc, indent)
        got = Counter(line.rstrip() for line in text.splitlines())
        misses = sum(((want - got) + (got - want)).values())
        if best is None or misses < best[0]:
            best = (misses, indent, text)
        if misses <= enough:
            break
    assert best is not None
    return best[1], best[2]


def _guess_indent(source: str) -> tuple[int, int, int]:
    """(mapping, sequence, offset) from the file's first nested mapping and first sequence."""
    mapping, offset = None, None
    lines = [ln for ln in source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for above, line in zip(lines, lines[1:]):
        depth_above = len(above) - len(above.lstrip(" "))
        depth = len(line) - len(line.lstrip(" "))
        if not above.split("#")[0].rstrip().endswith(":"):
            continue
        if line.lstrip().startswith("- "):
            offset = depth - depth_above if offset is None else offset
        elif depth > depth_above and mapping is None:
            mapping = depth - depth_above
        if mapping is not None and offset is not None:
            break
    mapping = mapping or 2
    offset = offset if offset in (0, 2) else 0
    return mapping, mapping + offset if offset else mapping, offset


def _header(source: str) -> list[str]:
    """The lines before the document's content when it has an explicit start: directives,
    comments and blank lines, through the ``---`` line (empty without a ``---``)."""
    lines = source.splitlines(keepends=True)
    for n, line in enumerate(lines):
        text = line.strip()
        if text == "---" or text.startswith("--- #"):
            return lines[: n + 1]
        if text and not text.startswith(("%", "#")):
            return []
    return []


def _with_header(source: str, edited: str) -> str:
    """``edited`` (ruamel's emission) led by ``source``'s :func:`_header`, each header line
    once: the ones ruamel kept are not repeated."""
    header = _header(source)
    if not header:
        return edited
    body = edited.splitlines(keepends=True)
    kept = {line.strip() for line in header} | {
        line.strip()[3:].strip() for line in header if line.strip().startswith("--- #")
    }  # ruamel re-emits the comment of ``--- # ...`` as a line of its own
    while body and (body[0].strip() in kept or body[0].strip() == "---"):
        body.pop(0)
    if not header[-1].endswith("\n"):
        header[-1] += "\n"
    return "".join(header + body)


def _carry_over(
    source: str, base: str, edited: str, newline: str, *, ruamel_tail: bool = False
) -> str | None:
    """Three-way merge: the changes from ``base`` (ruamel's emission of the unedited file) to
    ``edited`` applied to ``source``; every line outside a change comes from ``source``.
    None when a change touches a line ruamel re-emits other than as written (beyond trailing
    blanks): the caller then takes ``edited`` as it is. ``ruamel_tail``: the lines ruamel
    respelled at the very end of the file are taken as ruamel wrote them (a block scalar that
    ended a file without a final newline is ``|-`` once keys follow it)."""
    mine = source.splitlines(keepends=True)
    old = base.splitlines(keepends=True)
    new = edited.splitlines(keepends=True)
    # anchor[b]: the last source line that base line b stands for (equal but for trailing
    # blanks, or the end of a run ruamel respelled); respelled[b]: b is in such a run;
    # theirs[b]: b is written as ruamel writes it
    anchor: dict[int, int] = {}
    respelled: set[int] = set()
    theirs: set[int] = set()
    skip = (0, 0)  # the source lines ruamel's tail stands for
    same = _opcodes([s.rstrip() for s in mine], [s.rstrip() for s in old])
    last = max((n for n, op in enumerate(same) if op[0] == "replace"), default=None)
    if ruamel_tail and last is not None and all(op[0] == "equal" for op in same[last + 1 :]):
        _, i1, i2, j1, j2 = same[last]
        header = mine[i2 - 1].rstrip()
        if header.endswith(("|", ">")) and old[j2 - 1].rstrip() == header + "-":
            theirs.add(j2 - 1)
            skip = (i2 - 1, i2)
            rest = [("replace", i1, i2 - 1, j1, j2 - 1)] if i2 - 1 > i1 and j2 - 1 > j1 else []
            same = same[:last] + rest + same[last + 1 :]
    for tag, i1, i2, j1, j2 in same:
        if tag == "equal":
            for k in range(j2 - j1):
                anchor[j1 + k] = i1 + k
        elif tag == "replace":
            respelled.update(range(j1, j2))
            anchor[j2 - 1] = i2 - 1
    out: list[str] = []
    pos = 0  # the next source line not yet emitted
    for tag, i1, i2, j1, j2 in _opcodes(old, new):
        if tag == "equal":
            for k, b in enumerate(range(i1, i2)):
                if b in theirs:
                    out.extend(mine[pos : skip[0]])
                    pos = max(pos, skip[1])
                    out.append(new[j1 + k])
                elif b in anchor:
                    out.extend(mine[pos : anchor[b] + 1])
                    pos = anchor[b] + 1
            continue
        if respelled.intersection(range(i1, i2)):
            return None
        touched = [anchor[b] for b in range(i1, i2) if b in anchor]
        if touched:
            out.extend(mine[pos : touched[0]])  # lines only the source has, before the change
            pos = touched[-1] + 1
        for line in new[j1:j2]:
            out.append(line[:-1] + newline if newline != "\n" and line.endswith("\n") else line)
    out.extend(mine[pos:])
    for i in range(len(out) - 1):  # a source line that was last and now is not
        if not out[i].endswith("\n"):
            out[i] += newline
    return "".join(out)


Opcode = tuple[str, int, int, int, int]


def _opcodes(a: Sequence[str], b: Sequence[str]) -> list[Opcode]:
    """``difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()`` where that is
    cheap; for large inputs the same opcodes from matching blocks found in linear time per
    level: common leading and trailing lines, then lines that occur once on each side, in the
    same order on both (patience diff), anchor the match and the gaps between them are
    matched the same way (difflib inside a gap small enough). A gap with nothing to anchor
    it stays a replacement: nothing is quadratic, whatever the lines."""
    if len(a) * len(b) <= _EXACT_DIFF_CELLS:
        return list(difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes())
    blocks: list[tuple[int, int, int]] = []
    todo = [(0, len(a), 0, len(b))]
    work = 64 * (len(a) + len(b))  # line visits: past it, what is left is replaced
    while todo:
        alo, ahi, blo, bhi = todo.pop()
        while alo < ahi and blo < bhi and a[alo] == b[blo]:
            blocks.append((alo, blo, 1))
            alo, blo = alo + 1, blo + 1
        while alo < ahi and blo < bhi and a[ahi - 1] == b[bhi - 1]:
            ahi, bhi = ahi - 1, bhi - 1
            blocks.append((ahi, bhi, 1))
        if alo >= ahi or blo >= bhi:
            continue
        if (ahi - alo) * (bhi - blo) <= _EXACT_DIFF_CELLS // 4:
            matcher = difflib.SequenceMatcher(None, a[alo:ahi], b[blo:bhi], autojunk=False)
            blocks.extend((alo + i, blo + j, n) for i, j, n in matcher.get_matching_blocks() if n)
            continue
        work -= (ahi - alo) + (bhi - blo)
        if work < 0:
            continue
        anchors = _unique_in_order(a, alo, ahi, b, blo, bhi)
        prev_a, prev_b = alo, blo
        for i, j in anchors:
            blocks.append((i, j, 1))
            todo.append((prev_a, i, prev_b, j))
            prev_a, prev_b = i + 1, j + 1
        if anchors:
            todo.append((prev_a, ahi, prev_b, bhi))
    blocks.sort()
    merged: list[list[int]] = []
    for i, j, n in blocks:
        if merged and merged[-1][0] + merged[-1][2] == i and merged[-1][1] + merged[-1][2] == j:
            merged[-1][2] += n
        else:
            merged.append([i, j, n])
    ops: list[Opcode] = []
    i = j = 0
    for ai, bj, size in [*merged, [len(a), len(b), 0]]:
        tag = "replace" if i < ai and j < bj else "delete" if i < ai else "insert" if j < bj else ""
        if tag:
            ops.append((tag, i, ai, j, bj))
        i, j = ai + size, bj + size
        if size:
            ops.append(("equal", ai, i, bj, j))
    return ops


def _unique_in_order(
    a: Sequence[str], alo: int, ahi: int, b: Sequence[str], blo: int, bhi: int
) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` of lines that occur exactly once in ``a[alo:ahi]`` and in
    ``b[blo:bhi]``, the longest run of them in the same order on both sides (patience
    sorting: O(n log n))."""
    import bisect
    from collections import Counter

    count_a, count_b = Counter(a[alo:ahi]), Counter(b[blo:bhi])
    where_b = {b[j]: j for j in range(blo, bhi) if count_b[b[j]] == 1}
    pairs = [(i, where_b[a[i]]) for i in range(alo, ahi) if count_a[a[i]] == 1 and a[i] in where_b]
    # longest increasing subsequence of the b positions, in a's order
    tails: list[int] = []  # b position ending the best run of each length
    tail_at: list[int] = []  # its index into pairs
    back: list[int] = [-1] * len(pairs)
    for k, (_, j) in enumerate(pairs):
        n = bisect.bisect_left(tails, j)
        back[k] = tail_at[n - 1] if n else -1
        if n == len(tails):
            tails.append(j)
            tail_at.append(k)
        else:
            tails[n], tail_at[n] = j, k
    out: list[tuple[int, int]] = []
    k = tail_at[-1] if tail_at else -1
    while k >= 0:
        out.append(pairs[k])
        k = back[k]
    return out[::-1]


def _reads_as(text: str, data: Any) -> bool:
    import yaml

    from .registry import _safe_loader

    try:
        got = yaml.load(text, Loader=_safe_loader())
    except Exception:  # what we wrote does not parse: not this text
        return False
    return _first_difference(got if got is not None else {}, data) is None


# --------------------------------------------------------------------------- comparing


def _plain(node: Any, memo: dict[int, Any] | None = None) -> Any:
    """The round-trip document as plain Python (aliases stay shared, so nothing expands)."""
    from ruamel.yaml.scalarbool import ScalarBoolean

    memo = {} if memo is None else memo
    if isinstance(node, Mapping):
        if id(node) in memo:
            return memo[id(node)]
        out: dict[Any, Any] = {}
        memo[id(node)] = out
        for key, value in node.items():
            out[_plain(key, memo)] = _plain(value, memo)
        return out
    if isinstance(node, list):
        if id(node) in memo:
            return memo[id(node)]
        items: list[Any] = []
        memo[id(node)] = items
        items.extend(_plain(v, memo) for v in node)
        return items
    if isinstance(node, ScalarBoolean):
        return bool(node)
    if isinstance(node, _KINDS["null"]):
        return None
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


def same_data(a: Any, b: Any) -> bool:
    """Whether two parsed documents are equal, types included (``1`` is not ``true``, ``1``
    is not ``1.0``), NaN equal to NaN; shared structure is compared once."""
    return _first_difference(a, b) is None


def _first_difference(a: Any, b: Any) -> str | None:
    """The dotted key where ``a`` and ``b`` first differ ("" for the root), None if equal."""
    seen: set[tuple[int, int]] = set()

    def walk(x: Any, y: Any, where: str) -> str | None:
        if isinstance(x, Mapping) or isinstance(y, Mapping):
            if not (isinstance(x, Mapping) and isinstance(y, Mapping)):
                return where
            if (id(x), id(y)) in seen:
                return None
            seen.add((id(x), id(y)))
            if len(x) != len(y):
                extra = [k for k in x if k not in y] + [k for k in y if k not in x]
                return f"{where}.{extra[0]}".lstrip(".") if extra else where
            for key, value in x.items():
                if key not in y:
                    return f"{where}.{key}".lstrip(".")
                found = walk(value, y[key], f"{where}.{key}".lstrip("."))
                if found is not None:
                    return found
            return None
        if isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
            if not (isinstance(x, (list, tuple)) and isinstance(y, (list, tuple))) or len(x) != len(
                y
            ):
                return where
            if (id(x), id(y)) in seen:
                return None
            seen.add((id(x), id(y)))
            for i, (u, v) in enumerate(zip(x, y)):
                found = walk(u, v, f"{where}[{i}]")
                if found is not None:
                    return found
            return None
        if isinstance(x, datetime.date) and isinstance(y, datetime.date):
            return None if x == y else where  # ruamel's TimeStamp is a datetime subclass
        if type(x) is not type(y):
            return where
        if isinstance(x, float) and math.isnan(x) and math.isnan(y):
            return None
        return None if x == y else where

    return walk(a, b, "")


# --------------------------------------------------------------------------- editing


def _resolve(doc: Any, dotted: str) -> list[Any] | None:
    """The key path a dotted key names in ``doc`` (keys may themselves hold dots)."""
    from ruamel.yaml.comments import CommentedMap

    def walk(node: Any, rest: str) -> list[Any] | None:
        if not isinstance(node, CommentedMap):
            return None
        if rest in node:
            return [rest]
        for key in node:
            text = str(key)
            if rest.startswith(text + "."):
                found = walk(node[key], rest[len(text) + 1 :])
                if found is not None:
                    return [key, *found]
        return None

    return walk(doc, dotted)


def _is_block(node: Any) -> bool:
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    return (
        isinstance(node, (CommentedMap, CommentedSeq))
        and len(node) > 0
        and not node.fa.flow_style()
    )


def _last(node: Any) -> Any:
    return next(reversed(node)) if isinstance(node, Mapping) else len(node) - 1


def _tail(container: Any, key: Any) -> tuple[Any, Any]:
    """Where ruamel keeps the comments that follow the entry ``container[key]``: the entry
    itself, or the last entry inside its block value, recursively."""
    while _is_block(container[key]):
        container, key = container[key], _last(container[key])
    return container, key


def _slot(container: Any) -> int:
    return 2 if isinstance(container, Mapping) else 0


def _token(container: Any, key: Any) -> Any:
    items = container.ca.items.get(key)
    return items[_slot(container)] if items else None


def _set_token(container: Any, key: Any, token: Any) -> None:
    items = container.ca.items.setdefault(key, [None, None, None, None])
    items[_slot(container)] = token


def _comment(value: str) -> Any:
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    return CommentToken(value, CommentMark(0))


def _take_following(container: Any, key: Any) -> str:
    """Detach and return the lines that follow entry ``key`` (full-line comments and blank
    lines, which introduce the next entry); its own end-of-line comment stays."""
    holder, hkey = _tail(container, key)
    token = _token(holder, hkey)
    if token is None:
        return ""
    if _block_scalar(holder[hkey]):  # it ended its own last line: every line follows it
        _set_token(holder, hkey, None)
        return token.value
    if "\n" not in token.value:
        return ""
    head, rest = token.value.split("\n", 1)
    if head.strip():
        token.value = head + "\n"
    else:
        _set_token(holder, hkey, None)
    return rest


def _put_following(container: Any, key: Any, rest: str) -> None:
    """Attach ``rest`` (from :func:`_take_following`) after entry ``key``."""
    if not rest:
        return
    holder, hkey = _tail(container, key)
    token = _token(holder, hkey)
    if token is None:
        _set_token(holder, hkey, _comment(rest if _block_scalar(holder[hkey]) else "\n" + rest))
    else:
        token.value = (token.value if token.value.endswith("\n") else token.value + "\n") + rest


def _block_scalar(value: Any) -> bool:
    from ruamel.yaml.scalarstring import FoldedScalarString, LiteralScalarString

    return isinstance(value, (LiteralScalarString, FoldedScalarString))


def _put_before_first(container: Any, rest: str) -> None:
    """Attach ``rest`` before the first entry of ``container`` (after its parent's key)."""
    if not rest:
        return
    comment = container.ca.comment
    if comment is None:
        container.ca.comment = comment = [None, None]
    if comment[1] is None:
        comment[1] = []
    comment[1].append(_comment(rest))


def _delete(doc: Any, path: list[Any]) -> None:
    parents = [doc]
    for key in path[:-1]:
        parents.append(parents[-1][key])
    container, key = parents[-1], path[-1]
    keys = list(container)
    index = keys.index(key)
    rest = _take_following(container, key)
    del container[key]
    container.ca.items.pop(key, None)
    if index > 0:
        _put_following(container, keys[index - 1], rest)
    elif len(container) > 0 or len(parents) == 1:
        _put_before_first(container, rest)
    else:  # the mapping is now empty, `{}` on its parent's line: the lines follow the parent
        _put_following(parents[-2], path[-2], rest)


def _apply_written(node: Any, written: Mapping[Any, Any], data: Mapping[Any, Any]) -> None:
    from ruamel.yaml.comments import CommentedMap

    for key, value in written.items():
        new = data[key]
        if (
            key in node
            and isinstance(node[key], CommentedMap)
            and isinstance(new, Mapping)
            and isinstance(value, Mapping)
            and value
        ):
            had = len(node[key])
            _apply_written(node[key], value, new)
            if (
                node[key].fa.flow_style()
                and len(node[key]) > had
                and len(_flow_text(new)) > _FLOW_MAPPING_WIDTH
            ):
                node[key].fa.set_block_style()  # keys added: one a line, not one long line
                token = _token(node, key)
                if token is not None and token.value.startswith("#"):  # now after `key:`
                    from ruamel.yaml.error import CommentMark

                    token.start_mark = CommentMark(0)
            continue
        if key in node:
            rest = _take_following(node, key)
            node[key] = _to_rt(new, like=node[key])
            _put_following(node, key, rest)
        else:
            last = _last(node) if len(node) else None
            rest = _take_following(node, last) if last is not None else ""
            node[key] = _to_rt(new, like=None)
            _put_following(node, key, rest)


def _flow_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_flow_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow_text(v) for v in value) + "]"
    return str(value)


def _to_rt(value: Any, like: Any) -> Any:
    """``value`` as a round-trip node, in the style of the value it replaces (``like``):
    its quoting for a string, its flow or block style for a collection."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString, SingleQuotedScalarString

    if isinstance(value, Mapping):
        out = CommentedMap()
        for k, v in value.items():
            out[k] = _to_rt(v, None)
        if isinstance(like, CommentedMap) and like.fa.flow_style():
            out.fa.set_flow_style()
        return out
    if isinstance(value, (list, tuple)):
        seq = CommentedSeq(_to_rt(v, None) for v in value)
        if isinstance(like, CommentedSeq):
            flow = like.fa.flow_style()
        else:
            flow = (
                all(v is None or isinstance(v, (bool, int, float, str)) for v in value)
                and len(repr(list(value))) <= _FLOW_LIST_WIDTH
            )
        if flow:
            seq.fa.set_flow_style()
        else:
            seq.fa.set_block_style()
        return seq
    if isinstance(value, str) and isinstance(
        like, (DoubleQuotedScalarString, SingleQuotedScalarString)
    ):
        return type(like)(value)
    spelled = _KINDS["bool"]
    if isinstance(value, bool) and isinstance(like, spelled) and like.text:
        out = spelled(value)
        word = "true" if value else "false"
        out.text = (
            word.upper()
            if like.text.isupper()
            else (word.title() if like.text[0].isupper() else word)
        )
        return out
    return value
