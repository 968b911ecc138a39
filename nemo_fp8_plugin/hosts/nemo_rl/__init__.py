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
By default it is an *overlay*: the input file's own keys plus the FP8 keys, with
``defaults:`` rewritten so the parent chain resolves from where the output is written. A
native FP8 key the input already sets to a different, non-BF16 value is refused, naming
the key: the recipe is stated once, in one place.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...capabilities import (
    CAPABILITIES,
    ENV_BLOCK_FP32_SCALES,
    ENV_CURRENT_POW2_SCALES,
    NVFP4_GENERATION_REFUSAL,
    arch_by_name,
    te_env,
    token_alignment,
)
from ...config import get_path
from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from ...spec import RecipeSpec
from .. import ApplyResult, HostKeys, apply_path

__all__ = ["native_keys", "apply_file", "apply_nemo_rl", "TRAINING_RECIPE"]

TRAINING_RECIPE = {
    kind: CAPABILITIES[kind].megatron_recipe for kind in ("block", "mx", "tensorwise")
}
"""Spec ``scaling`` -> NeMo RL ``policy.megatron_cfg.fp8_cfg.fp8_recipe`` (megatron-core names)."""

FP32_SCALES_ENV = ENV_BLOCK_FP32_SCALES
POW2_CURRENT_ENV = ENV_CURRENT_POW2_SCALES

_MEGATRON = "policy.megatron_cfg"
_VLLM = "policy.generation.vllm_cfg"

_MISSING = object()


class _NotFP8:
    """Desired-value marker: the key must not turn FP8 on (we write nothing)."""

    def __repr__(self) -> str:  # shows in error messages
        return "a non-FP8 value"


NOT_FP8 = _NotFP8()


# --------------------------------------------------------------------------- native keys


def _refusal(spec: RecipeSpec) -> str | None:
    if spec.scaling == "delayed":
        return (
            "NeMo RL cannot use delayed scaling: its scales come from an amax history of past "
            "steps, which goes stale when RL changes the weights every step"
        )
    return None


def _generation_fp8(spec: RecipeSpec) -> bool:
    # NeMo RL's vLLM path quantizes weights per 128x128 block or per 32 (MX); there is no
    # per-tensor FP8 generation path, so tensorwise recipes generate in BF16.
    return spec.generation == "fp8" and spec.scaling in ("block", "mx")


def _unexpressible(spec: RecipeSpec) -> list[str]:
    """Spec settings NeMo RL has no key for (it then uses TE's / vLLM's defaults)."""
    out = []
    training = spec.training == "fp8"
    if spec.scaling == "block":
        if (
            spec.activation_block != (1, 128)
            or spec.weight_block != (128, 128)
            or spec.gradient_block != (1, 128)
        ):
            out.append(
                "NeMo RL: block tiles other than 1x128 activations/gradients and 128x128 "
                "weights cannot be expressed (Transformer Engine's Float8BlockScaling "
                "defaults and vLLM's weight_block_size [128, 128] are used)"
            )
    if spec.scaling == "mx" and spec.weight_block != (1, 32) and training:
        out.append(
            "NeMo RL: MXFP8 weight tiles of 32x32 cannot be expressed in fp8_cfg (1x32 is used)"
        )
    if _generation_fp8(spec) and spec.generation_numerics == "trainer":
        out.append(
            "NeMo RL: generation_numerics=trainer cannot be expressed: NeMo RL generates "
            "with vLLM's own FP8 kernels, which quantize activations as vLLM does "
            "(generation_numerics: vllm); the trainer's numerics exist only in the plugin's "
            "nemo_fp8 emulation"
        )
    if _generation_fp8(spec) and spec.generation_numerics == "vllm_deepgemm_ue8m0":
        out.append(
            "NeMo RL: generation_numerics=vllm_deepgemm_ue8m0 cannot be expressed: NeMo RL "
            "sets VLLM_USE_DEEP_GEMM_E8M0=0 whenever use_deep_gemm is on (its "
            "generation/vllm/quantization/fp8.py), so vLLM generates with fp32 block scales "
            "(generation_numerics: vllm)"
        )
    if training:
        if spec.amax_epsilon:
            out.append(
                f"NeMo RL: amax_epsilon={spec.amax_epsilon} has no fp8_cfg key "
                "(Transformer Engine's default 0 is used)"
            )
        if not spec.fp8_wgrad:
            out.append(
                "NeMo RL: fp8_wgrad=false has no fp8_cfg key and megatron-core hands it "
                "to Transformer Engine only for delayed scaling, which TE 2.x ignores (the "
                "weight-gradient GEMM runs in FP8); the nearest TE setting, "
                "NVTE_BACKWARD_OVERRIDE=high_precision, moves the whole backward to high "
                "precision"
            )
        if spec.fp8_dot_product_attention or spec.fp8_multi_head_attention:
            out.append(
                "NeMo RL: FP8 attention has no fp8_cfg key (attention runs in BF16 in training)"
            )
    return out


def _rules_keys(spec: RecipeSpec, model: Any) -> HostKeys:
    """BF16 layer rules in NeMo RL's spelling, from the rules module."""
    from .rules import to_nemo_rl

    return to_nemo_rl(spec, model=model)


_RULE_LEAVES = (
    "num_first_layers_in_bf16",
    "num_last_layers_in_bf16",
    "quantization_ignored_layer_kws",
)


def _is_moe(model: Any) -> bool | None:
    """True / False from a rules model description, None when unknown."""
    if model is None:
        return None
    experts = (
        model.get("num_experts")
        if isinstance(model, Mapping)
        else getattr(model, "num_experts", None)
    )
    if experts is None:
        return None
    return bool(experts) and int(experts) > 0


FP8_PARAM_WARNING = (
    "NeMo RL: {key} is written false although recipe {name} sets fp8_param: low-precision "
    "parameters can make token_mult_prob_error NaN in NeMo RL (NVIDIA-NeMo/RL issue 1164) and "
    "NVIDIA's NeMo RL FP8 configs all use fp8_param: false; state fp8_param: true in the fp8: "
    "block to keep it"
)

BLOCK_MX_REFUSAL = (
    "block FP8 training with MXFP8 generation cannot work: the trainer's 128x128 block scales "
    "cannot become the 1x32 E8M0 scales vLLM's MXFP8 layers take without requantizing the "
    "weights from high precision, so rollouts and training would not see the same weights "
    "(NeMo RL refuses the combination)"
)
"""Why ``fp8_blockwise`` / ``fp8_subchannel`` training and MXFP8 rollouts do not mix."""

DEEP_GEMM_BLACKWELL = (
    "NeMo RL's use_deep_gemm: true sets VLLM_USE_DEEP_GEMM=1 and VLLM_USE_DEEP_GEMM_E8M0=0 "
    "(nemo_rl/models/generation/vllm/quantization/fp8.py), i.e. DeepGEMM with fp32 block "
    "scales, and DeepGEMM on Blackwell (SM100) takes UE8M0 scale factors only"
)
"""Why block-FP8 generation on Blackwell must not ask NeMo RL for DeepGEMM."""


def deep_gemm_wanted(spec: RecipeSpec) -> bool:
    """Whether block-FP8 generation written for NeMo RL asks for DeepGEMM: on Hopper (SM90),
    or when no target GPU is stated (NVIDIA's FP8 configs, written for H100); never for a
    Blackwell target (:data:`DEEP_GEMM_BLACKWELL`; vLLM does not pick DeepGEMM on SM12x)."""
    if spec.hardware is None:
        return True
    arch = arch_by_name(spec.hardware)
    return arch is None or (9, 0) in arch.sm


NVFP4_PARAM_GATHER_WARNING = (
    "NeMo RL: FP4 parameters (model_overrides.fp4_param: true) without fp4_param_gather: NeMo "
    "RL builds megatron-core's DistributedDataParallelConfig from fixed keys of "
    "policy.megatron_cfg.distributed_data_parallel_config (nemo_rl/models/megatron/setup.py, "
    "commit 7ea279a), none of them fp4_param_gather (megatron-core >= 0.18), which the "
    "distributed optimizer needs to requantize NVFP4 parameters"
)
"""Why FP4 parameters through NeMo RL lack the DDP half megatron-core >= 0.18 has."""

NVFP4_OVERRIDES = ("fp4", "fp4_recipe", "fp4_param")
"""``model_overrides`` keys (megatron-core ``TransformerConfig`` FP4 fields) nvfp4 writes."""


def native_keys(spec: RecipeSpec, model: Any = None, *, fp8_param_stated: bool = False) -> HostKeys:
    """NeMo RL's spelling of ``spec`` (no host import, no file access).

    ``model`` is a model description from :func:`nemo_fp8_plugin.rules.describe_model` (or
    None): it decides ``moe_router_dtype`` and lets the BF16 rules resolve per layer. A
    recipe NeMo RL refuses (delayed scaling) gives no keys and one warning saying why;
    :func:`apply_file` raises instead. ``fp8_param_stated``: the user's config itself asked
    for ``fp8_param`` (else a preset's ``fp8_param: true`` is written false, with a warning).
    """
    refusal = _refusal(spec)
    if refusal:
        return HostKeys(keys={}, warnings=[refusal + "; use fp8_blockwise"])
    keys: dict[str, Any] = {}
    env: dict[str, str] = {}
    warnings: list[str] = []

    def put(dotted: str, value: Any) -> None:
        node = keys
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value

    training = spec.training == "fp8"
    generation = _generation_fp8(spec)
    if training:
        fp8_param = spec.fp8_param and fp8_param_stated
        nvfp4 = spec.scaling == "nvfp4"
        if spec.fp8_param and not fp8_param:
            warnings.append(
                FP8_PARAM_WARNING.format(
                    name=spec.name,
                    key="model_overrides.fp4_param" if nvfp4 else "fp8_cfg.fp8_param",
                )
            )
        if nvfp4:
            # fp8_cfg is FP8 only; the provider's FP4 fields come through model_overrides,
            # which NeMo RL merges before it applies fp8_cfg (left disabled: FP4 xor FP8).
            for name, value in zip(NVFP4_OVERRIDES, ("e2m1", "nvfp4", fp8_param)):
                put(f"{_MEGATRON}.model_overrides.{name}", value)
            if fp8_param:
                warnings.append(NVFP4_PARAM_GATHER_WARNING)
        else:
            put(
                f"{_MEGATRON}.fp8_cfg",
                {
                    "enabled": True,
                    "fp8": spec.fp8_format,
                    "fp8_recipe": TRAINING_RECIPE[spec.scaling],
                    "fp8_param": fp8_param,
                },
            )
        # Every variable TE reads for this recipe, pinned either way (a cluster-wide
        # `=1` must not flip fp32 scales to power-of-2 or back): the capability table's.
        env.update(te_env(spec))
        for name, value in env.items():
            put(f"{_MEGATRON}.env_vars.{name}", value)
        put(f"{_MEGATRON}.optimizer.use_precision_aware_optimizer", False)
        moe = _is_moe(model)
        if moe:
            put(f"{_MEGATRON}.moe_router_dtype", "fp32")
    if generation:
        put(f"{_VLLM}.precision", "fp8")
        if spec.scaling == "block":
            put(f"{_VLLM}.use_deep_gemm", deep_gemm_wanted(spec))
            if spec.pow2_scales:
                put(f"{_VLLM}.pow2_weight_scaling_factors", True)
                put(f"{_VLLM}.pow2_activation_scaling_factors", True)
        else:
            # NVIDIA's MXFP8 rollout keys: NeMo RL takes power-of-2 (E8M0) scales only.
            put(f"{_VLLM}.is_mx", True)
            put(f"{_VLLM}.pow2_weight_scaling_factors", True)
            put(f"{_VLLM}.pow2_activation_scaling_factors", True)
        put(f"{_VLLM}.kv_cache_dtype", "fp8" if spec.kv_cache == "fp8" else "auto")
    elif spec.generation == "fp8":
        warnings.append(
            f"NeMo RL generates in FP8 with block or MXFP8 scaling only; "
            f"{spec.name} ({spec.scaling} scaling) trains in FP8 and generates in "
            f"BF16, so the two sides differ (the importance-sampling correction "
            f"absorbs it; fp8_blockwise keeps both sides identical)"
        )

    if not spec.bf16_layers.empty or (generation and model is not None):
        # The rules also add layers vLLM must keep unquantized for some models (routers).
        rules = _rules_keys(spec, model)
        warnings.extend(rules.warnings)
        overrides = get_path(rules.keys, f"{_MEGATRON}.model_overrides")
        if training and isinstance(overrides, Mapping):
            # First/last BF16 training layers: Bridge-provider (TransformerConfig) fields that
            # NeMo RL merges into the provider from model_overrides.
            for name, value in overrides.items():
                put(f"{_MEGATRON}.model_overrides.{name}", value)
        if generation:
            for name in _RULE_LEAVES:
                value = get_path(rules.keys, f"{_VLLM}.{name}", _MISSING)
                if value is not _MISSING:
                    put(
                        f"{_VLLM}.{name}",
                        list(value) if isinstance(value, (list, tuple)) else value,
                    )
    if generation:
        # A BF16 config has these at 0; writing them makes the output say what runs in BF16.
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            if get_path(keys, f"{_VLLM}.{name}") is None:
                put(f"{_VLLM}.{name}", 0)

    is_ = spec.importance_sampling
    if is_.enabled:
        put("loss_fn.use_importance_sampling_correction", True)
        put("loss_fn.sequence_level_importance_ratios", is_.level == "sequence")
        put("loss_fn.truncated_importance_sampling_type", is_.truncation)
        put(
            "loss_fn.truncated_importance_sampling_ratio",
            None if is_.truncation is None else is_.ratio_max,
        )
        put(
            "loss_fn.truncated_importance_sampling_ratio_min",
            None
            if is_.truncation is None
            else _window_low(is_.truncation, is_.ratio_max, is_.ratio_min),
        )
    warnings.extend(_unexpressible(spec))
    return HostKeys(keys=keys, warnings=warnings, env=env)


def _window_low(truncation: str, ratio_max: float, ratio_min: float | None) -> float | None:
    # NeMo RL requires the lower bound for icepop and seq-mask-tis; the spec's default for
    # them is the symmetric window (1 / ratio_max). For tis, None means 0 in both.
    if truncation in ("icepop", "seq-mask-tis") and ratio_min is None:
        return 1.0 / ratio_max
    return ratio_min


# --------------------------------------------------------------------------- applying to a file

# What a key stands for when a config leaves it out (NeMo RL's / Megatron's / vLLM's default).
_ABSENT = {
    "enabled": False,
    "fp8_param": False,
    "use_precision_aware_optimizer": False,
    "use_deep_gemm": False,
    "pow2_weight_scaling_factors": False,
    "pow2_activation_scaling_factors": False,
    "is_mx": False,
    "kv_cache_dtype": "auto",
    "num_first_layers_in_bf16": 0,
    "num_last_layers_in_bf16": 0,
    "quantization_ignored_layer_kws": [],
    "use_importance_sampling_correction": False,
    "sequence_level_importance_ratios": False,
    "first_last_layers_bf16": False,
    "fp4_param": False,
}


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _absent_value(key: str) -> Any:
    return _ABSENT.get(_leaf(key))


def _is_fp8_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower().startswith("fp8")


def _same(key: str, have: Any, want: Any) -> bool:
    """Whether an existing value already says what we would write."""
    if want is NOT_FP8:
        return not _is_fp8_text(have)
    if have is None:
        have = _absent_value(key)
    leaf = _leaf(key)
    if leaf == "kv_cache_dtype":
        norm = {"fp8_e4m3": "fp8", None: "auto"}
        return norm.get(have, have) == norm.get(want, want)
    if leaf == "quantization_ignored_layer_kws":
        return isinstance(have, (list, tuple)) and sorted(map(str, have)) == sorted(map(str, want))
    if ".env_vars." in key:  # environment values are strings, however YAML spelled them
        return have is not None and str(have).strip() == str(want)
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return float(have) == float(want)
    return have == want


def _neutral(key: str, have: Any, resolved: Mapping) -> bool:
    """Whether ``have`` is what a BF16 config holds there, so FP8 may overwrite it."""
    if have is None or (isinstance(have, str) and have.strip().startswith("${")):
        return True  # unset, or an interpolation of something else (e.g. ${policy.precision})
    leaf = _leaf(key)
    if ".fp8_cfg." in key:
        # A disabled fp8_cfg block is inert whatever its other fields say.
        return not get_path(resolved, f"{_MEGATRON}.fp8_cfg.enabled")
    if leaf == "precision":
        return not _is_fp8_text(have)
    if leaf == "moe_router_dtype":
        # Inherited from a parent (grpo_math_1B.yaml's fp64): NVIDIA's FP8 twins set fp32.
        # A value the file itself states is handled by _merge (fp64 kept, it is >= fp32).
        return have in ("fp64", "fp32")
    if leaf == "use_precision_aware_optimizer":
        return True  # NeMo RL's default true is a BF16 setting; FP8 training turns it off
    if leaf == "kv_cache_dtype":
        return have == "auto"
    if leaf == "quantization_ignored_layer_kws":
        return have == [] or have == ()
    if ".env_vars." in key:
        return False  # a variable set otherwise is a choice the recipe contradicts
    if leaf.startswith("truncated_importance_sampling"):
        return False  # None was handled above
    return have is False or have == 0


def _flatten(mapping: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(value, dotted))
        else:
            out.append((dotted, value))
    return out


def _set_path(mapping: dict, dotted: str, value: Any) -> None:
    node = mapping
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = (
                child  # replaces a null section (e.g. `env_vars: null`), as NeMo RL's merge does
            )
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def _delete_path(mapping: dict, dotted: str) -> None:
    parts = dotted.split(".")
    node = mapping
    for part in parts[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return
    node.pop(parts[-1], None)


def _contradiction(key: str, have: Any, want: Any, spec: RecipeSpec) -> FP8ConfigError:
    return ConflictingKeyError(
        f"already set to {format_value(have)}, but {spec.name} as requested needs "
        f"{format_value(want) if want is not NOT_FP8 else 'a non-FP8 value'}",
        key=key,
        value=have,
        hint="remove the key and let the recipe set it, or state the same thing in the fp8: block "
        "(bf16_layers, kv_cache, importance_sampling, pow2_scales, training, generation)",
    )


def _checks(spec: RecipeSpec, resolved: Mapping) -> None:
    """Requests NeMo RL cannot run, refused before anything is written."""
    if spec.training != "fp8" and not _generation_fp8(spec):
        raise FP8ConfigError(
            f"nothing would run in FP8: training is bf16 and NeMo RL cannot "
            f"generate with {spec.name} ({spec.scaling} scaling; its vLLM path "
            f"has block FP8 and MXFP8 only)",
            key="fp8.training",
            value="bf16",
            hint="use fp8_blockwise for FP8 generation",
        )
    if spec.training == "fp8" and get_path(resolved, f"{_MEGATRON}.enabled") is not True:
        # fp8_cfg is read by the Megatron path only; the DTensor path would drop it silently.
        raise FP8ConfigError(
            "NeMo RL trains in FP8 on its Megatron path only, and this config does not enable it",
            key=f"{_MEGATRON}.enabled",
            value=get_path(resolved, f"{_MEGATRON}.enabled"),
            hint="set policy.megatron_cfg.enabled: true (and "
            "policy.dtensor_cfg.enabled: false), or ask for FP8 generation "
            "only with fp8: {training: bf16}",
        )
    backend = get_path(resolved, "policy.generation.backend")
    if _generation_fp8(spec) and _has_generation(resolved) and backend not in (None, "vllm"):
        raise FP8ConfigError(
            f"FP8 generation is a vLLM setting; the {backend!r} backend would ignore it",
            key="policy.generation.backend",
            value=backend,
            hint="use backend: vllm, or fp8: {generation: bf16}",
        )
    if spec.training != "fp8" and not _has_generation(resolved):
        raise FP8ConfigError(
            "generation-only FP8 asked for, but the config has no policy.generation section",
            key="fp8.training",
            value="bf16",
        )
    if spec.kv_cache == "fp8" and not _generation_fp8(spec):
        raise FP8ConfigError(
            f"an FP8 KV cache needs FP8 generation, and NeMo RL generates {spec.name} in BF16",
            key="fp8.kv_cache",
            value="fp8",
            hint="use kv_cache: auto, or a block recipe such as fp8_blockwise",
        )
    if spec.scaling == "mx" and _generation_fp8(spec):
        for name in ("pow2_weight_scaling_factors", "pow2_activation_scaling_factors"):
            key = f"{_VLLM}.{name}"
            if get_path(resolved, key) is False:
                raise FP8ConfigError(
                    "is false, but MXFP8 scales are powers of two (NeMo RL refuses "
                    "the combination)",
                    key=key,
                    value=False,
                    hint="remove the key",
                )
    from .values import resolved_value  # omegaconf only when needed

    fp8_cfg_on = resolved_value(resolved, f"{_MEGATRON}.fp8_cfg.enabled") is True
    if (
        spec.training == "fp8"
        and spec.scaling == "block"
        and resolved_value(resolved, f"{_VLLM}.is_mx") is True
    ):
        raise FP8ConfigError(
            BLOCK_MX_REFUSAL,
            key=f"{_VLLM}.is_mx",
            value=True,
            hint="generate with the training recipe (remove is_mx), or train "
            "in BF16 for MXFP8 rollouts: fp8: {recipe: mxfp8, training: bf16}",
        )
    if (
        _generation_fp8(spec)
        and spec.scaling == "mx"
        and fp8_cfg_on
        and resolved_value(resolved, f"{_MEGATRON}.fp8_cfg.fp8_recipe", "blockwise") == "blockwise"
    ):
        raise FP8ConfigError(
            BLOCK_MX_REFUSAL,
            key=f"{_MEGATRON}.fp8_cfg.fp8_recipe",
            value="blockwise",
            hint="train with mxfp8 too (fp8: mxfp8, Blackwell), or in BF16: "
            "fp8: {recipe: mxfp8, training: bf16} with fp8_cfg disabled",
        )
    override = get_path(resolved, f"{_MEGATRON}.env_vars.NVTE_BACKWARD_OVERRIDE")
    if spec.training == "fp8" and override is not None:
        # NeMo RL exports env_vars in its Megatron workers before they import TE, which
        # (>= 2.15) then defaults every recipe's backward_override from it.
        raise FP8ConfigError(
            f"makes Transformer Engine (>= 2.15) run the whole backward of {spec.name} "
            f"{'in high precision' if override == 'high_precision' else 'off FP8'} (and refuse "
            f"delayed scaling), silently changing the recipe",
            key=f"{_MEGATRON}.env_vars.NVTE_BACKWARD_OVERRIDE",
            value=override,
            hint="remove it: no nemo-fp8-plugin recipe uses it",
        )
    rules = spec.bf16_layers
    nested = get_path(resolved, f"{_MEGATRON}.model_overrides.transformer")
    if (
        spec.training == "fp8"
        and rules.acts_on("training")
        and (rules.first or rules.last)
        and isinstance(nested, Mapping)
    ):
        raise FP8ConfigError(
            "is a mapping, so the model config is a GPTModelConfig (its TransformerConfig under "
            ".transformer), where NeMo RL's model_overrides merge rejects the flat "
            "first_last_layers_bf16 / num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 "
            "keys written for bf16_layers.first/last",
            key=f"{_MEGATRON}.model_overrides.transformer",
            value=nested,
            hint="set those three under model_overrides.transformer yourself and "
            "give the fp8: block bf16_layers.applies_to: generation",
        )
    is_ = spec.importance_sampling
    if (
        is_.enabled
        and is_.level == "sequence"
        and resolved_value(resolved, "loss_fn.token_level_loss", True)
    ):
        raise FP8ConfigError(
            "sequence-level importance ratios need a sequence-level loss in NeMo RL",
            key="loss_fn.token_level_loss",
            value=get_path(resolved, "loss_fn.token_level_loss", True),
            hint="set loss_fn.token_level_loss: false (GSPO-style), or use "
            "importance_sampling.level: token",
        )


FP8_CFG_KEYS = ("enabled", "fp8", "fp8_recipe", "fp8_param", "force_clear_fp8_caches")
"""Keys NeMo RL reads from ``policy.megatron_cfg.fp8_cfg``; anything else there is ignored."""

VLLM_FP8_KEYS = (
    "precision",
    "use_deep_gemm",
    "is_mx",
    "kv_cache_dtype",
    "num_first_layers_in_bf16",
    "num_last_layers_in_bf16",
    "quantization_ignored_layer_kws",
    "pow2_weight_scaling_factors",
    "pow2_activation_scaling_factors",
)
"""FP8 keys NeMo RL reads from ``policy.generation.vllm_cfg``."""

_VLLM_FP8_HINTS = ("fp8", "bf16", "pow2", "quantiz", "scaling", "deep_gemm", "mx")


def _dropped_keys(resolved: Mapping) -> None:
    """Refuse FP8 settings NeMo RL would silently ignore (typos, keys of other hosts)."""
    import difflib

    fp8_cfg = get_path(resolved, f"{_MEGATRON}.fp8_cfg")
    if isinstance(fp8_cfg, Mapping):
        for name in fp8_cfg:
            if name not in FP8_CFG_KEYS:
                near = difflib.get_close_matches(str(name), FP8_CFG_KEYS, n=1, cutoff=0.6)
                raise FP8ConfigError(
                    "is not read by NeMo RL (its fp8_cfg has only "
                    f"{', '.join(FP8_CFG_KEYS)}), so it would be ignored silently",
                    key=f"{_MEGATRON}.fp8_cfg.{name}",
                    value=fp8_cfg[name],
                    hint=f"did you mean {near[0]!r}?"
                    if near
                    else "state recipe details in the fp8: block, or Megatron fields in "
                    "policy.megatron_cfg.model_overrides",
                )
    vllm_cfg = get_path(resolved, _VLLM)
    if isinstance(vllm_cfg, Mapping):
        for name in vllm_cfg:
            lowered = str(name).lower()
            if name in VLLM_FP8_KEYS or not any(h in lowered for h in _VLLM_FP8_HINTS):
                continue
            near = difflib.get_close_matches(str(name), VLLM_FP8_KEYS, n=1, cutoff=0.6)
            if near:
                raise FP8ConfigError(
                    "is not an FP8 key NeMo RL reads, so it would be ignored silently",
                    key=f"{_VLLM}.{name}",
                    value=vllm_cfg[name],
                    hint=f"did you mean {near[0]!r}?",
                )


def _has_generation(resolved: Mapping) -> bool:
    return isinstance(get_path(resolved, "policy.generation"), Mapping)


def _desired(spec: RecipeSpec, hk: HostKeys, *, rl: bool = True) -> list[tuple[str, Any, bool]]:
    """Every native key the recipe decides: ``(key, value it needs, written)``. Unwritten
    entries are guards: an existing value must agree, but nothing is added for them.
    ``rl=False`` (a config without a generation section, e.g. SFT) keeps training keys only."""
    want = [(k, v, True) for k, v in _flatten(hk.keys)]
    decided = {k for k, _, _ in want}
    guards: list[tuple[str, Any]] = []
    if spec.training == "fp8":
        # No BF16 training layers asked for: a native first_last_layers_bf16: true contradicts.
        guards.append((f"{_MEGATRON}.model_overrides.first_last_layers_bf16", False))
        if spec.scaling == "nvfp4":  # FP4 and FP8 exclude each other in megatron-core
            guards.append((f"{_MEGATRON}.fp8_cfg.enabled", False))
        else:  # a native FP4 override contradicts an FP8 recipe
            guards.append((f"{_MEGATRON}.model_overrides.fp4", None))
    if not rl:
        return [entry for entry in want if entry[0].startswith(_MEGATRON)] + [
            (k, v, False) for k, v in guards if k not in decided
        ]
    if spec.training != "fp8":
        guards.append((f"{_MEGATRON}.fp8_cfg.enabled", False))
    if not _generation_fp8(spec):
        guards += [(f"{_VLLM}.precision", NOT_FP8), (f"{_VLLM}.kv_cache_dtype", "auto")]
    else:
        if spec.scaling == "block" and not spec.pow2_scales:
            guards += [
                (f"{_VLLM}.pow2_weight_scaling_factors", False),
                (f"{_VLLM}.pow2_activation_scaling_factors", False),
            ]
        if spec.scaling == "block":
            guards.append((f"{_VLLM}.is_mx", False))
        guards.append((f"{_VLLM}.quantization_ignored_layer_kws", []))
    return want + [(k, v, False) for k, v in guards if k not in decided]


def _fp8_param_stated(resolved: Mapping) -> bool:
    """Whether the config itself asks for ``fp8_param`` (rather than inheriting a preset's):
    in its ``fp8:`` block, or as ``true`` in an enabled native ``fp8_cfg``, which forcing
    false would contradict."""
    block = resolved.get("fp8")
    if isinstance(block, Mapping) and "fp8_param" in block:
        return True
    return (
        get_path(resolved, f"{_MEGATRON}.fp8_cfg.enabled") is True
        and get_path(resolved, f"{_MEGATRON}.fp8_cfg.fp8_param") is True
    )


def _moe_fallback(resolved: Mapping) -> bool | None:
    """MoE-ness read from the config when the model is unknown (expert parallelism > 1)."""
    from .values import resolved_value  # omegaconf only when needed

    ep = resolved_value(resolved, f"{_MEGATRON}.expert_model_parallel_size")
    if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1:
        return True
    return None


def _interpolation_users(resolved: Mapping, consumed: list[str]) -> None:
    """Refuse when another key interpolates a key we are about to remove."""
    roots = [k for k in consumed if "." not in k]
    if not roots:
        return
    for key, value in _flatten(resolved):
        if isinstance(value, str) and "${" in value:
            for root in roots:
                if f"${{{root}}}" in value or f"${{{root}." in value:
                    raise FP8ConfigError(
                        f"refers to `{root}`, which the plugin consumes and NeMo RL will not see",
                        key=key,
                        value=value,
                        hint="refer to a NeMo RL key instead (e.g. ${policy.precision})",
                    )


def _rewrite_defaults(value: Any, source: Path, output: Path | None) -> Any:
    """``defaults:`` entries re-pointed so they resolve from the output's directory."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        return value
    out = []
    for item in items:
        if Path(item).is_absolute():
            out.append(item)
            continue
        target = os.path.abspath(source.parent / item)
        if output is None:
            out.append(target)
        elif os.path.abspath(output.parent / item) == target:  # resolves as written: kept
            out.append(item)
        else:
            out.append(Path(os.path.relpath(target, os.path.abspath(output.parent))).as_posix())
    return out[0] if isinstance(value, str) else out


def apply_nemo_rl(
    config_path: str | Path,
    *,
    output: str | Path | None = None,
    resolve: bool = False,
    hardware: str | None = None,
    strict: bool = False,
) -> ApplyResult:
    """Rewrite a NeMo RL config that asks for an FP8 recipe into NeMo RL's own FP8 keys.

    Args:
        config_path: the NeMo RL YAML; its ``defaults:`` chain is followed.
        output: where the result will be written. Overlay output rewrites ``defaults:``
            relative to this file's directory; None (standard output) writes the parents'
            absolute paths, since the destination is unknown.
        resolve: False (default): overlay, the input file's own keys plus the FP8 keys,
            keeping ``defaults:``. True: the fully merged config without ``defaults:``.
            An overlay is impossible when the FP8 request sits in a parent file as a root
            key (``precision:`` / ``fp8:``), which a child cannot delete; the output is then
            fully resolved and a warning says so.
        hardware: target GPU for the recipe's hardware checks (overrides ``fp8.hardware``).
        strict: raise on the first warning (a rule NeMo RL cannot express).

    Returns:
        :class:`ApplyResult` with the output mapping and the warnings. A config without an
        FP8 request comes back unchanged (so the command is idempotent on its own output).

    Raises:
        FP8ConfigError: naming the key, for a recipe NeMo RL cannot run (``fp8_delayed``),
            a native FP8 key that contradicts the request, or any invalid request.
    """
    adapter = ADAPTER if not resolve else NeMoRLAdapter(resolve=True)
    return apply_path(adapter, config_path, hardware=hardware, strict=strict, output=output)


def _overlay_base(ctx, resolve: bool) -> dict:
    out = copy.deepcopy(dict(ctx.resolved if resolve else ctx.raw))
    if not resolve and "defaults" in out and ctx.path is not None:
        out["defaults"] = _rewrite_defaults(out["defaults"], ctx.path, ctx.output)
    return out


def _merge(ctx, resolve: bool) -> ApplyResult:
    raw, resolved, request = ctx.raw, ctx.resolved, ctx.request
    warnings: list[str] = []
    notes: list[str] = []
    consumed = list(request.keys)
    in_file = all(
        get_path(raw, k, _MISSING) is not _MISSING or k == "policy.precision" for k in consumed
    )
    if not resolve and not in_file:
        warnings.append(
            "the FP8 request is a root key of a parent file, which an overlay cannot "
            "remove; writing the fully resolved config instead"
        )
        resolve = True
    out = _overlay_base(ctx, resolve)

    spec = request.spec
    refusal = _refusal(spec)
    if refusal:
        key = "fp8.recipe" if isinstance(resolved.get("fp8"), Mapping) else request.keys[0]
        raise FP8ConfigError(
            refusal,
            key=key,
            value=spec.name,
            hint="use fp8_blockwise (block scales are computed from the current "
            "weights at every step)",
        )
    _checks(spec, resolved)
    _dropped_keys(resolved)
    _interpolation_users(resolved, consumed)

    model = ctx.model
    if request.model and model is None:
        warnings.append(
            f"model {request.model!r} is not in the architecture table: per-layer rules "
            f"and the MoE check cannot resolve against it"
        )
    hk = native_keys(spec, model=model, fp8_param_stated=_fp8_param_stated(resolved))
    if spec.training == "fp8" and _is_moe(model) is None and _moe_fallback(resolved):
        _set_path(hk.keys, f"{_MEGATRON}.moe_router_dtype", "fp32")
    elif spec.training == "fp8" and _is_moe(model) is None:
        warnings.append(
            "cannot tell whether the model is a mixture of experts; if it is, set "
            "policy.megatron_cfg.moe_router_dtype: fp32 as NVIDIA's FP8 MoE recipes do"
        )
    warnings += hk.warnings

    rl = _has_generation(resolved)
    if not rl:
        warnings.append(
            "the config has no policy.generation section (not an RL config): only the "
            "training keys are written, no generation or importance-sampling keys"
        )
    for key, want, written in _desired(spec, hk, rl=rl):
        have = get_path(resolved, key, _MISSING)
        if _leaf(key) == "use_deep_gemm" and get_path(raw, key, None) is False:
            # The user's own file turns DeepGEMM off: a kernel choice, not numerics (vLLM's
            # CUTLASS/Triton block kernels take the same fp32 scales), so it is kept.
            _set_path(out, key, False)
            if want is True:
                notes.append(f"nemo-rl: {key}: false kept as your config states it")
            continue
        if _leaf(key) == "use_deep_gemm" and have is True and want is False:
            raise FP8ConfigError(
                f"is true, but the target GPU is {spec.hardware}: {DEEP_GEMM_BLACKWELL}",
                key=key,
                value=True,
                hint=f"set {key}: false (vLLM then uses its CUTLASS block-FP8 kernels)",
            )
        if _leaf(key) == "moe_router_dtype" and get_path(raw, key, None) == "fp64":
            # The user's own file asks for an fp64 router: more precise than the fp32 FP8
            # recipes need, so it is the user's choice, kept (an inherited fp64 is not).
            _set_path(out, key, "fp64")
            continue
        if have is _MISSING:
            if written and not _same(key, None, want):
                _set_path(out, key, want)
            continue
        if _same(key, have, want):
            if written:
                _set_path(out, key, have)  # explicit in the output, in the user's spelling
            continue
        if not _neutral(key, have, resolved):
            raise _contradiction(key, have, want, spec)
        if written:
            _set_path(out, key, want)

    _check_alignment(spec, ctx, out, notes, warnings)
    if spec.scaling == "nvfp4" and spec.training == "fp8":
        notes.append(
            f"nemo-rl: {spec.name} trains in NVFP4 and generates in BF16 "
            f"({NVFP4_GENERATION_REFUSAL}); the importance-sampling correction "
            f"absorbs the difference"
        )

    for key in consumed:
        if key == "policy.precision":
            _set_path(out, key, "bfloat16")
        else:
            _delete_path(out, key)
    return ApplyResult(data=out, warnings=warnings, notes=notes, env=dict(hk.env))


SEQUENCE_KEY = "policy.make_sequence_length_divisible_by"
"""What NeMo RL pads unpacked training sequences to a multiple of."""

_PACKING_DIVISOR = {"block": 128, "mx": 32}
"""What NeMo RL's packer pads packed sequences to for an ``fp8_cfg`` recipe (16 for the
others; ``nemo_rl/models/megatron/data.py``, ``_get_pack_sequence_parameters_for_megatron``),
before the TP (sequence parallel) and 2 x CP factors."""


def _check_alignment(
    spec: RecipeSpec, ctx, out: dict, notes: list[str], warnings: list[str]
) -> None:
    """The token and model-dimension alignment FP8/FP4 training needs, before the run.

    Model sizes split over TP that the recipe's GEMMs cannot take are refused (warnings for
    block tiles). Packed sequences: NeMo RL pads them itself for its ``fp8_cfg`` recipes, so
    nothing is written; nvfp4 reaches the model through ``model_overrides``, which the packer
    does not know, so packing is refused. Unpacked: ``make_sequence_length_divisible_by`` (and
    ``dynamic_batching.sequence_length_round`` when dynamic batching is on) must be a multiple
    of :func:`~nemo_fp8_plugin.capabilities.token_alignment`; unset or a divisor of it
    (too small) is raised to it, with a note; anything else cannot work and is refused."""
    if spec.training != "fp8":
        return
    from ..alignment import dimension_findings, parallel_sizes
    from .values import resolved_value

    resolved = ctx.resolved
    if ctx.model is not None:
        for f in dimension_findings(spec, ctx.model, resolved, resolved_value):
            if f.level == "error":
                raise FP8ConfigError(
                    f"{f.message} (model {ctx.model.name})",
                    key=f.key if "parallel" in f.key else "policy.model_name",
                    hint=f"recipe {spec.name!r}: use a tensor parallel size "
                    f"that keeps every per-rank size a multiple, or "
                    f"another recipe",
                )
            warnings.append(f"{f.key}: {f.message}")
    sizes = parallel_sizes(resolved, resolved_value)
    need = token_alignment(
        spec.scaling,
        tensor_parallel=sizes.tensor_parallel,
        sequence_parallel=sizes.sequence_parallel,
        context_parallel=sizes.context_parallel,
    )
    why = (
        f"{spec.name}'s GEMMs need the tokens per rank to be a multiple of "
        f"{CAPABILITIES[spec.scaling].token_align} (Transformer Engine)"
        + (
            f", times TP {sizes.tensor_parallel} with sequence parallelism"
            if sizes.sequence_parallel
            else ""
        )
        + (f", times 2 x CP {sizes.context_parallel}" if sizes.context_parallel > 1 else "")
    )
    if resolved_value(resolved, "policy.sequence_packing.enabled", False) is True:
        if spec.scaling == "nvfp4":
            raise FP8ConfigError(
                f"NeMo RL pads packed sequences for its fp8_cfg recipes only, and {spec.name} "
                f"reaches the model through model_overrides, so packed batches would not be "
                f"aligned: {why}, i.e. {need}",
                key="policy.sequence_packing.enabled",
                value=True,
                hint=f"set policy.sequence_packing.enabled: false (apply then sets {SEQUENCE_KEY})",
            )
        divisor = _PACKING_DIVISOR.get(spec.scaling, 16)
        notes.append(
            f"nemo-rl: sequence packing is on, and NeMo RL pads packed sequences to a "
            f"multiple of {divisor} (x TP with sequence parallelism, x 2 CP) for "
            f"fp8_cfg recipes itself; {SEQUENCE_KEY} is left as it is"
        )
        return
    keys = [SEQUENCE_KEY]
    if resolved_value(resolved, "policy.dynamic_batching.enabled", False) is True:
        keys.append("policy.dynamic_batching.sequence_length_round")
    for key in keys:
        value = resolved_value(resolved, key)
        written = get_path(resolved, key)
        shown = f"{written} (= {value})" if written != value else f"{value}"
        if value is None or (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value >= 1
            and need % value == 0
            and value < need
        ):
            _set_path(out, key, need)
            notes.append(
                f"nemo-rl: {key} set to {need} (was {'unset' if value is None else shown}): {why}"
            )
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % need:
            raise FP8ConfigError(
                f"{shown} cannot work: {why}, so it must be a multiple of {need}",
                key=key,
                value=written,
                hint=f"use {need} or a multiple of it",
            )


def apply_file(
    path: str | Path,
    *,
    hardware: str | None = None,
    strict: bool = False,
    output: str | Path | None = None,
    resolve: bool = False,
) -> ApplyResult:
    """The host-adapter entry point behind ``nemo-fp8 apply CONFIG --host nemo-rl``; see
    :func:`apply_nemo_rl`."""
    return apply_nemo_rl(path, output=output, resolve=resolve, hardware=hardware, strict=strict)


class NeMoRLAdapter:
    """NeMo RL (its YAML with a ``defaults:`` chain; training, generation and loss keys).

    ``resolve``: write the fully merged config instead of an overlay of the input file."""

    name = "nemo-rl"
    runtime = (
        "NeMo RL's own FP8 paths: Megatron fp8_cfg for training, its init_fp8 patching "
        "of vLLM's fp8 method for generation (refit and KV scales inside its workers), "
        "ClippedPGLossFn for importance sampling; the plugin's nemo_fp8 vLLM method, "
        "refit quantizer and IS functions are not used"
    )
    follows_defaults = True

    def __init__(self, resolve: bool = False):
        self.resolve = resolve

    def spell(self, spec: RecipeSpec, ctx=None) -> HostKeys:
        stated = ctx is not None and _fp8_param_stated(ctx.resolved)
        return native_keys(spec, ctx.model if ctx is not None else None, fp8_param_stated=stated)

    def merge(self, ctx) -> ApplyResult:
        return _merge(ctx, self.resolve)

    def passthrough(self, ctx) -> Any:
        return _overlay_base(ctx, self.resolve)

    def validate(self, result: ApplyResult, ctx) -> list[str]:
        # NeMo RL is not installable from the registry; its keys are checked against its own
        # source in the test suite (tests/hosts/test_contract_hosts.py).
        return ["nemo-rl: not checked here (NeMo RL does not install from a package index)"]


ADAPTER = NeMoRLAdapter()
"""The NeMo RL adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
