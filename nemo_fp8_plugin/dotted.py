"""Dotted config paths (``policy.megatron_cfg.fp8_cfg``): get, set, delete and flatten, the
one implementation every adapter uses (stdlib only, core layer)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["get_path", "set_path", "delete_path", "flatten", "nest", "child_mapping"]


def _parts(path: tuple[str, ...] | str) -> tuple[str, ...]:
    return tuple(path.split(".")) if isinstance(path, str) else tuple(path)


def get_path(mapping: Any, path: tuple[str, ...] | str, default: Any = None) -> Any:
    """``mapping[a][b]...`` or ``default`` when any step is missing or not a mapping."""
    node = mapping
    for part in _parts(path):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def set_path(mapping: dict, path: tuple[str, ...] | str, value: Any) -> None:
    """Set ``mapping[a][b]... = value`` (a deep copy), creating the mappings on the way; a
    step that holds something other than a mapping (``env_vars: null``) is replaced by one,
    as OmegaConf's merge (and so NeMo RL's) does."""
    parts = _parts(path)
    node = mapping
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def delete_path(mapping: dict, path: tuple[str, ...] | str) -> None:
    """Remove ``mapping[a][b]...`` when it is there (nothing happens otherwise)."""
    parts = _parts(path)
    node: Any = mapping
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
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
