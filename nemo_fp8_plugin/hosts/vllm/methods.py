"""Layer methods of the ``nemo_fp8`` quantization: linear, fused MoE, attention (KV scales).

This module is their face: the methods live in ``linear.py``, ``moe.py`` and ``kv.py``, the
shared quantizer and loader in ``quantizer.py``, and the vetting of the GPU kernel vLLM
picks in ``kernels.py``.

Design rules, all for RL refit (weights replaced every step):

* **Parameters are created once and never replaced.** ``weight`` (float8_e4m3fn, ``[N, K]``)
  and ``weight_scale_inv`` (fp32, one per weight tile) keep their identity and their
  ``weight_loader`` for the life of the engine, so ``model.load_weights(...)`` after any
  number of steps writes into the same storage (vllm-project/vllm issue 28425 is what happens when a
  method swaps its parameters after loading). Run-time layouts a kernel wants are built
  beside them, never in their place.
* **Two payloads.** A float8 tensor is copied as is (with its ``<name>_scale_inv``, the
  trainer-side quantizer's output, half the bytes of BF16). A BF16/FP16/FP32 tensor is
  quantized on arrival with the same numerics, and its scales are loaded through the scale
  parameter's own loader with the same shard id, so fused and tensor-parallel layouts
  follow vLLM's rules.
* **Two backends.** ``vllm``: vLLM's own block-FP8 GEMM kernels (CUDA). ``emulate``: the
  numerics emulation of :mod:`nemo_fp8_plugin.numerics` (activations per 1x128 group,
  weights per 128x128 tile, products in fp32), which runs anywhere vLLM runs, CPU included.

After a refit call :func:`finish_refit` (the worker extension does) so that backends that
keep a run-time copy of the weights, and the attention layers' KV scales, catch up.
"""

from __future__ import annotations

import torch

from .kv import NemoFp8KVCacheMethod
from .linear import NemoBF16LinearMethod, NemoFp8LinearMethod
from .moe import NemoFp8MoEMethod
from .quantizer import FP8_DTYPES, _Quantizer

__all__ = [
    "NemoFp8LinearMethod",
    "NemoBF16LinearMethod",
    "NemoFp8MoEMethod",
    "NemoFp8KVCacheMethod",
    "finish_refit",
    "FP8_DTYPES",
    "_Quantizer",
]


def finish_refit(model: torch.nn.Module) -> int:
    """Run every ``nemo_fp8`` method's post-refit step; returns the number of layers touched.

    Call after ``model.load_weights(...)`` (the worker extension does). Layers without a
    ``nemo_fp8`` method are left alone.
    """
    touched = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (NemoFp8LinearMethod, NemoFp8MoEMethod, NemoFp8KVCacheMethod)):
            method.after_refit(module)
            touched += 1
    return touched
