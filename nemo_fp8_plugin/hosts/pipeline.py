"""The one pipeline: ``request -> refuse -> spell -> write -> finish -> strict``.

``nemo-fp8 apply`` and ``nemo-fp8 explain`` both run :func:`run`, so explain shows exactly
what apply writes and refuses exactly what apply refuses. :func:`write` is the one writer of
every host: the spelling's flat writes merged into the config, a value the config already
holds compared through the adapter (:meth:`~.contract.HostAdapter.same`, refused unless the
host may overwrite it), the request keys removed, a write that changes nothing left out, and
the change recorded (``written`` / ``removed``). Code that starts from a recipe, not a file,
calls :func:`recipe_keys`: the same refusals and the same keys.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..dotted import delete_path, get_path, set_path
from ..errors import ConflictingKeyError, FP8ConfigError
from .contract import (
    DELETE,
    NO_DEFAULT,
    NO_REQUEST,
    ApplyResult,
    HostAdapter,
    HostContext,
    Message,
    NativeRecipe,
    Spelling,
    Write,
)
from .table import ADAPTERS, adapters, get_adapter

__all__ = [
    "run",
    "write",
    "apply_path",
    "apply_mapping",
    "recipe_keys",
    "refuse_recipe",
    "check_model_shape",
    "model_shape_findings",
    "read_native",
    "native_context",
    "check_native",
    "diff_written",
]

_ABSENT = object()


def run(adapter: HostAdapter, ctx: HostContext) -> ApplyResult:
    """The pipeline on one host for one loaded config."""
    if ctx.request is not None and not adapter.follows_defaults and not ctx.in_file:
        raise FP8ConfigError(
            f"the FP8 request is in a parent file named by defaults:, which "
            f"{adapter.name} configs do not have",
            key=ctx.request.keys[0],
            hint="put the request in this file, or use --host "
            + " or ".join(a.name for a in adapters() if a.follows_defaults and a.edits_config),
        )
    if ctx.request is None:
        data = adapter.passthrough(ctx)
        reading = adapter.read_native(ctx)
        result = ApplyResult(
            data=data, warnings=[] if reading else [Message(NO_REQUEST)], requested=False
        )
        result.fmt = ctx.fmt
        result.written, result.removed = diff_written(ctx.raw, data)
        if reading is not None:
            check_native(adapter, ctx, reading, result)
        return result
    from ..config import check_sections

    # Typed before merging: a list where the host reads a mapping names its key.
    check_sections(adapter.name, ctx.raw)
    if adapter.follows_defaults:
        check_sections(adapter.name, ctx.resolved)
    # The model's shape first, as explain checks it before any host.
    shape = check_model_shape(ctx, adapter)
    _refuse_qat_elsewhere(adapter, ctx.spec, ctx)
    adapter.refuse(ctx.spec, ctx)
    try:
        result = write(adapter, ctx, adapter.spell(ctx.spec, ctx))
    except ConflictingKeyError as err:
        raise ConflictingKeyError(
            f"{err.bare_message} (host {adapter.name})", key=err.key, value=err.value, hint=err.hint
        ) from None
    result.warnings = list(dict.fromkeys([*shape, *result.warnings]))
    _refuse_warnings(ctx, result, "the rules")
    return result


def write(adapter: HostAdapter, ctx: HostContext, spelling: Spelling) -> ApplyResult:
    """``spelling`` written into the config of ``ctx`` (the adapter's :meth:`base`), then the
    adapter's :meth:`finish`.

    A key the config (its ``defaults:`` chain when the host reads one) already holds is kept
    when it says the same (:meth:`same`), overwritten when it is None or a value the host may
    overwrite (:meth:`overwrites`), refused otherwise (:meth:`conflict`); a guard only checks.
    The request keys leave the output unless a write sets them. A written key the file does
    not set whose value is what the config already means (a parent's value, else the host's
    :meth:`default`) is left out, and so is a new section it leaves empty."""
    assert ctx.request is not None
    out = adapter.base(ctx)
    view: Any = {}
    if adapter.edits_config:
        view = copy.deepcopy(dict(ctx.resolved if adapter.follows_defaults else ctx.raw))
    targets = {w.key for w in spelling.writes if not w.guard}
    for key in ctx.request.keys:
        delete_path(view, key)
        if key not in targets:
            delete_path(out, key)
    fresh: list[Write] = []
    for w in spelling.writes:
        if w.value is DELETE:
            delete_path(out, w.key)
            continue
        have = get_path(view, w.key, _ABSENT) if w.checked else _ABSENT
        if have is not _ABSENT and adapter.same(w.key, have, w.value):
            continue
        if (
            have is not _ABSENT
            and have is not None
            and not adapter.overwrites(ctx, w.key, have, w.value)
        ):
            raise adapter.conflict(ctx, w, have)
        if not w.guard:
            set_path(out, w.key, w.value, strict=True)
            fresh.append(w)
    _drop_no_ops(adapter, ctx, out, fresh)
    result = ApplyResult(
        data=out,
        warnings=[w if w.host else w.about(adapter.name) for w in spelling.warnings],
        notes=list(spelling.notes),
        env=dict(spelling.env),
        fmt=ctx.fmt,
        runtime=adapter.runtime,
        edit=adapter.edits_config,
    )
    result = adapter.finish(ctx, result)
    if adapter.edits_config:
        result.written, result.removed = diff_written(ctx.raw, result.data)
    else:
        result.written = result.data
    return result


def _drop_no_ops(
    adapter: HostAdapter, ctx: HostContext, out: dict[str, Any], fresh: list[Write]
) -> None:
    # A fully resolved output (a defaults: chain written out) carries its parents' keys itself.
    whole = "defaults" in ctx.raw and "defaults" not in out
    for w in fresh:
        if get_path(ctx.raw, w.key, _ABSENT) is not _ABSENT:
            continue  # the file sets it: written (reset) whatever it is
        meant = get_path(ctx.resolved, w.key, _ABSENT)
        if meant is not _ABSENT and whole:
            continue
        if meant is _ABSENT:
            meant = adapter.default(w.key, out)
        if meant is NO_DEFAULT or not adapter.same(w.key, meant, w.value):
            continue
        delete_path(out, w.key)
        parts = w.key.split(".")[:-1]
        while parts:
            here = ".".join(parts)
            if (
                get_path(out, here, _ABSENT) != {}
                or get_path(ctx.raw, here, _ABSENT) is not _ABSENT
            ):
                break
            delete_path(out, here)
            parts.pop()


def diff_written(before: Any, after: Any) -> tuple[dict[str, Any], list[str]]:
    """``(written, removed)``: the nested keys ``after`` sets or changes relative to
    ``before``, and the dotted keys it drops. Lists and scalars compare as wholes."""
    written: dict[str, Any] = {}
    removed: list[str] = []

    def walk(b: Any, a: Any, into: dict[str, Any], prefix: str) -> None:
        for key, value in a.items():
            old = b.get(key, _ABSENT) if isinstance(b, Mapping) else _ABSENT
            if isinstance(value, Mapping) and isinstance(old, Mapping) and value:
                child: dict[str, Any] = {}
                walk(old, value, child, f"{prefix}{key}.")
                if child:
                    into[key] = child
            elif old is _ABSENT or old != value or type(old) is not type(value):
                into[key] = copy.deepcopy(value)
        if isinstance(b, Mapping):
            removed.extend(f"{prefix}{key}" for key in b if key not in a)

    if isinstance(after, Mapping):
        walk(before if isinstance(before, Mapping) else {}, after, written, "")
    return written, removed


def apply_path(adapter: HostAdapter, path: str | Path, **context: Any) -> ApplyResult:
    """:func:`run` on a config file (``context``: :func:`~.context.load_context`'s options)."""
    from .context import load_context

    return run(adapter, load_context(path, **{"host": adapter.name, **context}))


def apply_mapping(adapter: HostAdapter, config: Mapping[str, Any], **context: Any) -> ApplyResult:
    """:func:`run` on a config mapping built in code (:func:`~.context.mapping_context`)."""
    from .context import mapping_context

    return run(adapter, mapping_context(config, **context))


def refuse_recipe(host: str | HostAdapter, spec: Any) -> None:
    """Everything ``host`` refuses of ``spec`` alone (no config)."""
    adapter = get_adapter(host) if isinstance(host, str) else host
    _refuse_qat_elsewhere(adapter, spec, None)
    adapter.refuse(spec, None)


def recipe_keys(host: str | HostAdapter, spec: Any, *, model: Any = None) -> Spelling:
    """The one function for code that starts from a recipe rather than a config: ``spec`` (a
    spec, a name or a mapping) refused as ``apply`` refuses it, then spelt as ``apply``
    spells it for a fresh config."""
    from ..registry import get_recipe

    adapter = get_adapter(host) if isinstance(host, str) else host
    spec = get_recipe(spec)
    refuse_recipe(adapter, spec)
    return adapter.spell(spec, None, model=model)


def _refuse_qat_elsewhere(adapter: HostAdapter, spec: Any, ctx: HostContext | None) -> None:
    """ModelOpt quantization-aware RL (``qat``) is spelled only by the hosts with its keys;
    any other would silently train Transformer Engine NVFP4 instead, so it is refused."""
    if spec.qat is None or adapter.spells_qat:
        return
    in_block = ctx is not None and isinstance(ctx.resolved.get("fp8"), Mapping)
    hosts = [a for a in adapters() if a.spells_qat]
    raise FP8ConfigError(
        f"ModelOpt quantization-aware RL is {' and '.join(a.label for a in hosts)}'s path; the "
        f"plugin writes no ModelOpt keys for {adapter.name}",
        key="fp8.qat" if in_block else "qat",
        value=spec.qat.preset,
        hint=f"use --host {hosts[0].name}, or remove qat (Transformer Engine NVFP4 training)",
    )


def model_shape_findings(ctx: HostContext, adapter: HostAdapter | None = None) -> list[Any]:
    """What the model's GEMM dimensions (split as the config splits them, its values read as
    ``adapter`` reads them) mean for the recipe, each keyed by the config key to change: the
    TP key when the split is at fault, ``<section>.<field>`` for sizes the config states,
    else the key naming the model. ``explain`` and :func:`run` both read this one list."""
    if ctx.request is None or ctx.model is None:
        return []
    from .alignment import dimension_findings
    from .context import model_sizes_section

    reader = adapter.value if adapter is not None else get_path
    out = []
    for f in dimension_findings(ctx.spec, ctx.model, ctx.resolved, reader):
        key = f.key
        if key.startswith("model.") and ctx.model_key is not None:
            field_name = key.split(".", 1)[1]
            named = model_sizes_section(ctx.resolved)
            key = (
                f"{ctx.model_key}.{field_name}"
                if named is not None and named[0] == ctx.model_key
                else ctx.model_key
            )
        out.append(type(f)(f.level, key, f.message))
    return out


def check_model_shape(ctx: HostContext, adapter: HostAdapter | None = None) -> list[Message]:
    """Refuse a model the recipe's GEMMs cannot run (:func:`model_shape_findings` at level
    error); return the warnings."""
    warnings = []
    for f in model_shape_findings(ctx, adapter):
        if f.level == "error":  # MXFP8 cannot run on a partial 32-element block
            assert ctx.model is not None
            raise FP8ConfigError(
                f"{f.message} (model {ctx.model.name})",
                key=f.key,
                hint=f"recipe {ctx.spec.name!r}: use a tensor parallel size that keeps "
                f"every per-rank size a multiple, or another recipe",
            )
        warnings.append(Message(f"{f.key}: {f.message}"))
    return warnings


def read_native(ctx: HostContext, host: str | None) -> NativeRecipe | None:
    """The one dispatch of :meth:`~.contract.HostAdapter.read_native` (``explain``): ``host``'s
    reader, else the first host whose reader finds FP8 keys in the config."""
    names = [host] if host is not None else list(ADAPTERS)
    for name in names:
        reading = get_adapter(name).read_native(ctx)
        if reading is not None:
            return reading
    return None


def native_context(ctx: HostContext, reading: NativeRecipe, *, target: bool = True) -> HostContext:
    """``ctx`` with the recipe a config's own FP8 keys spell (``reading.spec``) as its request,
    so the checks a requested recipe gets run on it: the ``--hardware`` target set in the spec
    once nothing the host runs is stopped there (``target=False``: judged without it).

    Raises :class:`FP8ConfigError` for a target the host cannot run the recipe on, keyed by
    ``--hardware`` and naming the native key the recipe was read from."""
    import dataclasses

    from ..config import FP8Request
    from ..spec import normalize_hardware
    from .hardware import targeted

    assert reading.spec is not None
    arch = normalize_hardware(ctx.hardware, key="--hardware") if ctx.hardware else None
    request = FP8Request(
        reading.spec, keys=(), hardware=arch, hardware_key="--hardware" if arch else None
    )
    if target:
        try:
            request = targeted(request, reading.host)  # type: ignore[assignment]
        except FP8ConfigError as err:
            read = ", ".join(f"{k}: {v}" for k, v in reading.read[:2])
            where = f" ({read})" if read else ""
            raise FP8ConfigError(
                f"{reading.host}'s own FP8 keys{where} read as {reading.spec.name}: "
                f"{err.bare_message}",
                key="--hardware",
                value=ctx.hardware,
                hint=err.hint,
            ) from None
    else:
        request = dataclasses.replace(request, hardware=None, hardware_key=None)
    return dataclasses.replace(ctx, request=request)


def check_native(
    adapter: HostAdapter,
    ctx: HostContext,
    reading: NativeRecipe,
    result: ApplyResult,
    *,
    target: bool = True,
) -> None:
    """The checks a requested recipe gets, on a config already FP8 in ``adapter``'s own keys
    (``reading``), left as it is in ``result``: the keys the host release does not read and
    those no recipe of ours spells (warnings), the ``--hardware`` target (``target=False``:
    not judged), then the host's own :meth:`~.contract.HostAdapter.check_native` (its start-up
    refusals, its rollout kernels; the host's refusals come before the target's).
    ``--strict`` makes the first warning an error."""
    host = adapter.name
    result.warnings += [Message(line, host) for line in (*reading.ignored, *reading.unmatched)]
    what = f"read as {reading.spec.name}" if reading.spec is not None else "no recipe of ours"
    result.notes.insert(
        0,
        Message(f"already FP8 in {adapter.label or host}'s own keys, {what}: left as it is", host),
    )
    if reading.spec is not None:
        # the host's own refusals (start-up asserts) first: they hold on any GPU
        refusal = None
        try:
            native = native_context(ctx, reading, target=target)
        except FP8ConfigError as err:
            native, refusal = native_context(ctx, reading, target=False), err
        adapter.check_native(native, result)
        if refusal is not None:
            raise refusal
    _refuse_warnings(ctx, result, "the config")


def _refuse_warnings(ctx: HostContext, result: ApplyResult, what: str) -> None:
    """Under ``--strict``, the first warning as the one-line refusal."""
    if ctx.strict and result.warnings:
        more = f" (and {len(result.warnings) - 1} more)" if len(result.warnings) > 1 else ""
        raise FP8ConfigError(
            f"{result.warnings[0]}{more}",
            key="--strict",
            hint=f"fix {what}, or drop --strict to see every warning",
        )
