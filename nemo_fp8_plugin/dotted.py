"""Dotted config paths (``policy.megatron_cfg.fp8_cfg``; a list item as ``plugins[1]``): get,
set, delete and flatten, the one implementation every adapter uses (stdlib only, core layer)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["get_path", "set_path", "delete_path", "flatten", "nest", "child_mapping"]


def _parts(path: tuple[str, ...] | str) -> tuple[Any, ...]:
    """``"trainer.plugins[1].fp8"`` -> ``("trainer", "plugins", 1, "fp8")``."""
    if not isinstance(path, str):
        return tuple(path)
    out: list[Any] = []
    for part in path.split("."):
        name, bracket, index = part.partition("[")
        out += [name, int(index[:-1])] if bracket and index[:-1].isdigit() else [part]
    return tuple(out)


def _walk(node: Any, parts: tuple[Any, ...], default: Any) -> Any:
    for part in parts:
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            node = node[part]
        elif isinstance(part, str) and isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return default
    return node


def get_path(mapping: Any, path: tuple[str, ...] | str, default: Any = None) -> Any:
    """``mapping[a][b]...`` or ``default`` when any step is missing or not a mapping."""
    return _walk(mapping, _parts(path), default)


def set_path(
    mapping: dict, path: tuple[str, ...] | str, value: Any, *, strict: bool = False
) -> None:
    """Set ``mapping[a][b]... = value`` (a deep copy), creating the mappings on the way (a
    list item one past the end is appended). A step that holds something other than a
    mapping (``env_vars: null``) is replaced by one, as OmegaConf's merge (and so NeMo RL's)
    does; with ``strict`` a step that is neither a mapping nor null is refused instead, naming
    it (:class:`~nemo_fp8_plugin.errors.FP8ConfigError`)."""
    parts = _parts(path)
    node: Any = mapping
    for i, part in enumerate(parts[:-1]):
        if isinstance(part, int):
            if part == len(node):
                node.append({})
            node = node[part]
            continue
        child = node.get(part)
        indexed = isinstance(child, list) and isinstance(parts[i + 1], int)
        if strict and child is not None and not isinstance(child, dict) and not indexed:
            from .errors import FP8ConfigError, format_value

            raise FP8ConfigError(
                f"expected a mapping, got {format_value(child)}",
                key=".".join(str(p) for p in parts[: i + 1]),
                value=child,
            )
        if not isinstance(child, dict) and not indexed:
            child = node[part] = {}
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def delete_path(mapping: dict, path: tuple[str, ...] | str) -> None:
    """Remove ``mapping[a][b]...`` when it is there (nothing happens otherwise)."""
    parts = _parts(path)
    node = _walk(mapping, parts[:-1], None)
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf)`` for every leaf of a nested mapping (an empty mapping and a list
    are leaves)."""
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            yield from flatten(value, dotted)
        else:
            yield dotted, value


def nest(pairs: Mapping[str, Any]) -> dict[str, Any]:
    """The nested mapping of ``{dotted key: value}`` (the inverse of :func:`flatten`)."""
    out: dict[str, Any] = {}
    for key, value in pairs.items():
        set_path(out, key, value)
    return out


def child_mapping(parent: dict, key: str, *, what: str, where: str) -> dict:
    """``parent[key]`` as the mapping an adapter writes into: created when absent or null,
    refused (naming the dotted key ``where``) when the file holds something else there.
    ``what``: what the mapping holds, for the message (``TransformerConfig fields``)."""
    from .errors import FP8ConfigError, format_value

    if parent.get(key) is None:
        parent[key] = {}
    node = parent[key]
    if not isinstance(node, dict):
        raise FP8ConfigError(
            f"expected a mapping of {what}, got {format_value(node)}", key=where, value=node
        )
    return node
