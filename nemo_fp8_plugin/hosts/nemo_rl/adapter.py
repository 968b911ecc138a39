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
from .spelling import (
    _MEGATRON,
    _VLLM,
    DEEP_GEMM_BLACKWELL,
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
            _dropped_keys(ctx.resolved)
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
    _refuse_deep_gemm(spec, ctx)
    _dropped_keys(ctx.resolved)
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
    if get_path(ctx.resolved, _DEEP_GEMM, None) is True:
        raise FP8ConfigError(
            f"is true, but the target GPU is {spec.hardware}: {DEEP_GEMM_BLACKWELL}",
            key=_DEEP_GEMM,
            value=True,
            hint=f"set {_DEEP_GEMM}: false (it sets no variable: a stock vLLM still runs "
            "DeepGEMM with UE8M0 scales there; VLLM_USE_DEEP_GEMM=0 in the driver's "
            "environment gives CUTLASS with fp32 scales)",
        )


def _spell(spec: RecipeSpec, ctx: HostContext) -> HostKeys:
    """The recipe's keys for this config: the MoE router from the config when the model is
    unknown, the training keys only for a config without generation, the sequence lengths
    alignment needs."""
    if spec.qat is not None:
        return qat_spell(spec, ctx)
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
    writes, notes = sequence_alignment(spec, resolved, ctx.assumed_version("nemo-rl"))
    if _block_generation(spec, ctx) and get_path(ctx.raw, _DEEP_GEMM, None) is False:
        # The user's own file says false: kept. It sets no variable, so vLLM's defaults pick
        # the kernel (DeepGEMM with UE8M0 scales on a stock install: hosts.vllm.rollout).
        if get_path(keys, _DEEP_GEMM, None) is True:
            notes.append(f"nemo-rl: {_DEEP_GEMM}: false kept as your config states it")
        set_path(keys, _DEEP_GEMM, False)
    for key, value in writes.items():
        set_path(keys, key, value)
    if capability(spec.scaling).is_nvfp4 and training:
        notes.append(
            f"nemo-rl: {spec.name} trains in NVFP4 and generates in BF16 "
            f"({NVFP4_GENERATION_REFUSAL}); the importance-sampling correction "
            f"absorbs the difference"
        )
    from ..vllm import mla_kv_cache_note

    mla_note = mla_kv_cache_note(spec, ctx.model) if _has_generation(resolved) else None
    notes += [mla_note] if mla_note else []
    return HostKeys(keys=keys, warnings=warnings, env=dict(hk.env), notes=notes)


def _merge(ctx: HostContext, keys: HostKeys, resolve: bool) -> ApplyResult:
    raw, resolved, spec = ctx.raw, ctx.resolved, ctx.spec
    warnings: list[str] = []
    if not resolve and not _in_file(ctx):
        warnings.append(
            "the FP8 request is a root key of a parent file, which an overlay cannot "
            "remove; writing the fully resolved config instead"
        )
        resolve = True
    out = _overlay_base(ctx, resolve)
    if spec.qat is not None:
        qat_merge(ctx, out, keys)
        _consume_request(ctx, out)
        return ApplyResult(data=out, warnings=warnings, notes=list(keys.notes))
    flat = dict(flatten(keys.keys))
    aligned = {k: flat.pop(k) for k in ALIGNMENT_KEYS if k in flat}
    native = HostKeys(keys=nest(flat))
    for key, want, written in _desired(spec, native, rl=_has_generation(resolved)):
        _merge_key(out, raw, resolved, spec, key, want, written)
    for key, value in aligned.items():
        set_path(out, key, value)
    _consume_request(ctx, out)
    return ApplyResult(
        data=out,
        warnings=warnings + list(keys.warnings),
        notes=list(keys.notes),
        env=dict(keys.env),
    )


def _consume_request(ctx: HostContext, out: dict) -> None:
    """The plugin's request keys leave the output (``policy.precision`` back to bfloat16)."""
    for key in ctx.request.keys:
        if key == "policy.precision":
            set_path(out, key, "bfloat16")
        else:
            delete_path(out, key)


def _merge_key(out: dict, raw, resolved, spec: RecipeSpec, key: str, want: Any, written: bool):
    """One native key: written, kept in the user's spelling, or refused as a contradiction."""
    have = get_path(resolved, key, _MISSING)
    if _leaf(key) == "moe_router_dtype" and get_path(raw, key, None) == "fp64":
        # The user's own file asks for an fp64 router: more precise than the fp32 FP8
        # recipes need, so it is the user's choice, kept (an inherited fp64 is not).
        set_path(out, key, "fp64")
        return
    if have is _MISSING:
        if written and (not _same(key, None, want) or key in native.REQUIRED):
            set_path(out, key, want)
        return
    if _same(key, have, want):
        if written:
            set_path(out, key, have)  # explicit in the output, in the user's spelling
        return
    if not _neutral(key, have, resolved):
        raise _contradiction(key, have, want, spec)
    if written:
        set_path(out, key, want)


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

        # module rules reach training through the TE precision file where NeMo RL has its key
        return nemo_rl_precision_file(ctx, _merge(ctx, keys, self.resolve))

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
