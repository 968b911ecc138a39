"""nemo-fp8-plugin: FP8 for NeMo, Megatron and NeMo RL training by editing YAML.

``import nemo_fp8_plugin`` imports no host framework and not even torch: the recipe
registry and config loader are pure Python, and the torch-based parts
(:mod:`nemo_fp8_plugin.numerics`, :mod:`nemo_fp8_plugin.rl`, ...) load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import FP8ConfigError, HostUnavailableError, RecipeRegistryError
from .registry import ENTRY_POINT_GROUP, get_recipe, list_recipes, register_recipe
from .spec import BF16Rules, ImportanceSampling, RecipeSpec

__all__ = [
    "__version__",
    "FP8ConfigError",
    "HostUnavailableError",
    "RecipeRegistryError",
    "ENTRY_POINT_GROUP",
    "get_recipe",
    "list_recipes",
    "register_recipe",
    "BF16Rules",
    "ImportanceSampling",
    "RecipeSpec",
]

# Subpackages that import torch (or a host) load lazily, on attribute access.
_LAZY_SUBMODULES = {
    "numerics",
    "rl",
    "rules",
    "hosts",
    "analyze",
    "config",
    "capabilities",
    "tools",
}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from . import analyze, capabilities, config, hosts, numerics, rl, rules, tools  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        module = import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
