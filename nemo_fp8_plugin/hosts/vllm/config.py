"""The ``nemo_fp8`` quantization config: what vLLM's machinery parses and asks for methods.

Imported by :func:`nemo_fp8_plugin.hosts.vllm.register` inside vLLM processes only. The layer
methods (``methods.py``) load on the first ``get_quant_method`` call, so registering stays
cheap.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from . import QUANT_METHOD

if TYPE_CHECKING:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.models.utils import WeightsMapper

    from ...capabilities import RecipeCapability
    from ...spec import BF16Rules

__all__ = ["NemoFp8Config"]

_GLOB_CHARS = set("*?[")

GENERATION_NUMERICS = ("vllm", "vllm_deepgemm_ue8m0", "trainer")
"""Values of ``quantization_config.generation_numerics`` (the recipe field of that name)."""


def _as_block(value: Any, key: str) -> list[int] | None:
    if value is None:
        return None
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return [int(value[0]), int(value[1])]
    raise ValueError(f"nemo_fp8 quantization_config.{key}: expected [rows, cols], got {value!r}")


def _scheme_kind(scheme: Any) -> RecipeCapability:
    """The capability row of ``quantization_config.scheme`` (a scaling kind the method
    serves: ``block`` or ``mx``), or ValueError."""
    from ...capabilities import CAPABILITIES

    row = CAPABILITIES.get(scheme) if isinstance(scheme, str) else None
    if row is None or not row.vllm_generation:
        served = [k for k, r in CAPABILITIES.items() if r.vllm_generation]
        raise ValueError(
            f"nemo_fp8 quantization_config.scheme: expected one of {served}, got {scheme!r}"
        )
    return row


def _check_release(features: tuple[str, ...], prefix: str) -> None:
    """Refuse a layer whose part of the method the running vLLM release cannot serve
    (:func:`.api.unsupported`: the release's row of the stacks table, or the running vLLM
    itself when the release is untested), naming the release and the minimum."""
    import vllm

    from ...errors import FP8ConfigError
    from ...stacks import TESTED
    from . import api

    version = str(getattr(vllm, "__version__", "0"))
    for feature in features:
        why = api.unsupported(feature, version)
        if why is None:
            continue
        raise FP8ConfigError(
            f"nemo_fp8: {prefix}: vLLM {version} cannot serve {why.what} "
            f"(needs vLLM >= {why.minimum}): {why.why}",
            key="vllm",
            value=version,
            hint=f"install vLLM >= {why.minimum} (releases read: {', '.join(TESTED['vllm'])}), "
            f"or keep these layers in BF16",
        )
    _warn_untested(version)


@functools.cache
def _warn_untested(version: str) -> None:
    """Once per process: the running release is not one the tests read (its parts were
    checked on the running vLLM itself, :func:`.api.probe`)."""
    from ...stacks import TESTED, lookup, newer_than_tested

    if not lookup("vllm", "nemo_fp8:config", version).tested:
        newer = " (newer than every release read)" if newer_than_tested("vllm", version) else ""
        warnings.warn(
            f"nemo_fp8: vLLM {version} is untested{newer}; releases read: "
            f"{', '.join(TESTED['vllm'])}. The method checked the vLLM names it uses on this "
            f"vLLM itself",
            stacklevel=3,
        )


def _experts_class() -> type[torch.nn.Module]:
    """vLLM's fused-MoE experts layer: ``RoutedExperts`` (0.25 on), ``FusedMoE`` before it,
    which the ``moe`` check then refuses naming the release (never served as unquantized)."""
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
    except ImportError:
        from vllm.model_executor.layers.fused_moe import FusedMoE

        return FusedMoE
    return RoutedExperts


class NemoFp8Config(QuantizationConfig):
    """Block FP8 / MXFP8 with weights that can be replaced in place every RL step.

    Args:
        scheme: ``"block"`` (fp32 or power-of-2 scale per weight tile; activations per 1x128
            group) or ``"mx"`` (MXFP8, one E8M0 scale per 32 elements).
        weight_block_size: weight tile, ``[128, 128]`` by default for ``block``; ``[1, 32]``
            (or ``[32, 32]``) for ``mx``.
        activation_block_size: activation group, ``[1, 128]`` / ``[1, 32]``.
        pow2_scales: block scales rounded down to powers of two (block scheme).
        amax_epsilon: floor applied to each amax before its scale is computed (the recipe's
            ``amax_epsilon``; block scheme: weights quantized on arrival, and emulated
            activations under ``generation_numerics: trainer``; vLLM's own quantizer has a
            fixed floor, which the ``vllm`` numerics keep, and a non-zero value is refused
            on vLLM's kernels).
        ignored_layers: modules kept in BF16, exact names or glob patterns.
        num_first_layers_in_bf16 / num_last_layers_in_bf16: leading / trailing transformer
            layers kept in BF16.
        kv_cache_dtype: the KV-cache dtype the recipe asked for; a different one at run time
            (vLLM's CPU backend stores FP8 caches as E5M2) is reported.
        backend: ``"auto"``, ``"vllm"`` (vLLM's block-FP8 kernels) or ``"emulate"`` (the
            numerics emulation, any device).
        generation_numerics: how activations (and, for DeepGEMM, weights) are quantized
            (the recipe's ``generation_numerics``): ``"vllm"`` (default: vLLM's ``QuantFP8``,
            ``s = amax / 448``, ``q = x / s``; UE8M0 scales for a power-of-2 recipe),
            ``"vllm_deepgemm_ue8m0"`` (UE8M0 activation scales and weights requantized to
            power-of-2 block scales, vLLM's DeepGEMM with ``VLLM_USE_DEEP_GEMM_E8M0=1``;
            block scheme only) or ``"trainer"`` (Transformer Engine's numerics, as the
            trainer quantizes: not what a GPU kernel computes, so the emulation backend
            only). The emulation computes the one named; on vLLM's kernels the method checks
            that the kernel vLLM picked computes it, and refuses otherwise.
    """

    def __init__(
        self,
        *,
        scheme: str = "block",
        weight_block_size: list[int] | None = None,
        activation_block_size: list[int] | None = None,
        pow2_scales: bool = False,
        amax_epsilon: float = 0.0,
        ignored_layers: list[str] | None = None,
        num_first_layers_in_bf16: int = 0,
        num_last_layers_in_bf16: int = 0,
        kv_cache_dtype: str = "auto",
        backend: str = "auto",
        generation_numerics: str = "vllm",
    ) -> None:
        super().__init__()
        from ...capabilities import amax_epsilon_problem

        kind = _scheme_kind(scheme)
        default_w = list(kind.default_tile("weight_block") or ())
        default_a = list(kind.default_tile("activation_block") or ())
        self.scheme = scheme
        self.weight_block_size = weight_block_size or default_w
        self.activation_block_size = activation_block_size or default_a
        allowed_w = [list(t) for t in sorted(kind.allowed("weight_block"))]
        if self.weight_block_size not in allowed_w:
            raise ValueError(
                f"nemo_fp8 quantization_config.weight_block_size: {self.weight_block_size} "
                f"is not supported for scheme {scheme!r} (use one of {allowed_w})"
            )
        if self.activation_block_size != default_a:
            raise ValueError(
                f"nemo_fp8 quantization_config.activation_block_size: expected "
                f"{default_a} for scheme {scheme!r}, got {self.activation_block_size}"
            )
        self.pow2_scales = bool(pow2_scales) or bool(kind.fixed_pow2)
        try:
            self.amax_epsilon = float(amax_epsilon or 0.0)
        except (TypeError, ValueError):
            raise ValueError(
                f"nemo_fp8 quantization_config.amax_epsilon: expected a number, "
                f"got {amax_epsilon!r}"
            ) from None
        if not 0.0 <= self.amax_epsilon < float("inf"):
            raise ValueError(
                f"nemo_fp8 quantization_config.amax_epsilon: expected a finite "
                f"number >= 0, got {amax_epsilon!r}"
            )
        floor = amax_epsilon_problem(scheme, self.amax_epsilon)
        if floor:
            raise ValueError(f"nemo_fp8 quantization_config.amax_epsilon: {floor}; use 0")
        self.ignored_layers = list(ignored_layers or [])
        self.num_first_layers_in_bf16 = int(num_first_layers_in_bf16 or 0)
        self.num_last_layers_in_bf16 = int(num_last_layers_in_bf16 or 0)
        if self.num_first_layers_in_bf16 < 0 or self.num_last_layers_in_bf16 < 0:
            raise ValueError(
                "nemo_fp8 quantization_config: num_first/last_layers_in_bf16 must be >= 0"
            )
        self.kv_cache_dtype = kv_cache_dtype
        if backend not in ("auto", "vllm", "emulate"):
            raise ValueError(
                f"nemo_fp8 quantization_config.backend: expected auto, vllm or emulate, "
                f"got {backend!r}"
            )
        self.backend = backend
        if generation_numerics not in GENERATION_NUMERICS:
            raise ValueError(
                f"nemo_fp8 quantization_config.generation_numerics: expected one of "
                f"{', '.join(GENERATION_NUMERICS)}, got {generation_numerics!r}"
            )
        if generation_numerics == "vllm_deepgemm_ue8m0" and not kind.deepgemm_generation:
            raise ValueError(
                "nemo_fp8 quantization_config.generation_numerics: vllm_deepgemm_ue8m0 is "
                f"vLLM's DeepGEMM block-FP8 path, not scheme {scheme!r} (use vllm or trainer)"
            )
        self.generation_numerics = generation_numerics
        self._num_layers: int | None = None

    # ------------------------------------------------------------------ vLLM interface

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # FP8 tensor cores start at Ada (SM89); vLLM skips this check on CPU.
        return 89

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NemoFp8Config:
        """Parse a ``quantization_config`` mapping (ours, or a vLLM ``fp8`` block checkpoint's)."""
        _check_release(("config",), "quantization_config")
        method = config.get("quant_method", QUANT_METHOD)
        if method not in (QUANT_METHOD, "fp8"):
            raise ValueError(f"nemo_fp8 cannot read quant_method {method!r}")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"nemo_fp8 quantization_config.fmt: only e4m3 is supported, got {fmt!r}"
            )
        scheme_act = config.get("activation_scheme", "dynamic")
        if scheme_act != "dynamic":
            raise ValueError(
                f"nemo_fp8 quantization_config.activation_scheme: only 'dynamic' "
                f"(per-token-group scales computed at run time), got {scheme_act!r}"
            )
        scheme = config.get("scheme", "block")
        weight_block = _as_block(config.get("weight_block_size"), "weight_block_size")
        if method == "fp8" and weight_block is None:
            raise ValueError(
                "nemo_fp8 reads block-quantized fp8 checkpoints only "
                "(quantization_config.weight_block_size is missing)"
            )
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        known = {
            "quant_method",
            "fmt",
            "activation_scheme",
            "scheme",
            "weight_block_size",
            "activation_block_size",
            "pow2_scales",
            "amax_epsilon",
            "ignored_layers",
            "modules_to_not_convert",
            "num_first_layers_in_bf16",
            "num_last_layers_in_bf16",
            "kv_cache_dtype",
            "backend",
            "scale_fmt",
            "generation_numerics",
        }
        unknown = sorted(k for k in config if k not in known)
        if method == QUANT_METHOD and unknown:
            raise ValueError(f"nemo_fp8 quantization_config: unknown key(s) {unknown}")
        return cls(
            scheme=scheme,
            weight_block_size=weight_block,
            activation_block_size=_as_block(
                config.get("activation_block_size"), "activation_block_size"
            ),
            pow2_scales=bool(config.get("pow2_scales", config.get("scale_fmt") == "ue8m0")),
            amax_epsilon=config.get("amax_epsilon", 0.0),
            ignored_layers=list(ignored),
            num_first_layers_in_bf16=config.get("num_first_layers_in_bf16", 0),
            num_last_layers_in_bf16=config.get("num_last_layers_in_bf16", 0),
            kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
            backend=config.get("backend", "auto"),
            generation_numerics=config.get("generation_numerics", "vllm"),
        )

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        # Claim a vLLM block-FP8 checkpoint (export_fp8_checkpoint's output, DeepSeek-style
        # checkpoints) only when the user asked for nemo_fp8: everything else is untouched.
        if user_quant != QUANT_METHOD or not isinstance(hf_quant_cfg, dict):
            return None
        if hf_quant_cfg.get("quant_method") == "fp8" and hf_quant_cfg.get("weight_block_size"):
            return QUANT_METHOD
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper: WeightsMapper) -> None:
        exact = [n for n in self.ignored_layers if not (_GLOB_CHARS & set(n))]
        globs = [n for n in self.ignored_layers if _GLOB_CHARS & set(n)]
        self.ignored_layers = list(hf_to_vllm_mapper.apply_list(exact)) + globs

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.attention import Attention, MLAAttention
        from vllm.model_executor.layers.linear import LinearBase

        kind = _scheme_kind(self.scheme)
        # Each part is checked against the running release before its module is imported.
        if isinstance(layer, LinearBase):
            if self.is_bf16(prefix):
                from .linear import NemoBF16LinearMethod

                return NemoBF16LinearMethod()
            _check_release(("block_linear" if kind.is_block else "mx_linear",), prefix)
            from . import methods

            return methods.NemoFp8LinearMethod(self, prefix)
        experts = _experts_class()
        if experts is not None and isinstance(layer, experts):
            _check_release(("moe",), prefix)
            from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

            if self.is_bf16(prefix):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            _check_release(("block_moe" if kind.is_block else "mx_moe",), prefix)
            from . import methods

            return methods.NemoFp8MoEMethod(self, layer, prefix)
        if isinstance(layer, (Attention, MLAAttention)):
            # MLAAttention (DeepSeek-V3, Moonlight, Kimi) is no Attention subclass, but takes
            # its KV-cache method from the quant config the same way (_init_kv_cache_quant).
            _check_release(("kv",), prefix)
            from . import methods

            return methods.NemoFp8KVCacheMethod(self, prefix)
        return None

    # ------------------------------------------------------------------ BF16 rules

    def _total_layers(self) -> int | None:
        if self._num_layers is None:
            from vllm.config import get_current_vllm_config

            try:
                hf = get_current_vllm_config().model_config.hf_text_config
                self._num_layers = int(hf.num_hidden_layers)
            except (AttributeError, TypeError, ValueError):
                return None
        return self._num_layers

    def _rules(self) -> BF16Rules:
        """``ignored_layers`` and the first/last counts in the plugin's rule language."""
        if self.__dict__.get("_bf16_rules", False) is False:
            from ...spec import BF16Rules

            self._bf16_rules = BF16Rules(
                first=self.num_first_layers_in_bf16,
                last=self.num_last_layers_in_bf16,
                modules=tuple(dict.fromkeys(self.ignored_layers)),
                applies_to="generation",
            )
        return self._bf16_rules

    def is_bf16(self, prefix: str) -> bool:
        """Whether the module at ``prefix`` stays in BF16.

        Exact names in ``ignored_layers`` follow vLLM's ``fp8`` method: a fused module
        (``qkv_proj``, ``gate_up_proj``) is checked through the Hugging Face names fused into
        it, and naming only some of them is an error (one GEMM runs them all). Patterns and
        first/last counts follow the plugin's rule language
        (:func:`nemo_fp8_plugin.rules.keeps_bf16` on the generation side: a pattern may use
        either naming, and a fused module is BF16 when any member matches).
        """
        head, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last) or []
        names = [f"{head}.{s}" if head else s for s in shards] or [prefix]
        exact = {n for n in self.ignored_layers if not (_GLOB_CHARS & set(n))}
        if prefix in exact:
            return True
        hits = [n in exact for n in names]
        if any(hits) and not all(hits):
            listed = [n for n, h in zip(names, hits) if h]
            missing = [n for n, h in zip(names, hits) if not h]
            raise ValueError(
                f"nemo_fp8: ignored_layers lists {listed} but not {missing}; vLLM runs "
                f"them as one fused GEMM ({prefix}), so list all of them or none"
            )
        if hits and all(hits):
            return True
        # Also keeps what no host runs in FP8 (MoE routers), as training does.
        from ...rules import keeps_bf16

        rules = self._rules()
        total = self._total_layers() if rules.last else None
        if rules.last and total is None:
            raise ValueError(
                "nemo_fp8: num_last_layers_in_bf16 needs the model's num_hidden_layers"
            )
        return any(
            keeps_bf16(rules, n, side="generation", num_layers=total) is not None for n in names
        )

    def __repr__(self) -> str:
        return (
            f"NemoFp8Config(scheme={self.scheme}, weight_block_size={self.weight_block_size}, "
            f"pow2_scales={self.pow2_scales}, amax_epsilon={self.amax_epsilon}, "
            f"ignored_layers={self.ignored_layers}, "
            f"bf16 first/last={self.num_first_layers_in_bf16}/{self.num_last_layers_in_bf16}, "
            f"backend={self.backend}, generation_numerics={self.generation_numerics})"
        )
