"""What a NeMo RL config's rollouts will run, before they run: the kernel and scale grid vLLM
picks (and the variables that keep the recipe's grid, :mod:`.rollout`), the KV cache a
colocated engine gets (:mod:`nemo_fp8_plugin.hosts.vllm.memory`), and which modules vLLM
really leaves in BF16 for the ignore list NeMo RL hands it
(:mod:`nemo_fp8_plugin.hosts.vllm.ignore`).

:func:`spell_rollout_env` is part of the adapter's spelling (the variables are written where
the release reads them); :func:`preflight` runs on the configuration as it will be written and
adds records (:attr:`ApplyResult.checks`: plain data for ``explain --json`` and ``doctor``) and
the lines that say them (notes; a warning for what is lost).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...dotted import get_path
from .. import ApplyResult, HostContext, Message, Spelling
from .releases import assumed_release
from .rollout import ENV_VARS_KEY, needed_line, rollout_archs, rollout_checks, rollout_line
from .spelling import _VLLM, _generation_fp8

if TYPE_CHECKING:
    from ...rules import ModelDescription
    from ...spec import RecipeSpec
    from .rollout import RolloutCheck

__all__ = ["spell_rollout_env", "preflight"]

_MISSING = object()


def _target_arch(spec: RecipeSpec) -> str | None | bool:
    """The GPU generation to judge: the spec's target when the rollout table knows it, None
    when no target is stated, False for a target it does not (no check)."""
    from ..vllm.rollout import GPU_ARCHS

    if spec.hardware is None:
        return None
    return spec.hardware if spec.hardware in GPU_ARCHS else False


def _checks(
    spec: RecipeSpec, ctx: HostContext, vllm_cfg: Mapping[str, Any]
) -> tuple[list[RolloutCheck], dict[str, str]]:
    arch = _target_arch(spec)
    use_deep_gemm = vllm_cfg.get("use_deep_gemm", False) is True
    if arch is False:
        return [], {}
    archs = [arch] if isinstance(arch, str) else rollout_archs(spec, use_deep_gemm)
    pow2 = tuple(
        vllm_cfg.get(f"pow2_{w}_scaling_factors") is True for w in ("weight", "activation")
    )
    env = vllm_cfg.get("env_vars")
    return rollout_checks(
        spec,
        assumed_release(ctx),
        archs,
        use_deep_gemm=use_deep_gemm,
        pow2=(pow2[0], pow2[1]),
        env=env if isinstance(env, Mapping) else None,
    )


def _reads_env_vars(ctx: HostContext) -> bool:
    from ...stacks import lookup

    return lookup("nemo-rl", ENV_VARS_KEY, assumed_release(ctx)).present is True


def spell_rollout_env(
    spec: RecipeSpec, ctx: HostContext, keys: Spelling
) -> tuple[dict[str, str], list[Message]]:
    """The variables that keep the recipe's scale grid in the rollouts, for the config as
    ``keys`` (as spelled) leave it: written into ``keys`` under
    ``policy.generation.vllm_cfg.env_vars`` where the release reads it; otherwise returned as
    ``(env, notes)`` for the environment NeMo RL starts from."""
    from .values import resolved_value

    if not (
        _generation_fp8(spec) and isinstance(get_path(ctx.resolved, "policy.generation"), Mapping)
    ):
        return {}, []

    def value(leaf: str) -> Any:
        got = keys.get(f"{_VLLM}.{leaf}", _MISSING)
        return resolved_value(ctx.resolved, f"{_VLLM}.{leaf}") if got is _MISSING else got

    vllm_cfg = {
        leaf: value(leaf)
        for leaf in (
            "use_deep_gemm",
            "pow2_weight_scaling_factors",
            "pow2_activation_scaling_factors",
            "env_vars",
        )
    }
    _, needed = _checks(spec, ctx, vllm_cfg)
    if not needed:
        return {}, []
    release = assumed_release(ctx)
    if _reads_env_vars(ctx):
        for name, setting in needed.items():
            keys.set(f"{ENV_VARS_KEY}.{name}", setting)
        return {}, [Message(needed_line(needed, release, spec, in_config=True), "nemo-rl")]
    return dict(needed), [Message(needed_line(needed, release, spec, in_config=False), "nemo-rl")]


def preflight(ctx: HostContext, result: ApplyResult, final: Mapping[str, Any]) -> None:
    """Add the pre-flight records and lines to ``result``, judged on ``final`` (the whole
    configuration the output makes)."""
    spec = ctx.spec
    generation = get_path(final, "policy.generation")
    if not isinstance(generation, Mapping):
        return
    vllm_cfg = generation.get("vllm_cfg")
    vllm_cfg = vllm_cfg if isinstance(vllm_cfg, Mapping) else {}
    if spec.qat is not None:  # ModelOpt QAT: of these, only its real-quant ignore list applies
        if _real_quant_rules(spec) and isinstance(generation.get("real_quant_ignore"), list):
            _ignore_list(ctx, result, vllm_cfg, real_quant=generation["real_quant_ignore"])
        return
    if _generation_fp8(spec) and generation.get("backend", "vllm") == "vllm":
        # judged without the config's variables, so ``needed`` names all the grid needs (in the
        # config where the release reads them there, else for the environment)
        checks, needed = _checks(spec, ctx, {**vllm_cfg, "env_vars": None})
        if checks:
            release = assumed_release(ctx)
            result.checks["rollout"] = {
                "gpus": [c.to_dict() for c in checks],
                "needed": dict(needed),
                "where": ENV_VARS_KEY if _reads_env_vars(ctx) else "environment",
            }
            line = rollout_line(checks, release, spec)
            said = None if line is None else Message(line, "nemo-rl")
            result.checks["rollout"]["line"] = None if said is None else str(said)
            if said is not None:
                lost = any(c.kernel is not None and not c.matches for c in checks)
                (result.warnings if lost else result.notes).append(said)
        _ignore_list(ctx, result, vllm_cfg)
    if generation.get("backend", "vllm") == "vllm":
        _kv_cache(ctx, result, final)


def _real_quant_rules(spec: RecipeSpec) -> bool:
    """A ModelOpt QAT real-quant rollout whose ``real_quant_ignore`` the BF16 rules wrote."""
    return spec.qat is not None and spec.qat.rollout == "real_quant" and not spec.bf16_layers.empty


def _ignore_list(
    ctx: HostContext,
    result: ApplyResult,
    vllm_cfg: Mapping[str, Any],
    real_quant: list[str] | None = None,
) -> None:
    """The modules vLLM really leaves in BF16 for the list NeMo RL builds from ``vllm_cfg``
    (or, given ``real_quant``, the QAT rollout's ``real_quant_ignore``, which NeMo RL hands
    ModelOpt as ``exclude_modules``: ``modelopt/utils.py`` ~79-108 at main 7ea279a), beside
    what the rules meant: a warning for each kind of difference, naming the modules."""
    from ...capabilities import capability
    from ..vllm.ignore import ignore_list_report
    from .ignored_layers import nemo_rl_ignored_layers
    from .rollout import vllm_of

    spec, model = ctx.spec, ctx.model
    release = assumed_release(ctx)
    vllm = vllm_of(release)
    if model is None or vllm is None:
        return
    # block FP8: vLLM's fp8 method (ignored_layers); MXFP8 (main): ModelOpt's, which NeMo RL
    # hands the same list as "ignore" (fp8.py ~302), matched with its substring fallback
    method = "modelopt" if capability(spec.scaling).is_mx or real_quant is not None else "fp8"
    if real_quant is None:
        entries = nemo_rl_ignored_layers(model, vllm_cfg, release)
        records = ignore_list_report(spec, model, entries, release=vllm, method=method)
    else:  # QAT: the recipe's generation side is not FP8, so the rules alone say what is meant
        entries = real_quant
        records = ignore_list_report(spec.bf16_layers, model, entries, release=vllm, method=method)
    differ = [r for r in records if r.status != "agrees"]
    result.checks["ignore_list"] = {
        "vllm": vllm,
        "method": method,
        "entries": len(entries),
        "differ": [r.to_dict() for r in differ],
    }
    for status, what in _DIFFERENCES.items():
        found = [r for r in differ if r.status == status]
        if not found:
            continue
        shown = ", ".join(r.module for r in found[:3]) + (
            f" and {len(found) - 3} more" if len(found) > 3 else ""
        )
        first = found[0]
        how = f" ({first.how}: {first.entry})" if first.entry else ""
        if any(r.module == "lm_head" for r in found) and status == "missing" and real_quant is None:
            how += "; NeMo RL builds the list from the base model's names, without the output head"
        said = what.format(n=len(found), vllm=vllm)
        if real_quant is not None:
            said = said.replace("the ignore list NeMo RL builds", f"{_GEN}.real_quant_ignore")
        result.warnings.append(Message(f"{said}: {shown}{how}", "nemo-rl"))


_DIFFERENCES = {
    "extra": "vLLM {vllm} leaves {n} module(s) in BF16 that the rules keep in FP8, as it "
    "matches the ignore list NeMo RL builds",
    "missing": "vLLM {vllm} quantizes {n} module(s) the rules keep in BF16: the ignore list "
    "NeMo RL builds does not reach them",
    "refused": "vLLM {vllm} refuses to load the model: the ignore list NeMo RL builds names some "
    "but not all parts of {n} fused module(s)",
}
"""The warning of each kind of difference (:class:`~nemo_fp8_plugin.hosts.vllm.ignore.IgnoreRecord`
status)."""


_GEN = "policy.generation"
_KV_BYTES = f"{_GEN}.vllm_kwargs.kv_cache_memory_bytes"
_UTILIZATION = f"{_VLLM}.gpu_memory_utilization"


def _gpu_name(ctx: HostContext) -> str | None:
    """The GPU as the user named it (``--hardware``, else ``fp8.hardware``): an H100 and an
    H200 are one architecture with different memory."""
    if ctx.hardware is not None:
        return ctx.hardware
    block = ctx.resolved.get("fp8")
    named = block.get("hardware") if isinstance(block, Mapping) else None
    return named if isinstance(named, str) else None


def _hf_config(model: ModelDescription) -> Mapping[str, Any] | None:
    """The model's ``config.json`` when the description was read from one (heads, vocabulary:
    sizes the weight count needs); None for a built-in description."""
    from pathlib import Path

    from ..._io import read_user_json

    source = Path(str(model.source))
    if model.source in ("built-in", "mapping", "TransformerConfig") or not source.is_file():
        return None
    found = read_user_json(source, key="--model-config", what="model config")
    return found if isinstance(found, Mapping) else None


def _bf16_generation(spec: RecipeSpec) -> RecipeSpec:
    import dataclasses

    return dataclasses.replace(spec, generation="bf16", kv_cache="auto", training="fp8")


def _kv_cache(ctx: HostContext, result: ApplyResult, final: Mapping[str, Any]) -> None:
    """The KV cache a colocated engine gets on the named GPU (an estimate), and the hint to pin
    it where the release's vLLM sizes it larger than 0.20 did."""
    from ...errors import FP8ConfigError
    from ..vllm.memory import GIB, estimate_kv_cache
    from .rollout import vllm_of
    from .values import resolved_value

    if resolved_value(final, f"{_GEN}.colocated.enabled") is not True or ctx.model is None:
        return
    spec, model = ctx.spec, ctx.model
    if not _generation_fp8(spec) and spec.generation == "fp8":
        spec = _bf16_generation(spec)  # NeMo RL rolls tensorwise recipes out in BF16
    gpu = _gpu_name(ctx)
    keys = {
        "gpu_memory_utilization": _UTILIZATION,
        "tensor_parallel_size": f"{_VLLM}.tensor_parallel_size",
        "kv_cache_memory_bytes": _KV_BYTES,
    }
    settings = {
        "gpu_memory_utilization": resolved_value(final, _UTILIZATION, 0.9),
        "tensor_parallel_size": resolved_value(final, keys["tensor_parallel_size"], 1),
        "kv_cache_memory_bytes": resolved_value(final, _KV_BYTES),
    }
    vllm = vllm_of(assumed_release(ctx))
    try:
        estimate = estimate_kv_cache(
            spec,
            model,
            hardware=gpu,
            vllm_version=vllm,
            colocated=True,
            config=_hf_config(model),
            **settings,
        )
    except FP8ConfigError as err:  # named as the NeMo RL key
        raise FP8ConfigError(
            err.bare_message, key=keys.get(err.key or "", err.key), value=err.value
        ) from None
    record = estimate.to_dict()
    record["keys"] = dict(keys)
    record["lines"] = lines = []
    result.checks["kv_cache"] = record
    weights = f"{estimate.weight_bytes / GIB:.1f} GiB of weights per GPU"
    memory = estimate.gpu_memory_bytes
    # a KV cache of none (the weights exceed the budget) is the hint's warning below
    if estimate.kv_cache_bytes is not None and estimate.kv_cache_bytes > 0 and memory is not None:
        if estimate.estimated:
            line = (
                f"KV cache of the colocated vLLM engine on one {gpu}: about "
                f"{estimate.kv_cache_bytes / GIB:.1f} GiB, an estimate: "
                f"{_UTILIZATION.rsplit('.', 1)[1]} {estimate.gpu_memory_utilization} x "
                f"{memory / GIB:.0f} GiB - {weights} ({spec.name}); vLLM's own profiling also "
                f"sets aside its activation peak and CUDA graphs"
            )
        else:
            line = (
                f"KV cache of the colocated vLLM engine on one {gpu}: "
                f"{estimate.kv_cache_bytes / GIB:.1f} GiB ({_KV_BYTES}), next to about {weights}"
            )
        if estimate.assumptions:
            line += f" (the weight count: {'; '.join(estimate.assumptions)})"
        said = Message(line, "nemo-rl")
        result.notes.append(said)
        lines.append(str(said))
    for hint in estimate.hints:
        if hint.code == "unknown_gpu_memory":
            continue
        text = hint.message + (
            f"; in NeMo RL: {_KV_BYTES}" if hint.key == "kv_cache_memory_bytes" else ""
        )
        lost = hint.code in ("weights_exceed_budget", "pinned_exceeds_memory")
        said = Message(text, "nemo-rl")
        (result.warnings if lost else result.notes).append(said)
        lines.append(str(said))
