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
from pathlib import Path
from typing import Any

from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from .. import ApplyResult, ConfigEditAdapter, HostKeys, apply_mapping, apply_path

__all__ = ["native_keys", "apply_file", "apply_vllm"]


def native_keys(spec, model=None) -> HostKeys:
    """The engine arguments for ``spec`` (see :func:`nemo_fp8_plugin.hosts.vllm.engine_spelling`)."""
    from . import engine_spelling

    kwargs, found = engine_spelling(spec, model)
    return HostKeys(keys=kwargs, warnings=found)


def _style(config: dict) -> str:
    """``-`` when the file spells options with dashes (``vllm serve --config`` style)."""
    return "-" if any(isinstance(k, str) and "-" in k for k in config) else "_"


def _find(config: dict, name: str) -> tuple[str | None, Any]:
    """The key (either spelling) under which ``config`` sets option ``name``, and its value."""
    for key in (name, name.replace("_", "-")):
        if key in config:
            return key, config[key]
    return None, None


def _refuse_two_spellings(config: dict) -> None:
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


def _drop_request_keys(config: dict, keys: tuple[str, ...]) -> None:
    for dotted in keys:
        parts = dotted.split(".")
        node = config
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(parts[-1], None)


def _canonical(value: Any) -> Any:
    # vLLM reads `fp8` as E4M3 for the KV cache.
    return "fp8_e4m3" if value == "fp8" else value


def apply_vllm(config: dict, *, hardware: str | None = None) -> tuple[dict, list[str]]:
    """Rewrite an engine-config mapping; returns ``(new mapping, warnings)`` (the
    :data:`ADAPTER` pipeline on a mapping)."""
    result = apply_mapping(ADAPTER, config, hardware=hardware)
    return result.data, result.warnings


def _merge(ctx) -> ApplyResult:
    from . import engine_spelling

    config, request = ctx.raw, ctx.request
    _refuse_two_spellings(config)
    out = copy.deepcopy(config)
    _drop_request_keys(out, request.keys)
    device_key, device = _find(out, "device")
    platform = "cpu" if device == "cpu" else None
    kwargs, found = engine_spelling(request.spec, ctx.model, platform=platform)
    if device_key is not None:  # vLLM 0.32's EngineArgs has no `device`
        del out[device_key]
        found.append(
            f"{device_key}: {format_value(device)} is not an engine argument of vLLM "
            f">= 0.32 (`vllm serve --config` refuses it; the installed vLLM build picks "
            f"the platform): read as the target platform and left out of the output"
        )
    sep = _style(out)

    for name, value in kwargs.items():
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
        out[name.replace("_", sep)] = value
    return ApplyResult(data=out, warnings=list(found), fmt=ctx.fmt)


def apply_file(
    path: str | Path, *, hardware: str | None = None, strict: bool = False, **_: Any
) -> ApplyResult:
    """Read a vLLM engine config (YAML or JSON) and return it with the FP8 engine arguments."""
    return apply_path(ADAPTER, path, hardware=hardware, strict=strict)


class VLLMAdapter(ConfigEditAdapter):
    """vLLM (an engine config: ``vllm serve --config`` YAML / ``vllm.LLM(**kwargs)``)."""

    name = "vllm"
    runtime = (
        "vLLM loads this package's nemo_fp8 quantization method (entry point "
        "nemo_fp8_plugin.hosts.vllm:register), so the package must be installed where "
        "vLLM runs; in-place refit goes through its worker extension"
    )

    def spell(self, spec, ctx=None) -> HostKeys:
        return native_keys(spec, ctx.model if ctx is not None else None)

    merge = staticmethod(_merge)

    def validate(self, result: ApplyResult, ctx) -> list[str]:
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


ADAPTER = VLLMAdapter()
"""The vLLM adapter (:class:`nemo_fp8_plugin.hosts.HostAdapter`)."""
