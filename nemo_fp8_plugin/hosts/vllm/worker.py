"""The refit entry point inside vLLM workers: ``LLM(worker_extension_cls=WORKER_EXTENSION)``.

vLLM mixes this class into its worker class, so each method below can be called on every
worker with ``llm.collective_rpc("nemo_fp8_load_weights", args=(payload,))``. The payload is
a list of ``(name, tensor)`` pairs in Hugging Face naming, as
:func:`nemo_fp8_plugin.rl.quantize_for_refit` yields them (FP8 weights plus ``_scale_inv``),
or plain BF16 weights (quantized on arrival), plus KV scales from
:func:`nemo_fp8_plugin.rl.refresh_scales`. Transports that move tensors their own way
(NCCL broadcast, CUDA IPC handles) call :func:`load_refit_payload` on the model once the
tensors are on the worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = ["NemoFp8WorkerExtension", "WORKER_EXTENSION", "load_refit_payload"]


class _LoadsWeights(Protocol):
    """A vLLM model's ``load_weights`` (torch types a module's attributes as
    ``Tensor | Module``, so the method is named here)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None: ...


WORKER_EXTENSION = "nemo_fp8_plugin.hosts.vllm.worker.NemoFp8WorkerExtension"
"""Dotted path for ``vllm.LLM(worker_extension_cls=...)``."""


def load_refit_payload(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, Any]:
    """Load ``(name, tensor)`` pairs into a vLLM model in place and finish the refit.

    Returns ``{"loaded": number of vLLM parameters written, "seconds": wall time}``, and
    under ``NEMO_FP8_VERIFY_REFIT`` the number of weights checked and the check's time
    (``verified``, ``verify_seconds``; see :mod:`.refit_check`).
    """
    from .methods import finish_refit
    from .refit_check import refit_check_from_env

    start = time.perf_counter()
    check = refit_check_from_env()  # NEMO_FP8_VERIFY_REFIT: sampled layers checked after
    if check is not None:
        named_tensors = check.watch(model, named_tensors)
    loaded = cast(_LoadsWeights, model).load_weights(weights=iter(named_tensors))
    finish_refit(model)
    result: dict[str, Any] = {
        "loaded": len(loaded) if loaded is not None else None,
        "seconds": time.perf_counter() - start,
    }
    if check is not None:  # raises RefitMismatch when a checked weight differs
        result["verified"] = len(check.verify(model))
        result["verify_seconds"] = check.seconds
    return result


class NemoFp8WorkerExtension:
    """Methods vLLM adds to its workers (callable through ``collective_rpc``)."""

    model_runner: GPUModelRunner  # the worker's own (this class is mixed into it)

    def _nemo_fp8_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def nemo_fp8_load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """Refit: load the payload into the running model (see :func:`load_refit_payload`)."""
        return load_refit_payload(self._nemo_fp8_model(), named_tensors)

    def nemo_fp8_describe(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every parameter, to check what the engine holds."""
        return {
            name: (str(p.dtype).replace("torch.", ""), tuple(p.shape))
            for name, p in self._nemo_fp8_model().named_parameters()
        }

    def nemo_fp8_get_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """CPU copies of the named parameters (or KV-scale parameters) of the model."""
        params = dict(self._nemo_fp8_model().named_parameters())
        return {n: params[n].detach().to("cpu").clone() for n in names}

    def nemo_fp8_methods(self) -> dict[str, str]:
        """Module name -> class name of its quantization method (for every module that has one)."""
        out = {}
        for name, module in self._nemo_fp8_model().named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                out[name] = type(method).__name__
        return out
