"""NeMo RL adapter: ``precision: fp8_blockwise`` in a NeMo RL YAML -> NeMo RL's own FP8 keys
(docs/hosts/nemo_rl.md has the table of keys and what each recipe means there).

NeMo RL (NVIDIA-NeMo/RL) is configured by YAML with a ``defaults:`` chain; FP8 there is a set
of keys over the training side (``policy.megatron_cfg``), the generation side
(``policy.generation.vllm_cfg``) and the loss (``loss_fn``). The package splits along its
seams: :mod:`.spelling` (the keys, plain data), :mod:`.checks` (what NeMo RL refuses, how an
existing native value compares), :mod:`.alignment` (sequence lengths), :mod:`.releases` (a
key written only for a release that reads it), :mod:`.modelopt` (ModelOpt QAT),
:mod:`.adapter` (the contract). The output is an overlay of the input file (``defaults:``
re-pointed to resolve from the output), holding NeMo RL's keys only; a native FP8 key the
input sets otherwise is refused, naming it. ``fp8_param`` is written false unless the config
states it (NVIDIA-NeMo/RL issue 1164: FP8 parameters can make ``token_mult_prob_error`` NaN).
"""

from __future__ import annotations

from .adapter import ADAPTER, NeMoRLAdapter
from .spelling import (
    BLOCK_MX_REFUSAL,
    DEEP_GEMM_BLACKWELL,
    FP8_PARAM_WARNING,
    NOT_FP8,
    NVFP4_OVERRIDES,
    NVFP4_PARAM_GATHER_WARNING,
    TRAINING_RECIPE,
    deep_gemm_wanted,
    native_keys,
)

__all__ = [
    "native_keys",
    "TRAINING_RECIPE",
    "NOT_FP8",
    "FP8_PARAM_WARNING",
    "BLOCK_MX_REFUSAL",
    "NVFP4_OVERRIDES",
    "NVFP4_PARAM_GATHER_WARNING",
    "DEEP_GEMM_BLACKWELL",
    "deep_gemm_wanted",
    "NeMoRLAdapter",
    "ADAPTER",
]
