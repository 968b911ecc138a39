"""Values of a NeMo RL config as NeMo RL reads them: ``${...}`` interpolations resolved.

NeMo RL loads its YAML with OmegaConf and registers four resolvers (``add``, ``mul``, ``div``,
``max``; ``nemo_rl/utils/config.py::register_omegaconf_resolvers``), so a value such as
``make_sequence_length_divisible_by: ${mul:8, ${policy.megatron_cfg.tensor_model_parallel_size}}``
means a number only after resolution. Checks that compare numbers read them through here.

Resolution is bounded before OmegaConf runs (``errors.LIMITS``): OmegaConf evaluates a
reference each time it is reached, so ``k0: ${k1}${k1}``, ``k1: ${k2}${k2}``... doubles the
work per line, and ``${mul:'abcdefghij',100000000}`` builds a gigabyte. The references a value
reaches are counted first, with their multiplicity (:data:`~nemo_fp8_plugin.errors.Limits`
``interpolations``), their chain and nesting depth (``interpolation_depth``) and the length
they expand to (``interpolated_chars``); only the part of the config they reach is handed to
OmegaConf, and the resolvers refuse a result longer than that length. Past a limit: one
:class:`~nemo_fp8_plugin.errors.FP8ConfigError` naming the key.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from ...errors import LIMITS, FP8ConfigError, check_limit, format_value

__all__ = ["NEMO_RL_RESOLVERS", "InterpolationError", "interpolated", "resolved_value"]

NEMO_RL_RESOLVERS = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}
"""The resolvers NeMo RL registers, by name. They are installed (bounded in the size of what
they return) only while this module resolves a value; whatever was registered before under
these names (NeMo RL's own, in a process that imported NeMo RL) is put back after."""

_MISSING = object()

KeyPath = tuple[Any, ...]


def resolved_value(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """One value of ``config`` as NeMo RL reads it: resolved when it is an interpolation
    (only the part of the config it reaches is resolved)."""
    from ...dotted import get_path

    value = get_path(config, dotted, _MISSING)
    if value is _MISSING:
        return default
    if isinstance(value, str) and "${" in value:
        return _resolve(config, tuple(dotted.split(".")), dotted)
    return value


def interpolated(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every interpolation resolved as NeMo RL would (OmegaConf), each within
    the limits :func:`resolved_value` applies."""
    out = copy.deepcopy(dict(config))
    for path in [p for p, v in _leaves(config) if isinstance(v, str) and "${" in v]:
        node: Any = out
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = _resolve(config, path, ".".join(map(str, path)))
    return out


# --------------------------------------------------------------------------- bounding


_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*:")
_PATH = re.compile(r"\s*(\.*)([^\s${}'\",:\\]*)\s*")
_PARTS = re.compile(r"[^.\[\]]+")


class _Plan:
    """The references one value reaches (a walk of the config, never of OmegaConf): what
    they cost OmegaConf, with multiplicity, and the paths to hand it."""

    def __init__(self, config: Mapping[str, Any], key: str) -> None:
        self.config, self.key = config, key
        self.cost: dict[KeyPath, int] = {}
        self.size: dict[KeyPath, int] = {}
        self.active: set[KeyPath] = set()
        self.paths: set[KeyPath] = set()
        self.whole = False  # a reference this walk cannot follow: hand OmegaConf everything

    def refuse(self, count: int, limit: int, what: str) -> None:
        check_limit(count, limit, f"resolving its ${{...}} interpolations: {what}", key=self.key)

    def visit(self, path: KeyPath, depth: int) -> tuple[int, int]:
        """(evaluations, characters) of resolving the node at ``path`` once."""
        path, node = _locate(self.config, path)
        if path in self.cost:
            return self.cost[path], self.size[path]
        self.refuse(depth, LIMITS.interpolation_depth, "references chained")
        if path in self.active:
            raise FP8ConfigError(
                f"resolving its ${{...}} interpolations: {'.'.join(map(str, path))} refers "
                f"back to itself",
                key=self.key,
            )
        self.active.add(path)
        try:
            if node is _MISSING:
                cost, size = 0, 0  # OmegaConf names what is missing
            elif isinstance(node, str):
                cost, size = self._string(path, node, depth)
            elif isinstance(node, (dict, list)):
                cost, size = 0, 0
                for sub, leaf in _leaves(node, path):
                    c, s = self.visit(sub, depth + 1) if _interpolates(leaf) else (1, _len(leaf))
                    cost, size = cost + c, size + s
            else:
                cost, size = 1, _len(node)
        finally:
            self.active.discard(path)
        if node is not _MISSING:
            self.paths.add(path)
        self.cost[path], self.size[path] = cost, size
        self.refuse(cost, LIMITS.interpolations, "evaluations")
        self.refuse(size, LIMITS.interpolated_chars, "characters")
        return cost, size

    def _string(self, path: KeyPath, text: str, depth: int) -> tuple[int, int]:
        cost, size = 1, len(text)
        bodies, nesting = _interpolations(text)
        self.refuse(nesting, LIMITS.interpolation_depth, "levels nested in one value")
        for body in bodies:
            target = _reference(body, path)
            if target is None:
                continue
            if target is False:
                self.whole = True
                continue
            c, s = self.visit(target, depth + 1)
            cost, size = cost + c, size + s
            self.refuse(cost, LIMITS.interpolations, "evaluations")
            self.refuse(size, LIMITS.interpolated_chars, "characters")
        return cost, size


def _interpolations(text: str) -> tuple[list[str], int]:
    """The body of every ``${...}`` in ``text``, nested ones included (an escaped ``\\${``
    is text), and the deepest nesting of ``${``, ``[`` and ``{`` inside them."""
    bodies: list[str] = []
    stack: list[int] = []  # where each open ${ starts (-1: a bracket inside one)
    deepest, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if text.startswith("${", i):
            stack.append(i + 2)
            i += 1
        elif stack and c in "[{":
            stack.append(-1)
        elif stack and c in "]}":
            start = stack.pop()
            if start >= 0:
                bodies.append(text[start:i])
        deepest = max(deepest, len(stack))
        i += 1
    return bodies, deepest


def _reference(body: str, here: KeyPath) -> KeyPath | None | Literal[False]:
    """The config path a ``${body}`` names: None when it names none (a resolver call whose
    arguments hold their own ``${...}``, found separately), False when it names one this walk
    cannot follow (a key built from an interpolation, another resolver's argument)."""
    if "${" in body:  # the nested ones are references of their own
        named = _NAME.match(body)
        return None if named and named.group(1) in NEMO_RL_RESOLVERS else False
    named = _NAME.match(body)
    if named:
        if named.group(1) in NEMO_RL_RESOLVERS or named.group(1) in ("oc.env", "oc.decode"):
            return None
        return False  # oc.select, oc.dict.keys, ...: a path given as text
    match = _PATH.fullmatch(body)
    if match is None:
        return False
    dots, dotted = match.groups()
    parts = tuple(_PARTS.findall(dotted))
    if not dots:
        return parts
    base = here[: len(here) - len(dots)]
    return base + parts


def _locate(config: Any, path: KeyPath) -> tuple[KeyPath, Any]:
    """``path`` with the keys the config really has (``0`` of a list, a YAML integer key
    named as text), and the node there (``_MISSING`` when there is none)."""
    node: Any = config
    found: list[Any] = []
    for part in path:
        if isinstance(node, dict):
            key = part if part in node else next((k for k in node if str(k) == str(part)), _MISSING)
            if key is _MISSING:
                return tuple(found) + tuple(path[len(found) :]), _MISSING
            node = node[key]
        elif isinstance(node, list) and str(part).lstrip("-").isdigit():
            key = int(part)
            if not -len(node) <= key < len(node):
                return tuple(found) + tuple(path[len(found) :]), _MISSING
            key %= len(node)
            node = node[key]
        else:
            return tuple(found) + tuple(path[len(found) :]), _MISSING
        found.append(key)
    return tuple(found), node


def _leaves(node: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    todo = [(path, node)]
    while todo:
        here, value = todo.pop()
        if isinstance(value, dict) and value:
            todo.extend((here + (k,), v) for k, v in value.items())
        elif isinstance(value, list) and value:
            todo.extend((here + (i,), v) for i, v in enumerate(value))
        else:
            yield here, value


def _interpolates(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _len(value: Any) -> int:
    return len(value) if isinstance(value, str) else 8


# --------------------------------------------------------------------------- resolving


class InterpolationError(FP8ConfigError):
    """A ``${...}`` interpolation of the config that cannot be resolved, or only beyond the
    limits: a mistake in the config (exit 2 in every command), whatever reads the key."""


def _resolve(config: Mapping[str, Any], path: KeyPath, key: str) -> Any:
    """The value at ``path`` resolved by OmegaConf, on the part of ``config`` it reaches;
    any refusal on the way is an :class:`InterpolationError`."""
    try:
        return _resolve_bounded(config, path, key)
    except InterpolationError:
        raise
    except FP8ConfigError as err:
        raise InterpolationError(
            err.bare_message, key=err.key, value=err.value, hint=err.hint
        ) from None


def _resolve_bounded(config: Mapping[str, Any], path: KeyPath, key: str) -> Any:
    """The value at ``path`` resolved by OmegaConf, on the part of ``config`` it reaches."""
    from omegaconf import OmegaConf  # only configs with ${...} need it
    from omegaconf.errors import OmegaConfBaseException

    plan = _Plan(config, key)
    plan.visit(path, 1)
    if plan.whole:
        check_limit(
            sum(1 for _ in _leaves(config)),
            LIMITS.interpolations,
            "resolving its ${...} interpolations (a reference read as text: the whole config): "
            "values",
            key=key,
        )
        part = dict(config)
    else:
        part = _part(config, plan.paths)
    refused: list[FP8ConfigError] = []
    try:
        with _bounded_resolvers(OmegaConf, refused, key):
            node = OmegaConf.select(
                OmegaConf.create(part), _select_key(path), throw_on_missing=True
            )
            out = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    except (OmegaConfBaseException, RecursionError, ValueError, TypeError, ArithmeticError) as exc:
        if refused:
            raise refused[0] from None
        detail = str(exc.msg if hasattr(exc, "msg") else exc).split("\n", 1)[0]
        raise FP8ConfigError(
            f"cannot resolve an interpolation: {format_value(detail, limit=200)}",
            key=getattr(exc, "full_key", None) or key,
        ) from None
    if refused:
        raise refused[0]
    return out


def _select_key(path: KeyPath) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _part(config: Mapping[str, Any], paths: set[KeyPath]) -> dict[str, Any]:
    """The mappings of ``config`` on the way to ``paths`` with the values there (a list on
    the way is taken whole: its indices must stay)."""
    out: dict[Any, Any] = {}
    for path in sorted(paths, key=len):
        node: Any = config
        into: dict[Any, Any] = out
        for i, part in enumerate(path):
            node = node[part]
            if i == len(path) - 1 or not isinstance(node, dict):
                into[part] = copy.deepcopy(node)
                break
            child = into.setdefault(part, {})
            if not isinstance(child, dict):
                break
            into = child
    return out


@contextlib.contextmanager
def _bounded_resolvers(
    omegaconf_class: Any, refused: list[FP8ConfigError], key: str
) -> Iterator[None]:
    """NeMo RL's resolvers, each refusing a result longer than ``interpolated_chars`` before
    building it, registered for the block; what was registered before is put back."""
    from omegaconf.basecontainer import BaseContainer

    register = _register_resolver(omegaconf_class)
    table = BaseContainer._resolvers
    before = {name: table[name] for name in NEMO_RL_RESOLVERS if name in table}
    for name, fn in NEMO_RL_RESOLVERS.items():
        register(name, _bounded(name, fn, refused, key), replace=True)
    try:
        yield
    finally:
        for name in NEMO_RL_RESOLVERS:
            if name in before:
                table[name] = before[name]
            else:
                table.pop(name, None)


def _bounded(name: str, fn: Any, refused: list[FP8ConfigError], key: str) -> Callable[..., Any]:
    def resolver(a: Any, b: Any) -> Any:
        size = _result_size(name, a, b)
        if size > LIMITS.interpolated_chars:
            refused.append(
                FP8ConfigError(
                    f"${{{name}:...}} would build {size} items or characters, more than the "
                    f"limit of {LIMITS.interpolated_chars}",
                    key=key,
                    value=format_value((a, b)),
                    hint="limits: docs/refusals.md",
                )
            )
            raise ValueError("over the limit")
        return fn(a, b)

    return resolver


def _result_size(name: str, a: Any, b: Any) -> int:
    """How long a sequence (string, list) ``name`` would return, before it is built."""
    sized = (str, bytes, list, tuple)
    if name == "mul":
        for seq, times in ((a, b), (b, a)):
            if isinstance(seq, sized) and isinstance(times, int):
                return len(seq) * max(times, 0)
    if name == "add" and isinstance(a, sized) and isinstance(b, sized):
        return len(a) + len(b)
    return 0


def _register_resolver(omegaconf_class: Any) -> Callable[..., Any]:
    """OmegaConf's registration of a resolver that takes typed arguments: ``register_resolver``
    from 2.4 on, where ``register_new_resolver`` warns that it is deprecated (five lines on
    every NeMo RL config with ``${...}``); ``register_new_resolver`` before, where
    ``register_resolver`` is the legacy string-only one."""
    import omegaconf

    major_minor = tuple(int(p) for p in omegaconf.__version__.split(".")[:2] if p.isdigit())
    if major_minor >= (2, 4):
        return omegaconf_class.register_resolver
    return omegaconf_class.register_new_resolver
