"""NeMo RL adapter: ``precision: fp8_blockwise`` in a NeMo RL YAML -> NeMo RL's own FP8 keys.

NeMo RL (NVIDIA-NeMo/RL) is configured by YAML with a ``defaults:`` chain. FP8 there is a
set of keys spread over the training side (Megatron + Transformer Engine), the generation
side (vLLM) and the loss. This module writes all of them from one recipe spec:

========================================================  =====================================
NeMo RL key                                               from the spec
========================================================  =====================================
``policy.megatron_cfg.fp8_cfg.{enabled,fp8,fp8_recipe,     ``training``, ``fp8_format``,
fp8_param}``                                               ``scaling``; ``fp8_param`` only when
                                                           stated (see below), else false
``policy.megatron_cfg.env_vars.                            block scaling: ``'1'`` for fp32
NVTE_FP8_BLOCK_SCALING_FP32_SCALES``                       scales, ``'0'`` for ``pow2_scales``
``policy.megatron_cfg.optimizer.                           ``false`` whenever training is FP8
use_precision_aware_optimizer``                            (as NVIDIA's FP8 recipes set it)
``policy.megatron_cfg.moe_router_dtype``                   ``fp32`` for MoE models (FP8 training)
``policy.generation.vllm_cfg.{precision,use_deep_gemm,     ``generation``, ``scaling``,
is_mx,pow2_weight_scaling_factors,                         ``pow2_scales``, ``kv_cache``
pow2_activation_scaling_factors,kv_cache_dtype}``
``policy.generation.vllm_cfg.{num_first_layers_in_bf16,    ``bf16_layers`` (through
num_last_layers_in_bf16,quantization_ignored_layer_kws}``  :func:`nemo_fp8_plugin.rules.to_nemo_rl`)
``policy.megatron_cfg.model_overrides.                     ``bf16_layers.first`` / ``last`` on
{first_last_layers_bf16,num_layers_at_start_in_bf16,       the training side (NeMo RL merges
num_layers_at_end_in_bf16}``                               model_overrides into the provider)
``loss_fn.{use_importance_sampling_correction,             ``importance_sampling``
sequence_level_importance_ratios,
truncated_importance_sampling_type,
truncated_importance_sampling_ratio,
truncated_importance_sampling_ratio_min}``
``grpo.seq_logprob_error_threshold``                       ``importance_sampling.
                                                           max_sequence_error`` (GRPO configs)
``policy.router_replay.enabled``                           ``router_replay`` (v0.7.0 on)
``policy.generation.vllm_cfg.env_vars.VLLM_*``             the kernel variable the rollouts'
                                                           scale grid needs (v0.7.0 on;
                                                           :mod:`.preflight`)
``policy.precision``                                       back to ``bfloat16`` when it named
                                                           a recipe
========================================================  =====================================

What each recipe means here (NeMo RL's vLLM path has block FP8 and MXFP8 only):

* ``fp8_blockwise``: block FP8 (E4M3, fp32 scales) for training and generation.
* ``fp8_subchannel``: block FP8 on both sides with power-of-2 scales (HYBRID training,
  vLLM ``pow2_*_scaling_factors``).
* ``mxfp8``: ``fp8_recipe: mxfp8`` and vLLM ``is_mx: true`` with power-of-2 scales (NeMo RL
  refuses anything else for MXFP8); ``fp8: {recipe: mxfp8, training: bf16}`` is NVIDIA's
  MXFP8 rollouts (BF16 training, MXFP8 generation on Blackwell, modules kept out of FP8 by
  ``quantization_ignored_layer_kws`` from the BF16 rules). Block FP8 training with MXFP8
  generation (a native ``is_mx: true`` next to ``fp8_blockwise``, or a native blockwise
  ``fp8_cfg`` next to MXFP8 generation) is refused: the trainer's 128x128 block scales
  cannot become 1x32 E8M0 scales without requantizing from high precision.
* ``nvfp4``: training only. ``fp8_cfg`` carries FP8 alone (NeMo RL copies ``fp8``,
  ``fp8_recipe`` and ``fp8_param`` from it onto the provider), so ``fp4: e2m1``,
  ``fp4_recipe: nvfp4`` and ``fp4_param`` go to ``policy.megatron_cfg.model_overrides``,
  which NeMo RL merges into the Megatron-Bridge provider (a megatron-core
  ``TransformerConfig``) before it builds the model, with ``fp8_cfg`` left disabled and the
  ``NVTE_NVFP4_*`` variables in ``env_vars``. Generation stays BF16
  (:data:`nemo_fp8_plugin.capabilities.NVFP4_GENERATION_REFUSAL`). NeMo RL's sequence packer
  pads for its ``fp8_cfg`` recipes only, so nvfp4 with ``sequence_packing`` is refused.
* ``nvfp4`` with ``qat: PRESET``: NVIDIA's ModelOpt quantization-aware RL instead (BF16 policy
  through ModelOpt fake quantizers, NVFP4 rollouts fake- or real-quantized): ``policy.quant_cfg``,
  ``policy.quant_calib_*``, ``policy.generation.{quant_cfg,real_quant,real_quant_ignore}``, no
  Transformer Engine key (:mod:`.modelopt`; NeMo RL v0.7.0 on, per ``stacks.py``).
* ``fp8_current``: tensorwise FP8 training with BF16 generation, and a warning that the two
  sides then differ (the importance-sampling correction stays on to absorb it).
* ``fp8_delayed``: refused; delayed scales come from an amax history that goes stale when
  the weights change every step.

``training: bf16`` gives generation-only FP8 (NVIDIA's "FP8 rollouts"); ``generation: bf16``
gives training-only FP8.

``fp8_param`` is written false even for the presets that set it (``mxfp8``, ``fp8_current``,
chosen for NeMo 2 pretraining): NeMo RL warns that FP8 parameters can make
``token_mult_prob_error`` NaN (NVIDIA-NeMo/RL issue 1164, reported with block scaling and
tensor parallelism, pointing at the weight refit into vLLM), and every FP8 config NVIDIA ships
for NeMo RL sets ``fp8_param: false``. A warning says so. The user gets
``true`` by stating it: ``fp8_param: true`` in the ``fp8:`` block, or an enabled
``policy.megatron_cfg.fp8_cfg`` with ``fp8_param: true`` in the config.

The output holds NeMo RL's keys only (the plugin's ``precision`` / ``fp8`` keys are consumed).
The package splits along its seams: :mod:`.spelling` (the keys, plain data),
:mod:`.checks` (what NeMo RL refuses, how an existing native value compares),
:mod:`.alignment` (sequence lengths), :mod:`.adapter` (the contract: refuse, spell, merge).

By default it is an *overlay*: the input file's own keys plus the FP8 keys, with
``defaults:`` rewritten so the parent chain resolves from where the output is written. A
native FP8 key the input already sets to a different, non-BF16 value is refused, naming
the key: the recipe is stated once, in one place.
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
