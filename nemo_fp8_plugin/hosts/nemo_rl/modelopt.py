"""NVFP4 RL through NeMo RL's ModelOpt quantization-aware training, from one preset.

NeMo RL (v0.7.0 on; read at main 7ea279a) trains with ModelOpt fake-quant on the Megatron worker
(``policy.quant_cfg``, a ModelOpt config YAML from ``examples/modelopt/quant_configs/``,
calibrated on ``policy.quant_calib_*``; ``models/policy/__init__.py:598-606``) and
rolls out with the same recipe in vLLM (``policy.generation.quant_cfg``), optionally with
real NVFP4 kernels (``policy.generation.real_quant``; the modules left in BF16 are
``policy.generation.real_quant_ignore``, passed to ModelOpt as ``exclude_modules``:
``modelopt/utils.py:79-108``, default ``DEFAULT_NVFP4_IGNORE`` at :34-42;
``models/generation/vllm/config.py:178-186``).

:func:`modelopt_qat_keys` writes exactly those keys, as NVIDIA's shipped configs do
(``examples/modelopt/qa_grpo_llama8b_megatron.v2.yaml``, ``qa_grpo_nano3_megatron.yaml``
and the recipe ``grpo-nanov3-30ba3b-4n4g-megatron-qa-nvfp4-w4a16-real.yaml``), with the
BF16 rules (:class:`~nemo_fp8_plugin.spec.BF16Rules`, the set that drives the FP8 paths)
spelled as ``real_quant_ignore``.

Which NeMo RL versions have these keys: :data:`nemo_fp8_plugin.stacks.FACTS` (names in
:data:`MODELOPT_FACTS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...dotted import get_path
from ...errors import FP8ConfigError
from ...spec import BF16Rules, RecipeSpec
from .. import HostContext, Message, Spelling
from .releases import assumed_release
from .spelling import _MEGATRON

__all__ = [
    "MODELOPT_FACTS",
    "qat_stack_refusal",
    "QAT_PRESETS",
    "QATPreset",
    "DEFAULT_NVFP4_IGNORE",
    "modelopt_qat_keys",
    "real_quant_ignore",
    "qat_refuse",
    "qat_recipe_keys",
    "qat_spell",
]

MODELOPT_FACTS = (
    "policy.quant_cfg",
    "policy.generation.quant_cfg",
    "policy.generation.real_quant",
)
"""The :data:`nemo_fp8_plugin.stacks.FACTS` names (host ``nemo-rl``) this route needs: a stack
whose NeMo RL lacks one refuses the preset naming the version (:func:`qat_stack_refusal`)."""

DEFAULT_NVFP4_IGNORE = (
    "lm_head",
    "*output_layer*",
    "*mlp.gate",
    "*router*",
    "*block_sparse_moe.gate*",
    "*self_attention*",
    "*self_attn*",
)
"""NeMo RL's ``DEFAULT_NVFP4_IGNORE`` (``modelopt/utils.py:34-42``): what stays BF16 in a
real-quant rollout when ``real_quant_ignore`` is not given."""


@dataclass(frozen=True)
class QATPreset:
    """One of NVIDIA's ModelOpt QAT recipes, as its shipped config writes it."""

    quant_cfg: str
    """ModelOpt config path, relative to NeMo RL's checkout (both sides use it)."""

    policy: tuple[tuple[str, Any], ...] = ()
    """Further ``policy.*`` keys the shipped config sets for the recipe (dotted, value)."""

    calib_data: str = "cnn_dailymail"
    """``policy.quant_calib_data``."""

    calib_size: int = 512
    """``policy.quant_calib_size``."""

    calib_batch_size: int = 1
    """``policy.quant_batch_size``."""

    calib_sequence_length: int = 2048
    """``policy.quant_sequence_length``."""

    real_quant_ignore: tuple[str, ...] | None = None
    """What the shipped real-quant config keeps in BF16 for this recipe's model when the
    spec has no BF16 rules; None: NeMo RL's own default (:data:`DEFAULT_NVFP4_IGNORE`)."""


NANO3_REAL_QUANT_IGNORE = (
    *DEFAULT_NVFP4_IGNORE,
    "*proj_out.*",
    "*.gate.*",
    "*mlp.shared_expert_gate.*",
    "*linear_attn.conv1d*",
    "*mixer.conv1d*",
    "*.mixer.in_proj*",
    "*.mixer.out_proj*",
    "*.shared_expert.*",
    "*.shared_experts.*",
    "*.norm.*",
    "*.q_proj*",
    "*.k_proj*",
    "*.v_proj*",
    "*.o_proj*",
    "*.qkv_proj*",
    "*.linear_proj*",
    "*.linear_qkv*",
    "*.layers.4.*",
    "*.layers.11.*",
    "*.layers.18.*",
    "*.layers.25.*",
    "*.layers.32.*",
    "*.layers.41.*",
)
"""Nemotron-3 Nano's BF16 paths in a real-quant rollout ("Nano3-specific paths that stay in
BF16"): ``examples/configs/recipes/llm/grpo-nanov3-30ba3b-4n4g-megatron-qa-nvfp4-w4a16-real
.yaml`` (NeMo RL 7ea279a): Mamba mixers, attention, routers and shared experts, norms, and six
sensitive layers."""

QAT_PRESETS: dict[str, QATPreset] = {
    # examples/modelopt/qa_grpo_llama8b_megatron.v2.yaml (NeMo RL 7ea279a)
    "w4a16": QATPreset(
        quant_cfg="examples/modelopt/quant_configs/nvfp4_a16.yaml",
        policy=(("megatron_cfg.gradient_accumulation_fusion", False),),
    ),
    # examples/modelopt/qa_grpo_math_megatron.yaml (NeMo RL 7ea279a): ModelOpt's built-in
    # W4A4 config ("known convergence issue" on GRPO, docs/guides/quantization-aware-rl.md)
    "w4a4": QATPreset(
        quant_cfg="NVFP4_DEFAULT_CFG",
        policy=(("megatron_cfg.gradient_accumulation_fusion", False),),
    ),
    # examples/modelopt/qa_grpo_nano3_megatron.yaml and, for real_quant, the recipe
    # grpo-nanov3-30ba3b-4n4g-megatron-qa-nvfp4-w4a16-real.yaml (NeMo RL 7ea279a)
    "nano3-w4a16": QATPreset(
        quant_cfg="examples/modelopt/quant_configs/nano3_nvfp4_weightonly.yaml",
        policy=(
            ("disable_modelopt_layer_spec", True),
            ("megatron_cfg.gradient_accumulation_fusion", False),
        ),
        real_quant_ignore=NANO3_REAL_QUANT_IGNORE,
    ),
    # examples/configs/recipes/llm/grpo-qwen3-30ba3b-4n4g-megatron-qa-nvfp4-w4a4-real.yaml
    # (NVIDIA-NeMo/RL 0a30fee) over examples/modelopt/qa_grpo_qwen3_30ba3b_megatron.yaml:
    # routed-expert W4A4 (quant_configs/nvfp4_experts.yaml, in 7ea279a too), calibrated on
    # 16 samples of 512 tokens. 7ea279a's rollout reads the recipe from
    # policy.generation.quant_cfg, so it is written there as well (0a30fee derives it from
    # the policy and sets it null).
    "experts-w4a4": QATPreset(
        quant_cfg="examples/modelopt/quant_configs/nvfp4_experts.yaml",
        policy=(("megatron_cfg.gradient_accumulation_fusion", False),),
        calib_size=16,
        calib_sequence_length=512,
    ),
}
"""Preset name (:data:`nemo_fp8_plugin.spec.QAT_PRESETS`) -> NVIDIA's recipe. "ModelOpt
quantization is incompatible with gradient accumulation fusion" (every config's comment), so
the presets turn it off."""


def qat_stack_refusal(version: str | None, *, real_quant: bool) -> str | None:
    """Why NeMo RL release ``version`` cannot run the ModelOpt route (None: it can, or the
    release is unknown), from :data:`nemo_fp8_plugin.stacks.FACTS`."""
    from ...stacks import lookup, release_label

    for name in MODELOPT_FACTS:
        if name.endswith("real_quant") and not real_quant:
            continue
        found = lookup("nemo-rl", name, version)
        if found.present is False:
            fact = found.fact
            assert fact is not None
            return (
                f"{release_label(version)} has no {name} (ModelOpt quantization-aware RL; "
                f"in: {fact.versions.label})"
            )
    return None


def real_quant_ignore(rules: BF16Rules, num_layers: int | None = None) -> list[str]:
    """``rules`` as NeMo RL's ``real_quant_ignore`` globs (ModelOpt ``exclude_modules``).

    ``modules`` globs pass as written (fnmatch globs both sides read the same way:
    ``fnmatchcase`` in NeMo RL's ``matches_quant_ignore_pattern``, ``fnmatch`` in vLLM's
    ``ModelOptQuantConfigBase.is_layer_excluded``); a name without wildcards gets its first
    character as a one-character class (``mlp.gate`` -> ``[m]lp.gate``), which fnmatch reads
    as that same name, because vLLM would otherwise also match it as a **substring** of every
    module name containing it (``mlp.gate`` excluding ``mlp.gate_up_proj``); ``first`` / ``last``
    become ``*.layers.N.*`` per layer, which needs ``num_layers`` for ``last``. Rules for
    training only cannot be expressed (ModelOpt's training exclusions live in the
    ``quant_cfg`` file) and are refused.
    """
    if rules.applies_to == "training":
        raise FP8ConfigError(
            "training-only BF16 rules cannot be expressed for ModelOpt QAT: the policy's "
            "exclusions are the quant_cfg file's, and real_quant_ignore acts on the rollout",
            key="bf16_layers.applies_to",
            value="training",
            hint="use applies_to: generation (or both), or put the exclusions in the "
            "ModelOpt quant_cfg",
        )
    if rules.last and num_layers is None:
        raise FP8ConfigError(
            "the last layers cannot be spelled as real_quant_ignore without the layer count",
            key="bf16_layers.last",
            value=rules.last,
            hint="name the model (policy.model_name in the model table, or --model-config)",
        )
    layers = list(range(rules.first))
    if rules.last and num_layers is not None:
        layers += [i for i in range(num_layers - rules.last, num_layers) if i not in layers]
    return [_exact_entry(p) for p in rules.modules] + [f"*.layers.{i}.*" for i in layers]


def _exact_entry(pattern: str) -> str:
    """``pattern`` as an ``exclude_modules`` entry vLLM's ModelOpt matching reads as the rule
    does: a glob as written (no module name holds ``*?[``, so no substring fallback hits it),
    a plain name with its first character as a class, which only the glob step matches."""
    if any(c in pattern for c in "*?[") or not (pattern[:1].isalnum() or pattern[:1] == "_"):
        return pattern
    return f"[{pattern[0]}]{pattern[1:]}"


def modelopt_qat_keys(
    preset: str,
    rules: BF16Rules | None = None,
    *,
    real_quant: bool = False,
    num_layers: int | None = None,
) -> dict[str, Any]:
    """The dotted NeMo RL keys of ``preset`` (:data:`QAT_PRESETS`), NVIDIA's spelling.

    ``real_quant``: real NVFP4 rollout kernels (``policy.generation.real_quant``), with
    ``rules`` as ``real_quant_ignore`` (without rules: the preset's model-specific list, else
    no key, so NeMo RL applies its :data:`DEFAULT_NVFP4_IGNORE`). Without ``real_quant`` the rollout fake-quantizes with the same
    ``quant_cfg``, whose own exclusions decide the BF16 modules: BF16 rules then cannot be
    expressed and are refused, naming the key.
    """
    if preset not in QAT_PRESETS:
        raise FP8ConfigError(
            f"unknown ModelOpt QAT preset {preset!r}",
            key="qat.preset",
            value=preset,
            hint=", ".join(sorted(QAT_PRESETS)),
        )
    p = QAT_PRESETS[preset]
    keys: dict[str, Any] = {
        "policy.quant_cfg": p.quant_cfg,
        "policy.quant_calib_data": p.calib_data,
        "policy.quant_calib_size": p.calib_size,
        "policy.quant_batch_size": p.calib_batch_size,
        "policy.quant_sequence_length": p.calib_sequence_length,
    }
    keys.update({f"policy.{k}": v for k, v in p.policy})
    keys["policy.generation.quant_cfg"] = p.quant_cfg
    has_rules = rules is not None and not rules.empty
    if real_quant:
        keys["policy.generation.real_quant"] = True
        if has_rules and rules is not None:
            keys["policy.generation.real_quant_ignore"] = real_quant_ignore(rules, num_layers)
        elif p.real_quant_ignore is not None:
            keys["policy.generation.real_quant_ignore"] = list(p.real_quant_ignore)
        # else: unset, as NVIDIA's configs leave it; NeMo RL then applies DEFAULT_NVFP4_IGNORE
    elif has_rules:
        raise FP8ConfigError(
            "without real_quant, NeMo RL's rollout applies the quant_cfg file's own "
            "exclusions (ModelOpt fake quant); BF16 rules are spelled only as "
            "policy.generation.real_quant_ignore",
            key="bf16_layers",
            hint="set qat.rollout: real_quant, or put the exclusions in the ModelOpt quant_cfg",
        )
    return keys


# --------------------------------------------------------------------------- the adapter's route


def _request_key(ctx: HostContext, field: str) -> str:
    """How a message names a spec field: ``fp8.<field>`` when the request is an fp8: block."""
    return f"fp8.{field}" if isinstance(ctx.resolved.get("fp8"), Mapping) else field


def qat_recipe_keys(spec: RecipeSpec, model: Any = None) -> Spelling:
    """The preset's keys without a config (``recipe_keys``): ``model`` gives the layer count."""
    assert spec.qat is not None
    out = Spelling()
    flat = modelopt_qat_keys(
        spec.qat.preset,
        spec.bf16_layers,
        real_quant=spec.qat.rollout == "real_quant",
        num_layers=getattr(model, "num_layers", None),
    )
    for key, value in flat.items():
        out.set(key, value)
    return out


def _qat_keys(spec: RecipeSpec, ctx: HostContext) -> dict[str, Any]:
    assert spec.qat is not None
    try:
        return modelopt_qat_keys(
            spec.qat.preset,
            spec.bf16_layers,
            real_quant=spec.qat.rollout == "real_quant",
            num_layers=ctx.model.num_layers if ctx.model is not None else None,
        )
    except FP8ConfigError as err:
        if isinstance(ctx.resolved.get("fp8"), Mapping) and err.key and err.key != "qat.preset":
            raise err.with_prefix("fp8") from None
        raise


def qat_refuse(spec: RecipeSpec, ctx: HostContext) -> None:
    """What NeMo RL cannot run of a ModelOpt QAT request: a version without the keys, a rule
    set ModelOpt cannot express, a config that also turns on Transformer Engine FP8/FP4."""
    assert spec.qat is not None
    version = assumed_release(ctx)
    refusal = qat_stack_refusal(version, real_quant=spec.qat.rollout == "real_quant")
    if refusal:
        raise FP8ConfigError(
            refusal,
            key=_request_key(ctx, "qat"),
            value=spec.qat.preset,
            hint="use a NeMo RL that has the keys (--stack nemo-rl-0.7.0 or later), or recipe "
            "nvfp4 without qat (Transformer Engine NVFP4 training, BF16 rollouts)",
        )
    megatron = get_path(ctx.resolved, f"{_MEGATRON}.enabled", None)
    if megatron is not True:
        # NeMo RL's ModelOpt policy worker is a Megatron worker: with the DTensor policy
        # the quant_cfg keys would be read by nothing, and the policy trains in BF16.
        raise FP8ConfigError(
            "is not true, and ModelOpt quantization-aware RL runs on NeMo RL's Megatron policy "
            "worker only (a DTensor policy would train in BF16, ignoring quant_cfg)",
            key=f"{_MEGATRON}.enabled",
            value=megatron,
            hint="set policy.megatron_cfg.enabled: true and policy.dtensor_cfg.enabled: false, "
            "or remove qat",
        )
    for key in (f"{_MEGATRON}.fp8_cfg.enabled", f"{_MEGATRON}.model_overrides.fp4"):
        have = get_path(ctx.resolved, key, None)
        if have not in (None, False):
            raise FP8ConfigError(
                "turns on Transformer Engine low precision, and ModelOpt QAT trains the "
                "BF16 policy through fake quantizers: the two cannot both quantize it",
                key=key,
                value=have,
                hint="remove it (QAT needs no Transformer Engine FP8/FP4 keys)",
            )
    _qat_keys(spec, ctx)


def qat_spell(spec: RecipeSpec, ctx: HostContext) -> Spelling:
    """NVIDIA's keys for the preset, with a note on what the route leaves alone; a key the
    config already sets otherwise is refused by the writer (the recipe is stated once)."""
    assert spec.qat is not None
    out = Spelling()
    for key, value in _qat_keys(spec, ctx).items():
        out.set(key, value)
    p = QAT_PRESETS[spec.qat.preset]
    text = (
        f"ModelOpt quantization-aware RL, preset {spec.qat.preset} ({p.quant_cfg}, "
        f"{spec.qat.rollout} rollout): the policy trains in BF16 through ModelOpt fake "
        f"quantizers, not Transformer Engine NVFP4; the loss_fn and the sequence lengths are "
        f"left as the config states"
    )
    out.notes.append(Message(text, "nemo-rl"))
    return out
