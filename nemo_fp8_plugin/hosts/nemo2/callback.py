"""NeMo 2's Lightning callback: the TE check at ``setup``, scale refresh on resume, a per-step
hook (:class:`nemo_fp8_plugin.hosts.refresh.ScaleRefresher` does the work)."""

from typing import Any

from ..refresh import ScaleRefresher

__all__ = ["FP8ScaleRefreshCallback"]

try:  # the Lightning base class when Lightning is installed (NeMo 2 always has it)
    from lightning.pytorch.callbacks import Callback as _LightningCallback
except ImportError:  # pragma: no cover - Bridge-only or torch-only installs
    _LightningCallback = object  # type: ignore[misc,assignment]  # a plain base without Lightning


class FP8ScaleRefreshCallback(_LightningCallback):
    """Lightning callback for NeMo 2: TE check at ``setup``, scale refresh before the first
    optimizer step of a resumed run, ``after_optimizer_step`` hook, overhead accounting.

    Arguments: those of :class:`ScaleRefresher` (spelled out so NeMo-Run's CLI and YAML can
    set them). A run counts as resumed when the trainer's ``global_step`` is above 0 when
    training starts (a checkpoint was restored). The refresh runs in ``on_train_batch_start``
    of the first batch, on ``calibration_batches`` or, when none are given, on that batch
    (``calibration_steps`` passes).
    """

    def __init__(
        self,
        recipe: Any = None,
        calibration_steps: int = 4,
        calibration_batches: Any = None,
        forward_fn: Any = None,
        after_optimizer_step: Any = None,
        refresh_on_resume: bool = True,
        verify_te: bool = True,
        log_every_n_steps: int = 100,
    ) -> None:
        super().__init__()
        self.refresher = ScaleRefresher(
            recipe,
            calibration_steps=calibration_steps,
            calibration_batches=calibration_batches,
            forward_fn=forward_fn,
            after_optimizer_step=after_optimizer_step,
            refresh_on_resume=refresh_on_resume,
            verify_te=verify_te,
            log_every_n_steps=log_every_n_steps,
        )
        if self.refresher.spec is not None:  # what apply --host nemo2 refuses, refused here
            from .. import refuse_recipe

            refuse_recipe("nemo2", self.refresher.spec)
        self._resumed = False
        self._last_step: int | None = None

    @property
    def stats(self) -> dict:
        """Seconds and overhead fraction (see :class:`ScaleRefresher`)."""
        return self.refresher.stats

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.refresher.verify("this NeMo 2 training process")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._resumed = int(getattr(trainer, "global_step", 0) or 0) > 0
        self._last_step = int(getattr(trainer, "global_step", 0) or 0)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.refresher.wants_refresh(self._resumed):
            self.refresher.refresh(pl_module, fallback_batch=batch)
        self.refresher.step_started()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(getattr(trainer, "global_step", 0) or 0)
        if self._last_step is not None and step == self._last_step:
            return  # gradient accumulation: no optimizer step happened
        self._last_step = step
        self.refresher.step_ended(trainer, pl_module, step)
        log = getattr(pl_module, "log", None)
        if callable(log) and getattr(trainer, "logger", None) is not None:
            log("fp8_refresh_overhead_fraction", self.refresher.stats["overhead_fraction"])
