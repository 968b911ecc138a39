"""NeMo RL's spelling of a recipe: the training (``policy.megatron_cfg``), generation
(``policy.generation.vllm_cfg``) and loss (``loss_fn``) keys, as plain data (the table in
:mod:`nemo_fp8_plugin.hosts.nemo_rl`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...capabilities import (
    CAPABILITIES,
    arch_by_name,
    capability,
    te_env,
)
from ...kinds import kind
from ...spec import RecipeSpec
from .. import Message, Spelling

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
    name: row.megatron_recipe
    for name, row in CAPABILITIES.items()
    if row.megatron_field == "fp8_recipe" and not row.history
}
"""Spec ``scaling`` -> NeMo RL ``policy.megatron_cfg.fp8_cfg.fp8_recipe`` (megatron-core names)."""

MEGATRON = _MEGATRON = "policy.megatron_cfg"
"""NeMo RL's Megatron training section."""
VLLM = _VLLM = "policy.generation.vllm_cfg"
"""NeMo RL's vLLM generation section."""


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


def _unexpressible(spec: RecipeSpec, te: str | None = None) -> list[str]:
    """Spec settings NeMo RL has no key for (it then uses TE's / vLLM's defaults); ``te``: the
    release's Transformer Engine (None: unknown), which decides the advice."""
    training = spec.training == "fp8"
    out = kind(spec.scaling).nemo_rl_unexpressible(spec)
    if _generation_fp8(spec) and spec.generation_numerics == "trainer":
        out.append(
            "generation_numerics=trainer cannot be expressed: NeMo RL generates "
            "with vLLM's own FP8 kernels, which quantize activations as vLLM does "
            "(generation_numerics: vllm); the trainer's numerics exist only in the plugin's "
            "nemo_fp8 emulation"
        )
    if training:
        if spec.amax_epsilon:
            out.append(
                f"amax_epsilon={spec.amax_epsilon} has no fp8_cfg key "
                "(Transformer Engine's default 0 is used)"
            )
        if not spec.fp8_wgrad:
            out.append(
                "fp8_wgrad=false has no fp8_cfg key and megatron-core hands it "
                "to Transformer Engine only for delayed scaling, which TE 2.x ignores (the "
                f"weight-gradient GEMM runs in FP8); {_backward_override_advice(te)}"
            )
        if spec.fp8_dot_product_attention or spec.fp8_multi_head_attention:
            out.append("FP8 attention has no fp8_cfg key (attention runs in BF16 in training)")
    return out


def _backward_override_advice(te: str | None) -> str:
    """The nearest TE setting to ``fp8_wgrad=false``, where Transformer Engine ``te`` reads it
    (``Recipe.backward_override``, from the ``NVTE_BACKWARD_OVERRIDE`` variable)."""
    from ...capabilities import ENV_BACKWARD_OVERRIDE
    from ...stacks import lookup

    found = lookup("transformer-engine", "Recipe.backward_override", te)
    if found.present is False:
        first = found.fact.minimum if found.fact is not None else "a newer release"
        return (
            f"Transformer Engine {te} has no setting for it ({ENV_BACKWARD_OVERRIDE}, which "
            f"moves the whole backward to high precision, is read from TE {first})"
        )
    return (
        f"the nearest TE setting, {ENV_BACKWARD_OVERRIDE}=high_precision, moves the whole "
        "backward to high precision"
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
    "{key} is written false although recipe {name} sets fp8_param: low-precision "
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
    "FP4 parameters (model_overrides.fp4_param: true) without fp4_param_gather: NeMo "
    "RL builds megatron-core's DistributedDataParallelConfig from fixed keys of "
    "policy.megatron_cfg.distributed_data_parallel_config (nemo_rl/models/megatron/setup.py, "
    "commit 7ea279a), none of them fp4_param_gather (megatron-core >= 0.18), which the "
    "distributed optimizer needs to requantize NVFP4 parameters"
)
"""Why FP4 parameters through NeMo RL lack the DDP half megatron-core >= 0.18 has."""

NVFP4_OVERRIDES = ("fp4", "fp4_recipe", "fp4_param")
"""``model_overrides`` keys (megatron-core ``TransformerConfig`` FP4 fields) nvfp4 writes."""


def native_keys(
    spec: RecipeSpec, model: Any = None, *, fp8_param_stated: bool = False, te: str | None = None
) -> Spelling:
    """NeMo RL's spelling of ``spec`` as writes (no host import, no file access): one function
    per concern, training, generation, BF16 rules, importance sampling.

    ``model`` is a model description from :func:`nemo_fp8_plugin.rules.describe_model` (or
    None): it decides ``moe_router_dtype`` and lets the BF16 rules resolve per layer. A
    recipe NeMo RL refuses (delayed scaling) gives no keys and one warning saying why; the
    adapter refuses it. ``fp8_param_stated``: the user's config itself asked for
    ``fp8_param`` (else a preset's ``fp8_param: true`` is written false, with a warning).
    ``te``: the Transformer Engine the release runs (None: unknown), for advice that names a
    TE setting.
    """
    out = Spelling()
    refusal = _refusal(spec)
    if refusal:
        out.warnings.append(Message(refusal + "; use fp8_blockwise"))
        return out
    if spec.training == "fp8":
        _training_keys(spec, model, fp8_param_stated, out, te)
    if _generation_fp8(spec):
        _generation_keys(spec, out)
    elif spec.generation == "fp8":
        out.warnings.append(
            Message(
                f"NeMo RL generates in FP8 with block or MXFP8 scaling only; {spec.name} "
                f"({spec.scaling} scaling) trains in FP8 and generates in BF16, so the two sides "
                f"differ (the importance-sampling correction absorbs it; fp8_blockwise keeps "
                f"both sides identical)"
            )
        )
    _rule_keys(spec, model, out)
    _importance_sampling_keys(spec, out)
    if spec.router_replay:
        out.set(ROUTER_REPLAY, True)
    out.warnings += [Message(text) for text in _unexpressible(spec, te)]
    return out


def _training_keys(
    spec: RecipeSpec, model: Any, fp8_param_stated: bool, out: Spelling, te: str | None = None
) -> None:
    fp8_param = spec.fp8_param and fp8_param_stated
    training = kind(spec.scaling).nemo_rl_training(spec, fp8_param)
    fp4 = f"{_MEGATRON}.model_overrides.fp4_param"
    if spec.fp8_param and not fp8_param:
        key = (
            "model_overrides.fp4_param"
            if "model_overrides.fp4_param" in training
            else "fp8_cfg.fp8_param"
        )
        out.warnings.append(Message(FP8_PARAM_WARNING.format(name=spec.name, key=key)))
    for key, value in training.items():
        out.set(f"{_MEGATRON}.{key}", value)
    if fp8_param and out.get(fp4) is not None:
        out.warnings.append(Message(NVFP4_PARAM_GATHER_WARNING))
    # Every variable TE reads for this recipe, pinned either way (a cluster-wide `=1` must not
    # flip fp32 scales to power-of-2 or back): the capability table's, those the release's
    # TE reads.
    out.env.update(te_env(spec, te))
    for name, value in out.env.items():
        out.set(f"{_MEGATRON}.env_vars.{name}", value)
    out.set(f"{_MEGATRON}.optimizer.use_precision_aware_optimizer", False)
    if _is_moe(model):
        out.set(f"{_MEGATRON}.moe_router_dtype", "fp32")


def _generation_keys(spec: RecipeSpec, out: Spelling) -> None:
    for key, value in kind(spec.scaling).nemo_rl_generation(spec, deep_gemm_wanted(spec)).items():
        out.set(f"{_VLLM}.{key}", value)
    out.set(f"{_VLLM}.kv_cache_dtype", "fp8" if spec.kv_cache == "fp8" else "auto")


def _rule_keys(spec: RecipeSpec, model: Any, out: Spelling) -> None:
    training, generation = spec.training == "fp8", _generation_fp8(spec)
    if not spec.bf16_layers.empty or (generation and model is not None):
        # The rules also add layers vLLM must keep unquantized for some models (routers).
        from .rules import to_nemo_rl

        rules = to_nemo_rl(spec, model=model)
        out.warnings += rules.warnings
        for w in rules.writes:
            # First/last BF16 training layers: Bridge-provider (TransformerConfig) fields that
            # NeMo RL merges into the provider from model_overrides.
            ours = training if w.key.startswith(_MEGATRON) else generation
            if ours:
                out.set(w.key, list(w.value) if isinstance(w.value, tuple) else w.value)
    if generation:
        # A BF16 config has these at 0; writing them makes the output say what runs in BF16.
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            if out.get(f"{_VLLM}.{name}") is None:
                out.set(f"{_VLLM}.{name}", 0)


ROUTER_REPLAY = "policy.router_replay.enabled"
"""NeMo RL's router replay (R3) switch (v0.7.0 on): the recipe's ``router_replay``."""

SEQUENCE_ERROR = "grpo.seq_logprob_error_threshold"
"""NeMo RL's sequence masking on the generation/training log-prob error (GRPO): the recipe's
``importance_sampling.max_sequence_error``, ``null`` for none."""


def _importance_sampling_keys(spec: RecipeSpec, out: Spelling) -> None:
    is_ = spec.importance_sampling
    # Which sequences count, not how they are weighted: written with the correction on or off.
    out.set(SEQUENCE_ERROR, is_.max_sequence_error)
    if not is_.enabled:
        return
    truncated = is_.truncation is not None
    out.set("loss_fn.use_importance_sampling_correction", True)
    out.set("loss_fn.sequence_level_importance_ratios", is_.level == "sequence")
    out.set("loss_fn.truncated_importance_sampling_type", is_.truncation)
    out.set("loss_fn.truncated_importance_sampling_ratio", is_.ratio_max if truncated else None)
    low = (
        _window_low(is_.truncation, is_.ratio_max, is_.ratio_min)
        if is_.truncation is not None
        else None
    )
    out.set("loss_fn.truncated_importance_sampling_ratio_min", low)


def _window_low(truncation: str, ratio_max: float, ratio_min: float | None) -> float | None:
    # NeMo RL requires the lower bound for icepop and seq-mask-tis; the spec's default for
    # them is the symmetric window (1 / ratio_max). For tis, None means 0 in both.
    if truncation in ("icepop", "seq-mask-tis") and ratio_min is None:
        return 1.0 / ratio_max
    return ratio_min
