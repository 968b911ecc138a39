"""Per-tensor delayed scaling state (TE ``DelayedScaling``).

The state of one tensor role of one layer: an amax history window and the scale derived
from it. The update follows TE's fused kernel ``kernel_bulk`` in
``common/recipe/delayed_scaling.cu`` (not the ``NVTE_UNFUSED_FP8_UPDATE`` Python path,
which differs on edge cases). Everything is done with tensor ops (no host sync), so the
state can live on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import FP8ConfigError
from .formats import check_format, fp8_max
from .quantize import QTensor, quantize_with_scale, tensor_amax
from .scaling import FLT_MAX, reciprocal

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DelayedScalingState"]


class DelayedScalingState:
    """Amax history and scale of one tensor under delayed scaling.

    Usage per step, as TE does it: :meth:`quantize` casts with the current :attr:`scale`
    and max-reduces the tensor's amax into slot 0 of the history (:meth:`record_amax`);
    :meth:`update` then rolls the history and recomputes the scale, so the scale used at
    step t comes from amaxes seen before t.

    Args:
        history_len: window length L (TE ``amax_history_len``; default 1024).
        algo: ``"max"`` (max over the window) or ``"most_recent"`` (TE ``amax_compute_algo``).
        margin: ``scale = (fp8_max * 2^-margin) / amax`` (TE ``margin``).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        device: where the state tensors live (default CPU).
    """

    def __init__(
        self,
        history_len: int = 1024,
        algo: str = "max",
        margin: int = 0,
        fmt: str = "e4m3",
        device: torch.device | str | None = None,
    ):
        if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
            raise FP8ConfigError(
                f"must be a positive integer, got {history_len!r}",
                key="amax_history_len",
                value=history_len,
            )
        if algo not in ("max", "most_recent"):
            raise FP8ConfigError(
                f"expected 'max' or 'most_recent', got {algo!r}",
                key="amax_compute_algo",
                value=algo,
            )
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise FP8ConfigError(
                f"must be a non-negative integer, got {margin!r}", key="margin", value=margin
            )
        self.history_len = history_len
        """Window length L."""
        self.algo = algo
        """``"max"`` or ``"most_recent"``."""
        self.margin = margin
        """Power-of-two headroom below fp8_max."""
        self.fmt = check_format(fmt)
        """Element format of the tensor this state scales."""
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        """``[L]`` fp32; slot 0 collects the current step's amax, slots 1.. are older steps
        (slot L-1 the most recent completed one)."""
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        """0-d fp32 quantization scale (``data = x * scale``); 1 at start."""
        self.scale_inv = torch.ones((), dtype=torch.float32, device=device)
        """0-d fp32 ``1 / scale``."""

    @property
    def scaled_max(self) -> float:
        """``fp8_max * 2^-margin``, the value an amax is mapped to (exact in fp32)."""
        return fp8_max(self.fmt) * 2.0 ** (-self.margin)

    def to(self, device: torch.device | str) -> DelayedScalingState:
        """Move the state tensors (in place) and return self."""
        self.amax_history = self.amax_history.to(device)
        self.scale = self.scale.to(device)
        self.scale_inv = self.scale_inv.to(device)
        return self

    def record_amax(self, amax: torch.Tensor | float) -> None:
        """Max-reduce ``amax`` into slot 0 (NaN-ignoring, like TE's casts and ``fmaxf``)."""
        amax = torch.as_tensor(amax, dtype=torch.float32, device=self.amax_history.device)
        amax = amax.reshape(())
        self.amax_history[0] = torch.fmax(self.amax_history[0], amax)

    def all_reduce_amax(self, group: ProcessGroup | None = None) -> None:
        """MAX all-reduce of slot 0 across ``group`` (TE ``reduce_amax``); a no-op unless
        torch.distributed is initialised with more than one rank."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(self.amax_history[:1], op=dist.ReduceOp.MAX, group=group)

    def update(self, amax: torch.Tensor | float | None = None) -> None:
        """Roll the history and recompute the scale (TE ``kernel_bulk``).

        With ``amax`` given it is recorded first (``record_amax``), so ``update(a)`` is one
        whole step. With ``last = history[0]``: if ``last == 0`` nothing rolls and the scale
        stays; otherwise ``new[i] = old[i+1]`` for ``0 < i < L-1``, ``new[L-1] = last``,
        ``new[0] = 0``, and the amax used is the NaN-ignoring max of the old window
        (``max``) or ``last`` (``most_recent``). ``scale = scaled_max / amax`` when that amax
        is finite and > 0, else the previous scale; an infinite scale becomes FLT_MAX;
        ``scale_inv = 1 / scale``.
        """
        if amax is not None:
            self.record_amax(amax)
        hist = self.amax_history
        last = hist[0]
        rolled = torch.cat([hist[1:], last.reshape(1)])
        rolled_amax = torch.where(torch.isnan(rolled), torch.zeros_like(rolled), rolled).amax()
        skip = last == 0
        if self.algo == "max":
            amax_used = torch.where(skip, torch.zeros_like(rolled_amax), rolled_amax)
        else:
            amax_used = last.clone()
        new_hist = rolled.clone()
        new_hist[0] = 0.0
        self.amax_history.copy_(torch.where(skip, hist, new_hist))
        ok = torch.isfinite(amax_used) & (amax_used > 0)
        amax_d = torch.where(ok, amax_used, torch.ones_like(amax_used)).double()
        candidate = (torch.full_like(amax_d, self.scaled_max) / amax_d).float()
        scale = torch.where(ok, candidate, self.scale)
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
        self.scale.copy_(scale)
        self.scale_inv.copy_(reciprocal(scale))

    def quantize(self, x: torch.Tensor, *, record: bool = True) -> QTensor:
        """Cast ``x`` with the current scale and (by default) record its amax for the next
        update. The QTensor's ``scale_inv`` is a copy of the state's at cast time."""
        q = quantize_with_scale(x, self.scale, self.fmt, scale_inv=self.scale_inv.clone())
        if record:
            self.record_amax(tensor_amax(x))
        return q

    def reset(self) -> None:
        """Back to the initial state (zero history, scale 1)."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)
        self.scale_inv.fill_(1.0)

    def state_dict(self) -> dict:
        """Tensors and settings, for checkpointing."""
        return {
            "amax_history": self.amax_history.clone(),
            "scale": self.scale.clone(),
            "scale_inv": self.scale_inv.clone(),
            "history_len": self.history_len,
            "algo": self.algo,
            "margin": self.margin,
            "fmt": self.fmt,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict` (the history length must match)."""
        if int(state["history_len"]) != self.history_len:
            raise FP8ConfigError(
                f"amax history length {state['history_len']} does not match {self.history_len}",
                key="amax_history_len",
                value=state["history_len"],
            )
        self.amax_history.copy_(state["amax_history"])
        self.scale.copy_(state["scale"])
        self.scale_inv.copy_(state["scale_inv"])

    def __repr__(self) -> str:
        return (
            f"DelayedScalingState(history_len={self.history_len}, algo={self.algo!r}, "
            f"margin={self.margin}, fmt={self.fmt!r}, scale={float(self.scale):.6g})"
        )
