"""NeMo RL's spelling of a recipe: the training (``policy.megatron_cfg``), generation
(``policy.generation.vllm_cfg``) and loss (``loss_fn``) keys, as plain data (the table in
:mod:`nemo_fp8_plugin.hosts.nemo_rl`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...capabilities import (
    CAPABILITIES,
    ENV_BLOCK_FP32_SCALES,
    ENV_CURRENT_POW2_SCALES,
    arch_by_name,
    capability,
    te_env,
)
from ...dotted import get_path, set_path
from ...spec import RecipeSpec
from .. import HostKeys

__all__ = [
    "native_keys",
    "TRAINING_RECIPE",
    "NOT_FP8",
    "FP8_PARAM_WARNING",
    "BLOCK_MX_REFUSAL",
    "NVFP4_OVERRIDES",
    "DEEP_GEMM_BLACKWELL",
    "NVFP4_PARAM_GATHER_WARNING",
    "deep_gemm_wanted",
    "MEGATRON",
    "VLLM",
    "ROUTER_REPLAY",
    "SEQUENCE_ERROR",
]

TRAINING_RECIPE = {
    kind: row.megatron_recipe
    for kind, row in CAPABILITIES.items()
    if row.is_block or row.is_mx or row.is_current
}
"""Spec ``scaling`` -> NeMo RL ``policy.megatron_cfg.fp8_cfg.fp8_recipe`` (megatron-core names)."""

FP32_SCALES_ENV = ENV_BLOCK_FP32_SCALES
POW2_CURRENT_ENV = ENV_CURRENT_POW2_SCALES

MEGATRON = _MEGATRON = "policy.megatron_cfg"
"""NeMo RL's Megatron training section."""
VLLM = _VLLM = "policy.generation.vllm_cfg"
"""NeMo RL's vLLM generation section."""

_MISSING = object()


class _NotFP8:
    """Desired-value marker: the key must not turn FP8 on (we write nothing)."""

    def __repr__(self) -> str:  # shows in error messages
        return "a non-FP8 value"


NOT_FP8 = _NotFP8()


# --------------------------------------------------------------------------- native keys


def _refusal(spec: RecipeSpec) -> str | None:
    if capability(spec.scaling).history:
        return (
            "NeMo RL cannot use delayed scaling: its scales come from an amax history of past "
            "steps, which goes stale when RL changes the weights every step"
        )
    return None


def _generation_fp8(spec: RecipeSpec) -> bool:
    # NeMo RL's vLLM path quantizes weights per 128x128 block or per 32 (MX); there is no
    # per-tensor FP8 generation path, so tensorwise recipes generate in BF16.
    return spec.generation == "fp8" and capability(spec.scaling).nemo_rl_generation


def _unexpressible(spec: RecipeSpec) -> list[str]:
    """Spec settings NeMo RL has no key for (it then uses TE's / vLLM's defaults)."""
    out = []
    training = spec.training == "fp8"
    row = capability(spec.scaling)
    if row.is_block:
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
    if row.is_mx and spec.weight_block != (1, 32) and training:
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
    """Whether block-FP8 generation written for NeMo RL asks for DeepGEMM with fp32 scales
    (``use_deep_gemm: true``): on Hopper (SM90), or when no target GPU is stated (NVIDIA's FP8
    configs, written for H100); never for a Blackwell target (:data:`DEEP_GEMM_BLACKWELL`), nor
    for ``generation_numerics: vllm_deepgemm_ue8m0``. ``false`` sets no variable: vLLM's
    defaults then pick DeepGEMM with UE8M0 (power-of-2) scales on SM90, SM100 and (vLLM >= 0.25)
    SM12x, which is ``vllm_deepgemm_ue8m0``; ``VLLM_USE_DEEP_GEMM=0`` gives CUTLASS with fp32
    scales (:mod:`.rollout` names the kernel and the variables per release)."""
    if spec.generation_numerics == "vllm_deepgemm_ue8m0":
        return False
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
    recipe NeMo RL refuses (delayed scaling) gives no keys and one warning saying why; the
    adapter refuses it. ``fp8_param_stated``: the user's config itself asked for
    ``fp8_param`` (else a preset's ``fp8_param: true`` is written false, with a warning).
    """
    refusal = _refusal(spec)
    if refusal:
        return HostKeys(keys={}, warnings=[refusal + "; use fp8_blockwise"])
    keys: dict[str, Any] = {}
    env: dict[str, str] = {}
    warnings: list[str] = []
    if spec.training == "fp8":
        _training_keys(spec, model, fp8_param_stated, keys, env, warnings)
    if _generation_fp8(spec):
        _generation_keys(spec, keys)
    elif spec.generation == "fp8":
        warnings.append(
            f"NeMo RL generates in FP8 with block or MXFP8 scaling only; "
            f"{spec.name} ({spec.scaling} scaling) trains in FP8 and generates in "
            f"BF16, so the two sides differ (the importance-sampling correction "
            f"absorbs it; fp8_blockwise keeps both sides identical)"
        )
    _rule_keys(spec, model, keys, warnings)
    _importance_sampling_keys(spec, keys)
    if spec.router_replay:
        set_path(keys, ROUTER_REPLAY, True)
    warnings.extend(_unexpressible(spec))
    return HostKeys(keys=keys, warnings=warnings, env=env)


def _training_keys(
    spec: RecipeSpec,
    model: Any,
    fp8_param_stated: bool,
    keys: dict[str, Any],
    env: dict[str, str],
    warnings: list[str],
) -> None:
    fp8_param = spec.fp8_param and fp8_param_stated
    nvfp4 = capability(spec.scaling).is_nvfp4
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
            set_path(keys, f"{_MEGATRON}.model_overrides.{name}", value)
        if fp8_param:
            warnings.append(NVFP4_PARAM_GATHER_WARNING)
    else:
        set_path(
            keys,
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
        set_path(keys, f"{_MEGATRON}.env_vars.{name}", value)
    set_path(keys, f"{_MEGATRON}.optimizer.use_precision_aware_optimizer", False)
    if _is_moe(model):
        set_path(keys, f"{_MEGATRON}.moe_router_dtype", "fp32")


def _generation_keys(spec: RecipeSpec, keys: dict[str, Any]) -> None:
    set_path(keys, f"{_VLLM}.precision", "fp8")
    if capability(spec.scaling).is_block:
        set_path(keys, f"{_VLLM}.use_deep_gemm", deep_gemm_wanted(spec))
        if spec.pow2_scales:
            set_path(keys, f"{_VLLM}.pow2_weight_scaling_factors", True)
            set_path(keys, f"{_VLLM}.pow2_activation_scaling_factors", True)
    else:
        # NVIDIA's MXFP8 rollout keys: NeMo RL takes power-of-2 (E8M0) scales only.
        set_path(keys, f"{_VLLM}.is_mx", True)
        set_path(keys, f"{_VLLM}.pow2_weight_scaling_factors", True)
        set_path(keys, f"{_VLLM}.pow2_activation_scaling_factors", True)
    set_path(keys, f"{_VLLM}.kv_cache_dtype", "fp8" if spec.kv_cache == "fp8" else "auto")


def _rule_keys(spec: RecipeSpec, model: Any, keys: dict[str, Any], warnings: list[str]) -> None:
    training, generation = spec.training == "fp8", _generation_fp8(spec)
    if not spec.bf16_layers.empty or (generation and model is not None):
        # The rules also add layers vLLM must keep unquantized for some models (routers).
        rules = _rules_keys(spec, model)
        warnings.extend(rules.warnings)
        overrides = get_path(rules.keys, f"{_MEGATRON}.model_overrides")
        if training and isinstance(overrides, Mapping):
            # First/last BF16 training layers: Bridge-provider (TransformerConfig) fields that
            # NeMo RL merges into the provider from model_overrides.
            for name, value in overrides.items():
                set_path(keys, f"{_MEGATRON}.model_overrides.{name}", value)
        if generation:
            for name in _RULE_LEAVES:
                value = get_path(rules.keys, f"{_VLLM}.{name}", _MISSING)
                if value is not _MISSING:
                    set_path(
                        keys,
                        f"{_VLLM}.{name}",
                        list(value) if isinstance(value, (list, tuple)) else value,
                    )
    if generation:
        # A BF16 config has these at 0; writing them makes the output say what runs in BF16.
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            if get_path(keys, f"{_VLLM}.{name}") is None:
                set_path(keys, f"{_VLLM}.{name}", 0)


ROUTER_REPLAY = "policy.router_replay.enabled"
"""NeMo RL's router replay (R3) switch (v0.7.0 on): the recipe's ``router_replay``."""

SEQUENCE_ERROR = "grpo.seq_logprob_error_threshold"
"""NeMo RL's sequence masking on the generation/training log-prob error (GRPO): the recipe's
``importance_sampling.max_sequence_error``, ``null`` for none."""


def _importance_sampling_keys(spec: RecipeSpec, keys: dict[str, Any]) -> None:
    is_ = spec.importance_sampling
    # Which sequences count, not how they are weighted: written with the correction on or off.
    set_path(keys, SEQUENCE_ERROR, is_.max_sequence_error)
    if not is_.enabled:
        return
    set_path(keys, "loss_fn.use_importance_sampling_correction", True)
    set_path(keys, "loss_fn.sequence_level_importance_ratios", is_.level == "sequence")
    set_path(keys, "loss_fn.truncated_importance_sampling_type", is_.truncation)
    set_path(
        keys,
        "loss_fn.truncated_importance_sampling_ratio",
        None if is_.truncation is None else is_.ratio_max,
    )
    set_path(
        keys,
        "loss_fn.truncated_importance_sampling_ratio_min",
        None
        if is_.truncation is None
        else _window_low(is_.truncation, is_.ratio_max, is_.ratio_min),
    )


def _window_low(truncation: str, ratio_max: float, ratio_min: float | None) -> float | None:
    # NeMo RL requires the lower bound for icepop and seq-mask-tis; the spec's default for
    # them is the symmetric window (1 / ratio_max). For tis, None means 0 in both.
    if truncation in ("icepop", "seq-mask-tis") and ratio_min is None:
        return 1.0 / ratio_max
    return ratio_min
