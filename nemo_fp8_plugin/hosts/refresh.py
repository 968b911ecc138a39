"""Scale refresh on resume, a per-step hook, and the start-of-training TE check.

Three entry points share one implementation:

* :func:`refresh_fp8_scales` (plain function): run a few calibration forward passes that
  record amaxes and update delayed-scaling scales without training, then report.
* :class:`FP8ScaleRefreshCallback` (Lightning ``Callback``, NeMo 2): added to
  ``trainer.callbacks`` by the NeMo 2 factories and ``nemo-fp8 apply --host nemo2``.
* :class:`FP8ScaleRefreshBridgeCallback` (Megatron-Bridge): pass it in ``callbacks=[...]``
  to ``pretrain``/``finetune``; Bridge's ``CallbackManager`` registers the ``on_*`` methods
  it overrides.

What they do:

1. **Verify Transformer Engine at start** (``setup`` / ``on_train_start``): when TE is
   importable, the recipe object megatron-core will build is compared with the spec
   (:func:`nemo_fp8_plugin.hosts.te.verify_host_recipe`), and a process whose TE fixed
   power-of-2 block scales while the recipe needs fp32 ones (or the reverse) stops with a
   :class:`~nemo_fp8_plugin.errors.FP8ConfigError` naming the variable. Without TE there is
   nothing to verify (the emulation backend takes the spec as given).
2. **Refresh scales on resume** (delayed scaling only): after a checkpoint restore the amax
   history and scales describe the weights and activations of the run that saved them;
   NVIDIA/TransformerEngine issue 982 reports the loss blowing up right after resuming FP8
   training. Before the first optimizer step of a resumed run, ``calibration_steps``
   forward passes (no gradients) record fresh amaxes and update the scales. Recipes that
   compute scales from the current tensor (current, block, MX scaling) have no stale state
   and are left alone.
3. **Run a hook after every optimizer step** (``after_optimizer_step(trainer_or_context,
   module)``), e.g. to requantize the generation engine's weights in RL.
4. **Account for its own time**: the refresh and hook seconds and their fraction of the
   step time are kept in ``stats`` and logged every ``log_every_n_steps`` steps.

Backends. Models converted with :func:`nemo_fp8_plugin.numerics.convert_to_fp8_emulation`
(CPU, or any machine without TE) are refreshed through the converted modules' calibration
mode. Models with Transformer Engine modules are refreshed inside TE's calibration mode,
``transformer_engine.pytorch.autocast(enabled=False, calibrating=True)`` (``fp8_autocast``
on TE < 2.8), after which TE's delayed-scaling buffers are reduced and the scales updated;
that path needs a GPU and is not exercised by the CPU test suite.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import FP8ConfigError, format_value
from ..registry import get_recipe

if TYPE_CHECKING:
    import torch

    from ..spec import RecipeSpec

logger = logging.getLogger(__name__)

__all__ = ["RefreshReport", "ScaleRefresher", "refresh_fp8_scales"]


# --------------------------------------------------------------------------- backends


def _emulated_modules(model: torch.nn.Module) -> list:
    from ..numerics import emulated_modules

    return [m for _, m in emulated_modules(model)]


def _te_modules(model: torch.nn.Module) -> list:
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except Exception:  # no (working) TE: no TE modules
        return []
    return [m for m in model.modules() if isinstance(m, TransformerEngineBaseModule)]


@contextlib.contextmanager
def _emulation_calibration(model: torch.nn.Module) -> Iterator[None]:
    from ..numerics import fp8_calibration, update_fp8_scales

    with fp8_calibration(model):
        yield
    # Fold the last pass's amaxes into the scales now rather than at the next cast.
    update_fp8_scales(model)


def _scale_snapshot(modules: list[Any]) -> list:
    out = []
    for m in modules:
        for _role, state in sorted(m.fp8_states.items()):
            scale = getattr(state, "scale", None)
            if scale is not None:
                out.append(scale.detach().clone())
    return out


@contextlib.contextmanager
def _te_calibration() -> Iterator[None]:
    import transformer_engine.pytorch as te

    autocast = getattr(te, "autocast", None)
    ctx = (
        autocast(enabled=False, calibrating=True)
        if autocast is not None
        else te.fp8_autocast(enabled=False, calibrating=True)
    )
    with ctx:
        yield
    # TE folds recorded amaxes into scales only when an FP8-enabled region exits with
    # gradients on; fold now. This reaches modules already registered in TE's global amax
    # buffer: in megatron-core models TransformerBlock wraps delayed-scaling layers in its
    # own FP8 region, which registers them during these passes. Plain TE modules that have
    # never run in FP8 fold their calibrated amaxes at the end of their first FP8 forward.
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.8
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)


@dataclass
class RefreshReport:
    """What one refresh did.

    Attributes:
        backend: ``"emulation"``, ``"transformer_engine"`` or ``"none"`` (nothing to refresh).
        modules: number of FP8 modules refreshed.
        passes: calibration forward passes run.
        seconds: wall time of the refresh.
        scales_changed: how many scale tensors differ after the refresh (emulation backend;
            -1 when not measured).
    """

    backend: str
    modules: int = 0
    passes: int = 0
    seconds: float = 0.0
    scales_changed: int = -1


def _default_forward(module: Any, batch: Any) -> Any:
    step = getattr(module, "forward_step", None)  # NeMo 2 LLM modules: forward_step(batch)
    if callable(step):
        return step(batch)
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def refresh_fp8_scales(
    model: torch.nn.Module,
    batches: Iterable,
    forward_fn: Callable | None = None,
    *,
    passes: int | None = None,
) -> RefreshReport:
    """Run calibration forward passes over ``batches`` (at most ``passes`` of them; cycling
    when there are fewer) so delayed-scaling amax histories and scales describe the model as
    it is now. No gradients, no optimizer step, the model's train/eval mode is restored.

    ``forward_fn(model, batch)`` defaults to ``model.forward_step(batch)`` when the model has
    one (NeMo 2), else ``model(**batch)`` / ``model(*batch)`` / ``model(batch)``.
    """
    import torch

    forward_fn = forward_fn or _default_forward
    emulated = _emulated_modules(model)
    te_modules = [] if emulated else _te_modules(model)
    if not emulated and not te_modules:
        return RefreshReport(backend="none")
    batches = list(batches)
    if not batches:
        raise FP8ConfigError(
            "no calibration batches to refresh FP8 scales with", key="calibration_batches"
        )
    n = passes if passes is not None else len(batches)
    start = time.perf_counter()
    before = _scale_snapshot(emulated) if emulated else None
    ctx = _emulation_calibration(model) if emulated else _te_calibration()
    was_training = model.training
    try:
        with torch.no_grad(), ctx:
            for i in range(n):
                forward_fn(model, batches[i % len(batches)])
    finally:
        model.train(was_training)
    changed = -1
    if emulated:
        after = _scale_snapshot(emulated)
        assert before is not None  # taken above for the emulated modules
        changed = sum(int(not torch.equal(a, b)) for a, b in zip(before, after))
    return RefreshReport(
        backend="emulation" if emulated else "transformer_engine",
        modules=len(emulated or te_modules),
        passes=n,
        seconds=time.perf_counter() - start,
        scales_changed=changed,
    )


# --------------------------------------------------------------------------- shared logic


class ScaleRefresher:
    """Host-independent state of the callbacks (see the module docstring).

    Args:
        recipe: the FP8 recipe (name, mapping or spec) the run uses; None skips the TE
            check and treats the model as delayed-scaled if it has delayed state.
        calibration_steps: forward passes per refresh. Default 4.
        calibration_batches: batches for the refresh, or a zero-argument callable returning
            them. Default None: the Lightning callback uses the first training batch.
        forward_fn: ``forward_fn(module, batch)`` for the calibration passes (see
            :func:`refresh_fp8_scales`).
        after_optimizer_step: ``hook(trainer_or_context, module)`` run after every optimizer
            step. Default None.
        refresh_on_resume: refresh before the first optimizer step of a resumed run. Default true.
        verify_te: run the TE check at start. Default true.
        log_every_n_steps: how often to log the overhead. Default 100.
    """

    def __init__(
        self,
        recipe: RecipeSpec | str | Mapping[str, Any] | None = None,
        *,
        calibration_steps: int = 4,
        calibration_batches: Iterable[Any] | None = None,
        forward_fn: Callable | None = None,
        after_optimizer_step: Callable | None = None,
        refresh_on_resume: bool = True,
        verify_te: bool = True,
        log_every_n_steps: int = 100,
    ) -> None:
        if (
            isinstance(calibration_steps, bool)
            or not isinstance(calibration_steps, int)
            or calibration_steps < 1
        ):
            raise FP8ConfigError(
                "must be a positive integer", key="calibration_steps", value=calibration_steps
            )
        if after_optimizer_step is not None and not callable(after_optimizer_step):
            raise FP8ConfigError(
                f"must be callable, got {format_value(after_optimizer_step)}",
                key="after_optimizer_step",
                value=after_optimizer_step,
            )
        self.spec = None if recipe is None else get_recipe(recipe)
        self.calibration_steps = calibration_steps
        self.calibration_batches = calibration_batches
        self.forward_fn = forward_fn
        self.after_optimizer_step = after_optimizer_step
        self.refresh_on_resume = refresh_on_resume
        self.verify_te = verify_te
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        self.refreshed = False
        self.last_report: RefreshReport | None = None
        self.stats = {
            "steps": 0,
            "step_seconds": 0.0,
            "refresh_seconds": 0.0,
            "hook_seconds": 0.0,
            "overhead_fraction": 0.0,
        }
        self._step_started: float | None = None

    # -- checks

    def verify(self, where: str = "the training process") -> bool:
        """The TE check; True when it ran (TE importable), False when there was nothing to check."""
        if not self.verify_te or self.spec is None:
            return False
        try:
            from transformer_engine.common import recipe as te_recipe
        except ImportError:
            return False
        from .te import verify_host_recipe

        verify_host_recipe(self.spec, te_recipe, where=where)
        return True

    def wants_refresh(self, resumed: bool) -> bool:
        if self.refreshed or not resumed or not self.refresh_on_resume:
            return False
        from ..capabilities import capability

        return self.spec is None or capability(self.spec.scaling).history

    # -- work

    def refresh(self, model: torch.nn.Module, fallback_batch: Any = None) -> RefreshReport:
        batches = self.calibration_batches
        if callable(batches):
            batches = batches()
        if batches is None:
            if fallback_batch is None or _is_iterator(fallback_batch):
                raise FP8ConfigError(
                    "cannot refresh FP8 scales after resume: no calibration batches (the "
                    "training step takes a data iterator, which the callback must not consume)",
                    key="calibration_batches",
                    hint="pass calibration_batches=... (a few training batches) to the callback",
                )
            batches = [fallback_batch]
        start = time.perf_counter()
        report = refresh_fp8_scales(model, batches, self.forward_fn, passes=self.calibration_steps)
        self.stats["refresh_seconds"] += time.perf_counter() - start
        self.refreshed = True
        self.last_report = report
        logger.info("nemo-fp8: refreshed FP8 scales after resume: %s", report)
        return report

    def step_started(self) -> None:
        self._step_started = time.perf_counter()

    def step_ended(self, owner: Any, module: torch.nn.Module, step: int) -> None:
        """After an optimizer step: the hook, then the time accounting."""
        hook_s = 0.0
        if self.after_optimizer_step is not None:
            t = time.perf_counter()
            self.after_optimizer_step(owner, module)
            hook_s = time.perf_counter() - t
        now = time.perf_counter()
        if self._step_started is not None:
            self.stats["step_seconds"] += now - self._step_started
        self._step_started = None
        self.stats["steps"] += 1
        self.stats["hook_seconds"] += hook_s
        total = self.stats["step_seconds"]
        ours = self.stats["hook_seconds"] + self.stats["refresh_seconds"]
        self.stats["overhead_fraction"] = ours / total if total > 0 else 0.0
        if step % self.log_every_n_steps == 0:
            logger.info(
                "nemo-fp8: step %d: refresh+hook %.3fs of %.3fs step time (%.2f%%)",
                step,
                ours,
                total,
                100 * self.stats["overhead_fraction"],
            )


def _is_iterator(obj: object) -> bool:
    return hasattr(obj, "__next__") and not hasattr(obj, "shape")
