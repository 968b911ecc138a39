"""One table of what each recipe needs and where it runs (standard library only).

Every host adapter, ``doctor``, ``explain`` and the spec's own hardware findings ask this
module, so a fact (a tile shape, a Transformer Engine variable, the GPUs a recipe runs on) is
written once. Sources: Transformer Engine 2.20 (``common/recipe/__init__.py``,
``pytorch/quantization.py``: ``check_*_support``), megatron-core 0.16 (``fp8_utils.py``), vLLM
0.32 (``kernels/linear``), NeMo RL (``models/generation/fp8.py``); ``../shared/HOSTS.md`` and
``../shared/NUMERICS.md`` restate them.

The keys are the spec's ``scaling`` kinds (:data:`ScalingKind`); nothing here imports the spec,
so the spec module can import this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = [
    "ScalingKind", "SCALING_KINDS", "Side", "Arch", "ARCHS", "ARCH_NAMES", "FP8_MAX",
    "RecipeCapability", "CAPABILITIES", "capability", "ENV_BLOCK_FP32_SCALES",
    "ENV_CURRENT_POW2_SCALES", "ENV_BACKWARD_OVERRIDE", "te_env", "arch_by_name",
    "arch_of_capability", "hardware_problems", "HardwareProblem",
]

ScalingKind = Literal["delayed", "tensorwise", "block", "mx"]
"""How scales are chosen. delayed: one per tensor from an amax history (TE DelayedScaling);
tensorwise: one per tensor from its own amax (TE Float8CurrentScaling); block: one fp32 (or
power-of-2) scale per 1x128 or 128x128 tile (TE Float8BlockScaling, DeepSeek-V3); mx: one E8M0
scale per 32 elements (OCP MXFP8, TE MXFP8BlockScaling)."""

SCALING_KINDS: tuple[ScalingKind, ...] = ("delayed", "tensorwise", "block", "mx")
"""Every :data:`ScalingKind`, in the order recipes are listed."""

Side = Literal["training", "generation"]
"""Where a GEMM runs: the trainer (Transformer Engine under megatron-core) or the generation
engine (vLLM)."""

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite magnitude of each element format (``torch.finfo(torch.float8_e4m3fn).max``
and ``torch.finfo(torch.float8_e5m2).max``; the numerics read torch's own values)."""

ENV_BLOCK_FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
"""``"1"``: Float8BlockScaling's class-level quantizer parameters use fp32 scales; anything
else (TE's default): power-of-2 scales. Read once, when TE is imported."""

ENV_CURRENT_POW2_SCALES = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
"""``"1"``: Float8CurrentScaling defaults to power-of-2 scales; TE's default ``"0"``: fp32.
Read once, when TE is imported."""

ENV_BACKWARD_OVERRIDE = "NVTE_BACKWARD_OVERRIDE"
"""TE >= 2.15: ``high_precision`` or ``dequantized`` switches the whole backward of every
recipe away from FP8 (``DelayedScaling`` raises). No preset wants it set."""


@dataclass(frozen=True)
class Arch:
    """A GPU generation as the validation knows it.

    Attributes:
        name: the value ``hardware:`` / ``--hardware`` normalizes to.
        sm: compute capabilities (major, minor) of the generation.
        gpus: GPU names that mean this generation (lower case, no spaces or dashes).
        fp8: whether its tensor cores have FP8 at all (Ampere has none).
    """

    name: str
    sm: tuple[tuple[int, int], ...]
    gpus: tuple[str, ...]
    fp8: bool = True


ARCHS: tuple[Arch, ...] = (
    Arch("ampere", ((8, 0), (8, 6), (8, 7)), ("a100", "a800", "a10", "a10g", "a30", "a40",
                                            "rtx3090", "rtxa6000"), fp8=False),
    Arch("ada", ((8, 9),), ("l4", "l40", "l40s", "rtx4090", "rtx6000ada")),
    Arch("hopper", ((9, 0),), ("h100", "h200", "h800", "h20", "gh200")),
    Arch("blackwell", ((10, 0), (10, 3)), ("b100", "b200", "b300", "gb200", "gb300")),
    # SM 12.x: RTX PRO 6000 Blackwell and GeForce RTX 50: FP8 tensor cores, but Transformer
    # Engine refuses MXFP8 there (`_compute_mxfp8_support`: "not supported on 12.0+").
    Arch("blackwell_sm120", ((12, 0), (12, 1)), ("rtxpro6000", "rtx5090", "rtx5080", "dgxspark",
                                                 "gb10")),
)
"""GPU generations, oldest first."""

ARCH_NAMES: tuple[str, ...] = tuple(a.name for a in ARCHS if a.fp8)
"""Architectures that have FP8 (what ``hardware:`` accepts)."""


def arch_by_name(name: str) -> Arch | None:
    """The :class:`Arch` for an architecture name, ``sm90``-style spelling or GPU name
    (``"H100"``, ``"NVIDIA H100 80GB HBM3"``, ``"sm_100"``), or None."""
    text = name.strip().lower().replace("-", "").replace(" ", "").replace("_", "")
    if text.startswith("nvidia"):
        text = text[len("nvidia"):]
    for arch in ARCHS:
        if text == arch.name.replace("_", ""):
            return arch
        if any(text == f"sm{major}{minor}" for major, minor in arch.sm):
            return arch
    # nvidia-smi names carry memory sizes and form factors after the model ("NVIDIA H100 80GB
    # HBM3"): the longest GPU name the text starts with wins, so "a100" beats "a10".
    names = sorted(((gpu, arch) for arch in ARCHS for gpu in arch.gpus),
                   key=lambda item: len(item[0]), reverse=True)
    for gpu, arch in names:
        if text.startswith(gpu):
            return arch
    return None


def arch_of_capability(major: int, minor: int) -> Arch | None:
    """The :class:`Arch` of a CUDA compute capability, or None for pre-Ampere GPUs."""
    for arch in ARCHS:
        if (major, minor) in arch.sm:
            return arch
    if major >= 12:
        return ARCHS[-1]
    if major == 10 or major == 11:
        return next(a for a in ARCHS if a.name == "blackwell")
    return None


@dataclass(frozen=True)
class RecipeCapability:
    """What one scaling kind is, needs and runs on.

    Attributes:
        scaling: the :data:`ScalingKind` this row describes.
        te_class: Transformer Engine recipe class (``transformer_engine.common.recipe``).
        megatron_recipe: megatron-core ``fp8_recipe`` value (also NeMo 2's and Bridge's, and
            NeMo RL's ``fp8_cfg.fp8_recipe``).
        tiles: ``(activation, weight, gradient)`` default tile shapes, None per tensor.
        allowed_tiles: per role, the tile shapes the recipe accepts.
        history: whether scales come from an amax history (only delayed scaling).
        scale_format: ``"fp32"`` (scale may be power-of-2 rounded) or ``"e8m0"``.
        training_archs: architectures Transformer Engine trains this recipe on.
        generation_archs: architectures where vLLM 0.32 has real FP8 kernels for it (empty:
            the plugin's vLLM path has no such layout).
        vllm_generation: whether the plugin's ``nemo_fp8`` vLLM method serves it.
        nemo_rl_generation: whether NeMo RL's own FP8 generation path serves it.
        te_env: the TE variable whose value decides this recipe's scales at TE import, or None.
    """

    scaling: ScalingKind
    te_class: str
    megatron_recipe: str
    tiles: tuple[tuple[int, int] | None, tuple[int, int] | None, tuple[int, int] | None]
    allowed_tiles: tuple[frozenset[tuple[int, int]], frozenset[tuple[int, int]],
                         frozenset[tuple[int, int]]]
    history: bool
    scale_format: Literal["fp32", "e8m0"]
    training_archs: frozenset[str]
    generation_archs: frozenset[str]
    vllm_generation: bool
    nemo_rl_generation: bool
    te_env: str | None

    @property
    def block(self) -> int | None:
        """The inner-dimension length GEMM operands must be a multiple of (None per tensor)."""
        act = self.tiles[0]
        return None if act is None else act[1]


_NONE: frozenset[tuple[int, int]] = frozenset()
_ALL_FP8 = frozenset({"ada", "hopper", "blackwell", "blackwell_sm120"})

CAPABILITIES: dict[str, RecipeCapability] = {
    "delayed": RecipeCapability(
        "delayed", "DelayedScaling", "delayed", (None, None, None), (_NONE, _NONE, _NONE),
        history=True, scale_format="fp32", training_archs=_ALL_FP8,
        generation_archs=frozenset(), vllm_generation=False, nemo_rl_generation=False,
        te_env=None),
    "tensorwise": RecipeCapability(
        "tensorwise", "Float8CurrentScaling", "tensorwise", (None, None, None),
        (_NONE, _NONE, _NONE), history=False, scale_format="fp32", training_archs=_ALL_FP8,
        generation_archs=frozenset(), vllm_generation=False, nemo_rl_generation=False,
        te_env=ENV_CURRENT_POW2_SCALES),
    "block": RecipeCapability(
        "block", "Float8BlockScaling", "blockwise", ((1, 128), (128, 128), (1, 128)),
        (frozenset({(1, 128), (128, 128)}),) * 3, history=False, scale_format="fp32",
        # Hopper natively (cuBLAS >= 12.9 block-scaled GEMMs); Blackwell by TE's MXFP8
        # emulation, which needs power-of-2 scales (see hardware_problems).
        training_archs=frozenset({"hopper", "blackwell"}),
        generation_archs=frozenset({"hopper", "blackwell", "blackwell_sm120"}),
        vllm_generation=True, nemo_rl_generation=True, te_env=ENV_BLOCK_FP32_SCALES),
    "mx": RecipeCapability(
        "mx", "MXFP8BlockScaling", "mxfp8", ((1, 32), (1, 32), (1, 32)),
        (frozenset({(1, 32)}), frozenset({(1, 32), (32, 32)}), frozenset({(1, 32)})),
        history=False, scale_format="e8m0", training_archs=frozenset({"blackwell"}),
        # vLLM's MXFP8 linear kernels need SM100 (FlashInfer); on SM90 it falls back to
        # weight-only Marlin or emulation without an error.
        generation_archs=frozenset({"blackwell"}), vllm_generation=True,
        nemo_rl_generation=True, te_env=None),
}
"""Scaling kind -> :class:`RecipeCapability`."""


def capability(scaling: str) -> RecipeCapability:
    """The row for a scaling kind (KeyError for a kind the table does not know)."""
    return CAPABILITIES[scaling]


class _SpecLike(Protocol):
    # Read-only members, so that a frozen dataclass (RecipeSpec) matches.
    @property
    def scaling(self) -> str: ...
    @property
    def training(self) -> str: ...
    @property
    def generation(self) -> str: ...
    @property
    def pow2_scales(self) -> bool: ...
    @property
    def fp8_dot_product_attention(self) -> bool: ...


def te_env(spec: _SpecLike) -> dict[str, str]:
    """Environment variables the training process needs *before* TE is imported so that a
    recipe object a host builds (megatron-core) quantizes as the spec says.

    Always set, to either value, for the scaling kinds TE reads one for, so a cluster-wide
    setting cannot flip a recipe silently: block -> ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``
    (``"1"`` for fp32 scales), tensorwise -> ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``
    (``"1"`` for power-of-2 scales). Empty when training is not FP8.
    """
    if spec.training != "fp8":
        return {}
    var = CAPABILITIES[spec.scaling].te_env
    if var == ENV_BLOCK_FP32_SCALES:
        return {var: "0" if spec.pow2_scales else "1"}
    if var == ENV_CURRENT_POW2_SCALES:
        return {var: "1" if spec.pow2_scales else "0"}
    return {}


@dataclass(frozen=True)
class HardwareProblem:
    """Why a recipe cannot (``error``) or may not (``warning``) run on an architecture.

    Attributes:
        level: ``"error"`` or ``"warning"``.
        key: the spec field to change (``hardware``, ``pow2_scales``, ...).
        message: one sentence naming the GPU generation and what to use instead.
        side: the side it concerns, or None for both.
    """

    level: Literal["error", "warning"]
    key: str
    message: str
    side: Side | None = None


def hardware_problems(spec: _SpecLike, arch: str) -> list[HardwareProblem]:
    """What stops ``spec`` on ``arch`` (an :data:`ARCH_NAMES` value), side by side."""
    cap = CAPABILITIES[spec.scaling]
    out: list[HardwareProblem] = []
    label = {"ada": "Ada (SM89)", "hopper": "Hopper (SM90)", "blackwell": "Blackwell (SM100)",
             "blackwell_sm120": "Blackwell SM 12.0 (RTX PRO 6000)"}.get(arch, arch)
    training = spec.training == "fp8"
    generation = spec.generation == "fp8"
    if training and arch not in cap.training_archs:
        if spec.scaling == "mx":
            msg = (f"MXFP8 training needs Blackwell (SM100/SM103); Transformer Engine cannot run "
                   f"it on {label} (use fp8_blockwise or fp8_subchannel on Hopper, "
                   f"fp8_current elsewhere)")
        else:
            msg = (f"{cap.te_class} training cannot run on {label} (use fp8_current or "
                   f"fp8_delayed there)")
        out.append(HardwareProblem("error", "hardware", msg, "training"))
    elif training and spec.scaling == "block" and arch == "blackwell" and not spec.pow2_scales:
        out.append(HardwareProblem(
            "error", "pow2_scales",
            "on Blackwell Transformer Engine emulates block scaling with MXFP8 and needs "
            "power-of-2 scales; fp32 block scales cannot run there (use fp8_subchannel, or set "
            "pow2_scales: true)", "training"))
    elif training and spec.scaling == "block" and arch == "hopper":
        out.append(HardwareProblem(
            "warning", "hardware", "block scaling on Hopper needs CUDA >= 12.9 (cuBLAS "
            "block-scaled GEMMs); `nemo-fp8 doctor` checks it", "training"))
    if generation and cap.vllm_generation and arch not in cap.generation_archs:
        what = "MXFP8" if spec.scaling == "mx" else "block FP8"
        out.append(HardwareProblem(
            "error", "hardware",
            f"vLLM's {what} kernels do not run on {label} (vLLM 0.32 falls back to weight-only "
            f"or emulated kernels without an error); generate with fp8_blockwise there, or "
            f"set generation: bf16", "generation"))
    if spec.fp8_dot_product_attention and arch == "ada":
        out.append(HardwareProblem("warning", "fp8_dot_product_attention",
                                   "FP8 attention kernels target Hopper and Blackwell"))
    return out
