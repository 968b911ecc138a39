"""NVFP4 RL through NeMo RL's ModelOpt quantization-aware training, from one preset.

NeMo RL (snapshot 7ea279a) trains with ModelOpt fake-quant on the Megatron worker
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

Version facts (for ``stacks.py`` when it lands): :data:`MODELOPT_QAT_SINCE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import FP8ConfigError
from ...spec import BF16Rules

__all__ = [
    "MODELOPT_QAT_SINCE",
    "QAT_PRESETS",
    "QATPreset",
    "DEFAULT_NVFP4_IGNORE",
    "modelopt_qat_keys",
    "real_quant_ignore",
]

MODELOPT_QAT_SINCE = {
    "policy.quant_cfg": "7ea279abfbeb698b092856d0dab61e7cf39bc909",
    "policy.generation.quant_cfg": "7ea279abfbeb698b092856d0dab61e7cf39bc909",
    "policy.generation.real_quant": "7ea279abfbeb698b092856d0dab61e7cf39bc909",
    "policy.generation.real_quant_ignore": "7ea279abfbeb698b092856d0dab61e7cf39bc909",
}
"""NeMo RL commit known to declare each key (NVIDIA-NeMo/RL at 7ea279a, the snapshot the
tests read; earlier commits not checked). Belongs in the NeMo RL rows of ``stacks.py``: a stack whose
NeMo RL predates it refuses the preset naming the version."""

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


QAT_PRESETS: dict[str, QATPreset] = {
    # examples/modelopt/qa_grpo_llama8b_megatron.v2.yaml (NeMo RL 7ea279a)
    "nvfp4-w4a16": QATPreset(
        quant_cfg="examples/modelopt/quant_configs/nvfp4_a16.yaml",
        policy=(("megatron_cfg.gradient_accumulation_fusion", False),),
    ),
    # examples/modelopt/qa_grpo_nano3_megatron.yaml (NeMo RL 7ea279a)
    "nano3-nvfp4-w4a16": QATPreset(
        quant_cfg="examples/modelopt/quant_configs/nano3_nvfp4_weightonly.yaml",
        policy=(
            ("disable_modelopt_layer_spec", True),
            ("megatron_cfg.gradient_accumulation_fusion", False),
        ),
    ),
}
"""Preset name -> NVIDIA's recipe. "ModelOpt quantization is incompatible with gradient
accumulation fusion" (both configs' comment), so the presets turn it off."""


def real_quant_ignore(rules: BF16Rules, num_layers: int | None = None) -> list[str]:
    """``rules`` as NeMo RL's ``real_quant_ignore`` globs (ModelOpt ``exclude_modules``).

    ``modules`` patterns pass as written (fnmatch globs both sides read the same way);
    ``first`` / ``last`` become ``*.layers.N.*`` per layer, which needs ``num_layers`` for
    ``last``. Rules that act on training only leave the rollout list empty.
    """
    if rules.applies_to == "training":
        return []
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
    return list(rules.modules) + [f"*.layers.{i}.*" for i in layers]


def modelopt_qat_keys(
    preset: str,
    rules: BF16Rules | None = None,
    *,
    real_quant: bool = False,
    num_layers: int | None = None,
) -> dict[str, Any]:
    """The dotted NeMo RL keys of ``preset`` (:data:`QAT_PRESETS`), NVIDIA's spelling.

    ``real_quant``: real NVFP4 rollout kernels (``policy.generation.real_quant``), with
    ``rules`` as ``real_quant_ignore`` (NeMo RL's default list when ``rules`` is None).
    Without ``real_quant`` the rollout fake-quantizes with the same ``quant_cfg``, whose
    own exclusions decide the BF16 modules: generation-side module rules then cannot be
    expressed and are refused, naming the key.
    """
    if preset not in QAT_PRESETS:
        raise FP8ConfigError(
            f"unknown ModelOpt QAT preset {preset!r}",
            key="modelopt.preset",
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
    has_rules = rules is not None and (rules.first or rules.last or rules.modules)
    if real_quant:
        keys["policy.generation.real_quant"] = True
        keys["policy.generation.real_quant_ignore"] = (
            real_quant_ignore(rules, num_layers)
            if rules is not None
            else list(DEFAULT_NVFP4_IGNORE)
        )
    elif has_rules and rules is not None and rules.applies_to != "training":
        raise FP8ConfigError(
            "without real_quant, NeMo RL's rollout applies the quant_cfg file's own "
            "exclusions (ModelOpt fake quant); BF16 rules are spelled only as "
            "policy.generation.real_quant_ignore",
            key="bf16_layers",
            hint="set real_quant: true, or put the exclusions in the ModelOpt quant_cfg",
        )
    return keys
