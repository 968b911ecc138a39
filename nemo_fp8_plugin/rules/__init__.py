"""Per-layer BF16 rules: model descriptions and resolution per module, host-neutral.

Standard library only (no torch, no YAML): config-only commands import it, and so do the
refit quantizer and the emulation converter on machines that have only torch. No host's key
names live here: each host spells the decisions in ``nemo_fp8_plugin.hosts.<host>.rules``.

The rule language (``fp8.bf16_layers``: ``first``, ``last``, ``modules``, ``applies_to``) is
declared in :class:`nemo_fp8_plugin.spec.BF16Rules`; ``docs/rules.md`` is the user guide.
"""

from .models import (
    BUILTIN_MODELS,
    HF_MODEL_TYPES,
    ModelDescription,
    describe_model,
    from_hf_config,
    from_transformer_config,
)
from .names import builtin_high_precision, generic_counterparts, layer_index, strip_param_suffix
from .resolve import (
    SIDES,
    LayerDecision,
    Resolution,
    keeps_bf16,
    module_filter,
    plain_keyword,
    resolve,
    rule_label,
    side_rules,
    template,
)
from .table import render_layer_table

__all__ = [
    "ModelDescription",
    "describe_model",
    "from_hf_config",
    "from_transformer_config",
    "BUILTIN_MODELS",
    "HF_MODEL_TYPES",
    "LayerDecision",
    "Resolution",
    "SIDES",
    "resolve",
    "keeps_bf16",
    "module_filter",
    "rule_label",
    "template",
    "plain_keyword",
    "side_rules",
    "layer_index",
    "strip_param_suffix",
    "generic_counterparts",
    "builtin_high_precision",
    "render_layer_table",
]
