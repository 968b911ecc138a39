"""NeMo RL's route for the BF16 module rules into training: the TE precision file.

NeMo RL's ``policy.megatron_cfg.te_precision_config_file`` (NVIDIA-NeMo/RL PR #3654, after the
0.6 snapshot; the version fact in :data:`nemo_fp8_plugin.stacks.FACTS`) names a file in
megatron-core's ``quant_recipe`` schema. The file itself is megatron-core's
(:mod:`nemo_fp8_plugin.hosts.megatron.precision_file` builds and checks it); this module
decides, for a NeMo RL config, whether the route applies and attaches the file to ``apply``'s
result. It lives with the NeMo RL adapter so the megatron package never imports NeMo RL's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...errors import FP8ConfigError
from ..megatron.precision_file import (
    FILE_SUFFIX,
    NEMO_RL_FACT,
    NEMO_RL_KEY,
    PrecisionFile,
    generation_only_note,
    precision_file_path,
    recipe_for,
)
from .releases import assumed_release

if TYPE_CHECKING:
    from ..contract import ApplyResult, HostContext

__all__ = ["nemo_rl_precision_file"]


_NEMO_RL_PP = "policy.megatron_cfg.pipeline_model_parallel_size"


def nemo_rl_precision_file(ctx: HostContext, result: ApplyResult) -> ApplyResult:
    """NeMo RL's route for module rules into training (the adapter's merge calls it last).

    Where the assumed NeMo RL version has :data:`NEMO_RL_KEY` and the output is a file, the
    TE precision file is attached to ``result.files`` (written next to the output, atomically,
    by ``apply``), the key points at it (an absolute path: NeMo RL opens it from the job's
    working directory) and the "training runs them in FP8" warnings go; otherwise a note
    says the module rules stay generation-only (or that ``-o`` is needed). Returns ``result``.
    """
    from ...dotted import get_path, set_path
    from ...stacks import fact, lookup
    from .. import Message, RuleIssueKind
    from .values import resolved_value

    spec = ctx.spec
    if spec.training != "fp8":
        return result
    moved = RuleIssueKind.TRAINING_UNEXPRESSIBLE
    if not any(w.kind is moved for w in result.warnings):
        return result
    version = assumed_release(ctx)
    answer = lookup("nemo-rl", NEMO_RL_FACT, version)
    row = fact("nemo-rl", NEMO_RL_FACT)
    minimum = row.minimum if row is not None else "0.8"
    if not answer.present:
        result.notes.append(generation_only_note("nemo-rl", version, minimum, NEMO_RL_KEY))
        return result
    if ctx.model is not None and ctx.model.layer_kinds:
        # Hybrid models (Mamba / linear-attention layers) train as megatron-core's hybrid
        # model, whose per-layer module names the file's patterns are not mapped to (yet).
        result.notes.append(
            Message(
                "module rules stay generation-only for a hybrid model (its Mamba / "
                "linear-attention layers): the TE precision file's patterns are written for "
                "megatron-core's GPT layer names only, so training runs the modules they "
                "match in FP8",
                "nemo-rl",
            )
        )
        return result
    path = precision_file_path(ctx.output) if ctx.output is not None else None
    if path is None:
        result.notes.append(
            Message(
                f"with -o OUT (a file), apply writes the module rules to a TE precision file "
                f"(OUT + {FILE_SUFFIX}) and sets {NEMO_RL_KEY}; to standard output or a device "
                f"they stay generation-only",
                "nemo-rl",
            )
        )
        return result
    # NeMo RL resolves ${...} in the pipeline size before megatron-core sees it
    pp = resolved_value(ctx.resolved, _NEMO_RL_PP, 1)
    recipe, warnings = recipe_for(ctx, _NEMO_RL_PP, pp)
    result.warnings[:] = [w for w in result.warnings if w.kind is not moved]
    if recipe is None:  # every rule names modules no TE layer runs in FP8 anyway
        return result
    stated = get_path(ctx.resolved, NEMO_RL_KEY, None)
    if stated is not None and os.path.realpath(str(stated)) != os.path.realpath(path):
        raise FP8ConfigError(
            "already names a TE precision file; the BF16 rules would replace it",
            key=NEMO_RL_KEY,
            value=stated,
            hint="remove the key (the plugin writes the file from bf16_layers), or remove "
            "bf16_layers.modules and keep your file",
        )
    file = PrecisionFile(path=path, recipe=recipe, warnings=tuple(warnings))
    set_path(result.data, NEMO_RL_KEY, os.path.realpath(path))
    result.files[str(path)] = file.text()
    result.warnings.extend(w.about("nemo-rl") for w in warnings)
    result.notes.append(
        Message(
            f"{len(file.patterns)} BF16 module pattern(s) for training go to {path.name} "
            f"({NEMO_RL_KEY}); megatron-core matches them against its module names",
            "nemo-rl",
        )
    )
    return result
