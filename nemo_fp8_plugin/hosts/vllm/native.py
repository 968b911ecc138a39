"""vLLM's own defaults for the engine options the adapter writes, and the reader of an engine
config already FP8 in them (``VLLMAdapter.default`` / ``VLLMAdapter.read_native``).

The defaults are recorded from vLLM 0.32's ``EngineArgs`` (``vllm/engine/arg_utils.py``);
``tests/hosts/vllm/test_vllm_native.py`` compares them with the installed vLLM's dataclass fields.
The ``hf_overrides.quantization_config`` block is this package's own method's config and is
written whole (it is the document the method reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...capabilities import CAPABILITIES
from .. import NO_DEFAULT, HostContext, NativeRecipe

__all__ = ["ENGINE_DEFAULTS", "option_default", "read_native"]

ENGINE_DEFAULTS: dict[str, Any] = {"kv_cache_dtype": "auto"}
"""vLLM engine option (underscore spelling) -> its ``EngineArgs`` default."""

_METHOD = "nemo_fp8"


def option_default(key: str, data: Mapping[str, Any]) -> Any:
    """What vLLM does with an absent top-level engine option (either spelling)."""
    if "." in key:
        return NO_DEFAULT
    return ENGINE_DEFAULTS.get(key.replace("-", "_"), NO_DEFAULT)


def _option(config: Mapping[str, Any], name: str) -> tuple[str, Any]:
    for key in (name, name.replace("_", "-")):
        if key in config:
            return key, config[key]
    return name, None


def read_native(ctx: HostContext) -> NativeRecipe | None:
    """The recipe an engine config's ``quantization`` + ``kv_cache_dtype`` (and the
    ``nemo_fp8`` method's ``quantization_config``) spell, or None when it asks vLLM for no
    FP8 at all."""
    from ..native import match_recipe

    config = ctx.resolved
    qkey, method = _option(config, "quantization")
    kvkey, kv = _option(config, "kv_cache_dtype")
    kv_fp8 = isinstance(kv, str) and kv.startswith("fp8")
    read: list[tuple[str, Any]] = [(qkey, method)] if method is not None else []
    read += [(kvkey, kv)] if kv_fp8 else []
    if method != _METHOD:
        unmatched = []
        if method is not None:
            unmatched.append(
                f"{qkey}: {method!r}: vLLM's own {method} method (for fp8: per-tensor weight "
                f"scales, dynamic per-token activation scales), which no recipe of ours "
                f"spells; nemo-fp8 apply writes quantization: {_METHOD}"
            )
        if kv_fp8:
            unmatched.append(
                f"{kvkey}: {kv}: an FP8 KV cache"
                + ("" if method is not None else " on unquantized weights")
                + "; our recipes state it as kv_cache: fp8 next to an FP8 recipe"
            )
        if not unmatched:
            return None
        return NativeRecipe("vllm", None, tuple(read), unmatched=tuple(unmatched))
    hkey, overrides = _option(config, "hf_overrides")
    qcfg = overrides.get("quantization_config") if isinstance(overrides, Mapping) else None
    if not isinstance(qcfg, Mapping):
        return NativeRecipe(
            "vllm",
            None,
            tuple(read),
            unmatched=(f"{qkey}: {_METHOD} without {hkey}.quantization_config: no recipe stated",),
        )
    scaling = qcfg.get("scheme", "block")
    if not isinstance(scaling, str) or scaling not in CAPABILITIES:  # [block]: unhashable
        return NativeRecipe(
            "vllm",
            None,
            tuple(read),
            unmatched=(f"{hkey}.quantization_config.scheme: {scaling!r}: not a kind of ours",),
        )
    read.append((f"{hkey}.quantization_config.scheme", scaling))
    return match_recipe("vllm", scaling, _fields(qcfg, kv_fp8, hkey), read=read, unmatched=[])


def _layer_count(qcfg: Mapping[str, Any], name: str, hkey: str) -> int:
    """``num_first/last_layers_in_bf16`` read back: absent is 0; anything but a whole
    number of layers (``abc``, ``.inf``, ``[1]``) is refused naming the key."""
    from ..native import layer_count

    value = qcfg.get(name)
    return 0 if value is None else layer_count(value, f"{hkey}.quantization_config.{name}")


def _fields(qcfg: Mapping[str, Any], kv_fp8: bool, hkey: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"generation": "fp8", "kv_cache": "fp8" if kv_fp8 else "auto"}
    # vLLM sees the forward format only, E4M3 for e4m3 and hybrid alike
    if qcfg.get("fmt") not in (None, "e4m3"):
        fields["fp8_format"] = qcfg["fmt"]
    for ours, theirs in (
        ("weight_block", "weight_block_size"),
        ("activation_block", "activation_block_size"),
        ("pow2_scales", "pow2_scales"),
        ("amax_epsilon", "amax_epsilon"),
        ("generation_numerics", "generation_numerics"),
    ):
        if qcfg.get(theirs) is not None:
            fields[ours] = qcfg[theirs]
    rules: dict[str, Any] = {
        side: _layer_count(qcfg, f"num_{side}_layers_in_bf16", hkey) for side in ("first", "last")
    }
    ignored = qcfg.get("ignored_layers") or []
    if isinstance(ignored, (list, tuple)) and ignored:
        rules["modules"] = [str(name) for name in ignored]  # module names: exact patterns
    fields["bf16_layers"] = rules
    return fields
