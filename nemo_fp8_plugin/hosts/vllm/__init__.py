"""vLLM generation in FP8: the ``nemo_fp8`` quantization method and the engine arguments.

Two halves, split so that importing this package stays free of torch and vLLM:

* Plain data, computed here without importing anything heavy:
  :func:`quantization_config` (the ``quantization_config`` mapping vLLM reads) and
  :func:`engine_kwargs` (the arguments of ``vllm.LLM`` / ``vllm serve``), both from a
  :class:`~nemo_fp8_plugin.spec.RecipeSpec`.
* :func:`register`, the ``vllm.general_plugins`` entry point. vLLM calls it in every
  process it starts; it registers the quantization method ``nemo_fp8`` (class
  :class:`nemo_fp8_plugin.hosts.vllm.config.NemoFp8Config`) and nothing else, so an engine that
  does not ask for ``quantization="nemo_fp8"`` behaves exactly as without the plugin.

The method itself (``config.py``, ``methods.py``) imports vLLM and is loaded only when vLLM
asks for it. See ``docs/hosts/vllm.md`` for the design (in-place refit, payloads, the CPU
emulation path, the KV-cache trap of vLLM's CPU build).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...rules import ModelDescription
    from ...spec import RecipeSpec

__all__ = [
    "QUANT_METHOD",
    "CONFIG_KEYS",
    "quantization_config",
    "engine_kwargs",
    "engine_spelling",
    "engine_env",
    "register",
    "refuse_spec",
    "ADAPTER",
]

QUANT_METHOD = "nemo_fp8"
"""Name of the quantization method in vLLM (``quantization="nemo_fp8"``)."""

CONFIG_KEYS = {
    "quant_method": "``nemo_fp8`` (a vLLM ``fp8`` block checkpoint is also accepted when the "
    "engine asks for ``quantization='nemo_fp8'``)",
    "fmt": "element format of weights and activations; only ``e4m3``",
    "activation_scheme": "``dynamic``: activations are quantized per token group at run time",
    "scheme": "``block`` (fp32 or power-of-2 scale per weight tile, 1x128 activation groups) "
    "or ``mx`` (MXFP8: E8M0 scale per 32 elements)",
    "weight_block_size": "weight tile ``[rows, cols]``: ``[128, 128]`` (block) or ``[1, 32]`` / "
    "``[32, 32]`` (mx)",
    "activation_block_size": "activation group ``[1, 128]`` (block) or ``[1, 32]`` (mx)",
    "pow2_scales": "round block scales down to powers of two (TE's default block recipe)",
    "amax_epsilon": "floor applied to every amax before its scale is computed (the recipe's "
    "``amax_epsilon``; weights, and emulated activations under ``generation_numerics: "
    "trainer``)",
    "ignored_layers": "modules kept in BF16: exact vLLM/Hugging Face module names, or glob "
    "patterns (``*``, ``?``, ``[...]``) matched against them",
    "num_first_layers_in_bf16": "leading transformer layers kept in BF16 (NeMo RL's key)",
    "num_last_layers_in_bf16": "trailing transformer layers kept in BF16 (NeMo RL's key)",
    "kv_cache_dtype": "the KV-cache dtype the recipe asked for (``auto`` or ``fp8_e4m3``); the "
    "method warns when the engine runs another one",
    "backend": "``auto`` (vLLM's block-FP8 kernels on CUDA, the numerics emulation elsewhere), "
    "``vllm`` or ``emulate``",
    "generation_numerics": "how activations (and DeepGEMM's weights) are quantized, the recipe's "
    "``generation_numerics``: ``vllm`` (default, vLLM's ``QuantFP8``), ``vllm_deepgemm_ue8m0`` "
    "(UE8M0 scales, weights requantized to power-of-2 block scales) or ``trainer`` (TE's "
    "numerics; emulation backend only)",
}
"""Keys of the ``quantization_config`` mapping the ``nemo_fp8`` method reads, and their meaning."""

_KV_CACHE_DTYPE = {"auto": "auto", "fp8": "fp8_e4m3"}


def _rules_spelling(spec: RecipeSpec, model: Any) -> tuple[list[str], int, int, list[str]]:
    """ignored_layers, first, last and warnings for the generation side of the BF16 rules.

    Without a model the rules travel as written: ``nemo_fp8`` matches glob patterns and
    counts first/last layers itself, once the engine knows the model. With a model the
    rules are expanded by :func:`nemo_fp8_plugin.rules.to_vllm` into exact vLLM module names
    (the spelling vLLM's own ``fp8`` method needs), routers and heads included.
    """
    rules = spec.bf16_layers
    if model is None:
        if not rules.acts_on("generation"):
            return [], 0, 0, []
        return list(rules.modules), rules.first, rules.last, []
    from ...rules import describe_model
    from .rules import to_vllm

    keys = to_vllm(spec, describe_model(model))
    return list(keys.get("ignored_layers", [])), 0, 0, [str(w) for w in keys.warnings]


def engine_spelling(
    spec: RecipeSpec | str | Mapping[str, Any], model: Any = None, *, platform: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The vLLM engine arguments for ``spec`` and the warnings that go with them.

    Args:
        spec: a :class:`~nemo_fp8_plugin.spec.RecipeSpec` (or a recipe name).
        model: a model description for :func:`nemo_fp8_plugin.rules.to_vllm` (expands the
            BF16 rules into module names), or None to let the engine resolve them.
        platform: ``"cuda"``, ``"cpu"`` or None (unknown: assumed to be a GPU). On ``"cpu"``
            an FP8 KV cache is not requested (see :func:`engine_kwargs`).

    Returns:
        ``(kwargs, warnings)``; ``kwargs`` is ``{}`` when the recipe leaves generation in BF16.
    """
    from ...capabilities import capability
    from ...registry import get_recipe

    spec = get_recipe(spec)
    refuse_spec(spec)
    found: list[str] = []
    if spec.generation != "fp8":
        return {}, ["generation: bf16 in this recipe; vLLM runs in the model dtype"]
    row = capability(spec.scaling)
    if not row.vllm_generation:
        # The nemo_fp8 method implements the block-scaled recipes NeMo RL generates with;
        # per-tensor scales would have to be re-derived from a history that a refit resets.
        return {}, [
            f"scaling: {spec.scaling} has no FP8 vLLM generation path here (the nemo_fp8 "
            f"method implements block and MX scaling); vLLM runs in BF16, so generation "
            f"and training differ: keep importance_sampling on, or use fp8_blockwise"
        ]
    kv = _KV_CACHE_DTYPE[spec.kv_cache]
    if kv != "auto" and platform == "cpu":
        found.append(
            "kv_cache: fp8 is not requested on vLLM's CPU backend: it stores an FP8 KV "
            "cache as E5M2 (older builds rewrite fp8_e4m3 to fp8_e5m2) or needs AVX-512/AMX, "
            "so its rollouts would not match an E4M3 GPU cache; the cache stays in the "
            "model dtype"
        )
        kv = "auto"
    qcfg = quantization_config(spec, model)
    found.extend(qcfg.pop("_warnings"))
    qcfg["kv_cache_dtype"] = kv
    # vLLM 0.32 has no `calculate_kv_scales` (nor `device`) engine argument: KV/Q scales come
    # from the checkpoint or a weight update, here the trainer's (refresh_scales) with every
    # refit, so nothing else is needed for an FP8 cache.
    kwargs: dict[str, Any] = {
        "quantization": QUANT_METHOD,
        "hf_overrides": {"quantization_config": qcfg},
        "kv_cache_dtype": kv,
    }
    if row.is_mx and spec.hardware not in (None, "blackwell"):
        found.append(
            f"scaling: mx on {spec.hardware}: no MXFP8 tensor-core GEMM there (vLLM falls "
            f"back to weight-only or emulated kernels); use fp8_blockwise on Hopper"
        )
    return kwargs, found


def refuse_spec(spec: RecipeSpec) -> None:
    """Every refusal vLLM makes of a recipe alone (the adapter's
    :meth:`~nemo_fp8_plugin.hosts.HostAdapter.refuse` adds those of a config): nvfp4
    generation, and MXFP8 with an ``amax_epsilon`` its E8M0 scales cannot honour."""
    from ...capabilities import amax_epsilon_problem, capability
    from ...errors import FP8ConfigError

    row = capability(spec.scaling)
    if row.generation_refusal:
        raise FP8ConfigError(
            f"vLLM cannot generate with {spec.scaling}: {row.generation_refusal}",
            key="scaling",
            value=spec.scaling,
            hint="serve the model in BF16 (no recipe in the vLLM config), or use "
            "mxfp8 for FP8 generation on Blackwell",
        )
    # The spec refuses it already; a spec built without its checks still cannot reach vLLM.
    floor = amax_epsilon_problem(spec.scaling, spec.amax_epsilon)
    if floor:
        raise FP8ConfigError(
            f"{floor}, so vLLM's nemo_fp8 method cannot honour it",
            key="amax_epsilon",
            value=spec.amax_epsilon,
            hint="use 0 with mxfp8, or a block recipe (fp8_blockwise)",
        )


def quantization_config(
    spec: RecipeSpec | str | Mapping[str, Any], model: Any = None
) -> dict[str, Any]:
    """The ``quantization_config`` mapping of the ``nemo_fp8`` method for ``spec``.

    This is what ``engine_kwargs(spec)["hf_overrides"]["quantization_config"]`` holds; its keys
    are documented in :data:`CONFIG_KEYS`. The returned mapping carries the warnings of the
    BF16-rule spelling under ``"_warnings"`` (callers pop it).
    """
    from ...registry import get_recipe

    spec = get_recipe(spec)
    refuse_spec(spec)
    ignored, first, last, found = _rules_spelling(spec, model)
    # The kinds vLLM generates with (block, mx) all have tiles.
    assert spec.weight_block is not None and spec.activation_block is not None
    cfg: dict[str, Any] = {
        "quant_method": QUANT_METHOD,
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scheme": spec.scaling,
        "weight_block_size": list(spec.weight_block),
        "activation_block_size": list(spec.activation_block),
        "pow2_scales": bool(spec.pow2_scales),
        "amax_epsilon": float(spec.amax_epsilon),
        "ignored_layers": ignored,
        "num_first_layers_in_bf16": first,
        "num_last_layers_in_bf16": last,
        "generation_numerics": spec.generation_numerics,
        "_warnings": found,
    }
    return cfg


def engine_kwargs(
    spec: RecipeSpec | str | Mapping[str, Any], model: Any = None, *, platform: str | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM(...)`` (and ``vllm serve`` options) for ``spec``.

    ``{"quantization": "nemo_fp8", "hf_overrides": {"quantization_config": {...}},
    "kv_cache_dtype": "auto" | "fp8_e4m3"}`` (every key an argument of vLLM 0.32's
    ``EngineArgs``); an empty mapping when the recipe keeps generation in BF16. Environment
    variables vLLM reads at start-up are not engine arguments: see :func:`engine_env`.
    Warnings (rules vLLM cannot express, the CPU KV-cache trap) are issued with
    :func:`warnings.warn`.

    Known trap, handled: vLLM's CPU build keeps an FP8 KV cache as E5M2 (older releases rewrite
    ``fp8_e4m3`` to ``fp8_e5m2`` silently; 0.32 needs AVX-512 or AMX for it), so with
    ``platform="cpu"`` the cache stays in the model dtype and a warning says why. Without
    ``platform`` a GPU is assumed; the method also checks the dtype the engine really uses.
    """
    from ...registry import get_recipe
    from .. import refuse_recipe

    spec = get_recipe(spec)
    refuse_recipe(ADAPTER, spec)  # the refusals of `apply --host vllm`
    kwargs, found = engine_spelling(spec, model, platform=platform)
    for message in found:
        warnings.warn(message, stacklevel=2)
    return kwargs


def mla_kv_cache_note(spec: RecipeSpec, model: ModelDescription | None) -> str | None:
    """The note for an FP8 KV cache on multi-head latent attention (DeepSeek-V2/V3, Moonlight,
    Kimi: the ``deepseek`` family), or None: vLLM's MLA caches the compressed latent under one
    ``k_scale`` per layer, which the refit's key/value calibration does not measure
    (``rl.kv_scales`` refuses it), so the scales stay vLLM's default 1.0 for the whole run."""
    from ...capabilities import capability

    row = capability(spec.scaling)
    generates_fp8 = spec.generation == "fp8" and row.vllm_generation
    if spec.kv_cache != "fp8" or not generates_fp8 or model is None or model.family != "deepseek":
        return None
    return (
        f"kv_cache: fp8 on {model.name}, multi-head latent attention: vLLM keeps the KV "
        f"cache's scales at 1.0 (no per-step KV scales for MLA: the latent's one k_scale per "
        f"layer is not what key/value calibration measures); its values must fit E4M3 "
        f"unscaled, or keep kv_cache: auto"
    )


def engine_env(
    spec: RecipeSpec | str | Mapping[str, Any],
    hardware: str | None = None,
    *,
    release: str | None = None,
) -> dict[str, str]:
    """Environment variables to set before vLLM starts so its rollout kernels keep the
    recipe's scale grid (vLLM reads them at start-up, so they cannot travel as engine
    arguments); ``{}`` when nothing is needed.

    ``hardware``: a GPU or architecture name (None: the recipe's ``hardware``, else every GPU
    generation the recipe runs on); ``release``: the vLLM release (None: the ``latest``
    stack's). The answer is :func:`.rollout.needed_env`: from the release's defaults (every
    variable 1 when unset) and its kernel choice, the fewest variables that make the rollout
    compute on the recipe's grid with the ``nemo_fp8`` method loading, never one the method
    then refuses. For example ``fp8_blockwise`` (fp32 scales) on H100 needs
    ``VLLM_USE_DEEP_GEMM_E8M0=0`` (DeepGEMM with its E8M0 mode would requantize weights and
    activations to power-of-2 scales), on B200 ``VLLM_USE_DEEP_GEMM=0`` (DeepGEMM's Blackwell
    kernels take UE8M0 scales only; CUTLASS keeps fp32); ``fp8_subchannel`` on H100 needs
    ``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0`` (FlashInfer's kernel quantizes small batches
    itself with fp32 scales), nothing on Blackwell; MXFP8 needs nothing. The kernel each
    release picks: :func:`.rollout.rollout`.

    Raises :class:`FP8ConfigError` (key ``release``) when the ``nemo_fp8`` method cannot load
    the recipe's FP8 layers on ``release`` at all (:func:`.rollout.method_minimum`), rather
    than answering ``{}``.
    """
    from ...capabilities import arch_by_name
    from ...errors import FP8ConfigError
    from ...registry import get_recipe
    from .rollout import method_minimum, needed_env

    spec = get_recipe(spec)
    unserved = method_minimum(spec, release) if release is not None else None
    if unserved is not None:
        minimum, why = unserved
        raise FP8ConfigError(
            f"vLLM {release} cannot load {spec.name}'s FP8 layers: {why}",
            key="release",
            value=release,
            hint=f"a vLLM >= {minimum}, or generation: bf16",
        )
    target = hardware if hardware is not None else spec.hardware
    arch = None
    if target is not None:
        found = arch_by_name(target)
        arch = found.name if found is not None else target
    return needed_env(spec, arch, release=release)


def register() -> None:
    """Entry point of group ``vllm.general_plugins``: register the ``nemo_fp8`` method.

    Cheap and idempotent (vLLM calls it once per process, possibly several times per
    program); it changes nothing but the list of quantization methods.
    """
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .config import NemoFp8Config

    # Registering again (a second call in one process) only re-binds the same class.
    register_quantization_config(QUANT_METHOD)(NemoFp8Config)


from .adapter import ADAPTER  # noqa: E402 - the adapter reads the functions above lazily
