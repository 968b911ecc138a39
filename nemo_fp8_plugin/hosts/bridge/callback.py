"""Megatron-Bridge's callback: the TE check at start, scale refresh on resume, a per-step hook
(:class:`nemo_fp8_plugin.hosts.refresh.ScaleRefresher` does the work)."""

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

    def __init__(self, recipe=None, **kwargs):
        self.refresher = ScaleRefresher(recipe, **kwargs)

    @property
    def stats(self) -> dict:
        return self.refresher.stats

    @staticmethod
    def _step(context) -> int:
        state = getattr(context, "state", None)
        train_state = getattr(state, "train_state", None)
        return int(getattr(train_state, "step", 0) or 0)

    @staticmethod
    def _module(context):
        model = getattr(context, "model", None)
        return model[0] if isinstance(model, (list, tuple)) and len(model) == 1 else model

    def on_train_start(self, context) -> None:
        self.refresher.verify("this Megatron-Bridge training process")
        if self.refresher.wants_refresh(self._step(context) > 0):
            module = self._module(context)
            if isinstance(module, (list, tuple)):
                if self.refresher.forward_fn is None:
                    raise FP8ConfigError("scale refresh with several model chunks (virtual "
                                         "pipeline stages) needs a forward_fn(chunks, batch)",
                                         key="forward_fn")
                import torch  # noqa: PLC0415

                module = torch.nn.ModuleList(module)  # one module tree over every chunk
            self.refresher.refresh(module)

    def on_train_step_start(self, context) -> None:
        self.refresher.step_started()

    def on_train_step_end(self, context) -> None:
        if getattr(context, "skipped_iter", False):
            return  # no optimizer update happened
        self.refresher.step_ended(context, self._module(context), self._step(context))
