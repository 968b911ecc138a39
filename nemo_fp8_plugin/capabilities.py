"""One table of what each recipe needs and where it runs (standard library only).

Every host adapter, ``doctor``, ``explain`` and the spec's own checks ask this module, so a
fact (a tile shape, a Transformer Engine variable, the GPUs a recipe runs on, a combination a
host refuses) is written once, in a row of :data:`CAPABILITIES`. Sources: Transformer Engine
2.20 (``common/recipe/__init__.py``, ``pytorch/quantization.py``: ``check_*_support``),
megatron-core 0.16 (``fp8_utils.py``, ``transformer_config.py``), vLLM 0.32
(``kernels/linear``), NeMo RL (``models/generation/fp8.py``); ``docs/numerics.md`` states the
numerics with the upstream file of each rule.

The keys are the spec's ``scaling`` kinds (:data:`ScalingKind`); nothing here imports the spec,
so the spec module can import this one. What differs between kinds in code is the kind's class
(:mod:`nemo_fp8_plugin.kinds`), which reads its row here.

Longer than the package's 600-line guide: it is one table (the GPU generations and their
names, one row per scaling kind, the alignment rules), and splitting it would put a fact in
two places.

Over 600 lines on purpose: the one capability table (architectures, recipes, alignment) every
host and command reads; splitting it would make two.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

__all__ = [
    "ScalingKind",
    "SCALING_KINDS",
    "Side",
    "Arch",
    "ARCHS",
    "ARCH_NAMES",
    "FP8_MAX",
    "E2M1_MAX",
    "E8M0_MAX",
    "FORMAT_MAX",
    "TILE_KEYS",
    "RecipeCapability",
    "CAPABILITIES",
    "VLLM_SCHEMES",
    "capability",
    "amax_epsilon_problem",
    "ENV_BLOCK_FP32_SCALES",
    "ENV_CURRENT_POW2_SCALES",
    "ENV_BACKWARD_OVERRIDE",
    "ENV_NVFP4",
    "te_env_read_by",
    "te_env",
    "arch_by_name",
    "arch_of_capability",
    "arch_label",
    "HardwareProblem",
    "SIDES",
    "HOST_SIDES",
    "host_sides",
    "NVFP4_GENERATION_REFUSAL",
    "token_alignment",
    "dimension_problems",
    "DimensionProblem",
]

ScalingKind = Literal["delayed", "tensorwise", "block", "mx", "nvfp4"]
"""How scales are chosen. delayed: one per tensor from an amax history (TE DelayedScaling);
tensorwise: one per tensor from its own amax (TE Float8CurrentScaling); block: one fp32 (or
power-of-2) scale per 1x128 or 128x128 tile (TE Float8BlockScaling, DeepSeek-V3); mx: one E8M0
scale per 32 elements (OCP MXFP8, TE MXFP8BlockScaling); nvfp4: E2M1 (FP4) elements, one E4M3
scale per 1x16 group (16x16 tile for weights) under an fp32 per-tensor scale (TE
NVFP4BlockScaling)."""

SCALING_KINDS: tuple[ScalingKind, ...] = ("delayed", "tensorwise", "block", "mx", "nvfp4")
"""Every :data:`ScalingKind`, in the order recipes are listed."""

Side = Literal["training", "generation"]
"""Where a GEMM runs: the trainer (Transformer Engine under megatron-core) or the generation
engine (vLLM)."""

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite magnitude of each FP8 element format: E4M3 (4 exponent bits, bias 7, 3
mantissa bits, no infinity: 1.75 * 2**8) and E5M2 (IEEE-like, bias 15: 1.75 * 2**15). These
equal ``torch.finfo(torch.float8_e4m3fn).max`` and ``torch.finfo(torch.float8_e5m2).max``,
which :mod:`nemo_fp8_plugin.numerics.formats` reads from torch (this module imports no torch;
``tests/test_capabilities.py`` checks the two agree)."""

E2M1_MAX = 6.0
"""Largest FP4 E2M1 magnitude (2 exponent bits, bias 1, 1 mantissa bit: 1.5 * 2**2), the
element format of NVFP4 (:data:`nemo_fp8_plugin.numerics.formats.E2M1_MAX` derives it from the
bit layout)."""

E8M0_MAX = 2.0**127
"""Largest E8M0 scale (an exponent byte with bias 127; byte 0xFE is 2**127, 0xFF is NaN):
``torch.finfo(torch.float8_e8m0fnu).max``. MXFP8's block scales."""

FORMAT_MAX: dict[str, float] = {**FP8_MAX, "e2m1": E2M1_MAX, "e8m0": E8M0_MAX}
"""Element or scale format -> its largest finite magnitude (what a row's
:attr:`RecipeCapability.element_max` reads)."""

TILE_KEYS = ("activation_block", "weight_block", "gradient_block")
"""The spec fields of the three GEMM operand roles, in the order of
:attr:`RecipeCapability.tiles` (activation, weight, output gradient)."""

ENV_BLOCK_FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
"""``"1"``: Float8BlockScaling's class-level quantizer parameters use fp32 scales; anything
else (TE's default): power-of-2 scales. Read once, when TE is imported."""

ENV_CURRENT_POW2_SCALES = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
"""``"1"``: Float8CurrentScaling defaults to power-of-2 scales; TE's default ``"0"``: fp32.
Read once, when TE is imported."""

ENV_BACKWARD_OVERRIDE = "NVTE_BACKWARD_OVERRIDE"
"""TE >= 2.15: ``high_precision`` or ``dequantized`` switches the whole backward of every
recipe away from FP8 (``DelayedScaling`` raises). No preset wants it set."""

ENV_NVFP4 = {
    "disable_rht": "NVTE_NVFP4_DISABLE_RHT",
    "disable_stochastic_rounding": "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
    "disable_2d_quantization": "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
    "row_scaled_activation": "NVTE_NVFP4_ROW_SCALED_ACTIVATION",
    "nvfp4_4over6": "NVTE_NVFP4_4OVER6",
    "nvfp4_4over6_e4m3_use_256": "NVTE_NVFP4_4OVER6_E4M3_USE_256",
    "nvfp4_4over6_err_mode": "NVTE_NVFP4_4OVER6_ERR_MODE",
}
"""TE 2.20 ``NVFP4BlockScaling`` field -> the variable its class default is read from when TE
is imported (megatron-core builds ``NVFP4BlockScaling()`` with no arguments, so these decide
the Hadamard transform, stochastic rounding, 2D weight tiles and "4over6" of every host-built
NVFP4 recipe)."""


def _nvfp4_generation_refusal() -> str:
    from .stacks import (
        NEMO_RL_MAIN,
        NEMO_RL_RELEASES,
        TESTED,
        release_label,
        release_version,
    )

    main = release_label(NEMO_RL_MAIN)
    commit = next(r.commit for r in NEMO_RL_RELEASES if r.name == NEMO_RL_MAIN)
    labels = [r.label for r in NEMO_RL_RELEASES]
    releases = f"{', '.join(labels[:-1])} and {labels[-1]}"
    return (
        f"the nvfp4 recipe trains through Transformer Engine, and {main} rolls out in "
        "NVFP4 only through ModelOpt quantization-aware training (policy.generation.quant_cfg, "
        "real_quant: the nemo_fp8_plugin.hosts.nemo_rl.modelopt presets), not from TE-trained "
        "weights (TE NVFP4 training of the routed experts with per-token NVFP4 rollouts, "
        "policy.megatron_cfg.fp4_cfg with policy.generation.nvfp4_pertoken_rollout, arrived in "
        f"NVIDIA-NeMo/RL pull request 3566 after commit {commit}, in no release the stacks "
        f"table knows: "
        f"checked NeMo RL {releases}); vLLM ({release_version(NEMO_RL_MAIN, 'vllm')} under "
        f"{main}; every release read: {', '.join(TESTED['vllm'])}) serves NVFP4 only from an "
        "NVFP4 checkpoint in ModelOpt or compressed-tensors format on Blackwell (SM100), which "
        "the plugin does not export, and its nemo_fp8 vLLM method has no NVFP4 kernels"
    )


NVFP4_GENERATION_REFUSAL = _nvfp4_generation_refusal()
"""Why the TE ``nvfp4`` recipe generates in BF16 (vLLM, NeMo RL), naming the versions; NVFP4
rollouts are the ModelOpt route (:mod:`nemo_fp8_plugin.hosts.nemo_rl.modelopt`)."""


@dataclass(frozen=True, kw_only=True)
class Arch:
    """A GPU generation as the validation knows it.

    Attributes:
        name: the value ``hardware:`` / ``--hardware`` normalizes to.
        sm: compute capabilities (major, minor) of the generation.
        gpus: GPU names that mean this generation (lower case, no spaces, dashes or
            underscores; a name the text starts with matches, so ``nvidia-smi``'s memory sizes
            and form factors after the model are ignored).
        families: regular expressions, matched at the start of the same normalized text, for
            product lines whose model numbers follow a pattern (GeForce ``RTX 5090``,
            ``RTX 5000 Ada Generation``, ``RTX PRO 4500 Blackwell``).
        fp8: whether its tensor cores have FP8 at all (Ampere has none).
    """

    name: str
    sm: tuple[tuple[int, int], ...]
    gpus: tuple[str, ...]
    families: tuple[str, ...] = ()
    fp8: bool = True


ARCHS: tuple[Arch, ...] = (
    Arch(
        name="ampere",
        sm=((8, 0), (8, 6), (8, 7)),
        gpus=("a100", "a800", "a10", "a10g", "a30", "a40", "a16"),
        # RTX A6000/A5000/A4000..., GeForce RTX 3050-3090.
        families=(r"rtxa\d{4}", r"rtx30[5-9]0"),
        fp8=False,
    ),
    Arch(
        name="ada",
        sm=((8, 9),),
        gpus=("l4", "l40", "l40s", "l20", "rtx6000ada"),
        # GeForce RTX 4050-4090 (4090 D, 4070 Ti SUPER, ...), and the workstation "RTX <n> Ada
        # Generation" (2000, 4000 SFF, 4500, 5000, 6000): the only RTX names that say "ada".
        families=(r"rtx40[5-9]0", r"rtx\d{4}(sff)?ada"),
    ),
    Arch(name="hopper", sm=((9, 0),), gpus=("h100", "h200", "h800", "h20", "gh200")),
    Arch(
        name="blackwell",
        sm=((10, 0), (10, 3)),
        gpus=("b100", "b200", "b300", "gb200", "gb300"),
    ),
    # SM 12.x: RTX PRO Blackwell, GeForce RTX 50, DGX Spark (GB10, SM 12.1): FP8 tensor cores,
    # but Transformer Engine refuses MXFP8 there (`_compute_mxfp8_support`: "not supported on
    # 12.0+").
    Arch(
        name="blackwell_sm120",
        sm=((12, 0), (12, 1)),
        gpus=("rtxpro6000", "dgxspark", "gb10"),
        # GeForce RTX 5050-5090 and RTX PRO 2000-6000 Blackwell.
        families=(r"rtx50[5-9]0", r"rtxpro\d{4}"),
    ),
)
"""GPU generations, oldest first."""

ARCH_NAMES: tuple[str, ...] = tuple(a.name for a in ARCHS if a.fp8)
"""Architectures that have FP8 (what messages offer; an Ampere target such as ``a100`` is
accepted too, and :func:`hardware_problems` says nothing runs there)."""

# "sm90", "sm_90a", "sm100a", "sm_100f", "compute_90", "sm 12.1": a CUDA architecture name.
# The "a"/"f" suffixes (arch-specific / family features) name the same compute capability.
_SM = re.compile(r"(?:sm|compute|cc)(\d{1,2}?)\.?(\d)[af]?")
# nvidia-smi prefixes that carry no generation ("NVIDIA GeForce RTX 4090").
_VENDOR = ("nvidia", "geforce")


def _normalized(name: str) -> str:
    text = name.strip().lower()
    for sep in ("-", " ", "_"):
        text = text.replace(sep, "")
    for prefix in _VENDOR:
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def arch_by_name(name: str) -> Arch | None:
    """The :class:`Arch` for an architecture name, CUDA architecture spelling or GPU name
    (``"H100"``, ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA GeForce RTX 5090"``, ``"sm_90a"``,
    ``"sm100a"``, ``"sm121"``), or None."""
    if any(sep in name for sep in ",;/+"):  # a list of GPUs is no one GPU's name
        return None
    text = _normalized(name)
    for arch in ARCHS:
        if text == arch.name.replace("_", ""):
            return arch
    sm = _SM.fullmatch(text)
    if sm:
        return arch_of_capability(int(sm.group(1)), int(sm.group(2)))
    # nvidia-smi names carry memory sizes and form factors after the model ("NVIDIA H100 80GB
    # HBM3", "NVIDIA A100-SXM4-80GB"): the longest GPU name the text starts with wins, so
    # "a100" beats "a10", and only where the model name ends there (a separator or the end
    # follows it: "b2000" and "h100x" are no B200 or H100).
    spaced = _without_vendor(name)
    names = sorted(
        ((gpu, arch) for arch in ARCHS for gpu in arch.gpus),
        key=lambda item: len(item[0]),
        reverse=True,
    )
    for gpu, arch in names:
        if _spelled(gpu).match(spaced):
            return arch
    for arch in ARCHS:
        if any(re.match(family + r"(?!\d)", text) for family in arch.families):
            return arch
    return None


def _without_vendor(name: str) -> str:
    """``name`` lower-cased, separators kept, without the vendor words nvidia-smi puts first."""
    text = name.strip().lower()
    for prefix in _VENDOR:
        if re.match(prefix + r"[\s_-]*", text):
            text = re.sub("^" + prefix + r"[\s_-]*", "", text)
    return text


def _spelled(gpu: str) -> re.Pattern[str]:
    """A GPU name as written with or without separators ("rtx 6000 ada"), ending there."""
    return re.compile(r"[\s_-]*".join(map(re.escape, gpu)) + r"(?![a-z0-9])")


def arch_of_capability(major: int, minor: int) -> Arch | None:
    """The :class:`Arch` of a CUDA compute capability, or None for pre-Ampere GPUs (and
    capabilities no GPU has, such as 9.5). Every SM 12.x minor version is the SM 12 family
    (12.0 RTX PRO / GeForce RTX 50, 12.1 GB10); 10.x and 11.x are Blackwell."""
    for arch in ARCHS:
        if (major, minor) in arch.sm:
            return arch
    if major >= 12:
        return ARCHS[-1]
    if major == 10 or major == 11:
        return next(a for a in ARCHS if a.name == "blackwell")
    return None


_Tile = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class RecipeCapability:
    """What one scaling kind is, needs and runs on: one row of :data:`CAPABILITIES`.

    Attributes:
        scaling: the :data:`ScalingKind` this row describes.
        te_class: Transformer Engine recipe class (``transformer_engine.common.recipe``).
        megatron_recipe: megatron-core ``fp8_recipe`` value (also NeMo 2's and Bridge's, and
            NeMo RL's ``fp8_cfg.fp8_recipe``); for NVFP4 megatron-core's ``fp4_recipe`` value.
        megatron_field: the megatron-core field ``megatron_recipe`` goes to: ``fp8_recipe``, or
            ``fp4_recipe`` for NVFP4 (with ``fp4: e2m1``; the FP8 fields stay off). The FP4
            field: a host asks ``row.megatron_field == "fp4_recipe"``, not the kind.
        tiles: ``(activation, weight, gradient)`` default tile shapes (the order of
            :data:`TILE_KEYS`), None per tensor.
        allowed_tiles: per role, the tile shapes the recipe accepts (empty per tensor); the
            spec refuses any other.
        history: whether scales come from an amax history (only delayed scaling). NeMo RL
            refuses such a recipe: a refit changes the weights every step, so the history of
            past steps is stale.
        scale_format: ``"fp32"`` (scale may be power-of-2 rounded), ``"e8m0"`` (always a
            power of two: the spec requires ``pow2_scales: true``) or ``"e4m3"`` (NVFP4: E4M3
            block scales under one fp32 scale per tensor; ``pow2_scales: true`` refused).
        fp8_formats: the spec ``fp8_format`` values the kind takes (``e4m3``/``hybrid`` for
            the FP8 kinds, ``e2m1`` for NVFP4 and only there).
        amax_floor: whether an amax floor (``amax_epsilon``) means anything for the kind's
            scales. False for MXFP8: its E8M0 exponent is rounded up from the block's own amax,
            and no host has a floor for it (TE 2.20's ``MXFP8BlockScaling`` has no
            ``amax_epsilon``, nor has the ``nemo_fp8`` vLLM method's MX scheme), so the spec
            refuses ``amax_epsilon > 0`` (:func:`amax_epsilon_problem`).
        te_amax_epsilon: whether TE's recipe class takes an amax epsilon (``QParams``'s, on
            ``Float8CurrentScaling`` and ``Float8BlockScaling``); elsewhere a training host
            drops the spec's ``amax_epsilon`` with a warning.
        fp8_attention: whether TE's recipe class runs FP8 attention (``fp8_dpa``); the spec
            refuses ``fp8_dot_product_attention: true`` where it does not (TE 2.14-2.20:
            ``Float8BlockScaling`` asserts ``not fp8_dpa``). True for NVFP4: TE 2.14.1 and
            2.20.2's ``NVFP4BlockScaling`` takes ``fp8_dpa``; a host version that does not pass
            it (megatron-core < 0.17) is refused by its adapter.
        bf16_edge_layers: whether megatron-core keeps the first/last layers in BF16 under this
            kind (``first_last_layers_bf16``; megatron-core 0.16 refuses it with delayed
            scaling, so the spec refuses ``bf16_layers.first``/``last`` for training there).
        training_archs: architectures Transformer Engine trains this recipe on.
        generation_archs: architectures where vLLM 0.32 has real FP8 kernels for it (empty:
            the plugin's vLLM path has no such layout).
        vllm_generation: whether the plugin's ``nemo_fp8`` vLLM method serves it (its
            ``scheme``, :data:`VLLM_SCHEMES`); elsewhere vLLM generates in BF16.
        nemo_rl_generation: whether NeMo RL's own FP8 generation path (vLLM block or MX FP8
            weights) serves it; elsewhere NeMo RL generates in BF16.
        deepgemm_generation: whether vLLM's DeepGEMM block-FP8 kernels serve it
            (``generation_numerics: vllm_deepgemm_ue8m0`` is refused elsewhere).
        generation_refusal: why FP8 generation is refused outright (the spec refuses
            ``generation: fp8``), or None. A kind without a vLLM path but without a refusal
            generates in BF16 with a warning.
        te_env: the TE variable whose value decides this recipe's scales at TE import, or None.
        token_align: what the token count (the product of the leading dims of a GEMM input, per
            rank) must be a multiple of: TE 2.20's ``get_align_size_for_quantization`` (16 for
            per-tensor and block FP8, which also covers ``assert_dim_for_fp8_exec``'s 8; 32 for
            MXFP8; 128 for NVFP4).
        dim_align: what hidden and intermediate sizes (per rank) must be multiples of, or TE
            refuses the GEMM: 16 (``assert_dim_for_fp8_exec``), 32 (MXFP8 ``is_quantizable``;
            NVFP4: 16-element groups and the 16-byte TMA rows of FP4 GEMM operands, 32 values,
            megatron-core ``get_fp4_align_size``).
        tile_align: a larger multiple that fills every scale tile (block scaling: 128); a size
            off it runs with partial tiles, at a cost (a warning), or None.
        nearest: ``(architecture, "rl" | "train") -> recipe``: the nearest built-in recipe
            that trains where this kind cannot (``"rl"``: it also generates in FP8, so the
            replacement needs a vLLM FP8 path there; checked against the table itself in
            ``tests/hosts/test_retarget.py``).
        generation_nearest: architecture -> the recipe to generate with where this kind's vLLM
            FP8 generation cannot run but block FP8 generation can.
    """

    scaling: ScalingKind
    te_class: str
    megatron_recipe: str
    megatron_field: Literal["fp8_recipe", "fp4_recipe"] = "fp8_recipe"
    tiles: tuple[_Tile | None, _Tile | None, _Tile | None] = (None, None, None)
    allowed_tiles: tuple[frozenset[_Tile], frozenset[_Tile], frozenset[_Tile]] = (
        frozenset(),
        frozenset(),
        frozenset(),
    )
    history: bool = False
    scale_format: Literal["fp32", "e8m0", "e4m3"] = "fp32"
    fp8_formats: tuple[str, ...] = ("e4m3", "hybrid")
    amax_floor: bool = True
    te_amax_epsilon: bool = False
    fp8_attention: bool = True
    bf16_edge_layers: bool = True
    training_archs: frozenset[str]
    generation_archs: frozenset[str] = frozenset()
    vllm_generation: bool = False
    nemo_rl_generation: bool = False
    deepgemm_generation: bool = False
    generation_refusal: str | None = None
    te_env: str | None = None
    token_align: int = 16
    dim_align: int = 16
    tile_align: int | None = None
    nearest: Mapping[tuple[str, str], str] = field(default_factory=dict)
    generation_nearest: Mapping[str, str] = field(default_factory=dict)

    @property
    def block(self) -> int | None:
        """The inner-dimension length GEMM operands must be a multiple of (None per tensor)."""
        act = self.tiles[0]
        return None if act is None else act[1]

    # Kind predicates (as TE's ``Recipe.delayed()``/``mxfp8()``): the one place a kind is
    # compared as a string, so code elsewhere asks the row, not the spelling.
    @property
    def is_delayed(self) -> bool:
        """Delayed scaling: per-tensor scales from an amax history (TE ``DelayedScaling``)."""
        return self.scaling == "delayed"

    @property
    def is_current(self) -> bool:
        """Per-tensor current scaling (TE ``Float8CurrentScaling``)."""
        return self.scaling == "tensorwise"

    @property
    def is_block(self) -> bool:
        """FP8 block scaling, 1x128 / 128x128 tiles (TE ``Float8BlockScaling``)."""
        return self.scaling == "block"

    @property
    def is_mx(self) -> bool:
        """MXFP8: 1x32 E8M0 scales (TE ``MXFP8BlockScaling``)."""
        return self.scaling == "mx"

    @property
    def is_nvfp4(self) -> bool:
        """NVFP4: E2M1 elements, E4M3 group scales, fp32 tensor scale (TE ``NVFP4BlockScaling``)."""
        return self.scaling == "nvfp4"

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor (delayed or current scaling): no tiles."""
        return self.tiles[0] is None

    @property
    def tiled(self) -> bool:
        """Scales per tile or group (block, MXFP8, NVFP4)."""
        return self.tiles[0] is not None

    @property
    def element_format(self) -> str:
        """Element format of forward tensors: ``"e4m3"``, or ``"e2m1"`` for FP4 (NVFP4)."""
        return "e2m1" if "e2m1" in self.fp8_formats else "e4m3"

    @property
    def element_max(self) -> float:
        """Largest magnitude of :attr:`element_format` (448, or 6 for E2M1)."""
        return FORMAT_MAX[self.element_format]

    @property
    def fixed_pow2(self) -> bool | None:
        """What ``pow2_scales`` must be, from :attr:`scale_format`: True for E8M0 scales,
        False for E4M3 block scales, None where fp32 scales take either."""
        return {"e8m0": True, "e4m3": False}.get(self.scale_format)

    @property
    def argless_tiles(self) -> tuple[_Tile | None, _Tile | None, _Tile | None] | None:
        """The tiles a host gets when it builds TE's recipe with no tile arguments
        (megatron-core's ``get_fp8_recipe``): :attr:`tiles`, or None when there are none (per
        tensor) or when :attr:`te_env` pins them at TE import (NVFP4's
        ``NVTE_NVFP4_DISABLE_2D_QUANTIZATION``, from :func:`te_env`), so the spec's own
        tiles reach TE."""
        if self.per_tensor or self.is_nvfp4:
            return None
        return self.tiles

    def default_tile(self, key: str) -> _Tile | None:
        """The default tile of a :data:`TILE_KEYS` role (``"weight_block"``, ...)."""
        return self.tiles[TILE_KEYS.index(key)]

    def allowed(self, key: str) -> frozenset[_Tile]:
        """The tiles a :data:`TILE_KEYS` role accepts (empty per tensor)."""
        return self.allowed_tiles[TILE_KEYS.index(key)]


_ALL_FP8 = frozenset({"ada", "hopper", "blackwell", "blackwell_sm120"})

_CURRENT_ON_ADA_AND_SM120 = {
    (arch, use): "fp8_current" for arch in ("ada", "blackwell_sm120") for use in ("rl", "train")
}

CAPABILITIES: dict[str, RecipeCapability] = {
    "delayed": RecipeCapability(
        scaling="delayed",
        te_class="DelayedScaling",
        megatron_recipe="delayed",
        history=True,
        amax_floor=True,
        bf16_edge_layers=False,
        training_archs=_ALL_FP8,
    ),
    "tensorwise": RecipeCapability(
        scaling="tensorwise",
        te_class="Float8CurrentScaling",
        megatron_recipe="tensorwise",
        te_amax_epsilon=True,
        training_archs=_ALL_FP8,
        te_env=ENV_CURRENT_POW2_SCALES,
    ),
    "block": RecipeCapability(
        scaling="block",
        te_class="Float8BlockScaling",
        megatron_recipe="blockwise",
        tiles=((1, 128), (128, 128), (1, 128)),
        allowed_tiles=(frozenset({(1, 128), (128, 128)}),) * 3,
        te_amax_epsilon=True,
        fp8_attention=False,
        # Hopper natively (cuBLAS >= 12.9 block-scaled GEMMs); Blackwell by TE's MXFP8
        # emulation, which needs power-of-2 scales (see hardware_problems).
        training_archs=frozenset({"hopper", "blackwell"}),
        generation_archs=frozenset({"hopper", "blackwell", "blackwell_sm120"}),
        vllm_generation=True,
        nemo_rl_generation=True,
        deepgemm_generation=True,
        te_env=ENV_BLOCK_FP32_SCALES,
        tile_align=128,
        nearest=_CURRENT_ON_ADA_AND_SM120,
    ),
    "mx": RecipeCapability(
        scaling="mx",
        te_class="MXFP8BlockScaling",
        megatron_recipe="mxfp8",
        tiles=((1, 32), (1, 32), (1, 32)),
        allowed_tiles=(frozenset({(1, 32)}), frozenset({(1, 32), (32, 32)}), frozenset({(1, 32)})),
        scale_format="e8m0",
        amax_floor=False,
        training_archs=frozenset({"blackwell"}),
        # vLLM 0.32's W8A8 MXFP8 linear kernels: FlashInfer's CuTe-DSL/TRT-LLM (SM100
        # family) and CUTLASS mm_mxfp8 (SM100 and later, SM12x included; B12x on SM12x);
        # on SM90 it falls back to weight-only Marlin or emulation without an error.
        generation_archs=frozenset({"blackwell", "blackwell_sm120"}),
        vllm_generation=True,
        nemo_rl_generation=True,
        token_align=32,
        dim_align=32,
        nearest={
            ("hopper", "rl"): "fp8_blockwise",
            ("hopper", "train"): "fp8_subchannel",
            **_CURRENT_ON_ADA_AND_SM120,
        },
        generation_nearest={"hopper": "fp8_blockwise", "blackwell_sm120": "fp8_blockwise"},
    ),
    "nvfp4": RecipeCapability(
        scaling="nvfp4",
        te_class="NVFP4BlockScaling",
        megatron_recipe="nvfp4",
        megatron_field="fp4_recipe",
        tiles=((1, 16), (16, 16), (1, 16)),
        allowed_tiles=(frozenset({(1, 16)}), frozenset({(16, 16), (1, 16)}), frozenset({(1, 16)})),
        scale_format="e4m3",
        fp8_formats=("e2m1",),
        # TE 2.14/2.20's NVFP4BlockScaling has fp8_dpa (FP8 attention under an FP4 recipe)
        # without an assert against it; whether a host passes it depends on its version
        # (megatron-core from 0.17: stacks.FACTS), so the adapters decide, naming the version.
        # TE's own gate (check_nvfp4_support) is SM >= 10.0; the plugin trains NVFP4 on the
        # data-center Blackwells (SM100/SM103) only, where NVIDIA's NVFP4 recipes are run.
        training_archs=frozenset({"blackwell"}),
        generation_refusal=NVFP4_GENERATION_REFUSAL,
        token_align=128,
        dim_align=32,
        nearest={
            ("hopper", "train"): "fp8_subchannel",
            ("hopper", "rl"): "fp8_blockwise",
            **_CURRENT_ON_ADA_AND_SM120,
        },
    ),
}
"""Scaling kind -> :class:`RecipeCapability`."""

VLLM_SCHEMES: tuple[str, ...] = tuple(k for k, row in CAPABILITIES.items() if row.vllm_generation)
"""The kinds the ``nemo_fp8`` vLLM method serves (its ``quantization_config.scheme`` values)."""


def capability(scaling: str) -> RecipeCapability:
    """The row for a scaling kind (KeyError for a kind the table does not know)."""
    return CAPABILITIES[scaling]


def amax_epsilon_problem(scaling: str, amax_epsilon: float) -> str | None:
    """Why ``amax_epsilon`` cannot be used with ``scaling`` (a row whose
    :attr:`~RecipeCapability.amax_floor` is False), or None. The one statement of the rule: the
    spec refuses with it, and so does the ``nemo_fp8`` vLLM method's config, which can be
    written by hand."""
    row = CAPABILITIES[scaling]
    if not amax_epsilon or row.amax_floor:
        return None
    return (
        f"amax_epsilon {amax_epsilon!r} has no meaning for {row.te_class} (its E8M0 "
        f"exponents are rounded up from each block's own amax: Transformer Engine's "
        f"{row.te_class} and vLLM's nemo_fp8 method have no amax floor)"
    )


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
    @property
    def weight_block(self) -> tuple[int, int] | None: ...
    @property
    def name(self) -> str: ...


def nvfp4_te_fields(spec: _SpecLike) -> dict[str, bool | str]:
    """The ``NVFP4BlockScaling`` fields an ``nvfp4`` spec means: TE's default NVFP4 training
    recipe (Hadamard transform on the wgrad operands, stochastic rounding of gradients, no
    row-scaled activations, no "4over6"), with 16x16 weight tiles unless ``weight_block`` is
    [1, 16] (``disable_2d_quantization``)."""
    return {
        "disable_rht": False,
        "disable_stochastic_rounding": False,
        "disable_2d_quantization": tuple(spec.weight_block or ()) != (16, 16),
        "row_scaled_activation": False,
        "nvfp4_4over6": "none",
        "nvfp4_4over6_e4m3_use_256": "all",
        "nvfp4_4over6_err_mode": "MAE",
    }


def _env_value(value: object) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


_ENV_FACTS = {
    **{var: f"NVFP4BlockScaling.{f}" for f, var in ENV_NVFP4.items()},
    ENV_BACKWARD_OVERRIDE: "Recipe.backward_override",
}
"""Each TE variable that only some TE releases read -> the ``transformer-engine`` fact of the
recipe field it defaults (:data:`nemo_fp8_plugin.stacks.FACTS`)."""


def te_env_read_by(env: Mapping[str, str], te: str | None) -> dict[str, str]:
    """``env`` less the variables Transformer Engine ``te`` does not read (its recipe lacks the
    field the variable defaults, :data:`_ENV_FACTS`) and whose value is what that release does
    anyway (the field's off value): writing them would name a setting that release never sees.
    A variable asking for more than the release has is kept, for the host's checks to refuse;
    ``te`` None (unknown): every variable kept."""
    from .stacks import lookup

    out: dict[str, str] = {}
    for var, value in env.items():
        name = _ENV_FACTS.get(var)
        fact = lookup("transformer-engine", name, te) if name is not None else None
        if fact is not None and fact.present is False and fact.fact is not None:
            if value == _env_value(fact.fact.off):
                continue
        out[var] = value
    return out


def te_env(spec: _SpecLike, te: str | None = None) -> dict[str, str]:
    """Environment variables the training process needs *before* TE is imported so that a
    recipe object a host builds (megatron-core) quantizes as the spec says.

    Always set, to either value, for the scaling kinds TE reads one for, so a cluster-wide
    setting cannot flip a recipe silently: block -> ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``
    (``"1"`` for fp32 scales), tensorwise -> ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``
    (``"1"`` for power-of-2 scales), nvfp4 -> every variable of :data:`ENV_NVFP4` that
    Transformer Engine ``te`` reads (:func:`te_env_read_by`; None: every one). Empty when
    training is not FP8.
    """
    if spec.training != "fp8":
        return {}
    if CAPABILITIES[spec.scaling].is_nvfp4:
        # Every NVFP4 class default TE reads at import, pinned to the value the spec means.
        env = {ENV_NVFP4[f]: _env_value(v) for f, v in nvfp4_te_fields(spec).items()}
        return te_env_read_by(env, te)
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
        message: one sentence naming the GPU generation, what cannot run there, the nearest
            recipe that can and the exact YAML change.
        side: the side it concerns, or None for both.
        recipe: the recipe :attr:`change` leads to, one that runs there (the same recipe when
            the fix is a field, e.g. ``pow2_scales: true``; None when nothing runs there).
        change: the exact YAML change, e.g. ``fp8: {recipe: fp8_subchannel}`` (None: no FP8
            recipe runs there at all).
    """

    level: Literal["error", "warning"]
    key: str
    message: str
    side: Side | None = None
    recipe: str | None = None
    change: str | None = None


_LABELS = {
    "ampere": "Ampere (SM80)",
    "ada": "Ada (SM89)",
    "hopper": "Hopper (SM90)",
    "blackwell": "Blackwell (SM100/SM103)",
    "blackwell_sm120": "Blackwell SM 12.x (RTX PRO 6000, GeForce RTX 50)",
}


SIDES: tuple[Side, ...] = ("training", "generation")

HOST_SIDES: dict[str, tuple[Side, ...]] = {
    "megatron": ("training",),
    "nemo2": ("training",),
    "bridge": ("training",),
    "te": ("training",),
    "vllm": ("generation",),
    "nemo-rl": SIDES,
}
"""The sides each host runs (the ``--host`` names): megatron-core, NeMo 2, Megatron-Bridge and
Transformer Engine train, vLLM generates, NeMo RL does both. What cannot run on a GPU is judged,
and said, for these sides only (:func:`hardware_problems`)."""


def host_sides(host: str | None) -> tuple[Side, ...]:
    """The sides ``host`` runs (:data:`HOST_SIDES`; ``nemo_rl`` spells ``nemo-rl`` as
    ``--host`` takes it); both when no host is known."""
    return HOST_SIDES.get(host.replace("_", "-"), SIDES) if host is not None else SIDES


def arch_label(arch: str) -> str:
    """``"Hopper (SM90)"`` for ``"hopper"``: how messages name a GPU generation."""
    return _LABELS.get(arch, arch)


def _change(
    spec: _SpecLike,
    recipe: str | None = None,
    *,
    sides: tuple[Side, ...] = SIDES,
    key: str | None = None,
    **fields: str,
) -> str:
    """The ``fp8:`` block that moves ``spec`` to ``recipe`` (or changes ``fields`` in place),
    keeping what the user chose for each side the host runs (``sides``). A plain move of a
    config that names its recipe by one key (``key``: ``precision``, ``policy.precision``,
    ``mixed_precision``) is that key with the new name, and an ``fp8:`` block without a recipe
    for the rest (``{precision: fp8_subchannel, fp8: {generation: bf16}}``): an ``fp8:`` block
    naming another recipe next to it would be refused as a conflict."""
    items = [f"recipe: {recipe or spec.name}"]
    if recipe is not None:
        if spec.training == "bf16" and "training" in sides:
            items.append("training: bf16")
        if spec.generation == "bf16" and recipe != "nvfp4" and "generation" in sides:
            items.append("generation: bf16")
    items += [f"{k}: {v}" for k, v in fields.items()]
    if recipe is None or key in (None, "fp8"):
        return "fp8: {" + ", ".join(items) + "}"
    if len(items) == 1:
        return f"{key}: {recipe}"
    return f"{{{key}: {recipe}, fp8: {{{', '.join(items[1:])}}}}}"


# --------------------------------------------------------------------------- alignment


def token_alignment(
    scaling: str,
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    context_parallel: int = 1,
) -> int:
    """What a training sequence length must be a multiple of for ``scaling``'s GEMMs: the
    token count each rank hands a GEMM must be a multiple of the kind's ``token_align`` (TE's
    ``get_align_size_for_quantization``; ``assert_dim_for_fp8_exec`` raises below 8), and
    sequence parallelism splits the sequence over the ``tensor_parallel`` ranks, context
    parallelism (load-balanced) into ``2 * context_parallel`` chunks."""
    need = CAPABILITIES[scaling].token_align
    if sequence_parallel and tensor_parallel > 1:
        need *= tensor_parallel
    if context_parallel > 1:
        need *= 2 * context_parallel
    return need


@dataclass(frozen=True)
class DimensionProblem:
    """A model dimension (per rank) that a recipe's GEMMs cannot take.

    Attributes:
        level: ``"error"`` (cannot run) or ``"warning"`` (runs with partial tiles).
        key: the dimension's name (``hidden_size``, ``ffn_hidden_size``, ...) or the parallel
            size that makes it impossible (``tensor_model_parallel_size``).
        message: one sentence with the sizes and what they must be multiples of.
    """

    level: Literal["error", "warning"]
    key: str
    message: str


def dimension_problems(
    scaling: str, dims: dict[str, int], *, tensor_parallel: int = 1
) -> list[DimensionProblem]:
    """Hidden and intermediate sizes (``dims``, whole-model values) that break ``scaling``
    once split over ``tensor_parallel`` ranks: a size TP does not divide, or a per-rank size
    that is not a multiple of the kind's ``dim_align`` (per-tensor kinds: 16, from
    ``assert_dim_for_fp8_exec``)."""
    cap = CAPABILITIES[scaling]
    out: list[DimensionProblem] = []
    tp = max(int(tensor_parallel or 1), 1)
    for name, size in dims.items():
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            continue
        # hidden_size is the input of the column-parallel GEMMs (whole on every rank); the
        # intermediate sizes are split over TP (the input of the row-parallel GEMM).
        split = tp if name != "hidden_size" else 1
        if size % split:
            out.append(
                DimensionProblem(
                    "error",
                    "tensor_model_parallel_size",
                    f"{name} {size} is not divisible by tensor parallel size {tp}",
                )
            )
            continue
        local = size // split
        where = f"{name} {size}" + (f" / TP {tp} = {local}" if split > 1 else "")
        level: Literal["error", "warning"]
        for need, level in ((cap.dim_align, "error"), (cap.tile_align, "warning")):
            if need is None or local % need == 0:
                continue
            tail = (
                "partial tiles run, at a cost"
                if level == "warning"
                else f"Transformer Engine's {cap.te_class} GEMMs refuse it"
            )
            # A size that fits whole but not per rank is the TP size's fault.
            blame = "tensor_model_parallel_size" if split > 1 and size % need == 0 else name
            out.append(
                DimensionProblem(
                    level, blame, f"{where} is not a multiple of {need} ({scaling} scaling; {tail})"
                )
            )
            break
    return out
