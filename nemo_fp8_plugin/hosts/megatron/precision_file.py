"""The Transformer Engine precision file: per-module BF16 rules as training reads them.

megatron-core (from 0.16, NVIDIA/Megatron-LM PR #2359) selects a Transformer Engine recipe per
module from a YAML file: Megatron-LM's ``--te-precision-config-file``, NeMo RL's
``policy.megatron_cfg.te_precision_config_file`` (NeMo RL after 0.7, PR #3654). Both load it
with ``megatron.core.quantization.utils.load_quantization_recipe`` into
``TransformerConfig.quant_recipe``; after the model is built, every module with
``finish_init`` (the Transformer Engine linear and grouped-linear modules) is matched by its
``named_modules()`` name against the file's ordered glob matchers (the first enabled match
wins), and a config whose ``training_recipe`` is empty runs that module with the FP8 autocast
disabled, in BF16 (``_get_fp8_autocast_for_quant_recipe`` in
``megatron/core/extensions/transformer_engine.py``). The schema::

    configs:
      bf16: {transformer_engine_config_type: TEQuantizationParams, training_recipe: {}}
    matchers:
      bf16_0: {config: bf16, type: glob, pattern: "decoder.layers.*.mlp.linear_fc1", enabled: true}

The file holds the ``bf16_layers.modules`` rules, resolved against the model (the patterns of
:func:`nemo_fp8_plugin.hosts.megatron.rules.to_megatron`); ``first`` / ``last`` stay in the
first/last-layer fields (``first_last_layers_bf16`` ...), which megatron-core counts by global
layer number. Module names are stage-local (``decoder.layers.<i>`` restarts at 0 on every
pipeline stage), so a pattern naming particular layers cannot be written for a pipeline-parallel
run: :func:`precision_recipe` refuses it, naming the key that sets the pipeline size.

Standard library only (YAML through :mod:`nemo_fp8_plugin._io`); megatron-core is never
imported here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import FP8ConfigError
from ...rules import ModelDescription
from ...rules.names import layer_index
from ...rules.resolve import side_rules
from ...spec import RecipeSpec
from .. import Message

if TYPE_CHECKING:
    from ..contract import ApplyResult, HostContext

__all__ = [
    "MEGATRON_LM_FLAG",
    "NEMO_RL_KEY",
    "NEMO_RL_FACT",
    "FILE_SUFFIX",
    "PrecisionFile",
    "precision_file_path",
    "precision_recipe",
    "generation_only_note",
    "recipe_for",
    "megatron_lm_precision_file",
]

MEGATRON_LM_FLAG = "--te-precision-config-file"
"""Megatron-LM's argument naming the file (``megatron/training/arguments.py``, core_v0.16.0+)."""

NEMO_RL_KEY = "policy.megatron_cfg.te_precision_config_file"
"""NeMo RL's key naming the file (``MegatronConfig.te_precision_config_file``)."""

NEMO_RL_FACT = NEMO_RL_KEY
"""The :data:`nemo_fp8_plugin.stacks.FACTS` row (host ``nemo-rl``) saying which NeMo RL
versions have :data:`NEMO_RL_KEY`."""

FILE_SUFFIX = ".te_precision.yaml"
"""The file is written next to the output: the output's file name + this suffix."""

_HEADER = (
    "# Transformer Engine per-module precision (megatron-core quant_recipe), written by\n"
    "# nemo-fp8 apply from the config's bf16_layers.modules rules: modules whose name matches\n"
    "# a pattern run in BF16; the rest keep the config's FP8 recipe.\n"
)


@dataclass(frozen=True)
class PrecisionFile:
    """A TE precision file to write.

    Attributes:
        path: where it goes (next to the output, :func:`precision_file_path`).
        recipe: the mapping ``RecipeConfig.from_config_dict`` takes (``configs`` + ordered
            ``matchers``).
        warnings: what the translation could not say exactly (a rule splitting a fused module
            keeps the whole module BF16, ...), labelled with the rule.
    """

    path: Path
    recipe: Mapping[str, Any]
    warnings: tuple[Message, ...] = field(default=())

    @property
    def patterns(self) -> list[str]:
        """The glob patterns, in matching order."""
        return [m["pattern"] for m in self.recipe["matchers"].values()]

    def text(self) -> str:
        """The file's YAML text (a comment header, then the mapping)."""
        from ..._io import dump_yaml

        return _HEADER + dump_yaml(dict(self.recipe))


def precision_file_path(output: str | os.PathLike[str]) -> Path | None:
    """Where the file for ``output`` goes: beside it, ``output``'s name + :data:`FILE_SUFFIX`
    (``run.yaml`` -> ``run.yaml.te_precision.yaml``: two outputs never share one); None when
    ``output`` is a character device or FIFO, beside which nothing is written."""
    from ..._io import companion_path

    return companion_path(output, FILE_SUFFIX)


def precision_recipe(
    spec: RecipeSpec,
    model: ModelDescription | None,
    *,
    pipeline_parallel: int = 1,
    pipeline_key: str = "pipeline_model_parallel_size",
) -> tuple[dict[str, Any] | None, list[Message]]:
    """The file's mapping for ``spec``'s module rules (None when no rule keeps a Transformer
    Engine module of the training side in BF16), and the translation's warnings.

    Refused (:class:`FP8ConfigError`): a rule naming particular layers when
    ``pipeline_parallel`` > 1 (key ``pipeline_key``: the file's names are stage-local), and a
    rule that names particular layers in Hugging Face names when there is no model description
    to translate it (key ``bf16_layers.modules[i]``)."""
    from .. import RuleIssueKind
    from .rules import to_megatron

    rules, training_on, _ = side_rules(spec)
    if not training_on or not rules.acts_on("training") or not rules.modules:
        return None, []
    keys = to_megatron(spec, model)
    # to_megatron's note that layer-specific patterns need pipeline size 1: the file route
    # checks the size itself (below) instead.
    warnings = [w for w in keys.warnings if w.kind is not RuleIssueKind.STAGE_LOCAL]
    # Without a model the name-only translation may name layers in Hugging Face names (no
    # megatron-core name to write) or pass a pattern on unrecognised: the file would keep
    # nothing of it in BF16, so it is refused rather than written.
    refused = (RuleIssueKind.UNTRANSLATABLE, RuleIssueKind.PASSED_AS_IS)
    untranslatable = [w for w in keys.warnings if w.kind in refused]
    if untranslatable:
        raise FP8ConfigError(
            "cannot be translated to megatron-core module names without a model description "
            "(it names particular layers, or no module the plugin knows); the TE precision "
            "file matches megatron-core names only",
            key=untranslatable[0].key,
            value=untranslatable[0].patterns[0],
            hint="pass --model or --model-config (or set fp8.model)",
        )
    recipe = keys.get("quant_recipe")
    if recipe is None:
        return None, warnings
    layered = [p for p in _patterns(recipe) if layer_index(p) is not None]
    if layered and pipeline_parallel > 1:
        raise FP8ConfigError(
            f"is {pipeline_parallel}, but the BF16 rules name particular layers "
            f"({layered[0]}{', ...' if len(layered) > 1 else ''}); megatron-core matches the TE "
            f"precision file against stage-local module names (decoder.layers.<i> restarts at "
            f"0 on every pipeline stage), so the file cannot name them",
            key=pipeline_key,
            value=pipeline_parallel,
            hint="write rules that hold for every layer (e.g. '*.linear_fc2'), use "
            "bf16_layers.first / last, or train with pipeline_model_parallel_size 1",
        )
    return dict(recipe), warnings


def _patterns(recipe: Mapping[str, Any]) -> list[str]:
    return [m["pattern"] for m in recipe.get("matchers", {}).values()]


def generation_only_note(host: str, version: str | None, minimum: str, key: str) -> Message:
    """The note for a stack without the file's key: module rules act on generation only."""
    why = (
        f"{host} {version} has no {key} (from {minimum})"
        if version
        else f"the {host} version is unknown here and {key} exists from {minimum} only "
        f"(pass --stack naming one that has it)"
    )
    return Message(
        f"module rules stay generation-only: {why}, so training runs the modules they match in FP8",
        host,
    )


# --------------------------------------------------------------------------- shared by the routes


def recipe_for(
    ctx: HostContext, pipeline_key: str, pp: Any = None
) -> tuple[dict[str, Any] | None, list[Message]]:
    """:func:`precision_recipe` for a command's context: the pipeline size ``pp`` (None: read
    from ``pipeline_key``; a host with interpolations passes it resolved), a quoted integer
    read as one, anything else refused naming the key (whether a layer rule can be written
    depends on it); a refusal naming a rule keyed under the request's prefix
    (``fp8.bf16_layers.modules[0]``)."""
    from ...dotted import get_path
    from ...errors import format_value

    if pp is None:
        pp = get_path(ctx.resolved, pipeline_key, 1)
    if isinstance(pp, str) and pp.strip().isdigit():
        pp = int(pp)
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise FP8ConfigError(
            f"expected a positive integer pipeline size, got {format_value(pp)}",
            key=pipeline_key,
            value=pp,
            hint="the TE precision file's layer rules depend on it (module names restart "
            "on each pipeline stage)",
        )
    try:
        return precision_recipe(
            ctx.spec,
            ctx.model,
            pipeline_parallel=pp,
            pipeline_key=pipeline_key,
        )
    except FP8ConfigError as err:
        if ctx.prefix and (err.key or "").startswith("bf16_layers."):
            raise err.with_prefix(ctx.prefix) from None
        raise


# --------------------------------------------------------------------------- Megatron-LM YAML


_LM_PP = "model_parallel.pipeline_model_parallel_size"


def megatron_lm_precision_file(ctx: HostContext, result: ApplyResult) -> ApplyResult:
    """Megatron-LM's ``--yaml-cfg`` layout (a ``language_model:`` section; the megatron
    adapter's merge calls this last): its loader turns every nested mapping into a
    ``SimpleNamespace`` (``megatron/training/yaml_arguments.py``, ``load_yaml``) and passes
    ``language_model`` to ``TransformerConfig`` as is, so an inline ``quant_recipe`` reaches
    megatron-core as a namespace it cannot match, and that path reads no precision file. The
    inline mapping is taken out; with an output file the rules go to the TE precision file
    beside it, for Megatron-LM's argparse ``--te-precision-config-file``; a warning says that
    under ``--yaml-cfg`` those modules train in FP8. Returns ``result``."""
    from ...dotted import get_path

    section = result.data.get("language_model") if isinstance(result.data, dict) else None
    ours = isinstance(section, dict) and "quant_recipe" in section
    if not ours or get_path(ctx.raw, "language_model.quant_recipe", None) is not None:
        return result
    recipe, _ = recipe_for(ctx, _LM_PP)
    assert isinstance(section, dict)  # ours
    del section["quant_recipe"]
    loss = (
        "Megatron-LM's --yaml-cfg loader turns language_model.quant_recipe into a "
        "SimpleNamespace megatron-core cannot match and reads no precision file, so the BF16 "
        "module rules are not written inline"
    )
    if recipe is None:
        return result
    path = precision_file_path(ctx.output) if ctx.output is not None else None
    if path is None:
        result.warnings.append(
            Message(
                f"{loss}; apply -o OUT (a file) writes them to a TE precision file for "
                f"{MEGATRON_LM_FLAG} (with --yaml-cfg those modules train in FP8)",
                "megatron",
            )
        )
        return result
    result.files[str(path)] = PrecisionFile(path=path, recipe=recipe).text()
    result.warnings.append(
        Message(
            f"{loss}: they are in {path.name}; run Megatron-LM with argparse arguments and "
            f"{MEGATRON_LM_FLAG} {os.path.realpath(path)} (with --yaml-cfg those modules train "
            f"in FP8)",
            "megatron",
        )
    )
    return result
