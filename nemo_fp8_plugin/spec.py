"""The recipe spec: one typed, immutable description of an FP8 recipe.

Everything downstream (host adapters, the numerics reference, the RL refit path, the
CLI) reads a :class:`RecipeSpec`; nothing reads raw YAML. A spec is a frozen dataclass
that validates itself in ``__post_init__``, so an invalid spec cannot exist. The field
names are also the keys of the YAML ``fp8:`` block.

This module imports nothing beyond the standard library: config-only commands must not
pay for torch.

Transformer Engine (TE) names are given for each field. The TE recipe classes are
``DelayedScaling`` (scaling="delayed"), ``Float8CurrentScaling`` ("tensorwise"),
``Float8BlockScaling`` ("block"), ``MXFP8BlockScaling`` ("mx") and ``NVFP4BlockScaling``
("nvfp4", FP4 elements: the "fp8" of ``training``/``generation`` then means the recipe's
quantized format).

Over 600 lines on purpose: the one typed spec and the checks that keep it valid, each field
declared and checked in one place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from . import capabilities as _caps
from . import kinds as _kinds
from .errors import FP8ConfigError, format_value, suggest

_T = TypeVar("_T")

__all__ = [
    "SCALING_KINDS",
    "FP8_FORMATS",
    "FP8_MAX",
    "HARDWARE_ARCHS",
    "GENERATION_NUMERICS",
    "BF16Rules",
    "ImportanceSampling",
    "QuantizationAwareRL",
    "QAT_PRESETS",
    "QAT_ROLLOUTS",
    "RecipeSpec",
    "Finding",
    "normalize_hardware",
    "check_importance_combination",
]

SCALING_KINDS = _caps.SCALING_KINDS
"""Scaling strategies (:data:`nemo_fp8_plugin.capabilities.ScalingKind`). delayed: per-tensor
scale from an amax history (TE DelayedScaling); tensorwise: per-tensor scale from the tensor's
own amax (TE Float8CurrentScaling); block: one fp32 scale per 1x128 or 128x128 tile (TE
Float8BlockScaling, DeepSeek-V3); mx: one E8M0 scale per 32 elements (OCP MXFP8, TE
MXFP8BlockScaling); nvfp4: E2M1 elements, one E4M3 scale per 1x16 group or 16x16 weight tile
and an fp32 scale per tensor (TE NVFP4BlockScaling)."""

FP8_FORMATS = ("e4m3", "hybrid", "e2m1")
"""e4m3: every FP8 tensor is E4M3 (TE Format.E4M3). hybrid: forward tensors (inputs,
weights) E4M3, backward tensors (output gradients) E5M2 (TE Format.HYBRID). e2m1: every
tensor is FP4 E2M1 (TE Format.E2M1, ``fp4_format``), the format of ``scaling: nvfp4`` and
only of it. Pure E5M2 is refused, as TE refuses it."""

FP8_MAX = _caps.FP8_MAX
"""Largest finite magnitude of each element format."""

HARDWARE_ARCHS = _caps.ARCH_NAMES
"""GPU architectures the validation knows (:data:`nemo_fp8_plugin.capabilities.ARCHS`):
ada = SM89 (L4, L40S), hopper = SM90 (H100, H200, GH200), blackwell = SM100/SM103 (B200,
GB200, B300, GB300), blackwell_sm120 = SM 12.x (RTX PRO 6000 Blackwell)."""

GENERATION_NUMERICS = ("vllm", "vllm_deepgemm_ue8m0", "trainer")
"""Values of :attr:`RecipeSpec.generation_numerics`: how the generation engine quantizes.
vllm: as vLLM's own activation quantizer (``QuantFP8`` / ``per_token_group_quant_fp8``:
``s = amax / 448`` with a fixed floor, ``q = x / s``); vllm_deepgemm_ue8m0: the same with
power-of-2 (UE8M0) scales and weights requantized to power-of-2 block scales, as vLLM's
DeepGEMM kernels run with ``VLLM_USE_DEEP_GEMM_E8M0=1``; trainer: Transformer Engine's
numerics (``q = x * (448 / amax)``), the trainer's own, which no vLLM GPU kernel computes.
The same names as :data:`nemo_fp8_plugin.numerics.vllm_numerics.NUMERICS`."""

_ROLES = ("input", "weight", "grad_output")


def normalize_hardware(value: Any, key: str = "hardware") -> str | None:
    """Map a GPU name, ``nvidia-smi`` name, ``sm90``-style capability or architecture
    (``"H100"``, ``"NVIDIA H100 80GB HBM3"``, ``"sm90"``, ``"hopper"``) to an architecture."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise FP8ConfigError(
            f"expected a GPU name or architecture, got {format_value(value)}",
            key=key,
            value=value,
            hint=f"one of {', '.join(HARDWARE_ARCHS)}",
        )
    if any(sep in value for sep in ",;/+"):  # "b200,h100" was read as its first name
        raise FP8ConfigError(
            f"expected one GPU or architecture, got a list: {format_value(value)}",
            key=key,
            value=value,
            hint="check one target at a time",
        )
    arch = _caps.arch_by_name(value)
    if arch is None:
        raise FP8ConfigError(
            f"unknown hardware {format_value(value)}",
            key=key,
            value=value,
            hint=f"use an architecture ({', '.join(HARDWARE_ARCHS)}), a GPU "
            f"name such as h100, h200, b200, or a capability such as sm90",
        )
    # An Ampere GPU is a valid target that nothing runs on: the hardware findings say so (and
    # what to do), so explain can report it rather than refuse the flag.
    return arch.name


# --------------------------------------------------------------------------- checks


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise FP8ConfigError(f"expected true or false, got {format_value(value)}", key=key, value=value)


def _int(key: str, value: Any, lo: int, hi: int) -> int:
    # bool is an int subclass in Python; `margin: true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise FP8ConfigError(
            f"expected an integer, got {format_value(value)}", key=key, value=value
        )
    if not lo <= value <= hi:
        raise FP8ConfigError(f"must be between {lo} and {hi}, got {value}", key=key, value=value)
    return value


def _float(key: str, value: Any, lo: float, hi: float, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FP8ConfigError(f"expected a number, got {format_value(value)}", key=key, value=value)
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise FP8ConfigError(
            f"must be a finite number between {lo} and {hi}, got {value}", key=key, value=value
        )
    return cast(float, value)


def _choice(
    key: str, value: Any, choices: Collection[Any], *, optional: bool = False
) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, str) and value in choices:
        return value
    shown = [c for c in choices if c is not None]
    near = suggest(value, shown) if isinstance(value, str) else None
    hint = f"did you mean {near!r}?" if near else None
    raise FP8ConfigError(
        f"expected one of {', '.join(map(str, shown))}, got {format_value(value)}",
        key=key,
        value=value,
        hint=hint,
    )


def _block(key: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise FP8ConfigError(
        f"expected a tile shape [rows, cols] such as [1, 128], got {format_value(value)}",
        key=key,
        value=value,
    )


def _str_tuple(key: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise FP8ConfigError(
            f"expected a list of glob patterns, got {format_value(value)}", key=key, value=value
        )
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise FP8ConfigError(
                f"expected a non-empty glob pattern, got {format_value(item)}",
                key=f"{key}[{i}]",
                value=item,
            )
        out.append(item.strip())
    return tuple(out)


def _check_keys(prefix: str, mapping: Mapping[Any, Any], allowed: Collection[str]) -> None:
    for k in mapping:
        if not isinstance(k, str):
            raise FP8ConfigError(
                f"keys must be strings, got {format_value(k)}",
                key=f"{prefix}.{k}" if prefix else str(k),
                value=k,
            )
        if k not in allowed:
            near = suggest(k, allowed)
            raise FP8ConfigError(
                "unknown key",
                key=f"{prefix}.{k}" if prefix else k,
                hint=f"did you mean {near!r}?"
                if near
                else f"valid keys: {', '.join(sorted(allowed))}",
            )


@dataclass(frozen=True)
class Finding:
    """One validation result. level is ``"error"`` or ``"warning"``; key is the dotted key it is about."""

    level: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.key}: {self.message}"


# --------------------------------------------------------------------------- rule set


@dataclass(frozen=True)
class BF16Rules:
    """Which linear layers stay in BF16 while the rest run in FP8.

    Rules are applied in a fixed order and the first one that matches a module decides
    it: ``first``, then ``last``, then each pattern of ``modules`` in the order written.
    Modules no rule matches run in FP8. ``nemo-fp8 explain`` shows the deciding rule of
    every module, and a pattern that matches nothing is reported.
    """

    first: int = 0
    """Number of leading transformer layers kept in BF16. Default 0. Megatron:
    ``first_last_layers_bf16`` + ``num_layers_at_start_in_bf16``; NeMo RL (vLLM side):
    ``num_first_layers_in_bf16``."""

    last: int = 0
    """Number of trailing transformer layers kept in BF16. Default 0. Megatron:
    ``num_layers_at_end_in_bf16``; NeMo RL: ``num_last_layers_in_bf16``."""

    modules: tuple[str, ...] = ()
    """fnmatch-style glob patterns (``*``, ``?``, ``[...]``) on qualified module names,
    e.g. ``"*.router"``, ``"output_layer"``, ``"*a_proj*"``. Default empty. Matched against
    Megatron names on the training side and Hugging Face / vLLM names on the generation
    side, through the name mapping of :mod:`nemo_fp8_plugin.rules`. vLLM: ``ignored_layers``;
    NeMo RL: ``quantization_ignored_layer_kws``; megatron-core: ``quant_recipe`` matchers."""

    applies_to: str = "both"
    """Where the rules act: ``"training"``, ``"generation"`` or ``"both"`` (default)."""

    FIELDS = ("first", "last", "modules", "applies_to")

    def __post_init__(self) -> None:
        object.__setattr__(self, "first", _int("first", self.first, 0, 100_000))
        object.__setattr__(self, "last", _int("last", self.last, 0, 100_000))
        object.__setattr__(self, "modules", _str_tuple("modules", self.modules))
        object.__setattr__(
            self,
            "applies_to",
            _choice("applies_to", self.applies_to, ("training", "generation", "both")),
        )
        seen = set()
        for i, pat in enumerate(self.modules):
            if pat in seen:
                raise FP8ConfigError(
                    f"pattern {pat!r} is listed twice", key=f"modules[{i}]", value=pat
                )
            seen.add(pat)

    @property
    def empty(self) -> bool:
        """True when no layer is kept in BF16."""
        return self.first == 0 and self.last == 0 and not self.modules

    def acts_on(self, side: str) -> bool:
        """Whether the rules apply to ``side`` (``"training"`` or ``"generation"``)."""
        return self.applies_to in ("both", side)

    @classmethod
    def from_mapping(cls, value: Any, base: BF16Rules | None = None) -> BF16Rules:
        """Build from YAML. Keys given override ``base`` field by field."""
        base = base or cls()
        if value is None:
            return base
        if not isinstance(value, Mapping):
            raise FP8ConfigError(
                f"expected a mapping with keys {', '.join(cls.FIELDS)}, got {format_value(value)}",
                value=value,
            )
        _check_keys("", value, cls.FIELDS)
        modules = value.get("modules")
        if isinstance(modules, (list, tuple)):  # counted before each is parsed and matched
            from .errors import LIMITS, check_limit

            check_limit(len(modules), LIMITS.bf16_rules, "module rules", key="modules")
        return _wrap(lambda: dataclasses.replace(base, **dict(value)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "first": self.first,
            "last": self.last,
            "modules": list(self.modules),
            "applies_to": self.applies_to,
        }


def check_importance_combination(level: str, truncation: str | None) -> None:
    """Refuse ``seq-mask-tis`` with sequence-level ratios (it masks sequences but weights
    tokens; NeMo RL's loss refuses the combination too). One check for the recipe's
    ``importance_sampling`` block and for :func:`nemo_fp8_plugin.rl.importance_weights`."""
    if truncation == "seq-mask-tis" and level == "sequence":
        raise FP8ConfigError(
            "seq-mask-tis masks sequences but weights tokens; it cannot be "
            "combined with sequence-level ratios",
            key="level",
            value="sequence",
            hint="use level: token (NeMo RL refuses the combination too)",
        )


@dataclass(frozen=True)
class ImportanceSampling:
    """Token-level importance-sampling correction of the generation/training mismatch (RL only).

    With FP8 generation the sampling policy differs slightly from the training policy;
    each token's loss is weighted by ``exp(train_logprob - gen_logprob)``. Training-only
    hosts ignore this block. NeMo RL keys: ``loss_fn.use_importance_sampling_correction``,
    ``truncated_importance_sampling_type``, ``truncated_importance_sampling_ratio``,
    ``truncated_importance_sampling_ratio_min``, ``sequence_level_importance_ratios``.
    """

    enabled: bool = True
    """Apply the correction. Default true (the end-to-end FP8 RL recipe relies on it)."""

    level: str = "token"
    """``"token"`` (default): one weight per token. ``"sequence"``: one weight per sequence,
    ``exp(sum(train - gen))`` over its valid tokens (NeMo RL ``sequence_level_importance_ratios``)."""

    truncation: str | None = None
    """None (default): plain weights. ``"tis"``: clamp weights to [ratio_min or 0, ratio_max].
    ``"icepop"``: zero tokens whose weight is outside [ratio_min, ratio_max].
    ``"seq-mask-tis"``: zero whole sequences whose geometric-mean weight is outside
    [ratio_min, ratio_max], keep plain token weights elsewhere."""

    ratio_max: float = 2.0
    """Upper bound of the truncation window. Default 2.0. Ignored without ``truncation``."""

    ratio_min: float | None = None
    """Lower bound of the truncation window. Default None (0 for ``tis``; for ``icepop`` and
    ``seq-mask-tis`` None means 1/ratio_max). Ignored without ``truncation``."""

    max_sequence_error: float | None = None
    """Drop whole sequences whose generation/training log-prob error is too large: a sequence
    whose mean over its valid tokens of ``exp(|gen - train|)`` (NeMo RL's
    ``token_mult_prob_error``, per sequence: 1.0 means identical) exceeds this value leaves
    the loss, as if its sample mask were 0. None (default): no sequence is dropped. At least
    1.0 (1.0 drops any sequence that differs at all; NeMo RL's example value is 1.5).
    Applies whether or not ``enabled`` (it changes which sequences count, not their
    weights). NeMo RL ``grpo.seq_logprob_error_threshold`` (v0.6.0 and later); the numerics
    are :func:`nemo_fp8_plugin.rl.sequence_mask.sequence_error_mask`."""

    FIELDS = ("enabled", "level", "truncation", "ratio_max", "ratio_min", "max_sequence_error")

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", _bool("enabled", self.enabled))
        object.__setattr__(self, "level", _choice("level", self.level, ("token", "sequence")))
        object.__setattr__(
            self,
            "truncation",
            _choice(
                "truncation", self.truncation, ("tis", "icepop", "seq-mask-tis"), optional=True
            ),
        )
        object.__setattr__(self, "ratio_max", _float("ratio_max", self.ratio_max, 1e-6, 1e6))
        object.__setattr__(
            self, "ratio_min", _float("ratio_min", self.ratio_min, 0.0, 1e6, optional=True)
        )
        if self.ratio_min is not None and self.ratio_min > self.ratio_max:
            raise FP8ConfigError(
                f"ratio_min ({self.ratio_min}) exceeds ratio_max ({self.ratio_max})",
                key="ratio_min",
                value=self.ratio_min,
            )
        error = _float("max_sequence_error", self.max_sequence_error, 0.0, 1e6, optional=True)
        if error is not None and error < 1.0:
            raise FP8ConfigError(
                f"must be at least 1.0, got {error}: a sequence's error, the mean of "
                f"exp(|gen - train|), is 1.0 when the two agree, so every sequence would leave "
                f"the loss",
                key="max_sequence_error",
                value=self.max_sequence_error,
                hint="NeMo RL's example value is 1.5; null keeps every sequence",
            )
        object.__setattr__(self, "max_sequence_error", error)
        check_importance_combination(self.level, self.truncation)

    @classmethod
    def from_mapping(cls, value: Any, base: ImportanceSampling | None = None) -> ImportanceSampling:
        base = base or cls()
        if value is None:
            return base
        if isinstance(value, bool):  # `importance_sampling: false` is the natural shorthand
            return dataclasses.replace(base, enabled=value)
        if not isinstance(value, Mapping):
            raise FP8ConfigError(
                f"expected true, false or a mapping with keys "
                f"{', '.join(cls.FIELDS)}, got {format_value(value)}",
                value=value,
            )
        _check_keys("", value, cls.FIELDS)
        return _wrap(lambda: dataclasses.replace(base, **dict(value)))

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}


QAT_PRESETS = ("w4a16", "w4a4", "nano3-w4a16", "experts-w4a4")
"""NVIDIA's ModelOpt quantization-aware RL recipes for NeMo RL, by the name
:attr:`QuantizationAwareRL.preset` takes. w4a16: NVFP4 weights, BF16 activations
(``nvfp4_a16.yaml``, ``qa_grpo_llama8b_megatron.v2.yaml``); w4a4: NVFP4 weights and
activations (ModelOpt's ``NVFP4_DEFAULT_CFG``, ``qa_grpo_math_megatron.yaml``); nano3-w4a16:
Nemotron-3 Nano's weight-only recipe (``nano3_nvfp4_weightonly.yaml``,
``qa_grpo_nano3_megatron.yaml``); experts-w4a4: NVFP4 weights and activations of the routed
experts only (``nvfp4_experts.yaml``, the Qwen3-30B-A3B real-quant recipe). Each is spelled
by :mod:`nemo_fp8_plugin.hosts.nemo_rl.modelopt`."""

QAT_ROLLOUTS = ("fake_quant", "real_quant")
"""Values of :attr:`QuantizationAwareRL.rollout`: how vLLM runs the quantized rollout."""


@dataclass(frozen=True)
class QuantizationAwareRL:
    """NVFP4 RL through ModelOpt quantization-aware training (NeMo RL's QA-GRPO / QARL).

    Instead of Transformer Engine's NVFP4 GEMMs, the policy trains in BF16 with ModelOpt
    fake-quantizers (straight-through gradients) and the rollout runs the same recipe in
    vLLM. Only NeMo RL has this path; other hosts refuse it. YAML: ``qat: w4a16`` or
    ``qat: {preset: nano3-w4a16, rollout: real_quant}`` in the ``fp8:`` block, with
    ``recipe: nvfp4``.
    """

    preset: str
    """NVIDIA's recipe, one of :data:`QAT_PRESETS` (the ModelOpt ``quant_cfg`` both the
    policy and the rollout use, its calibration, and the keys the shipped config sets)."""

    rollout: str = "fake_quant"
    """``"fake_quant"`` (default, NeMo RL's default when ``policy.generation.quant_cfg`` is
    set): vLLM runs BF16 weights through fake-quantized layers. ``"real_quant"``: vLLM's
    ModelOpt NVFP4 kernels on packed NVFP4 weights (``policy.generation.real_quant``),
    with the BF16 rules as ``policy.generation.real_quant_ignore``."""

    FIELDS = ("preset", "rollout")

    def __post_init__(self) -> None:
        object.__setattr__(self, "preset", _choice("preset", self.preset, QAT_PRESETS))
        object.__setattr__(self, "rollout", _choice("rollout", self.rollout, QAT_ROLLOUTS))

    @classmethod
    def from_value(cls, value: Any) -> QuantizationAwareRL | None:
        """From YAML: None (no QAT), a preset name, or a mapping with :attr:`FIELDS`."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(preset=value)
        if not isinstance(value, Mapping):
            raise FP8ConfigError(
                f"expected a preset name ({', '.join(QAT_PRESETS)}) or a mapping with keys "
                f"{', '.join(cls.FIELDS)}, got {format_value(value)}",
                value=value,
            )
        _check_keys("", value, cls.FIELDS)
        if "preset" not in value:
            raise FP8ConfigError("is required", key="preset", hint=", ".join(QAT_PRESETS))
        return _wrap(lambda: cls(**dict(value)))

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}


def _wrap(build: Callable[[], _T]) -> _T:
    """Run a dataclass constructor, turning a stray TypeError into our error type."""
    try:
        return build()
    except FP8ConfigError:
        raise
    except TypeError as exc:  # e.g. an unhashable value reaching a field
        raise FP8ConfigError(f"invalid value: {exc}") from None


# --------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class RecipeSpec:
    """An FP8 training/generation recipe, validated and immutable.

    Build one from a registered name or a mapping with :func:`nemo_fp8_plugin.get_recipe`;
    derive a variant with :meth:`replace`. Field defaults below are those of a bare spec;
    the named presets in ``conf/recipes/`` set every field explicitly.
    """

    name: str
    """Registry name, the value users write in ``precision:`` (e.g. ``"fp8_blockwise"``)."""

    scaling: _caps.ScalingKind
    """Scaling strategy, one of :data:`SCALING_KINDS`. TE class: delayed -> DelayedScaling,
    tensorwise -> Float8CurrentScaling, block -> Float8BlockScaling, mx -> MXFP8BlockScaling,
    nvfp4 -> NVFP4BlockScaling. megatron-core ``fp8_recipe``: delayed, tensorwise, blockwise,
    mxfp8; nvfp4 is megatron-core's ``fp4_recipe: nvfp4`` (with ``fp4: e2m1``, FP8 off)."""

    description: str = ""
    """One line shown by ``nemo-fp8 recipes``."""

    fp8_format: str = "hybrid"
    """``"e4m3"`` or ``"hybrid"`` (default). Forward tensors are always E4M3 (max 448); output
    gradients are E4M3 under e4m3 and E5M2 (max 57344) under hybrid. TE ``fp8_format``
    (Format.E4M3 / Format.HYBRID); megatron-core ``fp8``. ``"e2m1"`` (FP4, max 6) for
    ``scaling: nvfp4`` and only there: TE ``fp4_format`` (Format.E2M1); megatron-core ``fp4``."""

    activation_block: tuple[int, int] | None = None
    """Tile shape of activation (GEMM input) scales: None (default) = one scale per tensor;
    [1, 128] for block; [1, 32] for mx; [1, 16] for nvfp4. TE ``x_block_scaling_dim`` 1
    (1x128) or 2 (128x128)."""

    weight_block: tuple[int, int] | None = None
    """Tile shape of weight scales: None (default) = per tensor; [128, 128] or [1, 128] for
    block (TE ``w_block_scaling_dim`` 2 or 1); [1, 32] or [32, 32] for mx (TE
    ``enable_2d_quantization``); [16, 16] or [1, 16] for nvfp4 (TE
    ``disable_2d_quantization`` false / true). vLLM ``weight_block_size``."""

    gradient_block: tuple[int, int] | None = None
    """Tile shape of output-gradient scales: None (default) = per tensor; [1, 128] for block
    (TE ``grad_block_scaling_dim`` 1); [1, 32] for mx; [1, 16] for nvfp4."""

    pow2_scales: bool = False
    """Round every scale down to a power of two (clear its 23 mantissa bits). Default false.
    TE: ``Float8CurrentScaling.use_power_2_scales`` / ``not Float8BlockScaling.use_f32_scales``,
    i.e. the quantizer parameters ``fp8_quant_{fwd_inp,fwd_weight,bwd_grad}.power_2_scale``,
    which TE fixes at import from ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` /
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``. Always true for mx (E8M0 scales are powers of two),
    always false for nvfp4 (E4M3 block scales)."""

    amax_epsilon: float = 0.0
    """Floor applied to amax before the scale is computed: ``amax = max(amax, eps)``.
    Default 0. TE ``QParams.amax_epsilon``."""

    amax_history_len: int = 1
    """Delayed scaling only: length L of the amax history window. Default 1. TE
    ``amax_history_len``; megatron-core ``fp8_amax_history_len``."""

    amax_compute_algo: str = "most_recent"
    """Delayed scaling only: ``"max"`` = amax is the max over the history window;
    ``"most_recent"`` (default) = the latest amax. TE ``amax_compute_algo``."""

    margin: int = 0
    """Delayed scaling: ``scale = (fp8_max * 2**-margin) / amax``. Default 0. TE ``margin``;
    megatron-core ``fp8_margin``."""

    reduce_amax: bool = True
    """Delayed scaling: all-reduce amaxes across the data-parallel group so every rank uses the
    same scale. Default true. TE ``reduce_amax``."""

    fp8_wgrad: bool = True
    """Run the weight-gradient GEMM in FP8. Default true; false keeps wgrad in high precision.
    megatron-core ``fp8_wgrad``."""

    fp8_dot_product_attention: bool = False
    """Run the attention core (QK^T, softmax, PV) in FP8. Default false. TE ``fp8_dpa``;
    megatron-core ``fp8_dot_product_attention``. Not supported by TE's block recipe."""

    fp8_multi_head_attention: bool = False
    """Keep the tensors between QKV projection, attention and output projection in FP8.
    Default false; needs fp8_dot_product_attention. TE ``fp8_mha``."""

    fp8_param: bool = False
    """Keep the model's primary weights in FP8 (saves memory and all-gather bytes). Default
    false. megatron-core ``fp8_param``; NeMo 2 ``fp8_param_gather``."""

    training: str = "fp8"
    """Precision of the training GEMMs: ``"fp8"`` (default: the recipe's quantized format,
    FP4 for nvfp4) or ``"bf16"``. ``bf16`` with ``generation: fp8`` is NeMo RL's
    generation-only FP8 mode."""

    generation: str = "fp8"
    """Precision of the generation engine's GEMMs (vLLM): ``"fp8"`` (default) or ``"bf16"``.
    nvfp4 refuses ``fp8`` (no NVFP4 generation path: see
    :data:`nemo_fp8_plugin.capabilities.NVFP4_GENERATION_REFUSAL`)."""

    kv_cache: str = "auto"
    """Generation KV cache dtype: ``"auto"`` (default, the model dtype) or ``"fp8"`` (E4M3,
    with per-layer k/v scales refreshed every RL step). vLLM ``kv_cache_dtype``."""

    generation_numerics: str = "vllm"
    """How the generation engine quantizes activations (and, for DeepGEMM, weights), one of
    :data:`GENERATION_NUMERICS`. ``"vllm"`` (default): vLLM's own per-group activation
    quantizer (``scale = amax / 448``, ``q = x / scale``, a fixed scale floor of 1/229376):
    about 3e-4 of the E4M3 codes and many scales' last bit differ from the trainer's, which
    is the generation/training mismatch importance sampling corrects. A power-of-2 recipe
    (``pow2_scales: true``) gets vLLM's UE8M0 scales. ``"vllm_deepgemm_ue8m0"``: vLLM's
    DeepGEMM path with ``VLLM_USE_DEEP_GEMM_E8M0=1`` (its default where DeepGEMM is
    installed, SM90/SM100): UE8M0 activation scales and weights requantized in place to
    power-of-2 128x128 block scales (``scaling: block`` only). ``"trainer"``: the trainer's
    Transformer Engine numerics on both sides (``q = x * (448 / amax)``), bit-identical to
    training; not what a GPU engine computes, so it only runs on the emulation backend.
    Read by vLLM's ``nemo_fp8`` method (``quantization_config.generation_numerics``; its
    emulation backend computes each of the three, its GPU backend checks that vLLM's kernel
    agrees) and by the CPU experiments' generation side."""

    bf16_layers: BF16Rules = field(default_factory=BF16Rules)
    """Layers kept in BF16; see :class:`BF16Rules`. Default: none."""

    importance_sampling: ImportanceSampling = field(default_factory=ImportanceSampling)
    """RL mismatch correction; see :class:`ImportanceSampling`. Default: token level, on."""

    qat: QuantizationAwareRL | None = None
    """ModelOpt quantization-aware RL instead of Transformer Engine NVFP4 training; see
    :class:`QuantizationAwareRL`. Default None (off). ``scaling: nvfp4`` only; NeMo RL
    only (other hosts refuse it)."""

    router_replay: bool = False
    """Router replay (R3) for mixture-of-experts RL: train each token through the experts the
    rollout engine routed it to, so an FP8 rounding that flips a routing decision in the rollout
    is not trained on as if the trainer had made it. Default false. NeMo RL
    ``policy.router_replay.enabled`` (v0.7.0 on; NeMo RL then asks vLLM for the routed experts
    itself, ``enable_return_routed_experts``); a model without experts is refused. Training-only
    hosts ignore it, as they ignore ``importance_sampling``."""

    hardware: str | None = None
    """Target GPU architecture (``ada``, ``hopper``, ``blackwell``, ``blackwell_sm120``; GPU
    names such as ``h100``, ``nvidia-smi`` names and ``sm90``-style capabilities are accepted;
    an Ampere GPU such as ``a100`` is accepted and then refused by the hardware rules, since it
    has no FP8). Default None: hardware rules are checked only when it is stated. Rules, with
    the nearest recipe that runs and the YAML change:
    :func:`nemo_fp8_plugin.kinds.hardware_problems`."""

    # Fields whose values users may set from YAML (everything but the identity).
    OVERRIDABLE = (
        "scaling",
        "description",
        "fp8_format",
        "activation_block",
        "weight_block",
        "gradient_block",
        "pow2_scales",
        "amax_epsilon",
        "amax_history_len",
        "amax_compute_algo",
        "margin",
        "reduce_amax",
        "fp8_wgrad",
        "fp8_dot_product_attention",
        "fp8_multi_head_attention",
        "fp8_param",
        "training",
        "generation",
        "kv_cache",
        "generation_numerics",
        "bf16_layers",
        "importance_sampling",
        "qat",
        "router_replay",
        "hardware",
    )

    def __post_init__(self) -> None:
        def set_(k: str, v: Any) -> None:  # a frozen dataclass
            object.__setattr__(self, k, v)

        if not isinstance(self.name, str) or not self.name.strip():
            raise FP8ConfigError(
                f"a recipe needs a non-empty name, got {format_value(self.name)}",
                key="name",
                value=self.name,
            )
        if not isinstance(self.description, str):
            raise FP8ConfigError(
                f"expected a string, got {format_value(self.description)}",
                key="description",
                value=self.description,
            )
        if self.fp8_format == "e5m2":
            raise FP8ConfigError(
                "pure E5M2 is refused: forward tensors need E4M3's precision",
                key="fp8_format",
                value="e5m2",
                hint="use 'hybrid' for E5M2 gradients with E4M3 forward",
            )
        set_("scaling", _choice("scaling", self.scaling, tuple(_caps.CAPABILITIES)))
        set_("fp8_format", _choice("fp8_format", self.fp8_format, FP8_FORMATS))
        for key in ("activation_block", "weight_block", "gradient_block"):
            set_(key, _block(key, getattr(self, key)))
        for key in (
            "pow2_scales",
            "reduce_amax",
            "fp8_wgrad",
            "fp8_dot_product_attention",
            "fp8_multi_head_attention",
            "fp8_param",
            "router_replay",
        ):
            set_(key, _bool(key, getattr(self, key)))
        set_("amax_epsilon", _float("amax_epsilon", self.amax_epsilon, 0.0, 1e30))
        set_("amax_history_len", _int("amax_history_len", self.amax_history_len, 1, 1 << 20))
        set_(
            "amax_compute_algo",
            _choice("amax_compute_algo", self.amax_compute_algo, ("max", "most_recent")),
        )
        set_("margin", _int("margin", self.margin, 0, 64))
        set_("training", _choice("training", self.training, ("fp8", "bf16")))
        set_("generation", _choice("generation", self.generation, ("fp8", "bf16")))
        set_("kv_cache", _choice("kv_cache", self.kv_cache, ("auto", "fp8")))
        set_(
            "generation_numerics",
            _choice("generation_numerics", self.generation_numerics, GENERATION_NUMERICS),
        )
        if not isinstance(self.bf16_layers, BF16Rules):
            set_("bf16_layers", _prefixed("bf16_layers", BF16Rules.from_mapping, self.bf16_layers))
        if not isinstance(self.importance_sampling, ImportanceSampling):
            set_(
                "importance_sampling",
                _prefixed(
                    "importance_sampling", ImportanceSampling.from_mapping, self.importance_sampling
                ),
            )
        set_("qat", _prefixed("qat", QuantizationAwareRL.from_value, self.qat))
        if self.qat is not None and _caps.capability(self.scaling).element_format != "e2m1":
            raise FP8ConfigError(
                f"ModelOpt quantization-aware RL is an NVFP4 path, not a {self.scaling} one",
                key="qat",
                value=self.qat.to_dict(),
                hint="use recipe: nvfp4, or remove qat",
            )
        set_("hardware", normalize_hardware(self.hardware))
        self._check_tiles()
        self._check_combinations()
        errors = [f for f in self.findings() if f.level == "error"]
        if errors:
            raise FP8ConfigError(errors[0].message, key=errors[0].key)

    # ------------------------------------------------------------------ validation

    def _check_tiles(self) -> None:
        row = _caps.capability(self.scaling)
        blocks = {key: getattr(self, key) for key in _caps.TILE_KEYS}
        if row.per_tensor:
            for key, blk in blocks.items():
                if blk is not None:
                    raise FP8ConfigError(
                        f"per-tensor scaling ({self.scaling}) has no tiles; got {list(blk)}",
                        key=key,
                        value=list(blk),
                        hint="remove it or use scaling: block",
                    )
            return
        for key, blk in blocks.items():
            allowed = row.allowed(key)
            if blk is None or blk not in allowed:
                shown = "missing" if blk is None else f"{list(blk)} is not supported"
                raise FP8ConfigError(
                    f"{shown} for scaling: {self.scaling}",
                    key=key,
                    value=None if blk is None else list(blk),
                    hint=f"use {list(row.default_tile(key) or ())}; allowed: "
                    f"{', '.join(str(list(b)) for b in sorted(allowed))}",
                )
        # cuBLAS has no 2D-by-2D block-scaled GEMM; TE asserts the same. (Only block scaling
        # lets more than one role take a 2D tile.)
        two_d = [k for k, b in blocks.items() if b is not None and b[0] > 1]
        if len(two_d) > 1:
            tile = blocks[two_d[1]]
            raise FP8ConfigError(
                f"{' and '.join(two_d)} are both {tile[0]}x{tile[1]}: no GEMM takes two "
                f"2D-scaled operands",
                key=two_d[1],
                value=list(tile),
            )

    def _check_combinations(self) -> None:
        row = _caps.capability(self.scaling)
        self._check_row_refusals(row)
        if self.fp8_multi_head_attention and not self.fp8_dot_product_attention:
            raise FP8ConfigError(
                "needs fp8_dot_product_attention: true", key="fp8_multi_head_attention", value=True
            )
        if (
            not row.bf16_edge_layers
            and (self.bf16_layers.first or self.bf16_layers.last)
            and self.bf16_layers.acts_on("training")
        ):
            which = "first" if self.bf16_layers.first else "last"
            count = getattr(self.bf16_layers, which)
            raise FP8ConfigError(
                f"{count} layer(s) in BF16 cannot be combined with {self.scaling} "
                "scaling (megatron-core refuses the combination)",
                key=f"bf16_layers.{which}",
                value=count,
                hint="use fp8_current or fp8_blockwise, or set applies_to: generation",
            )
        if self.training == "bf16" and self.generation == "bf16":
            raise FP8ConfigError(
                "training and generation are both bf16: nothing runs in FP8",
                key="training",
                value="bf16",
            )
        if self.generation_numerics == "vllm_deepgemm_ue8m0" and not row.deepgemm_generation:
            raise FP8ConfigError(
                f"vllm_deepgemm_ue8m0 is vLLM's DeepGEMM block-FP8 path (scaling: block), "
                f"not a {self.scaling} one",
                key="generation_numerics",
                value="vllm_deepgemm_ue8m0",
                hint="use generation_numerics: vllm or trainer",
            )
        if self.kv_cache == "fp8" and self.generation != "fp8":
            raise FP8ConfigError(
                "an FP8 KV cache needs FP8 generation",
                key="kv_cache",
                value="fp8",
                hint="set generation: fp8 or kv_cache: auto",
            )

    def _check_row_refusals(self, row: _caps.RecipeCapability) -> None:
        """What the scaling kind's row refuses: its element formats, its scale format's
        power-of-2 rule, an amax floor, FP8 attention, FP8 generation."""
        if self.fp8_format not in row.fp8_formats:
            if row.element_format == "e2m1":
                raise FP8ConfigError(
                    f"{row.te_class} elements are FP4 E2M1 (TE fp4_format E2M1); "
                    f"{self.fp8_format!r} is an FP8 format",
                    key="fp8_format",
                    value=self.fp8_format,
                    hint="use e2m1",
                )
            fp4 = [k for k, r in _caps.CAPABILITIES.items() if self.fp8_format in r.fp8_formats]
            raise FP8ConfigError(
                f"{self.fp8_format} (FP4) is the element format of scaling: "
                f"{' or '.join(fp4)} only, not of {self.scaling}",
                key="fp8_format",
                value=self.fp8_format,
                hint=f"use {' or '.join(row.fp8_formats)}, or scaling: {' or '.join(fp4)}",
            )
        if row.fixed_pow2 is not None and self.pow2_scales != row.fixed_pow2:
            if row.fixed_pow2:
                raise FP8ConfigError(
                    f"{row.te_class} scales are E8M0 (powers of two); pow2_scales must be true",
                    key="pow2_scales",
                    value=False,
                )
            raise FP8ConfigError(
                f"{row.te_class} block scales are E4M3 under an fp32 per-tensor scale, not "
                "powers of two",
                key="pow2_scales",
                value=True,
                hint="set pow2_scales: false, or use mxfp8 (E8M0 scales)",
            )
        floor = _caps.amax_epsilon_problem(self.scaling, self.amax_epsilon)
        if floor:
            raise FP8ConfigError(
                floor,
                key="amax_epsilon",
                value=self.amax_epsilon,
                hint="use 0, or a block recipe (fp8_blockwise) for an amax floor",
            )
        if self.fp8_dot_product_attention and not row.fp8_attention:
            raise FP8ConfigError(
                f"Transformer Engine's {row.te_class} has no FP8 attention (fp8_dpa)",
                key="fp8_dot_product_attention",
                value=True,
            )
        if self.generation == "fp8" and row.generation_refusal:
            raise FP8ConfigError(
                f"{self.scaling} cannot generate: {row.generation_refusal}",
                key="generation",
                value="fp8",
                hint="set generation: bf16 (train in this recipe, BF16 rollouts), "
                "or use mxfp8 for FP8 rollouts on Blackwell",
            )

    def findings(self) -> list[Finding]:
        """Hardware findings for the stated target (errors make the spec invalid), from the
        capability table (:func:`nemo_fp8_plugin.kinds.hardware_problems`)."""
        if self.hardware is None:
            return []
        return [
            Finding(p.level, p.key, p.message)
            for p in _kinds.hardware_problems(self, self.hardware)
        ]

    def check_dims(self, dims: Mapping[str, int], *, tensor_parallel: int = 1) -> list[Finding]:
        """Divisibility of named GEMM dimensions (hidden_size, ffn_hidden_size, ...), split
        over ``tensor_parallel`` ranks, by what the recipe's GEMMs need
        (:func:`nemo_fp8_plugin.capabilities.dimension_problems`).

        Every FP8 GEMM needs multiples of 16 (TE ``assert_dim_for_fp8_exec``), MXFP8 and NVFP4
        of 32 (errors); block scaling wants multiples of 128 (partial tiles work but waste a
        scale and, in vLLM's block-FP8 path, are refused for N: a warning). Keys are
        ``model.<name>``, or ``tensor_model_parallel_size`` when the TP split is at fault.
        """
        found = _caps.dimension_problems(self.scaling, dict(dims), tensor_parallel=tensor_parallel)
        return [
            Finding(
                p.level,
                p.key if p.key == "tensor_model_parallel_size" else f"model.{p.key}",
                p.message,
            )
            for p in found
        ]

    # ------------------------------------------------------------------ derived views

    @property
    def forward_format(self) -> str:
        """Element format of inputs and weights: ``"e4m3"`` (``"e2m1"`` for nvfp4)."""
        return "e2m1" if self.fp8_format == "e2m1" else "e4m3"

    @property
    def gradient_format(self) -> str:
        """Element format of output gradients: ``"e5m2"`` under hybrid, ``"e2m1"`` for nvfp4,
        else ``"e4m3"``."""
        return {"hybrid": "e5m2", "e2m1": "e2m1"}.get(self.fp8_format, "e4m3")

    def format_for(self, role: str) -> str:
        """Element format for a GEMM operand role: ``input``, ``weight`` or ``grad_output``."""
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
        return self.gradient_format if role == "grad_output" else self.forward_format

    def block_for(self, role: str) -> tuple[int, int] | None:
        """Scale tile for a GEMM operand role (None = per tensor)."""
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
        return {
            "input": self.activation_block,
            "weight": self.weight_block,
            "grad_output": self.gradient_block,
        }[role]

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples): the shape of YAML presets and ``--json`` output."""
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        for key in self.OVERRIDABLE:
            if key == "description":
                continue
            value = getattr(self, key)
            if isinstance(value, (BF16Rules, ImportanceSampling, QuantizationAwareRL)):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[key] = value
        return out

    def replace(self, **changes: Any) -> RecipeSpec:
        """A validated copy with ``changes`` applied (nested blocks merge field by field)."""
        return self.with_overrides(changes)

    def with_overrides(self, overrides: Mapping[str, Any], *, prefix: str = "") -> RecipeSpec:
        """A validated copy with YAML-style overrides; errors are keyed under ``prefix``."""
        allowed = set(self.OVERRIDABLE) | {"name"}
        try:
            _check_keys("", overrides, allowed)
            kwargs = dict(overrides)
            if "bf16_layers" in kwargs and not isinstance(kwargs["bf16_layers"], BF16Rules):
                kwargs["bf16_layers"] = _prefixed(
                    "bf16_layers", BF16Rules.from_mapping, kwargs["bf16_layers"], self.bf16_layers
                )
            if "importance_sampling" in kwargs and not isinstance(
                kwargs["importance_sampling"], ImportanceSampling
            ):
                kwargs["importance_sampling"] = _prefixed(
                    "importance_sampling",
                    ImportanceSampling.from_mapping,
                    kwargs["importance_sampling"],
                    self.importance_sampling,
                )
            return _wrap(lambda: dataclasses.replace(self, **kwargs))
        except FP8ConfigError as err:
            raise err.with_prefix(prefix) if prefix else err from None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, prefix: str = "") -> RecipeSpec:
        """A spec from a complete mapping (the format of ``conf/recipes/*.yaml``)."""
        try:
            if not isinstance(mapping, Mapping):
                raise FP8ConfigError(f"expected a mapping, got {format_value(mapping)}")
            _check_keys("", mapping, set(cls.OVERRIDABLE) | {"name"})
            for required in ("name", "scaling"):
                if required not in mapping:
                    raise FP8ConfigError("is required", key=required)
            kwargs = dict(mapping)
            kwargs["bf16_layers"] = _prefixed(
                "bf16_layers", BF16Rules.from_mapping, kwargs.get("bf16_layers")
            )
            kwargs["importance_sampling"] = _prefixed(
                "importance_sampling",
                ImportanceSampling.from_mapping,
                kwargs.get("importance_sampling"),
            )
            return _wrap(lambda: cls(**kwargs))
        except FP8ConfigError as err:
            raise err.with_prefix(prefix) if prefix else err from None


def _prefixed(prefix: str, build: Callable[..., _T], *args: Any) -> _T:
    try:
        return build(*args)
    except FP8ConfigError as err:
        raise err.with_prefix(prefix) from None
