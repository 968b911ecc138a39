"""The hosts there are: ``--host`` name -> the adapter object of its own module."""

from __future__ import annotations

from importlib import import_module

from ..errors import FP8ConfigError
from .contract import HostAdapter

__all__ = ["ADAPTERS", "HOSTS", "get_adapter", "adapters", "available_hosts"]

ADAPTERS = {
    "nemo2": "nemo_fp8_plugin.hosts.nemo2:ADAPTER",
    "bridge": "nemo_fp8_plugin.hosts.bridge:ADAPTER",
    "megatron": "nemo_fp8_plugin.hosts.megatron:ADAPTER",
    "nemo-rl": "nemo_fp8_plugin.hosts.nemo_rl:ADAPTER",
    "vllm": "nemo_fp8_plugin.hosts.vllm:ADAPTER",
    "te": "nemo_fp8_plugin.hosts.te:ADAPTER",
}
"""CLI host name -> ``module:attribute`` of its adapter object, by one rule: ``ADAPTER`` of
the host's own module ``nemo_fp8_plugin.hosts.<host>``. The order is the order ``explain``
shows hosts in."""

HOSTS = tuple(ADAPTERS)
"""Every host name ``--host`` accepts (``nemo_rl`` is accepted for ``nemo-rl``)."""


def get_adapter(name: str) -> HostAdapter:
    """The adapter of a host, by ``--host`` name (``nemo_rl`` accepted for ``nemo-rl``)."""
    name = name.replace("_", "-") if name.replace("_", "-") in ADAPTERS else name
    if name not in ADAPTERS:
        raise FP8ConfigError(
            f"unknown host {name!r}", key="--host", value=name, hint=f"one of {', '.join(ADAPTERS)}"
        )
    module, attr = ADAPTERS[name].split(":")
    adapter: HostAdapter = getattr(import_module(module), attr)
    return adapter


def adapters() -> list[HostAdapter]:
    """Every host's adapter, in :data:`ADAPTERS` order."""
    return [get_adapter(name) for name in ADAPTERS]


def available_hosts() -> list[str]:
    """Hosts whose adapter module exists in this installation."""
    from importlib.util import find_spec

    return [
        name for name, target in ADAPTERS.items() if find_spec(target.split(":")[0]) is not None
    ]
