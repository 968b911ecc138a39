"""The only callables of this package a config's ``_target_`` may name.

A YAML ``_target_`` is a dotted path the host imports and calls. Megatron-Bridge refuses one
outside its allow-list; :func:`nemo_fp8_plugin.hosts.bridge.register` adds exactly the
callables below (Bridge's exact allow-list, ``target_allowlist.add_exact``), or, on a Bridge
without one, this module as a prefix, never the package: the package's modules import
``os``, ``shutil`` and ``subprocess``, so ``nemo_fp8_plugin.<module>.os.system`` would pass a
package-wide prefix. Every ``_target_`` the plugin writes names one of these.

This module imports nothing at module level (not even ``__future__``: NeMo-Run parses a
callable's parameters from its annotations as objects, and cannot parse ``"list[str]"``), so ``nemo_fp8_plugin.hosts.targets.<anything else>`` resolves to
nothing; each callable imports what it needs when called. Its name has no leading
underscore because Bridge refuses private path segments in a ``_target_``.
"""

__all__ = ["bf16_quant_recipe", "mixed_precision_config"]


def bf16_quant_recipe(patterns: list[str]) -> object:
    """megatron-core's ``RecipeConfig`` keeping the modules matching ``patterns`` in BF16
    (:func:`nemo_fp8_plugin.hosts.megatron.bf16_quant_recipe`): the ``quant_recipe``
    ``_target_`` of NeMo-Run and Bridge YAML."""
    from .megatron import bf16_quant_recipe as build

    return build(patterns)


def mixed_precision_config(spec: object, model: object = None) -> object:
    """Megatron-Bridge's ``MixedPrecisionConfig`` for a recipe name or ``fp8:``-style mapping
    (:func:`nemo_fp8_plugin.hosts.bridge.mixed_precision_config`), for a ``mixed_precision``
    block written as ``{_target_: nemo_fp8_plugin.hosts.targets.mixed_precision_config,
    spec: fp8_blockwise}``."""
    from typing import Any, cast

    from .bridge import mixed_precision_config as build

    return build(cast(Any, spec), model)
