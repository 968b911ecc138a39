"""What NeMo RL refuses of a request and of the native keys a config already has, and how an
existing native value compares with the one the recipe needs (kept, overwritten, refused)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...capabilities import capability
from ...dotted import flatten, get_path
from ...errors import ConflictingKeyError, FP8ConfigError, format_value
from ...spec import RecipeSpec
from .. import HostKeys
from .spelling import _MEGATRON, _VLLM, BLOCK_MX_REFUSAL, NOT_FP8, _generation_fp8

__all__ = ["FP8_CFG_KEYS", "VLLM_FP8_KEYS", "fp8_cfg_keys", "vllm_fp8_keys"]

_ABSENT = {
    "enabled": False,
    "fp8_param": False,
    "use_precision_aware_optimizer": False,
    "use_deep_gemm": False,
    "pow2_weight_scaling_factors": False,
    "pow2_activation_scaling_factors": False,
    "is_mx": False,
    "kv_cache_dtype": "auto",
    "num_first_layers_in_bf16": 0,
    "num_last_layers_in_bf16": 0,
    "quantization_ignored_layer_kws": [],
    "use_importance_sampling_correction": False,
    "sequence_level_importance_ratios": False,
    "first_last_layers_bf16": False,
    "fp4_param": False,
}


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _absent_value(key: str) -> Any:
    return _ABSENT.get(_leaf(key))


def _is_fp8_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower().startswith("fp8")


def _same(key: str, have: Any, want: Any) -> bool:
    """Whether an existing value already says what we would write."""
    if want is NOT_FP8:
        return not _is_fp8_text(have)
    if have is None:
        have = _absent_value(key)
    leaf = _leaf(key)
    if leaf == "kv_cache_dtype":
        if not isinstance(have, str):  # a list or a number: no dtype at all
            return False
        norm = {"fp8_e4m3": "fp8", None: "auto"}
        return norm.get(have, have) == norm.get(want, want)
    if leaf == "quantization_ignored_layer_kws":
        return isinstance(have, (list, tuple)) and sorted(map(str, have)) == sorted(map(str, want))
    if ".env_vars." in key:  # environment values are strings, however YAML spelled them
        return have is not None and str(have).strip() == str(want)
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return float(have) == float(want)
    return have == want


def _neutral(key: str, have: Any, resolved: Mapping) -> bool:
    """Whether ``have`` is what a BF16 config holds there, so FP8 may overwrite it."""
    if have is None or (isinstance(have, str) and have.strip().startswith("${")):
        return True  # unset, or an interpolation of something else (e.g. ${policy.precision})
    leaf = _leaf(key)
    if ".fp8_cfg." in key:
        # A disabled fp8_cfg block is inert whatever its other fields say.
        return not get_path(resolved, f"{_MEGATRON}.fp8_cfg.enabled")
    if leaf == "precision":
        return not _is_fp8_text(have)
    if leaf == "moe_router_dtype":
        # Inherited from a parent (grpo_math_1B.yaml's fp64): NVIDIA's FP8 twins set fp32.
        # A value the file itself states is handled by _merge (fp64 kept, it is >= fp32).
        return have in ("fp64", "fp32")
    if leaf == "use_precision_aware_optimizer":
        return True  # NeMo RL's default true is a BF16 setting; FP8 training turns it off
    if leaf == "kv_cache_dtype":
        return have == "auto"
    if leaf == "quantization_ignored_layer_kws":
        return have == [] or have == ()
    if ".env_vars." in key:
        return False  # a variable set otherwise is a choice the recipe contradicts
    if leaf.startswith("truncated_importance_sampling") or leaf == "seq_logprob_error_threshold":
        return False  # None was handled above
    return have is False or have == 0


def _contradiction(key: str, have: Any, want: Any, spec: RecipeSpec) -> FP8ConfigError:
    return ConflictingKeyError(
        f"already set to {format_value(have)}, but {spec.name} as requested needs "
        f"{format_value(want) if want is not NOT_FP8 else 'a non-FP8 value'}",
        key=key,
        value=have,
        hint="remove the key and let the recipe set it, or state the same thing in the fp8: block "
        "(bf16_layers, kv_cache, importance_sampling, pow2_scales, training, generation)",
    )


def _checks(spec: RecipeSpec, resolved: Mapping) -> None:
    """Requests NeMo RL cannot run, refused before anything is written."""
    if spec.training != "fp8" and not _generation_fp8(spec):
        raise FP8ConfigError(
            f"nothing would run in FP8: training is bf16 and NeMo RL cannot "
            f"generate with {spec.name} ({spec.scaling} scaling; its vLLM path "
            f"has block FP8 and MXFP8 only)",
            key="fp8.training",
            value="bf16",
            hint="use fp8_blockwise for FP8 generation",
        )
    if spec.training == "fp8" and get_path(resolved, f"{_MEGATRON}.enabled") is not True:
        # fp8_cfg is read by the Megatron path only; the DTensor path would drop it silently.
        raise FP8ConfigError(
            "NeMo RL trains in FP8 on its Megatron path only, and this config does not enable it",
            key=f"{_MEGATRON}.enabled",
            value=get_path(resolved, f"{_MEGATRON}.enabled"),
            hint="set policy.megatron_cfg.enabled: true (and policy.dtensor_cfg.enabled: false)"
            + (
                ", or ask for FP8 generation only with fp8: {training: bf16}"
                if _has_generation(resolved)
                else "; this config has no policy.generation (SFT, DPO): FP8 generation "
                "is no alternative, training in FP8 needs the Megatron path"
            ),
        )
    backend = get_path(resolved, "policy.generation.backend")
    if _generation_fp8(spec) and _has_generation(resolved) and backend not in (None, "vllm"):
        raise FP8ConfigError(
            f"FP8 generation is a vLLM setting; the {backend!r} backend would ignore it",
            key="policy.generation.backend",
            value=backend,
            hint="use backend: vllm, or fp8: {generation: bf16}",
        )
    if spec.training != "fp8" and not _has_generation(resolved):
        raise FP8ConfigError(
            "generation-only FP8 asked for, but the config has no policy.generation section",
            key="fp8.training",
            value="bf16",
        )
    if spec.kv_cache == "fp8" and not _generation_fp8(spec):
        raise FP8ConfigError(
            f"an FP8 KV cache needs FP8 generation, and NeMo RL generates {spec.name} in BF16",
            key="fp8.kv_cache",
            value="fp8",
            hint="use kv_cache: auto, or a block recipe such as fp8_blockwise",
        )
    _native_checks(spec, resolved)


def _native_checks(spec: RecipeSpec, resolved: Mapping) -> None:
    """Native keys that contradict the request in ways a merge cannot resolve."""
    from .startup import KV_CACHE_DTYPES

    row = capability(spec.scaling)
    kv = get_path(resolved, f"{_VLLM}.kv_cache_dtype")
    if kv is not None and not (isinstance(kv, str) and (kv in KV_CACHE_DTYPES or "${" in kv)):
        raise FP8ConfigError(
            f"is not one of {', '.join(KV_CACHE_DTYPES)}, the values NeMo RL takes "
            f"(its init_fp8 raises on any other)",
            key=f"{_VLLM}.kv_cache_dtype",
            value=kv,
            hint="use auto, or state kv_cache: fp8 in the fp8: block",
        )
    if row.is_mx and _generation_fp8(spec):
        for name in ("pow2_weight_scaling_factors", "pow2_activation_scaling_factors"):
            key = f"{_VLLM}.{name}"
            if get_path(resolved, key) is False:
                raise FP8ConfigError(
                    "is false, but MXFP8 scales are powers of two (NeMo RL refuses "
                    "the combination)",
                    key=key,
                    value=False,
                    hint="remove the key",
                )
    from .values import resolved_value  # omegaconf only when needed

    fp8_cfg_on = resolved_value(resolved, f"{_MEGATRON}.fp8_cfg.enabled") is True
    if (
        spec.training == "fp8"
        and row.is_block
        and resolved_value(resolved, f"{_VLLM}.is_mx") is True
    ):
        raise FP8ConfigError(
            BLOCK_MX_REFUSAL,
            key=f"{_VLLM}.is_mx",
            value=True,
            hint="generate with the training recipe (remove is_mx), or train "
            "in BF16 for MXFP8 rollouts: fp8: {recipe: mxfp8, training: bf16}",
        )
    if (
        _generation_fp8(spec)
        and row.is_mx
        and fp8_cfg_on
        and resolved_value(resolved, f"{_MEGATRON}.fp8_cfg.fp8_recipe", "blockwise") == "blockwise"
    ):
        raise FP8ConfigError(
            BLOCK_MX_REFUSAL,
            key=f"{_MEGATRON}.fp8_cfg.fp8_recipe",
            value="blockwise",
            hint="train with mxfp8 too (fp8: mxfp8, Blackwell), or in BF16: "
            "fp8: {recipe: mxfp8, training: bf16} with fp8_cfg disabled",
        )
    override = get_path(resolved, f"{_MEGATRON}.env_vars.NVTE_BACKWARD_OVERRIDE")
    if spec.training == "fp8" and override is not None:
        # NeMo RL exports env_vars in its Megatron workers before they import TE, which
        # (>= 2.15) then defaults every recipe's backward_override from it.
        raise FP8ConfigError(
            f"makes Transformer Engine (>= 2.15) run the whole backward of {spec.name} "
            f"{'in high precision' if override == 'high_precision' else 'off FP8'} (and refuse "
            f"delayed scaling), silently changing the recipe",
            key=f"{_MEGATRON}.env_vars.NVTE_BACKWARD_OVERRIDE",
            value=override,
            hint="remove it: no nemo-fp8-plugin recipe uses it",
        )
    _override_checks(spec, resolved)


def _override_checks(spec: RecipeSpec, resolved: Mapping) -> None:
    """``model_overrides`` and loss settings the recipe's keys cannot live with."""
    from .values import resolved_value  # omegaconf only when needed

    rules = spec.bf16_layers
    nested = get_path(resolved, f"{_MEGATRON}.model_overrides.transformer")
    if (
        spec.training == "fp8"
        and rules.acts_on("training")
        and (rules.first or rules.last)
        and isinstance(nested, Mapping)
    ):
        raise FP8ConfigError(
            "is a mapping, so the model config is a GPTModelConfig (its TransformerConfig under "
            ".transformer), where NeMo RL's model_overrides merge rejects the flat "
            "first_last_layers_bf16 / num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 "
            "keys written for bf16_layers.first/last",
            key=f"{_MEGATRON}.model_overrides.transformer",
            value=nested,
            hint="set those three under model_overrides.transformer yourself and "
            "give the fp8: block bf16_layers.applies_to: generation",
        )
    is_ = spec.importance_sampling
    if (
        is_.enabled
        and is_.level == "sequence"
        and resolved_value(resolved, "loss_fn.token_level_loss", True)
    ):
        raise FP8ConfigError(
            "sequence-level importance ratios need a sequence-level loss in NeMo RL",
            key="loss_fn.token_level_loss",
            value=get_path(resolved, "loss_fn.token_level_loss", True),
            hint="set loss_fn.token_level_loss: false (GSPO-style), or use "
            "importance_sampling.level: token",
        )


def fp8_cfg_keys(release: str | None) -> tuple[str, ...]:
    """The keys NeMo RL ``release`` reads from ``policy.megatron_cfg.fp8_cfg`` (anything else
    there is ignored), from :data:`nemo_fp8_plugin.stacks.FACTS`."""
    from ...stacks import nemo_rl_keys

    return nemo_rl_keys(release, f"{_MEGATRON}.fp8_cfg")


def vllm_fp8_keys(release: str | None) -> tuple[str, ...]:
    """The FP8 keys NeMo RL ``release`` reads from ``policy.generation.vllm_cfg``."""
    from ...stacks import nemo_rl_keys

    return tuple(k for k in nemo_rl_keys(release, _VLLM) if k not in _VLLM_NOT_FP8)


_VLLM_NOT_FP8 = frozenset(
    {"async_engine", "env_vars", "gpu_memory_utilization", "tensor_parallel_size"}
)
"""``vllm_cfg`` keys of the table that are not FP8 settings (the start-up checks and the
pre-flight read them; ``env_vars`` carries the rollout kernel's variables)."""

FP8_CFG_KEYS = fp8_cfg_keys(None)
"""Keys any NeMo RL release reads from ``policy.megatron_cfg.fp8_cfg``."""

VLLM_FP8_KEYS = vllm_fp8_keys(None)
"""FP8 keys any NeMo RL release reads from ``policy.generation.vllm_cfg``."""

_VLLM_FP8_HINTS = ("fp8", "bf16", "pow2", "quantiz", "scaling", "deep_gemm", "mx")


def _dropped_keys(resolved: Mapping, release: str | None = None) -> None:
    """Refuse FP8 settings NeMo RL ``release`` would silently ignore: typos, keys of other
    hosts, and keys of another release (``is_mx`` before main, ``force_clear_fp8_caches`` at
    v0.6.0) set to anything but off."""
    import difflib

    from ...stacks import lookup, release_label

    sections = (
        (f"{_MEGATRON}.fp8_cfg", fp8_cfg_keys(release), True),
        (_VLLM, vllm_fp8_keys(release), False),
    )
    for section, known, every in sections:
        node = get_path(resolved, section)
        if not isinstance(node, Mapping):
            continue
        for name, value in node.items():
            key = f"{section}.{name}"
            if name in known:
                continue
            other = lookup("nemo-rl", key, release)
            if other.fact is not None and other.present is False:
                if value is None or _same(key, value, _absent_value(key)):
                    continue  # off, which is what the release does without the key
                raise FP8ConfigError(
                    f"is not read by {release_label(release)} (it is in: "
                    f"{other.fact.versions.label}), so it would be ignored silently",
                    key=key,
                    value=value,
                    hint="remove it, or choose a release that reads it with --stack",
                )
            lowered = str(name).lower()
            if not every and not any(h in lowered for h in _VLLM_FP8_HINTS):
                continue
            near = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
            if not every and not near:
                continue
            raise FP8ConfigError(
                f"is not read by {release_label(release)} (its {section.rsplit('.', 1)[-1]} "
                f"FP8 keys: {', '.join(known)}), so it would be ignored silently",
                key=key,
                value=value,
                hint=f"did you mean {near[0]!r}?"
                if near
                else "state recipe details in the fp8: block, or Megatron fields in "
                "policy.megatron_cfg.model_overrides",
            )


def _has_generation(resolved: Mapping) -> bool:
    return isinstance(get_path(resolved, "policy.generation"), Mapping)


def _desired(spec: RecipeSpec, hk: HostKeys, *, rl: bool = True) -> list[tuple[str, Any, bool]]:
    """Every native key the recipe decides: ``(key, value it needs, written)``. Unwritten
    entries are guards: an existing value must agree, but nothing is added for them.
    ``rl=False`` (a config without a generation section, e.g. SFT) keeps training keys only."""
    want = [(k, v, True) for k, v in flatten(hk.keys)]
    decided = {k for k, _, _ in want}
    guards: list[tuple[str, Any]] = []
    row = capability(spec.scaling)
    if spec.training == "fp8":
        # No BF16 training layers asked for: a native first_last_layers_bf16: true contradicts.
        guards.append((f"{_MEGATRON}.model_overrides.first_last_layers_bf16", False))
        if row.is_nvfp4:  # FP4 and FP8 exclude each other in megatron-core
            guards.append((f"{_MEGATRON}.fp8_cfg.enabled", False))
        else:  # a native FP4 override contradicts an FP8 recipe
            guards.append((f"{_MEGATRON}.model_overrides.fp4", None))
    if not rl:
        return [entry for entry in want if entry[0].startswith(_MEGATRON)] + [
            (k, v, False) for k, v in guards if k not in decided
        ]
    if spec.training != "fp8":
        guards.append((f"{_MEGATRON}.fp8_cfg.enabled", False))
    if not _generation_fp8(spec):
        guards += [(f"{_VLLM}.precision", NOT_FP8), (f"{_VLLM}.kv_cache_dtype", "auto")]
    else:
        if row.is_block and not spec.pow2_scales:
            guards += [
                (f"{_VLLM}.pow2_weight_scaling_factors", False),
                (f"{_VLLM}.pow2_activation_scaling_factors", False),
            ]
        if row.is_block:
            guards.append((f"{_VLLM}.is_mx", False))
        guards.append((f"{_VLLM}.quantization_ignored_layer_kws", []))
    return want + [(k, v, False) for k, v in guards if k not in decided]


def _fp8_param_stated(resolved: Mapping) -> bool:
    """Whether the config itself asks for ``fp8_param`` (rather than inheriting a preset's):
    in its ``fp8:`` block, or as ``true`` in an enabled native ``fp8_cfg``, which forcing
    false would contradict."""
    block = resolved.get("fp8")
    if isinstance(block, Mapping) and "fp8_param" in block:
        return True
    return (
        get_path(resolved, f"{_MEGATRON}.fp8_cfg.enabled") is True
        and get_path(resolved, f"{_MEGATRON}.fp8_cfg.fp8_param") is True
    )


def _moe_fallback(resolved: Mapping) -> bool | None:
    """MoE-ness read from the config when the model is unknown (expert parallelism > 1)."""
    from .values import resolved_value  # omegaconf only when needed

    ep = resolved_value(resolved, f"{_MEGATRON}.expert_model_parallel_size")
    if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1:
        return True
    return None


def _interpolation_users(resolved: Mapping, consumed: list[str]) -> None:
    """Refuse when another key interpolates a key we are about to remove."""
    roots = [k for k in consumed if "." not in k]
    if not roots:
        return
    for key, value in flatten(resolved):
        if isinstance(value, str) and "${" in value:
            for root in roots:
                if f"${{{root}}}" in value or f"${{{root}." in value:
                    raise FP8ConfigError(
                        f"refers to `{root}`, which the plugin consumes and NeMo RL will not see",
                        key=key,
                        value=value,
                        hint="refer to a NeMo RL key instead (e.g. ${policy.precision})",
                    )
