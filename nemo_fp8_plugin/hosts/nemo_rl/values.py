"""Values of a NeMo RL config as NeMo RL reads them: ``${...}`` interpolations resolved.

NeMo RL loads its YAML with OmegaConf and registers four resolvers (``add``, ``mul``, ``div``,
``max``; ``nemo_rl/utils/config.py::register_omegaconf_resolvers``), so a value such as
``make_sequence_length_divisible_by: ${mul:8, ${policy.megatron_cfg.tensor_model_parallel_size}}``
means a number only after resolution. Checks that compare numbers read them through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import FP8ConfigError

__all__ = ["NEMO_RL_RESOLVERS", "interpolated", "resolved_value"]

NEMO_RL_RESOLVERS = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}
"""The resolvers NeMo RL registers, by name (registered here only when missing, as NeMo RL
itself does, so a process that imported NeMo RL keeps NeMo RL's)."""

_MISSING = object()


def interpolated(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every interpolation resolved as NeMo RL would (OmegaConf)."""
    from omegaconf import OmegaConf  # only configs with ${...} need it
    from omegaconf.errors import OmegaConfBaseException

    register = _register_resolver(OmegaConf)
    for name, fn in NEMO_RL_RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            register(name, fn)
    try:
        out = OmegaConf.to_container(OmegaConf.create(dict(config)), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or None
        raise FP8ConfigError(
            f"cannot resolve an interpolation: {exc.msg if hasattr(exc, 'msg') else exc}", key=key
        ) from None
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def _register_resolver(omegaconf_class: Any):
    """OmegaConf's registration of a resolver that takes typed arguments: ``register_resolver``
    from 2.4 on, where ``register_new_resolver`` warns that it is deprecated (five lines on
    every NeMo RL config with ``${...}``); ``register_new_resolver`` before, where
    ``register_resolver`` is the legacy string-only one."""
    import omegaconf

    major_minor = tuple(int(p) for p in omegaconf.__version__.split(".")[:2] if p.isdigit())
    if major_minor >= (2, 4):
        return omegaconf_class.register_resolver
    return omegaconf_class.register_new_resolver


def resolved_value(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """One value of ``config`` as NeMo RL reads it: resolved when it is an interpolation."""
    from ...config import get_path

    value = get_path(config, dotted, _MISSING)
    if value is _MISSING:
        return default
    if isinstance(value, str) and "${" in value:
        return get_path(interpolated(config), dotted, default)
    return value
