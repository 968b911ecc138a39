"""Scaling kinds as objects: one class per kind (as Transformer Engine's recipe classes and
vLLM's kernel classes are), answering, as plain data and from its row of
:data:`nemo_fp8_plugin.capabilities.CAPABILITIES`, what differs between kinds: its Transformer
Engine recipe fields, megatron-core fields (NeMo 2 and Megatron-Bridge share the names), NeMo RL
keys, its verdict on a GPU generation and what runs there. Hosts ask :func:`kind` and never
compare kind names. Adding a kind: docs/architecture.md, "How to add a scaling kind".
"""

from __future__ import annotations

from typing import Any, ClassVar

from .capabilities import (
    ARCHS,
    CAPABILITIES,
    SIDES,
    HardwareProblem,
    RecipeCapability,
    Side,
    _change,
    _SpecLike,
    arch_label,
    nvfp4_te_fields,
)

__all__ = ["Kind", "KINDS", "kind", "register_kind", "hardware_problems", "side_summary"]

_FORMAT = {"hybrid": "HYBRID", "e4m3": "E4M3", "e2m1": "E2M1"}
"""Spec ``fp8_format`` -> Transformer Engine's ``Format`` member name."""


def _needs(archs: frozenset[str]) -> str:
    names = [arch_label(a.name) for a in ARCHS if a.name in archs]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class Kind:
    """A scaling kind: its capability row and what each host makes of it. The defaults
    describe an FP8 kind that megatron-core builds from ``fp8_recipe`` with its default tiles
    and that no generation path serves; subclasses override what differs."""

    name: ClassVar[str]
    """The spec's ``scaling`` value, the key of its row."""

    vllm_name: ClassVar[str] = ""
    """vLLM's name for its FP8 kernels of the kind (``""``: no vLLM FP8 path)."""

    vllm_layout: ClassVar[str] = ""
    """What vLLM's FP8 generation of the kind is, in words."""

    nemo_rl_pow2_choice: ClassVar[bool] = False
    """Whether power-of-2 rollout scales are a choice NeMo RL's vLLM path leaves to the config
    (block FP8: either grid; MXFP8's E8M0 scales are powers of two)."""

    nemo_rl_pack_align: ClassVar[int] = 16
    """What NeMo RL's sequence packer pads packed sequences to for the kind's ``fp8_cfg``
    recipe (``nemo_rl/models/megatron/data.py``), before the TP and 2 x CP factors."""

    megatron_attention_fact: ClassVar[str | None] = None
    """The stacks-table fact naming the megatron-core release whose recipe builder first passes
    ``fp8_dpa`` for the kind (None: the installed source's ``get_fp8_recipe`` decides)."""

    megatron_attention_builds: ClassVar[str] = ""
    """What that builder constructs, for the message (``MXFP8BlockScaling``)."""

    te_check: ClassVar[str] = ""
    """What :func:`nemo_fp8_plugin.hosts.te.verify_host_recipe` checks of a host-built recipe
    besides ``NVTE_BACKWARD_OVERRIDE``: ``"scales"`` (rounding fixed at TE import),
    ``"tiles"``, ``"nvfp4"`` (class defaults from ``NVTE_NVFP4_*``), or nothing."""

    @property
    def row(self) -> RecipeCapability:
        """Its row of :data:`~nemo_fp8_plugin.capabilities.CAPABILITIES` (read each time)."""
        return CAPABILITIES[self.name]

    # ------------------------------------------------------------------ Transformer Engine

    def te_fields(self, spec: Any) -> dict[str, Any]:
        """The fields of its TE recipe object (``fp8_format`` as a ``Format`` member name)."""
        return {"fp8_format": _FORMAT[spec.fp8_format], **self._attention(spec)}

    def te_quantizers(self, spec: Any) -> dict[str, dict[str, Any]]:
        """The per-role quantizer parameters of its TE recipe object (``{}``: none)."""
        return {}

    def te_host_args(self, spec: Any) -> dict[str, Any]:
        """The arguments megatron-core builds the TE recipe with (``fp8_utils.get_fp8_recipe``
        passes the format only, so everything else is TE's default)."""
        return {"fp8_format": _FORMAT[spec.fp8_format]}

    @staticmethod
    def _attention(spec: Any) -> dict[str, bool]:
        return {"fp8_dpa": spec.fp8_dot_product_attention, "fp8_mha": spec.fp8_multi_head_attention}

    @staticmethod
    def _qparams(spec: Any) -> dict[str, dict[str, Any]]:
        params = {"power_2_scale": spec.pow2_scales, "amax_epsilon": spec.amax_epsilon}
        return {
            a: dict(params)
            for a in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
        }

    # ------------------------------------------------------------------ megatron-core

    def megatron_fields(self, spec: Any) -> dict[str, Any]:
        """Its ``TransformerConfig`` fields (the first/last-layer and ``quant_recipe`` fields
        are the rules'); history settings at megatron-core's neutral values unless read."""
        return {
            "fp8": spec.fp8_format,
            "fp8_recipe": self.row.megatron_recipe,
            "fp8_margin": 0,
            "fp8_amax_history_len": 1,
            "fp8_amax_compute_algo": "most_recent",
            "fp8_wgrad": spec.fp8_wgrad,
            "fp8_dot_product_attention": spec.fp8_dot_product_attention,
            "fp8_multi_head_attention": spec.fp8_multi_head_attention,
            "fp8_param": spec.fp8_param,
        }

    def ddp_fields(self, spec: Any) -> dict[str, bool]:
        """Its ``DistributedDataParallelConfig`` fields: FP8 parameters all-gathered in FP8."""
        return {"fp8_param_gather": spec.fp8_param, "reuse_grad_buf_for_mxfp8_param_ag": False}

    # ------------------------------------------------------------------ NeMo RL

    def nemo_rl_training(self, spec: Any, fp8_param: bool) -> dict[str, Any]:
        """Its training keys under ``policy.megatron_cfg`` (NeMo RL copies ``fp8``,
        ``fp8_recipe`` and ``fp8_param`` of ``fp8_cfg`` onto the provider)."""
        return {
            "fp8_cfg.enabled": True,
            "fp8_cfg.fp8": spec.fp8_format,
            "fp8_cfg.fp8_recipe": self.row.megatron_recipe,
            "fp8_cfg.fp8_param": fp8_param,
        }

    def nemo_rl_training_guards(self, spec: Any) -> dict[str, Any]:
        """Keys under ``policy.megatron_cfg`` a config must not set otherwise (an FP4 override
        contradicts an FP8 recipe)."""
        return {"model_overrides.fp4": None}

    def nemo_rl_generation(self, spec: Any, deep_gemm: bool) -> dict[str, Any]:
        """Its FP8 generation keys under ``policy.generation.vllm_cfg`` (``{}``: NeMo RL
        generates it in BF16); ``deep_gemm``: whether DeepGEMM is wanted there."""
        return {}

    def nemo_rl_generation_guards(self, spec: Any) -> dict[str, Any]:
        """``vllm_cfg`` keys a config must not set otherwise while NeMo RL generates it."""
        return {}

    def nemo_rl_unexpressible(self, spec: Any) -> list[str]:
        """Its spec settings NeMo RL has no key for."""
        return []

    # ------------------------------------------------------------------ hardware

    def training_verdict(self, spec: Any, arch: str) -> tuple[str | None, dict[str, str]]:
        """``(why training cannot run on arch or None, an in-place fix)``."""
        if arch in self.row.training_archs:
            return None, {}
        return f"{self.row.te_class} training needs {_needs(self.row.training_archs)}", {}

    def training_warning(self, spec: Any, arch: str) -> str | None:
        """What training on ``arch`` needs beyond the GPU (a CUDA version), or None."""
        return None

    def generation_verdict(self, spec: Any, arch: str) -> tuple[str | None, str | None]:
        """``(why vLLM FP8 generation cannot run on arch or None, the nearest recipe)``."""
        row = self.row
        if spec.generation != "fp8" or not row.vllm_generation or arch in row.generation_archs:
            return None, None
        from .stacks import VLLM_ENGINE

        return (
            f"vLLM's {self.vllm_name} kernels need "
            f"{_needs(row.generation_archs)} (vLLM {VLLM_ENGINE} falls back to weight-only or "
            f"emulated kernels elsewhere, without an error)",
            row.generation_nearest.get(arch),
        )

    def nearest(self, spec: Any, arch: str, generates: bool) -> str | None:
        """The nearest built-in recipe that trains on ``arch`` (``generates``: the host also
        generates with it, so the replacement needs a vLLM FP8 path there too)."""
        use = (
            "rl" if generates and spec.generation == "fp8" and self.row.vllm_generation else "train"
        )
        return self.row.nearest.get((arch, use))

    def runs_training(self, spec: Any, arch: str) -> str:
        """What training runs on ``arch``, in words (it can run there)."""
        return f"{self.row.te_class} on {arch_label(arch)}"


class Delayed(Kind):
    """Delayed scaling: per-tensor scales from an amax history (TE ``DelayedScaling``)."""

    name = "delayed"

    def te_fields(self, spec: Any) -> dict[str, Any]:
        return {
            "fp8_format": _FORMAT[spec.fp8_format],
            "margin": spec.margin,
            "amax_history_len": spec.amax_history_len,
            "amax_compute_algo": spec.amax_compute_algo,
            "reduce_amax": spec.reduce_amax,
            **self._attention(spec),
        }

    def te_host_args(self, spec: Any) -> dict[str, Any]:
        return {
            "fp8_format": _FORMAT[spec.fp8_format],
            "margin": spec.margin,
            "amax_history_len": spec.amax_history_len,
            "amax_compute_algo": spec.amax_compute_algo,
        }

    def megatron_fields(self, spec: Any) -> dict[str, Any]:
        return {
            **super().megatron_fields(spec),
            "fp8_margin": spec.margin,
            "fp8_amax_history_len": spec.amax_history_len,
            "fp8_amax_compute_algo": spec.amax_compute_algo,
        }


class Tensorwise(Kind):
    """Per-tensor current scaling (TE ``Float8CurrentScaling``)."""

    name = "tensorwise"
    te_check = "scales"

    def te_fields(self, spec: Any) -> dict[str, Any]:
        return {
            "fp8_format": _FORMAT[spec.fp8_format],
            "use_power_2_scales": spec.pow2_scales,
            **self._attention(spec),
        }

    def te_quantizers(self, spec: Any) -> dict[str, dict[str, Any]]:
        return self._qparams(spec)

    def te_host_args(self, spec: Any) -> dict[str, Any]:
        return {"fp8_format": _FORMAT[spec.fp8_format], "fp8_dpa": spec.fp8_dot_product_attention}


class Block(Kind):
    """FP8 block scaling, 1x128 / 128x128 tiles (TE ``Float8BlockScaling``, DeepSeek-V3)."""

    name = "block"
    vllm_name = "block FP8"
    vllm_layout = "block FP8 (128x128 weights)"
    nemo_rl_pow2_choice = True
    nemo_rl_pack_align = 128
    te_check = "scales"

    def te_fields(self, spec: Any) -> dict[str, Any]:
        def dim(block: Any) -> int:  # TE's *_block_scaling_dim: 1 for 1x128, 2 for 128x128
            return 2 if block is not None and block[0] > 1 else 1

        return {
            "fp8_format": _FORMAT[spec.fp8_format],
            "use_f32_scales": not spec.pow2_scales,
            "x_block_scaling_dim": dim(spec.activation_block),
            "w_block_scaling_dim": dim(spec.weight_block),
            "grad_block_scaling_dim": dim(spec.gradient_block),
        }

    def te_quantizers(self, spec: Any) -> dict[str, dict[str, Any]]:
        return self._qparams(spec)

    def nemo_rl_generation(self, spec: Any, deep_gemm: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": "fp8", "use_deep_gemm": deep_gemm}
        if spec.pow2_scales:
            out.update(pow2_weight_scaling_factors=True, pow2_activation_scaling_factors=True)
        return out

    def nemo_rl_generation_guards(self, spec: Any) -> dict[str, Any]:
        off = {} if spec.pow2_scales else dict.fromkeys(_POW2, False)
        return {**off, "is_mx": False}

    def nemo_rl_unexpressible(self, spec: Any) -> list[str]:
        if (spec.activation_block, spec.weight_block, spec.gradient_block) == self.row.tiles:
            return []
        return [
            "NeMo RL: block tiles other than 1x128 activations/gradients and 128x128 "
            "weights cannot be expressed (Transformer Engine's Float8BlockScaling "
            "defaults and vLLM's weight_block_size [128, 128] are used)"
        ]

    def training_verdict(self, spec: Any, arch: str) -> tuple[str | None, dict[str, str]]:
        if arch == "blackwell" and not spec.pow2_scales:
            return (
                "on Blackwell Transformer Engine emulates block scaling with MXFP8 and "
                "needs power-of-2 scales; fp32 block scales cannot run there",
                {"pow2_scales": "true"},
            )
        return super().training_verdict(spec, arch)

    def training_warning(self, spec: Any, arch: str) -> str | None:
        if arch != "hopper":
            return None
        return (
            "block scaling on Hopper needs CUDA >= 12.9 (cuBLAS block-scaled GEMMs); "
            "`nemo-fp8 doctor` checks it"
        )

    def nearest(self, spec: Any, arch: str, generates: bool) -> str | None:
        if arch == "blackwell":
            return "fp8_subchannel"  # fp32 scales: the power-of-2 preset (or the fix in place)
        return super().nearest(spec, arch, generates)

    def runs_training(self, spec: Any, arch: str) -> str:
        if arch != "blackwell":
            return super().runs_training(spec, arch)
        return (
            f"{self.row.te_class} (power-of-2 scales), which Transformer Engine runs "
            f"with MXFP8 kernels on {arch_label(arch)}"
        )


_POW2 = ("pow2_weight_scaling_factors", "pow2_activation_scaling_factors")


class MX(Kind):
    """MXFP8: 1x32 E8M0 scales (TE ``MXFP8BlockScaling``)."""

    name = "mx"
    megatron_attention_fact = "get_fp8_recipe.mxfp8.fp8_dpa"
    megatron_attention_builds = "MXFP8BlockScaling"
    vllm_name = "MXFP8"
    vllm_layout = "MXFP8 (1x32 E8M0 scales)"
    nemo_rl_pack_align = 32
    te_check = "tiles"

    def te_fields(self, spec: Any) -> dict[str, Any]:
        return {
            "fp8_format": _FORMAT[spec.fp8_format],
            "margin": spec.margin,
            "enable_2d_quantization": spec.weight_block == (32, 32),
            **self._attention(spec),
        }

    def ddp_fields(self, spec: Any) -> dict[str, bool]:
        # megatron-core asserts fp8_param_gather for it; its optimizer warns without both
        return {
            "fp8_param_gather": spec.fp8_param,
            "reuse_grad_buf_for_mxfp8_param_ag": spec.fp8_param,
        }

    def nemo_rl_generation(self, spec: Any, deep_gemm: bool) -> dict[str, Any]:
        # NVIDIA's MXFP8 rollout keys: NeMo RL takes power-of-2 (E8M0) scales only.
        return {"precision": "fp8", "is_mx": True, **dict.fromkeys(_POW2, True)}

    def nemo_rl_unexpressible(self, spec: Any) -> list[str]:
        if spec.weight_block == (1, 32) or spec.training != "fp8":
            return []
        return [
            "NeMo RL: MXFP8 weight tiles of 32x32 cannot be expressed in fp8_cfg (1x32 is used)"
        ]

    def training_verdict(self, spec: Any, arch: str) -> tuple[str | None, dict[str, str]]:
        if arch in self.row.training_archs:
            return None, {}
        return "MXFP8 training needs Blackwell (SM100/SM103)" + (
            "; Transformer Engine refuses MXFP8 on SM 12.0+" if arch == "blackwell_sm120" else ""
        ), {}


class NVFP4(Kind):
    """NVFP4: E2M1 elements, E4M3 group scales, fp32 tensor scale (TE ``NVFP4BlockScaling``)."""

    name = "nvfp4"
    megatron_attention_fact = "get_fp4_recipe.fp8_dpa"
    megatron_attention_builds = "NVFP4BlockScaling()"
    nemo_rl_pack_align = 0  # NeMo RL's packer pads for fp8_cfg recipes only
    te_check = "nvfp4"

    def te_fields(self, spec: Any) -> dict[str, Any]:
        # FP4 elements, E4M3 block scales; FP8 attention where asked (megatron-core >= 0.17
        # passes fp8_dpa; the megatron adapter refuses it before)
        te = nvfp4_te_fields(spec)
        return {
            "fp4_format": _FORMAT[spec.fp8_format],
            "fp8_format": "E4M3",
            **te,
            **self._attention(spec),
        }

    def te_quantizers(self, spec: Any) -> dict[str, dict[str, Any]]:
        # derived by NVFP4BlockScaling.__post_init__: read back, never set
        te = nvfp4_te_fields(spec)
        rht, sr = not te["disable_rht"], not te["disable_stochastic_rounding"]
        two_d = not te["disable_2d_quantization"]

        def params(hadamard: bool, stochastic: bool, two: bool) -> dict[str, bool]:
            return {
                "random_hadamard_transform": hadamard,
                "stochastic_rounding": stochastic,
                "fp4_2d_quantization": two,
            }

        return {
            "fp4_quant_fwd_inp": params(rht, False, False),
            "fp4_quant_fwd_weight": params(False, False, two_d),
            "fp4_quant_bwd_grad": params(rht, sr, False),
        }

    def te_host_args(self, spec: Any) -> dict[str, Any]:
        return {}  # megatron-core's get_fp4_recipe: NVFP4BlockScaling()

    def megatron_fields(self, spec: Any) -> dict[str, Any]:
        # FP8 and FP4 exclude each other (TransformerConfig.__post_init__); the FP8 recipe
        # fields are inert without fp8 and left alone, but fp8_recipe (null: none)
        out: dict[str, Any] = {
            "fp8": None,
            "fp8_recipe": None,
            "fp8_param": False,
            "fp4": "e2m1",
            "fp4_recipe": self.row.megatron_recipe,
            "fp4_param": spec.fp8_param,
        }
        if spec.fp8_dot_product_attention:  # reached only where honoured (dropped settings)
            out["fp8_dot_product_attention"] = True
        return out

    def ddp_fields(self, spec: Any) -> dict[str, bool]:
        # FP4 parameters are TransformerConfig.fp4_param
        return {"fp8_param_gather": False, "reuse_grad_buf_for_mxfp8_param_ag": False}

    def nemo_rl_training(self, spec: Any, fp8_param: bool) -> dict[str, Any]:
        # fp8_cfg is FP8 only; the provider's FP4 fields come through model_overrides, which
        # NeMo RL merges before it applies fp8_cfg (left disabled: FP4 xor FP8)
        return {
            "model_overrides.fp4": "e2m1",
            "model_overrides.fp4_recipe": self.row.megatron_recipe,
            "model_overrides.fp4_param": fp8_param,
        }

    def nemo_rl_training_guards(self, spec: Any) -> dict[str, Any]:
        return {"fp8_cfg.enabled": False}

    def training_verdict(self, spec: Any, arch: str) -> tuple[str | None, dict[str, str]]:
        if arch in self.row.training_archs:
            return None, {}
        return (
            "NVFP4 training needs the Blackwell data-center GPUs (SM100/SM103: B200, GB200, "
            "B300, GB300)",
            {},
        )


KINDS: dict[str, Kind] = {k.name: k for k in (Delayed(), Tensorwise(), Block(), MX(), NVFP4())}
"""Scaling kind name -> its :class:`Kind`, in the order of the capability table."""


def kind(scaling: str) -> Kind:
    """The :class:`Kind` of a spec's ``scaling`` (KeyError for one no table knows)."""
    return KINDS[scaling]


def register_kind(new: Kind, row: RecipeCapability) -> Kind:
    """Add a scaling kind and its row (which joins
    :data:`~nemo_fp8_plugin.capabilities.CAPABILITIES`, so the spec accepts the kind); a name
    already taken is refused."""
    from .errors import RecipeRegistryError

    if new.name != row.scaling or new.name in KINDS or new.name in CAPABILITIES:
        raise RecipeRegistryError(
            f"scaling kind {new.name!r} is defined twice (or its row is another's)", key="scaling"
        )
    CAPABILITIES[new.name] = row
    KINDS[new.name] = new
    return new


# --------------------------------------------------------------------------- hardware


def hardware_problems(
    spec: _SpecLike, arch: str, sides: tuple[Side, ...] = SIDES, keys: tuple[str, ...] = ()
) -> list[HardwareProblem]:
    """What stops ``spec`` on ``arch`` (an :data:`ARCHS` name), each problem with the nearest
    recipe that runs there and the exact YAML change (:attr:`HardwareProblem.change`).

    ``sides``: the sides the config's host runs (:func:`host_sides`); a side it does not run
    is not judged, and the nearest recipe is the one for what the host does (a host that only
    trains is pointed at the training recipe docs/recipes.md names, never at vLLM's kernels).
    ``keys``: the config's request keys (:attr:`nemo_fp8_plugin.config.FP8Request.keys`); a
    config that names its recipe by one key is told the new name in that key.
    A recipe whose training and generation both fail gets one problem naming the recipe that
    trains there (its generation follows that recipe), so a config moved between GPU
    generations gets one message."""
    label = arch_label(arch)
    if not any(a.name == arch and a.fp8 for a in ARCHS):
        verbs = " and ".join({"training": "train", "generation": "generate"}[s] for s in sides)
        return [
            HardwareProblem(
                "error",
                "hardware",
                f"{label} GPUs have no FP8 tensor cores, so no FP8 (or FP4) "
                f"recipe runs there: {verbs} in BF16 (remove the FP8 request: the "
                f"precision/fp8 key) or target Ada (SM89), Hopper (SM90) or Blackwell (SM100)",
            )
        ]
    out: list[HardwareProblem] = []
    key = keys[0] if len(keys) == 1 else None

    def change_to(recipe: str | None, **fields: str) -> str:
        return _change(spec, recipe, sides=sides, key=key, **fields)

    generates = "generation" in sides
    training = spec.training == "fp8" and "training" in sides
    the = kind(spec.scaling)
    t_why, t_fix = the.training_verdict(spec, arch) if training else (None, {})
    t_near = the.nearest(spec, arch, generates) if t_why else None
    g_why, g_near = the.generation_verdict(spec, arch) if generates else (None, None)
    if t_why and g_why and not t_fix:
        change = change_to(t_near) if t_near else None
        msg = f"{spec.name} cannot run on {label}: {t_why}, and {g_why}; " + (
            f"the nearest recipe that runs there is {t_near}: `{change}`"
            if t_near
            else "no FP8 recipe runs there"
        )
        return [HardwareProblem("error", "hardware", msg, None, t_near, change)]
    if t_why:
        if t_fix and (generates or not t_near):
            # RL (the host also generates): the in-place fix keeps the end-to-end recipe's
            # formats and tiles; another recipe (fp8_subchannel's E5M2 gradients) is not the
            # RL choice (docs/recipes.md)
            fix = change_to(None, **t_fix)
            msg = f"{spec.name} cannot train on {label}: {t_why}; set `{fix}`"
            out.append(HardwareProblem("error", next(iter(t_fix)), msg, "training", spec.name, fix))
        elif t_fix:
            # a training host: the pretraining recipe docs/recipes.md names first, then the fix
            fix = change_to(None, **t_fix)
            alt = change_to(t_near)
            msg = (
                f"{spec.name} cannot train on {label}: {t_why}; use {t_near}: `{alt}` (the "
                f"pretraining recipe there), or set `{fix}`"
            )
            out.append(HardwareProblem("error", "hardware", msg, "training", t_near, alt))
        else:
            change = change_to(t_near) if t_near else None
            msg = f"{spec.name} cannot train on {label}: {t_why}; " + (
                f"the nearest recipe that trains there is {t_near}: `{change}`"
                if t_near
                else "no FP8 training recipe runs there"
            )
            out.append(HardwareProblem("error", "hardware", msg, "training", t_near, change))
    elif training and (warning := the.training_warning(spec, arch)):
        out.append(HardwareProblem("warning", "hardware", warning, "training"))
    if g_why:
        bf16 = change_to(None, generation="bf16")
        if g_near and not training:
            change = change_to(g_near)
            msg = (
                f"{spec.name} cannot generate on {label}: {g_why}; the nearest recipe that "
                f"generates there is {g_near}: `{change}`"
            )
        else:
            change = bf16 if training else None
            msg = f"{spec.name} cannot generate on {label}: {g_why}; " + (
                f"generate in BF16 there: `{change}`"
                if training
                else "no FP8 generation runs there"
            )
        out.append(
            HardwareProblem(
                "error", "hardware", msg, "generation", g_near if not training else None, change
            )
        )
    if training and spec.fp8_dot_product_attention and arch == "ada":
        out.append(
            HardwareProblem(
                "warning",
                "fp8_dot_product_attention",
                "FP8 attention kernels target Hopper and Blackwell",
            )
        )
    return out


def side_summary(spec: _SpecLike, arch: str) -> dict[str, str]:
    """What each side runs on ``arch``, in words: ``{"training": ..., "generation": ...}``."""
    the = kind(spec.scaling)
    label = arch_label(arch)
    problems = {p.side: p for p in hardware_problems(spec, arch) if p.level == "error"}
    both = problems.get(None)
    out: dict[str, str] = {}
    if spec.training != "fp8":
        out["training"] = "BF16 (training: bf16)"
    elif both or "training" in problems:
        out["training"] = f"cannot run on {label}"
    else:
        out["training"] = the.runs_training(spec, arch)
    if spec.generation != "fp8":
        out["generation"] = "BF16 (generation: bf16)"
    elif not the.row.vllm_generation:
        out["generation"] = (
            f"BF16: vLLM has no FP8 path for {spec.scaling} scaling here (block FP8 and MXFP8 only)"
        )
    elif both or "generation" in problems:
        out["generation"] = f"cannot run on {label}"
    else:
        out["generation"] = f"vLLM {the.vllm_layout} on {label}"
    return out
