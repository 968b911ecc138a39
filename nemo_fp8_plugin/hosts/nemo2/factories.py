"""NeMo-Run CLI factories: every FP8 recipe on the ``nemo`` command line.

NeMo-Run loads every entry point of group ``nemo_run.cli`` when the ``nemo`` command
starts; this package declares ``fp8 = nemo_fp8_plugin.hosts.nemo2.factories``, so once it is
installed, and without any import by the user:

* every registered recipe is a ``MegatronMixedPrecision`` factory, by import path::

      nemo llm finetune --factory llama3_8b \\
          trainer.plugins=nemo_fp8_plugin.hosts.nemo2.factories.fp8_blockwise

  (NeMo-Run resolves short names in a ``Union``-typed field such as ``trainer.plugins`` only
  by import path; the factories are also registered under the plugin type, so
  ``run.cli.resolve_factory(MegatronMixedPrecision, "fp8_blockwise")`` finds them.)
  The plugin is NeMo's own ``MegatronMixedPrecision``, built in the training process without
  code of this package, and the factory itself runs in the launcher: neither can check the
  Transformer Engine variable of the training process, and the factory logs a warning saying
  so (:func:`nemo_fp8_plugin.hosts.nemo2.plugin_only_warning`). ``<recipe>_callback`` is the
  matching start-of-training check and scale refresh::

      trainer.callbacks=[nemo_fp8_plugin.hosts.nemo2.factories.fp8_blockwise_callback]

* every stock ``llm.pretrain`` / ``llm.finetune`` recipe gets one FP8 variant per recipe,
  named ``<stock recipe>_<fp8 recipe>``::

      nemo llm finetune --factory llama3_8b_fp8_blockwise
      nemo llm pretrain --factory "llama31_8b_mxfp8(num_nodes=4)"

  A variant calls the stock recipe with the same arguments, puts the FP8 arguments on the
  recipe's own precision plugin (keeping its dtypes and ``grad_reduce_in_fp32``) and adds
  :class:`nemo_fp8_plugin.hosts.nemo2.callback.FP8ScaleRefreshCallback` to ``trainer.callbacks``. A
  name a stock factory already uses is never shadowed.

Importing this module imports NeMo-Run and ``nemo.collections.llm`` (NeMo's own ``llm``
entry point imports the latter anyway). When NeMo is not installed it registers nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ...registry import list_recipes

logger = logging.getLogger(__name__)

__all__ = [
    "plugin_factory",
    "callback_factory",
    "variant_factory",
    "register_all",
    "REGISTERED_VARIANTS",
]

REGISTERED_VARIANTS: dict[str, list[str]] = {}
"""Entry point (``"finetune"``, ``"pretrain"``) -> names of the FP8 variants registered."""

_HOSTS: tuple[str, ...] = ("finetune", "pretrain")


def plugin_factory(name: str) -> Callable[[], Any]:
    """A zero-argument factory returning ``run.Config[MegatronMixedPrecision]`` for recipe ``name``."""

    def factory() -> Any:
        from ...registry import get_recipe
        from . import plugin_config, plugin_only_warning

        spec = get_recipe(name)
        warning = plugin_only_warning(spec)
        if warning:
            logger.warning("%s", warning)
        return plugin_config(spec)

    factory.__name__ = factory.__qualname__ = name
    factory.__module__ = __name__
    factory.__doc__ = f"MegatronMixedPrecision for the FP8 recipe {name!r} on NeMo's bf16_mixed."
    return factory


def callback_factory(name: str) -> Callable[[], Any]:
    """A zero-argument factory returning ``run.Config[FP8ScaleRefreshCallback]`` for ``name``,
    for ``trainer.callbacks=[nemo_fp8_plugin.hosts.nemo2.factories.<name>_callback]``."""

    def factory() -> Any:
        from ...registry import get_recipe
        from . import callback_config

        return callback_config(get_recipe(name))

    factory.__name__ = factory.__qualname__ = f"{name}_callback"
    factory.__module__ = __name__
    factory.__doc__ = f"FP8ScaleRefreshCallback for the FP8 recipe {name!r}."
    return factory


def variant_factory(stock: Callable[..., Any], stock_name: str, recipe: str) -> Callable[..., Any]:
    """The FP8 variant of stock recipe factory ``stock``: same arguments, FP8 on top."""
    wrapped = getattr(stock, "wrapped", stock)

    @functools.wraps(wrapped)
    def variant(*args: Any, **kwargs: Any) -> Any:
        from ...registry import get_recipe
        from ..te import required_env
        from . import add_fp8_to_recipe

        spec = get_recipe(recipe)
        out = add_fp8_to_recipe(stock(*args, **kwargs), spec)
        for var, value in required_env(spec).items():
            if os.environ.get(var) != value:
                logger.warning(
                    "%s needs %s=%s in the training process's environment (executor "
                    "env_vars, or the shell for --direct runs); "
                    "FP8ScaleRefreshCallback stops the run at start without it",
                    recipe,
                    var,
                    value,
                )
        return out

    variant.__name__ = variant.__qualname__ = f"{stock_name}_{recipe}"
    variant.__module__ = __name__
    variant.__doc__ = (
        f"{stock_name} with the FP8 recipe {recipe!r} (nemo-fp8-plugin).\n\n{wrapped.__doc__ or ''}"
    )
    return variant


def register_all() -> None:
    """Register the plugin factories and the stock-recipe variants with NeMo-Run."""
    try:
        import nemo_run as run
        from nemo.collections import llm
        from nemo.lightning.pytorch.plugins.mixed_precision import MegatronMixedPrecision
    except ImportError as exc:  # NeMo-Run without NeMo: nothing to extend
        logger.debug("nemo_fp8_plugin: NeMo not importable (%s); no factories registered", exc)
        return
    import catalogue  # NeMo-Run's own registry
    from nemo_run.config import get_type_namespace

    module = sys.modules[__name__]
    names = [spec.name for spec in list_recipes()]
    plugin_ns = get_type_namespace(MegatronMixedPrecision)
    for name in names:
        factory = plugin_factory(name)
        factory.__annotations__ = {"return": run.Config[MegatronMixedPrecision]}
        if not catalogue.check_exists(plugin_ns, name):
            factory = run.cli.factory(factory)
        if not hasattr(module, name):  # never shadow this module's own names
            setattr(module, name, factory)
        if not hasattr(module, f"{name}_callback"):
            setattr(module, f"{name}_callback", callback_factory(name))
    for host in _HOSTS:
        target = getattr(llm, host)
        namespace = get_type_namespace(target)
        stock = {
            key[-1]: fn
            for key, fn in catalogue._get_all([namespace]).items()
            if len(key) == 2 and not getattr(fn, "_nemo_fp8_variant", False)
        }
        done = REGISTERED_VARIANTS.setdefault(host, [])
        for stock_name, fn in sorted(stock.items()):
            for name in names:
                variant_name = f"{stock_name}_{name}"
                if variant_name in stock or catalogue.check_exists(namespace, variant_name):
                    continue
                variant = variant_factory(fn, stock_name, name)
                variant._nemo_fp8_variant = True  # type: ignore[attr-defined]  # a marker
                run.cli.factory(variant, target=target, name=variant_name)
                done.append(variant_name)


register_all()
