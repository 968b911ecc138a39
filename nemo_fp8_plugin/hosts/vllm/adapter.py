"""vLLM adapter: ``precision: fp8_blockwise`` in a vLLM engine config (``vllm serve --config``
YAML, dashes or underscores; the mapping of ``vllm.LLM(**kwargs)``) -> the engine arguments of
:func:`nemo_fp8_plugin.hosts.vllm.engine_kwargs` (``quantization``,
``hf_overrides.quantization_config``, ``kv_cache_dtype``; docs/hosts/vllm.md).

Every other key is kept, in the file's spelling. An option already set otherwise is refused,
naming it. ``device: cpu`` selects vLLM's CPU backend (no FP8 KV cache requested there); no vLLM
release read has a ``device`` engine argument, so the key is read, left out and named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...rules import ModelDescription
    from ...spec import RecipeSpec

from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from .. import (
    DELETE,
    ApplyResult,
    HostAdapter,
    HostContext,
    Message,
    NativeRecipe,
    Spelling,
    Write,
    refuse_other_host,
)

__all__ = ["ENGINE_KEYS", "VLLMAdapter", "ADAPTER"]


ENGINE_KEYS = (
    "tensor_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "quantization",
    "kv_cache_dtype",
    "served_model_name",
    "enforce_eager",
    "dtype",
)
"""vLLM engine options (dashes or underscores) that, next to a string ``model:``, make a
config a vLLM engine config."""


def _env_and_notes(
    spec: RecipeSpec, model: ModelDescription | None, kwargs: Mapping[str, Any], release: str | None
) -> tuple[dict[str, str], list[Message]]:
    """The variables vLLM reads at start-up for the recipe's grid (:func:`.engine_env`, for
    ``release``: the assumed vLLM), and the notes: the rollout kernels with them set, an FP8
    KV cache on latent attention."""
    from ...errors import FP8ConfigError
    from . import engine_env, mla_kv_cache_note
    from .rollout import rollout_note

    if not kwargs:
        return {}, []
    try:
        env = engine_env(spec, release=release)
    except FP8ConfigError:
        env = {}  # the method cannot load there: the rollout note below says so, per GPU
    notes = [
        rollout_note(spec, spec.hardware, release=release, env=env),
        mla_kv_cache_note(spec, model),
    ]
    return env, [Message(n) for n in notes if n]


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


def _spell(spec: RecipeSpec, ctx: HostContext | None, model: ModelDescription | None) -> Spelling:
    """The engine options, each in the spelling the file gives it (else the file's style,
    dashes or underscores); ``device: cpu`` read as the target platform and left out (no vLLM
    release read has such an engine argument)."""
    from ...stacks import TESTED
    from . import engine_spelling

    raw: Mapping[str, Any] = ctx.raw if ctx is not None else {}
    device_key, device = _find(raw, "device")
    kwargs, found = engine_spelling(spec, model, platform="cpu" if device == "cpu" else None)
    out = Spelling(warnings=[Message(w) for w in found])
    if device_key is not None:
        out.warnings.append(
            Message(
                f"{device_key}: {format_value(device)} is not an engine argument of vLLM (none "
                f"of the releases read has it: {', '.join(TESTED['vllm'])}; `vllm serve "
                f"--config` refuses it; the installed vLLM build picks the platform): read as "
                f"the target platform and left out of the output"
            )
        )
        out.set(device_key, DELETE)
    request = ctx.request.keys if ctx is not None and ctx.request is not None else ()
    sep = _style({k: v for k, v in raw.items() if k not in request})
    for name, value in kwargs.items():
        key = _find(raw, name)[0] or name.replace("_", sep)
        if name == "hf_overrides":  # the config's other overrides are kept
            out.set(f"{key}.quantization_config", value["quantization_config"])
        else:
            out.set(key, value)
    # Read when vLLM starts: no engine argument; for the vLLM the command assumes.
    release = ctx.assumed_version("vllm") if ctx is not None else None
    out.env, out.notes = _env_and_notes(spec, model, kwargs, release)
    return out


class VLLMAdapter(HostAdapter):
    """vLLM (an engine config: ``vllm serve --config`` YAML / ``vllm.LLM(**kwargs)``)."""

    name = "vllm"
    label = "vLLM"
    runtime = (
        "vLLM loads this package's nemo_fp8 quantization method (entry point "
        "nemo_fp8_plugin.hosts.vllm:register), so the package must be installed where "
        "vLLM runs; in-place refit goes through its worker extension"
    )

    detect_order = 40

    def detects(self, config: Mapping[str, Any]) -> bool:
        options = {k.replace("-", "_") for k in config if isinstance(k, str)}
        return isinstance(config.get("model"), str) and bool(options & set(ENGINE_KEYS))

    def env_lines(self, result: ApplyResult) -> list[str]:
        # vLLM reads them when it starts: no engine argument carries them
        return [f"set {k}={v} where vLLM starts (not a config key)" for k, v in result.env.items()]

    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        from . import refuse_spec

        if ctx is not None:
            refuse_other_host(self, ctx, ("vllm",))
            _refuse_two_spellings(ctx.raw)
        refuse_spec(spec)

    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> Spelling:
        return _spell(spec, ctx, ctx.model if ctx else model)

    def overwrites(self, ctx: HostContext, key: str, have: Any, want: Any) -> bool:
        return _canonical(have) == _canonical(want)  # vLLM reads `fp8` as E4M3: respelt

    def conflict(self, ctx: HostContext, write: Write, have: Any) -> FP8ConfigError:
        name = write.key.replace("-", "_")
        hint = (
            "say `fp8: {recipe: ..., kv_cache: fp8}` for an FP8 KV cache"
            if name == "kv_cache_dtype"
            else f"remove it: the recipe sets {write.key} to {format_value(write.value)}"
        )
        return ConflictingKeyError(
            f"already set to {format_value(have)}; the recipe needs {format_value(write.value)}",
            key=write.key,
            value=have,
            hint=hint,
        )

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
