"""vLLM adapter: ``precision: fp8_blockwise`` in a vLLM engine config -> vLLM's own arguments.

The input is a vLLM engine config: the YAML ``vllm serve --config FILE`` reads (keys are
the command-line options, with dashes or underscores), which is also the mapping of
``vllm.LLM(**kwargs)``. It names a recipe the usual way (``precision: <recipe>`` or an
``fp8:`` block); the output is the same mapping with that request replaced by the engine
arguments of :func:`nemo_fp8_plugin.hosts.vllm.engine_kwargs`:

=================================  ==============================================================
vLLM option                        from the spec
=================================  ==============================================================
``quantization``                   ``nemo_fp8`` (the plugin's method, registered through the
                                   ``vllm.general_plugins`` entry point)
``hf_overrides.quantization_config``  scheme, tiles, ``pow2_scales``, ``ignored_layers`` and the
                                   first/last BF16 layers (``bf16_layers``), ``kv_cache_dtype``,
                                   ``generation_numerics``
``kv_cache_dtype``                 ``auto``, or ``fp8_e4m3`` for ``kv_cache: fp8`` (KV scales
                                   come with each refit; vLLM 0.32 has no ``calculate_kv_scales``)
=================================  ==============================================================

Every other key is kept. The output has no ``precision`` / ``fp8`` key left, so running
``apply`` on it again changes nothing. A config that already sets one of the options above to
something else (``quantization: fp8``, ``kv-cache-dtype: fp8_e5m2``, its own
``quantization_config``) is refused with the key named. ``device: cpu`` in the config
selects vLLM's CPU backend, where the FP8 KV cache is not requested (see
:func:`nemo_fp8_plugin.hosts.vllm.engine_kwargs`); vLLM 0.32 has no ``device`` engine
argument (``vllm serve --config`` refuses it), so the key is read, left out of the output
and named in a warning.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ...dotted import delete_path
from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from .. import (
    ApplyResult,
    HostAdapter,
    HostContext,
    HostKeys,
    NativeRecipe,
    refuse_other_host,
)

__all__ = ["native_keys", "VLLMAdapter", "ADAPTER"]


def native_keys(spec, model=None) -> HostKeys:
    """The engine arguments for ``spec`` (see :func:`nemo_fp8_plugin.hosts.vllm.engine_spelling`)."""
    from . import engine_spelling

    kwargs, found = engine_spelling(spec, model)
    env, notes = _env_and_notes(spec, model, kwargs, None)
    return HostKeys(keys=kwargs, warnings=found, env=env, notes=notes)


def _env_and_notes(spec, model, kwargs, release: str | None) -> tuple[dict[str, str], list[str]]:
    """The variables vLLM reads at start-up for the recipe's grid (:func:`.engine_env`, for
    ``release``: the assumed vLLM), and the notes: the rollout kernels with them set, an FP8
    KV cache on latent attention."""
    from . import engine_env, mla_kv_cache_note
    from .rollout import rollout_note

    if not kwargs:
        return {}, []
    env = engine_env(spec, release=release)
    notes = [n for n in (rollout_note(spec, spec.hardware, release=release, env=env),) if n]
    note = mla_kv_cache_note(spec, model)
    return env, notes + ([note] if note else [])


def _style(config: Mapping[str, Any]) -> str:
    """``-`` when the file spells options with dashes (``vllm serve --config`` style)."""
    return "-" if any(isinstance(k, str) and "-" in k for k in config) else "_"


def _find(config: Mapping[str, Any], name: str) -> tuple[str | None, Any]:
    """The key (either spelling) under which ``config`` sets option ``name``, and its value."""
    for key in (name, name.replace("_", "-")):
        if key in config:
            return key, config[key]
    return None, None


def _refuse_two_spellings(config: Mapping[str, Any]) -> None:
    """vLLM reads ``max-model-len`` and ``max_model_len`` as one option, and keeps one of
    the two silently: a config giving both is refused, naming both."""
    first: dict[str, str] = {}
    for key in config:
        if not isinstance(key, str):
            continue
        other = first.setdefault(key.replace("-", "_"), key)
        if other != key:
            raise FP8ConfigError(
                f"the same vLLM option as {format_value(other)} (vLLM reads "
                f"dashes and underscores alike and keeps one)",
                key=key,
                value=config[key],
                hint="keep one of the two spellings",
            )


def _canonical(value: Any) -> Any:
    # vLLM reads `fp8` as E4M3 for the KV cache.
    return "fp8_e4m3" if value == "fp8" else value


def _spell(spec, ctx: HostContext) -> HostKeys:
    """The engine options in the file's spelling (dashes or underscores); ``device: cpu``
    read as the target platform (vLLM >= 0.32 has no such engine argument)."""
    from . import engine_spelling

    device_key, device = _find(ctx.raw, "device")
    platform = "cpu" if device == "cpu" else None
    kwargs, found = engine_spelling(spec, ctx.model, platform=platform)
    if device_key is not None:
        found.append(
            f"{device_key}: {format_value(device)} is not an engine argument of vLLM "
            f">= 0.32 (`vllm serve --config` refuses it; the installed vLLM build picks "
            f"the platform): read as the target platform and left out of the output"
        )
    sep = _style({k: v for k, v in ctx.raw.items() if k not in ctx.request.keys})
    # Read when vLLM starts: no engine argument; for the vLLM the command assumes.
    env, notes = _env_and_notes(spec, ctx.model, kwargs, ctx.assumed_version("vllm"))
    return HostKeys(
        keys={k.replace("_", sep): v for k, v in kwargs.items()},
        warnings=found,
        env=env,
        notes=notes,
    )


def _merge(ctx: HostContext, keys: HostKeys) -> ApplyResult:
    """Write the engine options, replacing the request; ``hf_overrides`` keeps the config's
    other overrides; any option already set otherwise is refused, naming it."""
    out = copy.deepcopy(dict(ctx.raw))
    for dotted in ctx.request.keys:
        delete_path(out, dotted)
    device_key, _ = _find(out, "device")
    if device_key is not None:  # vLLM 0.32's EngineArgs has no `device`
        del out[device_key]
    for spelt, value in keys.keys.items():
        name = spelt.replace("-", "_")
        key, current = _find(out, name)
        if name == "hf_overrides":
            current = {} if current is None else current
            if not isinstance(current, dict):
                raise FP8ConfigError(
                    f"expected a mapping, got {format_value(current)}",
                    key=key or name,
                    value=current,
                )
            theirs = current.get("quantization_config")
            if theirs is not None and theirs != value["quantization_config"]:
                raise ConflictingKeyError(
                    "already sets a quantization_config; the recipe writes its own",
                    key=f"{key}.quantization_config",
                    value=theirs,
                    hint="remove it, or remove the precision/fp8 request",
                )
            value = {**current, **value}
        elif current is not None and _canonical(current) != _canonical(value):
            hint = (
                "say `fp8: {recipe: ..., kv_cache: fp8}` for an FP8 KV cache"
                if name == "kv_cache_dtype"
                else f"remove it: the recipe sets {name} to {value!r}"
            )
            raise ConflictingKeyError(
                f"already set to {format_value(current)}; the recipe needs {format_value(value)}",
                key=key,
                value=current,
                hint=hint,
            )
        if key is not None:
            del out[key]
        out[spelt] = value
    return ApplyResult(
        data=out,
        warnings=list(keys.warnings),
        notes=list(keys.notes),
        env=dict(keys.env),
        fmt=ctx.fmt,
    )


class VLLMAdapter(HostAdapter):
    """vLLM (an engine config: ``vllm serve --config`` YAML / ``vllm.LLM(**kwargs)``)."""

    name = "vllm"
    runtime = (
        "vLLM loads this package's nemo_fp8 quantization method (entry point "
        "nemo_fp8_plugin.hosts.vllm:register), so the package must be installed where "
        "vLLM runs; in-place refit goes through its worker extension"
    )

    def refuse(self, spec, ctx: HostContext | None) -> None:
        from . import refuse_spec

        if ctx is not None:
            refuse_other_host(self, ctx, ("vllm",))
            _refuse_two_spellings(ctx.raw)
        refuse_spec(spec)

    def spell(self, spec, ctx: HostContext | None = None, *, model=None) -> HostKeys:
        if ctx is None:
            return native_keys(spec, model)
        return _spell(spec, ctx)

    def merge(self, ctx: HostContext, keys: HostKeys) -> ApplyResult:
        return _merge(ctx, keys)

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        """vLLM's own ``EngineArgs`` takes the output's engine options (dashes or
        underscores), when vLLM is importable."""
        try:
            from vllm.engine.arg_utils import EngineArgs
        except Exception as exc:  # vLLM's import fails in many ways
            return [f"vllm: not checked (vLLM is not importable here: {type(exc).__name__})"]
        kwargs = {str(k).replace("-", "_"): v for k, v in result.data.items()}
        try:
            EngineArgs(**kwargs)
        except TypeError as exc:
            raise FP8ConfigError(
                f"vLLM's EngineArgs refuses the output: {exc}", key="engine config"
            ) from None
        return [f"vllm: EngineArgs accepted {len(kwargs)} options"]

    def default(self, key: str, data: Mapping[str, Any]) -> Any:
        from .native import option_default

        return option_default(key, data)

    def read_native(self, ctx: HostContext) -> NativeRecipe | None:
        from .native import read_native

        return read_native(ctx)


ADAPTER = VLLMAdapter()
"""The vLLM adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
