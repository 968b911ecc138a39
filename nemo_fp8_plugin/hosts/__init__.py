"""Per-host adapters: one module per host, each importing its host lazily.

Every adapter module exposes the same two functions, so the CLI and ``explain`` treat
hosts alike:

``native_keys(spec, model=None) -> HostKeys``
    The host's own spelling of a recipe spec (and its BF16 rules) as plain data, computed
    without importing the host. ``model`` is a model description from
    :mod:`nemo_fp8_plugin.rules` or None.

``apply_file(path, *, hardware=None, strict=False) -> ApplyResult``
    Rewrite a config file that says ``precision: <recipe>`` (or has an ``fp8:`` block) into
    the host's native keys. Pure: returns the text; the CLI writes it atomically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType
from typing import Any

from ..errors import FP8ConfigError

__all__ = ["HOSTS", "HostKeys", "ApplyResult", "host_module"]

HOSTS = {
    "nemo2": "nemo2",
    "bridge": "bridge",
    "megatron": "megatron",
    "nemo-rl": "nemo_rl",
    "vllm": "vllm.adapter",
}
"""CLI host name -> adapter module under ``nemo_fp8_plugin.hosts``."""


@dataclass
class HostKeys:
    """A host's native spelling of a recipe.

    Attributes:
        keys: native keys and values, nested as they appear in the host's config.
        warnings: what the host cannot express, each naming the rule and the host.
        env: environment variables the host's training process must have.
    """

    keys: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keys": self.keys}
        if self.env:
            out["env"] = self.env
        if self.warnings:
            out["warnings"] = self.warnings
        return out


@dataclass
class ApplyResult:
    """The rewritten config.

    Attributes:
        data: the output mapping (what gets written).
        warnings: messages to show the user (rules a host cannot express, ...).
        fmt: ``"yaml"`` or ``"json"``.
    """

    data: Any
    warnings: list[str] = field(default_factory=list)
    fmt: str = "yaml"


def host_module(name: str) -> ModuleType:
    """The adapter module of a host, by CLI name."""
    if name not in HOSTS:
        raise FP8ConfigError(f"unknown host {name!r}", key="--host", value=name,
                             hint=f"one of {', '.join(HOSTS)}")
    return import_module(f"{__name__}.{HOSTS[name]}")


def available_hosts() -> list[str]:
    """Hosts whose adapter module exists in this installation."""
    from importlib.util import find_spec

    return [name for name, mod in HOSTS.items() if find_spec(f"{__name__}.{mod}") is not None]
