"""Megatron-Bridge's callback: the run's model config and TE checked at start, scale refresh on
resume, a per-step hook (:class:`nemo_fp8_plugin.hosts.refresh.ScaleRefresher` does the work)."""

from typing import Any

from ...errors import FP8ConfigError
from ..refresh import ScaleRefresher

__all__ = ["FP8ScaleRefreshBridgeCallback"]


class FP8ScaleRefreshBridgeCallback:
    """Megatron-Bridge callback (``megatron.bridge.training.callbacks`` event names).

    ``pretrain(config, forward_step_func, callbacks=[FP8ScaleRefreshBridgeCallback(
    "fp8_blockwise")])``. Bridge's ``CallbackManager.add`` registers the ``on_*`` methods a
    callback defines, so this class needs no Bridge import. Bridge hands callbacks no data
    iterator, so a resumed delayed-scaling run needs ``calibration_batches`` (and usually a
    ``forward_fn(model_chunk, batch)``); without them the refresh is refused with a clear
    error rather than skipped silently. Arguments: those of :class:`ScaleRefresher`.
    """

    def __init__(self, recipe: Any = None, **kwargs: Any) -> None:
        self.refresher = ScaleRefresher(recipe, **kwargs)
        if self.refresher.spec is not None:  # what apply --host bridge refuses, refused here
            from .. import refuse_recipe

            refuse_recipe("bridge", self.refresher.spec)

    @property
    def stats(self) -> dict:
        return self.refresher.stats

    @staticmethod
    def _step(context: Any) -> int:
        state = getattr(context, "state", None)
        train_state = getattr(state, "train_state", None)
        return int(getattr(train_state, "step", 0) or 0)

    @staticmethod
    def _module(context: Any) -> Any:
        model = getattr(context, "model", None)
        return model[0] if isinstance(model, (list, tuple)) and len(model) == 1 else model

    # TransformerConfig fields that decide what trains in FP8; the run's must be the recipe's.
    _CHECKED = ("fp8", "fp8_recipe", "first_last_layers_bf16")
    _COUNTS = ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")

    def check_model_config(self, model_cfg: Any) -> bool:
        """Refuse a run whose model config (``ConfigContainer.model``: a provider, or a
        ``GPTModelConfig`` with its TransformerConfig under ``.transformer``) trains another
        FP8 recipe than the callback's, whose TE check and refresh would then not match it.
        Returns False when there is nothing to compare (no recipe, no config)."""
        spec = self.refresher.spec
        if spec is None or model_cfg is None or spec.training != "fp8":
            return False
        from ..megatron import transformer_config_fields
        from . import transformer_config_of, transformer_config_path

        want = transformer_config_fields(spec).keys
        tc, where = transformer_config_of(model_cfg), transformer_config_path(model_cfg)
        names = self._CHECKED + (self._COUNTS if want.get("first_last_layers_bf16") else ())
        for name in names:
            have = getattr(tc, name, None)
            have = getattr(have, "value", have)  # megatron-core's Fp8Recipe is a str enum
            if name == "first_last_layers_bf16":
                have = bool(have)  # None (unset) means no BF16 layers
            if have != want[name]:
                raise FP8ConfigError(
                    f"the run's model config has {name}={have!r}, but this callback was given "
                    f"recipe {spec.name!r}, which needs {want[name]!r}: the TE check and scale "
                    f"refresh would follow another recipe than the one training runs",
                    key=f"{where}.{name}",
                    value=have,
                    hint="give the callback the recipe the config's mixed_precision names",
                )
        return True

    def on_train_start(self, context: Any) -> None:
        cfg = getattr(getattr(context, "state", None), "cfg", None)
        self.check_model_config(getattr(cfg, "model", None))
        self.refresher.verify("this Megatron-Bridge training process")
        if self.refresher.wants_refresh(self._step(context) > 0):
            module = self._module(context)
            if isinstance(module, (list, tuple)):
                if self.refresher.forward_fn is None:
                    raise FP8ConfigError(
                        "scale refresh with several model chunks (virtual "
                        "pipeline stages) needs a forward_fn(chunks, batch)",
                        key="forward_fn",
                    )
                import torch

                module = torch.nn.ModuleList(module)  # one module tree over every chunk
            self.refresher.refresh(module)

    def on_train_step_start(self, context: Any) -> None:
        self.refresher.step_started()

    def on_train_step_end(self, context: Any) -> None:
        if getattr(context, "skipped_iter", False):
            return  # no optimizer update happened
        self.refresher.step_ended(context, self._module(context), self._step(context))
