"""The NeMo RL adapter: refuse (:mod:`.checks`), spell for the config (:mod:`.spelling`, the
sequence lengths of :mod:`.alignment`, the loss's truncation, the user's own choices), written
by the shared writer into an overlay of the input file (or the fully resolved config), then
NeMo RL's own start-up asserts and the TE precision file."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...capabilities import NVFP4_GENERATION_REFUSAL, capability
from ...dotted import get_path
from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from ...kinds import kind
from ...spec import RecipeSpec
from ...stacks import release_version
from .. import ApplyResult, HostAdapter, HostContext, Message, Spelling, Write, diff_written
from . import native
from .checks import (
    _absent_value,
    _checks,
    _dropped_keys,
    _fp8_param_stated,
    _guards,
    _has_generation,
    _interpolation_users,
    _leaf,
    _moe_fallback,
    _neutral,
    _same,
)
from .modelopt import qat_recipe_keys, qat_refuse, qat_spell
from .releases import (
    TRUNCATION_KEYS,
    assumed_release,
    refuse_unread,
    release_choice,
    request_key,
    truncation,
)
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


def _in_file(ctx: HostContext) -> bool:
    """Whether an overlay can carry the output: every request key is in the file itself
    (policy.precision is rewritten, so a parent's is fine)."""
    assert ctx.request is not None
    return all(
        get_path(ctx.raw, k, _MISSING) is not _MISSING or k == "policy.precision"
        for k in ctx.request.keys
    )


def _refuse(spec: RecipeSpec, ctx: HostContext | None) -> None:
    if spec.qat is not None:  # ModelOpt QAT: none of the Transformer Engine keys apply
        if ctx is not None:
            assert ctx.request is not None
            qat_refuse(spec, ctx)
            refuse_rl_only(spec, ctx)
            _dropped_keys(ctx.resolved, assumed_release(ctx))
            _interpolation_users(ctx.resolved, list(ctx.request.keys))
        return
    refusal = _refusal(spec)
    if refusal:
        raise FP8ConfigError(
            refusal,
            key="recipe" if ctx is None else request_key(ctx, ""),
            value=spec.name,
            hint="use fp8_blockwise (block scales are computed from the current "
            "weights at every step)",
        )
    if ctx is None:
        return
    assert ctx.request is not None
    _checks(spec, ctx.resolved)
    refuse_rl_only(spec, ctx)
    _refuse_deep_gemm(spec, ctx)
    _dropped_keys(ctx.resolved, assumed_release(ctx))
    _interpolation_users(ctx.resolved, list(ctx.request.keys))


def _block_generation(spec: RecipeSpec, ctx: HostContext) -> bool:
    """Whether NeMo RL generates this recipe with block-FP8 vLLM layers (use_deep_gemm)."""
    deep_gemm = capability(spec.scaling).deepgemm_generation
    return _generation_fp8(spec) and deep_gemm and _has_generation(ctx.resolved)


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


def _spell(spec: RecipeSpec, ctx: HostContext, resolve: bool) -> Spelling:
    """The recipe's keys for this config: one step per concern, each reading the config."""
    assert ctx.request is not None
    out = Spelling()
    if not resolve and not _in_file(ctx):
        out.warnings.append(
            Message(
                "the FP8 request is a root key of a parent file, which an overlay cannot "
                "remove; writing the fully resolved config instead"
            )
        )
    if spec.qat is not None:  # the RL options are policy and GRPO keys: QAT takes them too
        out.extend(qat_spell(spec, ctx))
        if spec.router_replay:
            out.set(ROUTER_REPLAY, True)
        if spec.importance_sampling.max_sequence_error is not None:
            out.set(SEQUENCE_ERROR, spec.importance_sampling.max_sequence_error)
    else:
        _recipe(spec, ctx, out)
    # The request is consumed: policy.precision back to bfloat16, the other keys removed.
    if "policy.precision" in ctx.request.keys:
        out.set("policy.precision", "bfloat16", checked=False)
    # a key only for a release that reads it (NeMo RL ignores unknown keys silently)
    refuse_unread(ctx, out.keys)
    return out


def _recipe(spec: RecipeSpec, ctx: HostContext, out: Spelling) -> None:
    resolved = ctx.resolved
    assert ctx.request is not None
    if ctx.request.model and ctx.model is None:
        out.warnings.append(
            Message(
                f"model {ctx.request.model!r} is not in the architecture table: per-layer "
                f"rules and the MoE check cannot resolve against it"
            )
        )
    te = release_version(assumed_release(ctx), "transformer-engine")
    hk = native_keys(spec, model=ctx.model, fp8_param_stated=_fp8_param_stated(resolved), te=te)
    # The training keys (written whatever the config's sections) that the release does not
    # read, refused before the config's own keys are checked against them (sequence packing,
    # alignment, below): what the release cannot train is the first thing to change, and the
    # one line names the release. The whole spelling is checked again at the end.
    training_keys = [w for w in hk.writes if w.key.startswith(_MEGATRON + ".")]
    refuse_unread(ctx, Spelling(writes=training_keys).keys)
    training = spec.training == "fp8"
    router = f"{_MEGATRON}.moe_router_dtype"
    if training and _is_moe(ctx.model) is None and _moe_fallback(resolved):
        hk.set(router, "fp32")
    elif training and _is_moe(ctx.model) is None:
        out.warnings.append(
            Message(
                "cannot tell whether the model is a mixture of experts; if it is, set "
                "policy.megatron_cfg.moe_router_dtype: fp32 as NVIDIA's FP8 MoE recipes do"
            )
        )
    out.warnings += hk.warnings
    out.env.update(hk.env)
    rl = _has_generation(resolved)
    if not rl:
        out.warnings.append(
            Message(
                "the config has no policy.generation section (not an RL config): only the "
                "training keys are written, no generation or importance-sampling keys"
            )
        )
        hk.writes = [w for w in hk.writes if w.key.startswith(_MEGATRON + ".")]
    elif not is_grpo(resolved):  # no GRPO loop reads the threshold (refused when set)
        hk.writes = [w for w in hk.writes if w.key != SEQUENCE_ERROR]
    from .alignment import sequence_alignment

    aligned, notes = sequence_alignment(spec, resolved, assumed_release(ctx), _model_known(ctx))
    out.notes += notes
    replay_warnings, replay_notes = router_replay_advice(spec, ctx)
    out.warnings += replay_warnings
    out.notes += replay_notes
    if _block_generation(spec, ctx) and get_path(ctx.raw, _DEEP_GEMM, None) is False:
        # The user's own file says false: kept. It sets no variable, so vLLM's defaults pick
        # the kernel (DeepGEMM with UE8M0 scales on a stock install: hosts.vllm.rollout).
        if hk.get(_DEEP_GEMM) is True:
            out.notes.append(
                Message(f"{_DEEP_GEMM}: false kept as your config states it", "nemo-rl")
            )
        hk.set(_DEEP_GEMM, False)
    out.notes += edge_layers_as_keywords(spec, ctx, hk)
    from .preflight import spell_rollout_env

    rollout_env, rollout_notes = spell_rollout_env(spec, ctx, hk)
    out.notes += rollout_notes
    out.env.update(rollout_env)
    if capability(spec.scaling).megatron_field == "fp4_recipe" and training:
        out.notes.append(
            Message(
                f"{spec.name} trains in NVFP4 and generates in BF16 "
                f"({NVFP4_GENERATION_REFUSAL}); the importance-sampling correction "
                f"absorbs the difference",
                "nemo-rl",
            )
        )
    from ..vllm import mla_kv_cache_note

    mla_note = mla_kv_cache_note(spec, ctx.model) if rl else None
    out.notes += [Message(mla_note)] if mla_note else []
    truncated = {k: hk.get(k) for k in TRUNCATION_KEYS if hk.get(k, _MISSING) is not _MISSING}
    for w in hk.writes:
        if w.key in truncated:
            continue
        if _leaf(w.key) == "moe_router_dtype" and get_path(ctx.raw, w.key, None) == "fp64":
            # The user's own file asks for an fp64 router: more precise than the fp32 FP8
            # recipes need, so it is the user's choice, kept (an inherited fp64 is not).
            continue
        have = get_path(resolved, w.key, _MISSING)
        if have is _MISSING and w.key == SEQUENCE_ERROR and w.value is None:
            if _sequence_error_required(ctx):  # read by subscript: written, even as null
                out.set(w.key, None, checked=False)
            continue
        if have is not _MISSING and _inert_count(ctx, w.key, have, w.value):
            out.set(w.key, w.value, checked=False)
            out.notes.append(
                Message(
                    f"{w.key}: {have} replaced by {w.value}: at this release it never reaches "
                    f"vLLM (the layers are written as quantization_ignored_layer_kws)",
                    "nemo-rl",
                )
            )
            continue
        kept = _users_choice(ctx, w.key, have, w.value) if have is not _MISSING else None
        if kept is not None:
            out.notes.append(kept)
            continue
        out.writes.append(w)
    if truncated:
        _truncation(ctx, truncated, out)
    for key, value in _guards(spec, rl):
        have = get_path(resolved, key, _MISSING)
        kept = _users_choice(ctx, key, have, value) if have is not _MISSING else None
        if kept is not None:
            out.notes.append(kept)
        elif out.get(key, _MISSING) is _MISSING:
            out.guard(key, value)
    for key, value in aligned.items():
        out.set(key, value, checked=False)


def _model_known(ctx: HostContext) -> bool:
    """Whether ``policy.model_name`` is in the model table (described once per command)."""
    from .alignment import MODEL_KEY, _basename
    from .values import resolved_value

    name = resolved_value(ctx.resolved, MODEL_KEY)
    if _basename(name) is None:
        return False
    try:
        ctx.describe(name, "model", (ctx.path or Path("config.yaml")).parent)
    except FP8ConfigError:
        return False
    return True


def _inert_count(ctx: HostContext, key: str, have: Any, want: Any) -> bool:
    """A ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16`` saying what the rules say,
    at a release where the counts never reach vLLM (:mod:`.ignored_layers`): the rules' layers
    are written as keywords instead, and the count changes nothing."""
    from .ignored_layers import counts_reach_vllm

    rules = ctx.spec.bf16_layers
    counts = {
        f"{_VLLM}.num_first_layers_in_bf16": rules.first,
        f"{_VLLM}.num_last_layers_in_bf16": rules.last,
    }
    if key not in counts or counts_reach_vllm(assumed_release(ctx)):
        return False
    if _same(key, have, want):  # already what is written: nothing replaced
        return False
    return rules.acts_on("generation") and _same(key, have, counts[key])


def _sequence_error_required(ctx: HostContext) -> bool:
    """Whether the assumed release reads the GRPO sequence-masking threshold without a default
    (v0.6.0: ``master_config["grpo"]["seq_logprob_error_threshold"]``), so it is written where
    the chain lacks it, even as null ("off"); elsewhere a null threshold is not written."""
    from ...stacks import lookup

    fact = f"{SEQUENCE_ERROR} is read by subscript"
    return bool(lookup("nemo-rl", fact, assumed_release(ctx)).present)


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


def _users_choice(ctx: HostContext, key: str, have: Any, want: Any) -> Message | None:
    """A note when the config's own value at ``key`` is a choice the recipe can live with and
    the ``fp8:`` block does not state otherwise (so it stands), else None.

    An FP8 KV cache (FP8 generation; NeMo RL recalibrates its scales every step) and
    power-of-2 rollout scales on a block recipe (rollouts and training then quantize to
    different scale grids; the importance-sampling correction absorbs it)."""
    if _same(key, have, want):
        return None
    leaf = _leaf(key)
    spec = ctx.spec
    stated_error = _stated(ctx, "importance_sampling", "max_sequence_error")
    if key == SEQUENCE_ERROR and want is None and not stated_error:
        return Message(
            f"{key}: {have} kept as your config states it (sequences whose log-prob "
            f"error exceeds it leave the loss; state importance_sampling.max_sequence_error in "
            f"the fp8: block to change it)",
            "nemo-rl",
        )
    if leaf == "kv_cache_dtype" and _generation_fp8(spec) and not _stated(ctx, "kv_cache"):
        if isinstance(have, str) and have.startswith("fp8") and want == "auto":
            return Message(
                f"{key}: {have} kept as your config states it (an FP8 KV cache; state "
                f"kv_cache: auto in the fp8: block to turn it off)",
                "nemo-rl",
            )
    pow2 = leaf in ("pow2_weight_scaling_factors", "pow2_activation_scaling_factors")
    if pow2 and kind(spec.scaling).nemo_rl_pow2_choice and not _stated(ctx, "pow2_scales"):
        choice = have is True or (have is False and get_path(ctx.raw, key, None) is False)
        if choice and isinstance(want, bool):
            grid = "power-of-2" if have else "fp32"
            return Message(
                f"{key}: {have} kept as your config states it: rollouts use {grid} block scales "
                f"while {spec.name} trains with {'power-of-2' if spec.pow2_scales else 'fp32'} "
                f"ones (the importance-sampling correction absorbs the difference); state "
                f"pow2_scales in the fp8: block to set both sides",
                "nemo-rl",
            )
    return None


def _truncation(ctx: HostContext, want: dict[str, Any], out: Spelling) -> None:
    """The truncation keys as one setting, read as the assumed release reads them
    (:func:`~nemo_fp8_plugin.hosts.nemo_rl.releases.truncation`: a type without a ratio is
    inert at v0.6.0). Equal: nothing written. The config's own truncation where the recipe
    asks for none and the ``fp8:`` block does not state one: kept, with a note. None in the
    config: the recipe's written. Two different ones: refused naming both."""
    from .values import resolved_value

    release = assumed_release(ctx)
    have_values = {k: resolved_value(ctx.resolved, k) for k in TRUNCATION_KEYS}
    have = truncation(have_values, release)
    wanted = truncation(want, release)
    if all(_same(k, a, b) for k, a, b in zip(TRUNCATION_KEYS, have, wanted)):
        return
    off = (None, None, None)
    stated = _stated(ctx, "importance_sampling", "truncation", "ratio_max", "ratio_min")
    if wanted == off and not stated:
        out.notes.append(
            Message(
                f"loss_fn truncation kept as your config states it: {have[0]}, ratio {have[1]}"
                + (f", ratio_min {have[2]}" if have[2] is not None else ""),
                "nemo-rl",
            )
        )
        return
    if have == off:
        for key, value in want.items():
            if value is not None or have_values[key] is not None:
                out.set(key, value, checked=False)
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


def _truncation_text(t: tuple) -> str:
    if t[0] is None and t[1] is None:
        return "none"
    return f"{t[0]} ratio {t[1]}" + (f" ratio_min {t[2]}" if t[2] is not None else "")


def _refuse_at_startup(ctx: HostContext, out: dict) -> None:
    """NeMo RL's own FP8 start-up asserts (:func:`~.startup.startup_problems`) on the config
    as it would be written (``out`` over its ``defaults:`` parents), the first refused; a
    request that turns the importance-sampling correction off is named as the cause."""
    from .startup import importance_sampling_required, startup_problems

    final = _final(ctx, out)
    release = assumed_release(ctx)
    problems = startup_problems(final, release)
    if not problems:
        return
    first = problems[0]
    if first.key == "loss_fn.use_importance_sampling_correction" and not (
        ctx.spec.importance_sampling.enabled
    ):
        raise FP8ConfigError(
            importance_sampling_required(release, "is off (importance_sampling: false)"),
            key=request_key(ctx, "importance_sampling"),
            value=False,
            hint="leave importance_sampling on for FP8 generation (NeMo RL requires it), or "
            "generate in BF16 (generation: bf16)",
        )
    raise first


def _final(ctx: HostContext, out: dict) -> dict:
    """The whole configuration the output ``out`` makes: itself when it has no ``defaults:``
    (fully resolved, or a file without parents), else an overlay over its parents."""
    return out if "defaults" not in out else _written_over_parents(ctx, out)


def _written_over_parents(ctx: HostContext, out: dict) -> dict:
    """The whole configuration an overlay ``out`` makes: its ``defaults:`` parents (the
    resolved input) with what ``out`` changes and drops applied."""
    from ...dotted import delete_path, flatten, set_path

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
    label = "NeMo RL"
    runtime = (
        "NeMo RL's own FP8 paths: Megatron fp8_cfg for training, its init_fp8 patching "
        "of vLLM's fp8 method for generation (refit and KV scales inside its workers), "
        "ClippedPGLossFn for importance sampling; the plugin's nemo_fp8 vLLM method, "
        "refit quantizer and IS functions are not used"
    )
    follows_defaults = True
    spells_qat = True
    detect_order = 10

    def __init__(self, resolve: bool = False):
        self.resolve = resolve

    def detects(self, config: Mapping[str, Any]) -> bool:
        policy = config.get("policy")
        return isinstance(policy, Mapping) and ("megatron_cfg" in policy or "generation" in policy)

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        _refuse(spec, ctx)

    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> Spelling:
        if ctx is None and spec.qat is not None:
            return qat_recipe_keys(spec, model)
        if ctx is None:
            return native_keys(spec, model)
        return _spell(spec, ctx, self.resolve)

    def base(self, ctx: HostContext) -> dict[str, Any]:
        """An overlay of the file (``defaults:`` re-pointed to resolve from the output), or
        the fully resolved config."""
        resolve = self.resolve or (ctx.request is not None and not _in_file(ctx))
        out = copy.deepcopy(dict(ctx.resolved if resolve else ctx.raw))
        if not resolve and "defaults" in out and ctx.path is not None:
            out["defaults"] = _rewrite_defaults(out["defaults"], ctx.path, ctx.output)
        return out

    def value(self, config: Mapping[str, Any], key: str, default: Any = None) -> Any:
        from .values import resolved_value

        return resolved_value(config, key, default)

    def same(self, key: str, have: Any, want: Any) -> bool:
        return _same(key, have, want)

    def overwrites(self, ctx: HostContext, key: str, have: Any, want: Any) -> bool:
        return _neutral(key, have, ctx.resolved)

    def conflict(self, ctx: HostContext, write: Write, have: Any) -> FP8ConfigError:
        from .checks import _contradiction

        return _contradiction(write.key, have, write.value, ctx.spec)

    def default(self, key: str, data: Mapping[str, Any]) -> Any:
        """NeMo RL's own default (:mod:`.native`), else what an absent key reads as where the
        FP8 path reads it as off (a required key has none: it is always written)."""
        found = native.key_default(key)
        if found is native.NO_DEFAULT and key not in native.REQUIRED:
            found = _absent_value(key, native.NO_DEFAULT)
        return found

    def finish(self, ctx: HostContext, result: ApplyResult) -> ApplyResult:
        from .te_precision import nemo_rl_precision_file

        _refuse_at_startup(ctx, result.data)
        # module rules reach training through the TE precision file where NeMo RL has its key
        result = nemo_rl_precision_file(ctx, result)
        from .preflight import preflight

        preflight(ctx, result, _final(ctx, result.data))
        return result

    def check_native(self, ctx: HostContext, result: ApplyResult) -> None:
        """NeMo RL's start-up asserts on the config as it is (the first refused), then the
        rollout pre-flight on the recipe its keys spell; the kernel variables a release
        without ``vllm_cfg.env_vars`` needs go to :attr:`ApplyResult.env`, where NeMo RL
        starts. A ``--hardware`` target the recipe cannot train on (the spec holds none) is
        reported by the caller; no rollout is judged for another GPU."""
        from .startup import startup_problems

        problems = startup_problems(ctx.resolved, assumed_release(ctx))
        if problems:
            raise problems[0]
        refused_target = ctx.hardware is not None and ctx.spec.hardware is None
        if ctx.spec.qat is None and not refused_target:
            from .preflight import preflight

            preflight(ctx, result, ctx.resolved)
            rollout = result.checks.get("rollout", {})
            if rollout.get("where") == "environment":
                result.env.update(rollout.get("needed", {}))

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        # NeMo RL is not installable from the registry; its keys are checked against its own
        # source in the test suite (tests/hosts/test_contract_hosts.py).
        return ["nemo-rl: not checked here (NeMo RL does not install from a package index)"]

    def preamble(self, ctx: HostContext) -> list[str]:
        return [release_choice(ctx).line]

    def refusal(self, err: FP8ConfigError, ctx: HostContext) -> FP8ConfigError:
        from .releases import release_hint

        return release_hint(err, release_choice(ctx))

    read_native = staticmethod(native.read_native)  # explain on a config already in FP8


ADAPTER = NeMoRLAdapter()
"""The NeMo RL adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
