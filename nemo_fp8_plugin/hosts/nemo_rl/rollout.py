"""A NeMo RL config's rollouts as its release's vLLM runs them: the linear kernel, the scale
grid it computes on, and the environment variables that keep the recipe's grid.

NeMo RL generates with vLLM's own block-FP8 method (``quantization="fp8"``), so the kernel is
vLLM's choice (:func:`nemo_fp8_plugin.hosts.vllm.rollout.rollout`, ``method="fp8"``), made with
the vLLM of the release's ``uv.lock`` (the ``nemo-rl-<release>`` stack's: v0.6.0 vLLM 0.17.1,
v0.7.0 0.20.0, main 0.25.1) and with what NeMo RL sets itself (MXFP8, main only, goes
through vLLM's ModelOpt MXFP8 method, whose kernel NeMo RL's refit replaces:
:data:`_MX_REFIT_KERNEL`):

* ``use_deep_gemm: true`` makes NeMo RL's ``init_fp8`` set ``VLLM_USE_DEEP_GEMM=1`` and
  ``VLLM_USE_DEEP_GEMM_E8M0=0`` in the vLLM worker before the engine starts
  (``nemo_rl/models/generation/vllm/quantization/fp8.py``: v0.6.0 and v0.7.0 ~188, main ~240),
  over whatever the environment says; ``false`` sets nothing, and vLLM's defaults (each 1)
  pick DeepGEMM with power-of-2 (UE8M0) scales on H100, B200 and, from vLLM 0.25, RTX PRO 6000;
* ``pow2_weight_scaling_factors`` makes NeMo RL's refit write power-of-2 weight scales, which a
  kernel keeping the stored scales keeps (DeepGEMM's UE8M0 mode rounds them to the same
  values); ``pow2_activation_scaling_factors`` patches vLLM's per-token-group activation
  quantizer (``fp8_utils.per_token_group_quant_fp8``) to power-of-2 scales, which every kernel
  here quantizes with but FlashInfer's Hopper kernel below 32 tokens (it quantizes inside its
  GEMM, with fp32 scales).

The variables that keep the recipe's grid are searched among those NeMo RL does not set
itself. Where the release reads ``policy.generation.vllm_cfg.env_vars`` (v0.7.0 on: NeMo RL
starts its vLLM workers with them, ``vllm_generation.py``) they are written there; at v0.6.0
they go in the environment NeMo RL starts from (the driver's, which its Ray workers inherit).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...spec import RecipeSpec

__all__ = ["RolloutCheck", "ENV_VARS_KEY", "rollout_checks", "rollout_archs", "vllm_of"]

ENV_VARS_KEY = "policy.generation.vllm_cfg.env_vars"
"""NeMo RL's environment of its vLLM workers (v0.7.0 on)."""

_MX_REFIT_KERNEL = "flashinfer-cutlass-mxfp8"
"""The one MXFP8 linear kernel NeMo RL's MXFP8 refit accepts (main's
``nemo_rl/models/generation/vllm/quantization/fp8.py``, ``process_weights_after_loading_mxfp8_linear``
~830-857): it keeps weights in the [N, K] layout, so it swaps vLLM's first choice on SM100,
FlashInfer's CuTe-DSL kernel (column-major [K, N]), for FlashInfer's CUTLASS one and stops at load
on any other kernel. Only main reads ``is_mx``."""


_DEEP_GEMM_ENV = {"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"}
"""What ``use_deep_gemm: true`` sets in NeMo RL's vLLM worker (the stacks fact
``vllm_cfg.use_deep_gemm sets VLLM_USE_DEEP_GEMM_E8M0=0``)."""


@dataclass(frozen=True)
class RolloutCheck:
    """NeMo RL's rollouts on one GPU generation.

    Attributes:
        vllm: the vLLM release (the NeMo RL release's).
        arch: the GPU generation (``hopper``, ``blackwell``, ``blackwell_sm120``).
        kernel: how messages name vLLM's linear kernel; None when unknown or not FP8.
        weight_scales / activation_scales: the grid the rollout computes on (``fp32``,
            ``pow2``, ``e8m0``, ``mixed``: fp32 below 32 tokens, power-of-2 from 32; ``bf16``);
            None with ``kernel``.
        recipe_scales: the grid the recipe quantizes to (what training computes on).
        runs: False when the kernel cannot run so (DeepGEMM's Blackwell kernels with fp32
            scales).
        matches: the rollout computes on the recipe's grid.
        set_by_nemo_rl: the variables NeMo RL sets itself in its vLLM workers.
        env: the variables judged with (``set_by_nemo_rl`` and what is to be set).
        notes: why, from vLLM's selection (each citing what decides it).
        replaced: the kernel vLLM picks that NeMo RL replaces with ``kernel`` (its MXFP8
            refit, :data:`_MX_REFIT_KERNEL`); None when it runs vLLM's pick.
    """

    vllm: str
    arch: str
    kernel: str | None
    weight_scales: str | None
    activation_scales: str | None
    recipe_scales: str
    runs: bool
    matches: bool
    set_by_nemo_rl: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    replaced: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "vllm": self.vllm,
            "arch": self.arch,
            "kernel": self.kernel,
            "weight_scales": self.weight_scales,
            "activation_scales": self.activation_scales,
            "recipe_scales": self.recipe_scales,
            "runs": self.runs,
            "matches": self.matches,
            "set_by_nemo_rl": dict(self.set_by_nemo_rl),
            "env": dict(self.env),
            "notes": list(self.notes),
            "replaced": self.replaced,
        }


def vllm_of(release: str | None) -> str | None:
    """The vLLM of NeMo RL ``release`` (its stack's, from its ``uv.lock``); None for a release
    without a stack."""
    from ...stacks import STACKS

    for stack in STACKS:
        if release is not None and stack.release == release:
            return stack.versions.get("vllm")
    return None


def rollout_archs(spec: RecipeSpec, use_deep_gemm: bool) -> list[str]:
    """The GPU generations to judge when no target GPU is stated: where ``use_deep_gemm:
    true`` is written, the Hopper GPUs it is written for (NVIDIA's FP8 configs; a Blackwell
    target gets ``false``); otherwise every generation the recipe runs on."""
    from ...kinds import hardware_problems
    from ..vllm.rollout import GPU_ARCHS

    if use_deep_gemm:
        return ["hopper"]
    return [a for a in GPU_ARCHS if not any(p.level == "error" for p in hardware_problems(spec, a))]


def _grid(spec: RecipeSpec) -> str:
    from ...capabilities import capability

    if capability(spec.scaling).is_mx:
        return "e8m0"
    numerics = spec.generation_numerics == "vllm_deepgemm_ue8m0"  # UE8M0 on purpose
    return "pow2" if spec.pow2_scales or numerics else "fp32"


def _judge(
    spec: RecipeSpec,
    arch: str,
    vllm: str,
    env: Mapping[str, str],
    pow2: tuple[bool, bool],
    forced: Mapping[str, str],
) -> RolloutCheck:
    from ...capabilities import capability
    from ..vllm.rollout import rollout

    r = rollout(spec, arch, release=vllm, env=env, method="fp8")
    want = _grid(spec)
    if r.kernel is None:
        return RolloutCheck(
            vllm, arch, None, None, None, want, False, r.matches, forced, env, r.notes
        )
    w, a = r.weight_scales, r.activation_scales
    label, runs, notes, replaced = r.kernel.label, r.runs, r.notes, None
    if capability(spec.scaling).is_mx:
        label, runs, notes, replaced = _mx_refit_kernel(r.kernel.name, r.runs, r.notes)
        matches = r.matches and runs
    else:
        pow2_weights, pow2_activations = pow2
        if pow2_weights and r.runs:
            w = "pow2"  # NeMo RL's refit writes them; the kernel keeps or UE8M0-rounds them
        if pow2_activations:
            a = "mixed" if r.kernel.quantizes_input else "pow2"
        matches = r.runs and w == want and a == want
    return RolloutCheck(vllm, arch, label, w, a, want, runs, matches, forced, env, notes, replaced)


def _mx_refit_kernel(
    picked: str, runs: bool, notes: tuple[str, ...]
) -> tuple[str, bool, tuple[str, ...], str | None]:
    """(label, runs, notes, the label of vLLM's pick it replaces) of the MXFP8 kernel NeMo RL
    runs where vLLM picks ``picked`` (:data:`_MX_REFIT_KERNEL`)."""
    from ..vllm.rollout import KERNELS

    kept = KERNELS[_MX_REFIT_KERNEL]
    if picked == _MX_REFIT_KERNEL:
        return kept.label, runs, notes, None
    if picked == "flashinfer-cutedsl-mxfp8":
        return kept.label, runs, notes, KERNELS[picked].label
    stop = (
        f"NeMo RL's MXFP8 refit takes {kept.label} only and stops at load on "
        f"{KERNELS[picked].label} (fp8.py, process_weights_after_loading_mxfp8_linear)"
    )
    return KERNELS[picked].label, False, (*notes, stop), None


def rollout_checks(
    spec: RecipeSpec,
    release: str | None,
    archs: list[str],
    *,
    use_deep_gemm: bool,
    pow2: tuple[bool, bool] = (False, False),
    env: Mapping[str, str] | None = None,
) -> tuple[list[RolloutCheck], dict[str, str]]:
    """``(checks, needed)``: the rollouts on each of ``archs`` with the variables ``needed``
    set, and those variables: the fewest of vLLM's kernel variables NeMo RL does not set
    itself that keep the recipe's grid on every one of ``archs`` (``{}`` when none is needed,
    or none helps: the checks then say what runs). ``use_deep_gemm`` and ``pow2`` (the
    ``pow2_weight_scaling_factors`` / ``pow2_activation_scaling_factors`` NeMo RL reads) are the
    written config's, ``env`` the variables the config already gives the vLLM workers; an empty
    list when the release's vLLM is unknown or the recipe generates in BF16."""
    from ...capabilities import capability
    from ..vllm.rollout import KERNEL_ENV

    vllm = vllm_of(release)
    row = capability(spec.scaling)
    if vllm is None or spec.generation != "fp8" or not row.nemo_rl_generation or not archs:
        return [], {}
    forced = dict(_DEEP_GEMM_ENV) if use_deep_gemm and not row.is_mx else {}
    # NeMo RL sets its variables in the worker after it starts, over the configured ones
    base = {k: str(v) for k, v in (env or {}).items() if k in KERNEL_ENV} | forced

    def judged(trial: Mapping[str, str]) -> list[RolloutCheck]:
        return [_judge(spec, arch, vllm, trial, pow2, forced) for arch in archs]

    plain = judged(base)
    if all(c.matches or c.kernel is None for c in plain) or row.is_mx:
        return plain, {}
    free = [name for name in KERNEL_ENV if name not in forced]
    for size in range(1, len(free) + 1):
        for names in itertools.combinations(free, size):
            flip = {name: "0" if _on(base.get(name)) else "1" for name in names}
            trial = judged(base | flip)
            if all(c.matches for c in trial if c.kernel is not None):
                return trial, flip
    return plain, {}


def _on(value: str | None) -> bool:
    """vLLM's reading of a kernel variable (``bool(int(...))``, each 1 when unset)."""
    if value is None:
        return True
    try:
        return bool(int(value))
    except ValueError:
        return True


# --------------------------------------------------------------------------- in words


def _grid_text(c: RolloutCheck) -> str:
    if c.weight_scales == c.activation_scales:
        return f"{c.weight_scales} scales"
    return f"weights {c.weight_scales}, activations {c.activation_scales} scales"


_GRID_WORDS = {
    "fp32": "fp32",
    "pow2": "power-of-2",
    "e8m0": "E8M0 (MXFP8)",
    "mixed": "fp32 below 32 tokens, power-of-2 from 32",
    "bf16": "BF16",
}


def rollout_line(checks: list[RolloutCheck], release: str | None, spec: RecipeSpec) -> str | None:
    """One line naming, per GPU, the kernel and scale grid of the rollouts and whether it is
    the grid training quantizes to (None without checks); said of the host ``nemo-rl``."""
    from ...capabilities import arch_label, capability
    from ...stacks import release_label

    if not checks:
        return None
    parts = []
    for c in checks:
        where = arch_label(c.arch)
        if c.kernel is None:
            parts.append(f"{where}: {c.notes[0] if c.notes else 'kernel unknown'}")
            continue
        grid = f"{spec.name}'s {_GRID_WORDS[c.recipe_scales]} grid"
        if not c.matches:
            state = f"not {grid}"
        elif spec.training == "fp8":
            state = f"{grid}, as in training"
        else:
            state = grid
        if not c.runs:
            state = f"cannot run ({'; '.join(c.notes)})"
        text = f"{where}: {c.kernel}, {_grid_text(c)} ({state})"
        if c.runs and c.replaced:
            text += (
                f"; NeMo RL's MXFP8 refit needs the [N, K] weight layout and replaces vLLM's "
                f"first choice, {c.replaced}, with it (fp8.py, "
                f"process_weights_after_loading_mxfp8_linear)"
            )
        pow2_training = spec.training == "fp8" and capability(spec.scaling).is_block
        if c.arch == "blackwell" and pow2_training and c.matches:
            text += (
                "; on Blackwell Transformer Engine trains block FP8 with power-of-2 scales only, "
                "so the rollouts must compute on them too: DeepGEMM's UE8M0 mode, vLLM's "
                "default there"
            )
        parts.append(text)
    first = checks[0]
    said = []
    if first.set_by_nemo_rl:
        forced = " ".join(f"{k}={v}" for k, v in first.set_by_nemo_rl.items())
        said.append(f"use_deep_gemm: true sets {forced} in its vLLM workers")
    others = {k: v for k, v in first.env.items() if k not in first.set_by_nemo_rl}
    if others:
        said.append("with " + " ".join(f"{k}={v}" for k, v in others.items()))
    context = "; ".join([f"the vLLM of {release_label(release)}", *said])
    return f"rollouts on vLLM {first.vllm} ({context}): " + "; ".join(parts)


def needed_line(
    needed: Mapping[str, str], release: str | None, spec: RecipeSpec, *, in_config: bool
) -> str:
    """Where the variables that keep the recipe's grid go, in words."""
    from ...stacks import release_label

    sets = " ".join(f"{k}={v}" for k, v in needed.items())
    why = f"so that vLLM {vllm_of(release)} rolls out {spec.name} on its own scale grid"
    if in_config:
        return (
            f"{sets} written to {ENV_VARS_KEY}: NeMo RL starts its vLLM workers "
            f"with these variables, {why}"
        )
    return (
        f"set {sets} in the environment NeMo RL starts from (the driver's; its Ray "
        f"workers, vLLM's among them, inherit it), {why}: {release_label(release)} has no "
        f"{ENV_VARS_KEY}"
    )
