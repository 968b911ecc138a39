"""The NeMo RL adapter: refuse (:mod:`.checks`, :mod:`.alignment`), spell (:mod:`.spelling`),
merge into an overlay of the input file (or the fully resolved config)."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...capabilities import NVFP4_GENERATION_REFUSAL, capability
from ...dotted import delete_path, flatten, get_path, nest, set_path
from ...errors import FP8ConfigError
from ...spec import RecipeSpec
from .. import ApplyResult, HostAdapter, HostContext, HostKeys
from . import native
from .alignment import ALIGNMENT_KEYS, sequence_alignment
from .checks import (
    _checks,
    _contradiction,
    _desired,
    _dropped_keys,
    _fp8_param_stated,
    _has_generation,
    _interpolation_users,
    _leaf,
    _moe_fallback,
    _neutral,
    _same,
)
from .modelopt import qat_merge, qat_recipe_keys, qat_refuse, qat_spell
from .releases import TRUNCATION_KEYS, refuse_unread, request_key, truncation
from .rl_options import edge_layers_as_keywords, is_grpo, refuse_rl_only, router_replay_advice
from .spelling import (
    _MEGATRON,
    _VLLM,
    DEEP_GEMM_BLACKWELL,
    ROUTER_REPLAY,
    SEQUENCE_ERROR,
    _generation_fp8,
    _is_moe,
    _refusal,
    deep_gemm_wanted,
    native_keys,
)

__all__ = ["NeMoRLAdapter", "ADAPTER"]

_MISSING = object()

_DEEP_GEMM = f"{_VLLM}.use_deep_gemm"
"""NeMo RL's switch for vLLM's DeepGEMM block-FP8 kernels."""


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
        # Physical paths, as NeMo RL's loader opens them (``base_dir / item``: the kernel
        # follows a symlinked directory before ``..``); a lexical abspath would name another
        # parent whenever a directory on the way is a link.
        target = os.path.realpath(source.parent / item)
        if output is None:
            out.append(target)
        elif os.path.realpath(output.parent / item) == target:  # resolves as written: kept
            out.append(item)
        else:
            out.append(Path(os.path.relpath(target, os.path.realpath(output.parent))).as_posix())
    return out[0] if isinstance(value, str) else out


def _overlay_base(ctx: HostContext, resolve: bool) -> dict:
    out = copy.deepcopy(dict(ctx.resolved if resolve else ctx.raw))
    if not resolve and "defaults" in out and ctx.path is not None:
        out["defaults"] = _rewrite_defaults(out["defaults"], ctx.path, ctx.output)
    return out


def _in_file(ctx: HostContext) -> bool:
    """Whether an overlay can carry the output: every request key is in the file itself
    (policy.precision is rewritten, so a parent's is fine)."""
    return all(
        get_path(ctx.raw, k, _MISSING) is not _MISSING or k == "policy.precision"
        for k in ctx.request.keys
    )


def _refuse(spec: RecipeSpec, ctx: HostContext | None) -> None:
    if spec.qat is not None:  # ModelOpt QAT: none of the Transformer Engine keys apply
        if ctx is not None:
            qat_refuse(spec, ctx)
            refuse_rl_only(spec, ctx)
            _dropped_keys(ctx.resolved, ctx.assumed_version("nemo-rl"))
            _interpolation_users(ctx.resolved, list(ctx.request.keys))
        return
    refusal = _refusal(spec)
    if refusal:
        key = (
            "recipe"
            if ctx is None
            else (
                "fp8.recipe"
                if isinstance(ctx.resolved.get("fp8"), Mapping)
                else ctx.request.keys[0]
            )
        )
        raise FP8ConfigError(
            refusal,
            key=key,
            value=spec.name,
            hint="use fp8_blockwise (block scales are computed from the current "
            "weights at every step)",
        )
    if ctx is None:
        return
    _checks(spec, ctx.resolved)
    refuse_rl_only(spec, ctx)
    _refuse_deep_gemm(spec, ctx)
    _dropped_keys(ctx.resolved, ctx.assumed_version("nemo-rl"))
    _interpolation_users(ctx.resolved, list(ctx.request.keys))
    sequence_alignment(spec, ctx.resolved, ctx.assumed_version("nemo-rl"))


def _block_generation(spec: RecipeSpec, ctx: HostContext) -> bool:
    """Whether NeMo RL generates this recipe with block-FP8 vLLM layers (use_deep_gemm)."""
    return (
        _generation_fp8(spec)
        and capability(spec.scaling).is_block
        and _has_generation(ctx.resolved)
    )


def _refuse_deep_gemm(spec: RecipeSpec, ctx: HostContext) -> None:
    """A config stating ``use_deep_gemm: true`` for block-FP8 generation on Blackwell is
    refused (:data:`DEEP_GEMM_BLACKWELL`); the user's own ``false`` is kept by :func:`_spell`."""
    if not _block_generation(spec, ctx) or deep_gemm_wanted(spec):
        return
    if get_path(ctx.resolved, _DEEP_GEMM, None) is not True:
        return
    if spec.generation_numerics == "vllm_deepgemm_ue8m0":
        raise FP8ConfigError(
            "is true, which makes NeMo RL set VLLM_USE_DEEP_GEMM_E8M0=0 in its vLLM workers "
            "(DeepGEMM with fp32 scales), and generation_numerics: vllm_deepgemm_ue8m0 is "
            "DeepGEMM's UE8M0 mode, vLLM's default",
            key=_DEEP_GEMM,
            value=True,
            hint=f"set {_DEEP_GEMM}: false, or use generation_numerics: vllm",
        )
    raise FP8ConfigError(
        f"is true, but the target GPU is {spec.hardware}: {DEEP_GEMM_BLACKWELL}",
        key=_DEEP_GEMM,
        value=True,
        hint=f"set {_DEEP_GEMM}: false (it sets no variable: vLLM then runs DeepGEMM "
        "with power-of-2 (UE8M0) scales there, or CUTLASS with fp32 ones under "
        "VLLM_USE_DEEP_GEMM=0; apply says which the recipe needs)",
    )


def _spell(spec: RecipeSpec, ctx: HostContext) -> HostKeys:
    """The recipe's keys for this config: the MoE router from the config when the model is
    unknown, the training keys only for a config without generation, the sequence lengths
    alignment needs."""
    if spec.qat is not None:  # the RL options are policy and GRPO keys: QAT takes them too
        qat = qat_spell(spec, ctx)
        if spec.router_replay:
            set_path(qat.keys, ROUTER_REPLAY, True)
        if spec.importance_sampling.max_sequence_error is not None:
            set_path(qat.keys, SEQUENCE_ERROR, spec.importance_sampling.max_sequence_error)
        return qat
    resolved = ctx.resolved
    warnings: list[str] = []
    if ctx.request.model and ctx.model is None:
        warnings.append(
            f"model {ctx.request.model!r} is not in the architecture table: per-layer rules "
            f"and the MoE check cannot resolve against it"
        )
    hk = native_keys(spec, model=ctx.model, fp8_param_stated=_fp8_param_stated(resolved))
    keys = hk.keys
    training = spec.training == "fp8"
    if training and _is_moe(ctx.model) is None and _moe_fallback(resolved):
        set_path(keys, f"{_MEGATRON}.moe_router_dtype", "fp32")
    elif training and _is_moe(ctx.model) is None:
        warnings.append(
            "cannot tell whether the model is a mixture of experts; if it is, set "
            "policy.megatron_cfg.moe_router_dtype: fp32 as NVIDIA's FP8 MoE recipes do"
        )
    warnings += hk.warnings
    if not _has_generation(resolved):
        warnings.append(
            "the config has no policy.generation section (not an RL config): only the "
            "training keys are written, no generation or importance-sampling keys"
        )
        keys = nest({k: v for k, v in flatten(keys) if k.startswith(_MEGATRON + ".")})
    elif not is_grpo(resolved):  # no GRPO loop reads the threshold (refused when set)
        keys = nest({k: v for k, v in flatten(keys) if k != SEQUENCE_ERROR})
    writes, notes = sequence_alignment(spec, resolved, ctx.assumed_version("nemo-rl"))
    replay_warnings, replay_notes = router_replay_advice(spec, ctx)
    warnings += replay_warnings
    notes += replay_notes
    if _block_generation(spec, ctx) and get_path(ctx.raw, _DEEP_GEMM, None) is False:
        # The user's own file says false: kept. It sets no variable, so vLLM's defaults pick
        # the kernel (DeepGEMM with UE8M0 scales on a stock install: hosts.vllm.rollout).
        if get_path(keys, _DEEP_GEMM, None) is True:
            notes.append(f"nemo-rl: {_DEEP_GEMM}: false kept as your config states it")
        set_path(keys, _DEEP_GEMM, False)
    for key, value in writes.items():
        set_path(keys, key, value)
    notes += edge_layers_as_keywords(spec, ctx, keys)
    from .preflight import spell_rollout_env

    rollout_env, rollout_notes = spell_rollout_env(spec, ctx, keys)
    notes += rollout_notes
    if capability(spec.scaling).is_nvfp4 and training:
        notes.append(
            f"nemo-rl: {spec.name} trains in NVFP4 and generates in BF16 "
            f"({NVFP4_GENERATION_REFUSAL}); the importance-sampling correction "
            f"absorbs the difference"
        )
    from ..vllm import mla_kv_cache_note

    mla_note = mla_kv_cache_note(spec, ctx.model) if _has_generation(resolved) else None
    notes += [mla_note] if mla_note else []
    return HostKeys(keys=keys, warnings=warnings, env=dict(hk.env) | rollout_env, notes=notes)


def _merge(ctx: HostContext, keys: HostKeys, resolve: bool) -> ApplyResult:
    resolved, spec = ctx.resolved, ctx.spec
    warnings: list[str] = []
    if not resolve and not _in_file(ctx):
        warnings.append(
            "the FP8 request is a root key of a parent file, which an overlay cannot "
            "remove; writing the fully resolved config instead"
        )
        resolve = True
    out = _overlay_base(ctx, resolve)
    notes = list(keys.notes)
    if spec.qat is not None:
        qat_merge(ctx, out, keys)
        _consume_request(ctx, out)
        _refuse_at_startup(ctx, out, resolve)
        return ApplyResult(data=out, warnings=warnings, notes=notes)
    flat = dict(flatten(keys.keys))
    aligned = {k: flat.pop(k) for k in ALIGNMENT_KEYS if k in flat}
    truncated = {k: flat.pop(k) for k in TRUNCATION_KEYS if k in flat}
    native = HostKeys(keys=nest(flat))
    for key, want, written in _desired(spec, native, rl=_has_generation(resolved)):
        _merge_key(ctx, out, key, want, written, notes)
    if truncated:
        _merge_truncation(ctx, out, truncated, notes)
    for key, value in aligned.items():
        set_path(out, key, value)
    _consume_request(ctx, out)
    _refuse_at_startup(ctx, out, resolve)
    return ApplyResult(
        data=out,
        warnings=warnings + list(keys.warnings),
        notes=notes,
        env=dict(keys.env),
    )


def _consume_request(ctx: HostContext, out: dict) -> None:
    """The plugin's request keys leave the output (``policy.precision`` back to bfloat16)."""
    for key in ctx.request.keys:
        if key == "policy.precision":
            set_path(out, key, "bfloat16")
        else:
            delete_path(out, key)


def _merge_key(ctx: HostContext, out: dict, key: str, want: Any, written: bool, notes: list):
    """One native key: written, kept in the user's spelling (or as the user's own choice the
    recipe can live with, with a note), or refused as a contradiction."""
    raw, resolved, spec = ctx.raw, ctx.resolved, ctx.spec
    have = get_path(resolved, key, _MISSING)
    if _leaf(key) == "moe_router_dtype" and get_path(raw, key, None) == "fp64":
        # The user's own file asks for an fp64 router: more precise than the fp32 FP8
        # recipes need, so it is the user's choice, kept (an inherited fp64 is not).
        set_path(out, key, "fp64")
        return
    if have is _MISSING:
        if written and (not _same(key, None, want) or key in _required(ctx)):
            set_path(out, key, want)
        return
    if _same(key, have, want):
        if written:
            set_path(out, key, have)  # explicit in the output, in the user's spelling
        return
    if _inert_count(ctx, key, have):
        if written:
            set_path(out, key, want)
        notes.append(
            f"nemo-rl: {key}: {have} replaced by {want}: at this release it never reaches vLLM "
            f"(the layers are written as quantization_ignored_layer_kws)"
        )
        return
    kept = _users_choice(ctx, key, have, want)
    if kept is not None:
        if get_path(out, key, _MISSING) is _MISSING:
            set_path(out, key, have)  # an overlay of a file whose parent set it: unchanged
        notes.append(kept)
        return
    if not _neutral(key, have, resolved):
        raise _contradiction(key, have, want, spec)
    if written:
        set_path(out, key, want)


def _inert_count(ctx: HostContext, key: str, have: Any) -> bool:
    """A ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16`` saying what the rules say,
    at a release where the counts never reach vLLM (:mod:`.ignored_layers`): the rules' layers
    are written as keywords instead, and the count changes nothing."""
    from .ignored_layers import counts_reach_vllm

    rules = ctx.spec.bf16_layers
    counts = {
        f"{_VLLM}.num_first_layers_in_bf16": rules.first,
        f"{_VLLM}.num_last_layers_in_bf16": rules.last,
    }
    if key not in counts or counts_reach_vllm(ctx.assumed_version("nemo-rl")):
        return False
    return rules.acts_on("generation") and _same(key, have, counts[key])


def _required(ctx: HostContext) -> tuple[str, ...]:
    """The keys the assumed release reads without a default (written where the chain lacks
    them, even with the value meaning "off"): :data:`.native.REQUIRED`, and at v0.6.0 the GRPO
    sequence-masking threshold (``master_config["grpo"]["seq_logprob_error_threshold"]``)."""
    from ...stacks import lookup

    release = ctx.assumed_version("nemo-rl")
    fact = f"{SEQUENCE_ERROR} is read by subscript"
    return native.REQUIRED + ((SEQUENCE_ERROR,) if lookup("nemo-rl", fact, release).present else ())


def _stated(ctx: HostContext, field: str, *inner: str) -> bool:
    """Whether the user's ``fp8:`` block states ``field`` (and, for a mapping such as
    ``importance_sampling``, one of ``inner``), so a native value otherwise is a conflict
    rather than a choice the preset's default must give way to."""
    if field not in ctx.stated:
        return False
    if not inner:
        return True
    block = ctx.resolved.get("fp8")
    value = block.get(field) if isinstance(block, Mapping) else None
    return isinstance(value, Mapping) and any(k in value for k in inner)


def _users_choice(ctx: HostContext, key: str, have: Any, want: Any) -> str | None:
    """A note when the config's own value at ``key`` is a choice the recipe can live with and
    the ``fp8:`` block does not state otherwise (so it stands), else None.

    An FP8 KV cache (FP8 generation; NeMo RL recalibrates its scales every step) and
    power-of-2 rollout scales on a block recipe (rollouts and training then quantize to
    different scale grids; the importance-sampling correction absorbs it)."""
    leaf = _leaf(key)
    spec = ctx.spec
    stated_error = _stated(ctx, "importance_sampling", "max_sequence_error")
    if key == SEQUENCE_ERROR and want is None and not stated_error:
        return (
            f"nemo-rl: {key}: {have} kept as your config states it (sequences whose log-prob "
            f"error exceeds it leave the loss; state importance_sampling.max_sequence_error in "
            f"the fp8: block to change it)"
        )
    if leaf == "kv_cache_dtype" and _generation_fp8(spec) and not _stated(ctx, "kv_cache"):
        if isinstance(have, str) and have.startswith("fp8") and want == "auto":
            return (
                f"nemo-rl: {key}: {have} kept as your config states it (an FP8 KV cache; "
                f"state kv_cache: auto in the fp8: block to turn it off)"
            )
    pow2 = leaf in ("pow2_weight_scaling_factors", "pow2_activation_scaling_factors")
    if pow2 and capability(spec.scaling).is_block and not _stated(ctx, "pow2_scales"):
        choice = have is True or (have is False and get_path(ctx.raw, key, None) is False)
        if choice and isinstance(want, bool):
            grid = "power-of-2" if have else "fp32"
            return (
                f"nemo-rl: {key}: {have} kept as your config states it: rollouts use {grid} "
                f"block scales while {spec.name} trains with "
                f"{'power-of-2' if spec.pow2_scales else 'fp32'} ones (the importance-sampling "
                f"correction absorbs the difference); state pow2_scales in the fp8: block to "
                f"set both sides"
            )
    return None


def _merge_truncation(ctx: HostContext, out: dict, want: dict[str, Any], notes: list) -> None:
    """The truncation keys as one setting, read as the assumed release reads them
    (:func:`~nemo_fp8_plugin.hosts.nemo_rl.releases.truncation`: a type without a ratio is
    inert at v0.6.0). Equal: nothing written. The config's own truncation where the recipe
    asks for none and the ``fp8:`` block does not state one: kept, with a note. None in the
    config: the recipe's written. Two different ones: refused naming both."""
    from ...errors import ConflictingKeyError, format_value
    from .values import resolved_value

    release = ctx.assumed_version("nemo-rl")
    have_values = {k: resolved_value(ctx.resolved, k) for k in TRUNCATION_KEYS}
    have = truncation(have_values, release)
    wanted = truncation(want, release)
    if _same_truncation(have, wanted):
        return
    off = (None, None, None)
    stated = _stated(ctx, "importance_sampling", "truncation", "ratio_max", "ratio_min")
    if wanted == off and not stated:
        notes.append(
            f"nemo-rl: loss_fn truncation kept as your config states it: {have[0]}, ratio "
            f"{have[1]}" + (f", ratio_min {have[2]}" if have[2] is not None else "")
        )
        return
    if have == off:
        for key, value in want.items():
            if value is not None or have_values[key] is not None:
                set_path(out, key, value)
        return
    key = next(k for k, a, b in zip(TRUNCATION_KEYS, have, wanted) if not _same(k, a, b))
    raise ConflictingKeyError(
        f"already turns truncation on as {_truncation_text(have)}, but {ctx.spec.name} as "
        f"requested needs {_truncation_text(wanted)}",
        key=key,
        value=get_path(ctx.resolved, key),
        hint="state the truncation you want once: in the fp8: block's importance_sampling "
        f"(truncation, ratio_max, ratio_min), or remove it there to keep the config's "
        f"(now {format_value(have[0])})",
    )


def _same_truncation(a: tuple, b: tuple) -> bool:
    return all(_same(k, x, y) for k, x, y in zip(TRUNCATION_KEYS, a, b))


def _truncation_text(t: tuple) -> str:
    if t[0] is None and t[1] is None:
        return "none"
    return f"{t[0]} ratio {t[1]}" + (f" ratio_min {t[2]}" if t[2] is not None else "")


def _refuse_at_startup(ctx: HostContext, out: dict, resolve: bool) -> None:
    """NeMo RL's own FP8 start-up asserts (:func:`~.startup.startup_problems`) on the config
    as it would be written (``out`` over its ``defaults:`` parents), the first refused; a
    request that turns the importance-sampling correction off is named as the cause."""
    from .startup import startup_problems

    final = out if resolve else _written_over_parents(ctx, out)  # as _final(ctx, out)
    problems = startup_problems(final, ctx.assumed_version("nemo-rl"))
    if not problems:
        return
    first = problems[0]
    is_off = not ctx.spec.importance_sampling.enabled
    if first.key == "loss_fn.use_importance_sampling_correction" and is_off:
        raise FP8ConfigError(
            first.bare_message.replace("is not true", "is off (importance_sampling: false)"),
            key=request_key(ctx, "importance_sampling"),
            value=False,
            hint="leave importance_sampling on for FP8 generation (NeMo RL requires it), or "
            "generate in BF16 (generation: bf16)",
        )
    raise first


def _final(ctx: HostContext, out: dict) -> dict:
    """The whole configuration the output ``out`` makes: itself when fully resolved (a
    ``defaults:`` the input had is gone), else an overlay over its parents."""
    if "defaults" in ctx.raw and "defaults" not in out:
        return out
    return _written_over_parents(ctx, out)


def _written_over_parents(ctx: HostContext, out: dict) -> dict:
    """The whole configuration an overlay ``out`` makes: its ``defaults:`` parents (the
    resolved input) with what ``out`` changes and drops applied."""
    from .. import diff_written

    final = copy.deepcopy(dict(ctx.resolved))
    written, removed = diff_written(ctx.raw, out)
    for key, value in flatten(written):
        set_path(final, key, value)
    for key in removed:
        delete_path(final, key)
    return final


class NeMoRLAdapter(HostAdapter):
    """NeMo RL (its YAML with a ``defaults:`` chain; training, generation and loss keys).

    ``resolve``: write the fully merged config instead of an overlay of the input file (the
    default overlay rewrites ``defaults:`` relative to where the output is written; a
    request that is a root key of a parent file makes the output fully resolved, with a
    warning)."""

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

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        _refuse(spec, ctx)

    def spell(self, spec: RecipeSpec, ctx: HostContext | None = None, *, model=None) -> HostKeys:
        if ctx is None and spec.qat is not None:
            return qat_recipe_keys(spec, model)
        if ctx is None:
            return native_keys(spec, model)
        return _spell(spec, ctx)

    def merge(self, ctx: HostContext, keys: HostKeys) -> ApplyResult:
        from .te_precision import nemo_rl_precision_file

        # a key only for a release that reads it (NeMo RL ignores unknown keys silently)
        refuse_unread(ctx, keys.keys)
        # module rules reach training through the TE precision file where NeMo RL has its key
        result = nemo_rl_precision_file(ctx, _merge(ctx, keys, self.resolve))
        if ctx.spec.qat is None:
            from .preflight import preflight

            preflight(ctx, result, _final(ctx, result.data))
        return result

    def passthrough(self, ctx: HostContext) -> Any:
        return _overlay_base(ctx, self.resolve)

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        # NeMo RL is not installable from the registry; its keys are checked against its own
        # source in the test suite (tests/hosts/test_contract_hosts.py).
        return ["nemo-rl: not checked here (NeMo RL does not install from a package index)"]

    default = staticmethod(native.hook_default)  # NeMo RL's own defaults (native.py)
    read_native = staticmethod(native.read_native)  # explain on a config already in FP8


ADAPTER = NeMoRLAdapter()
"""The NeMo RL adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
