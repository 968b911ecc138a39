"""NeMo RL's own defaults for the keys the adapter writes, and the reader of a config already
FP8 in NeMo RL's keys (``NeMoRLAdapter.default`` / ``NeMoRLAdapter.read_native``).

NeMo RL does not install from a package index, so its defaults are recorded here from its
source (commit 7ea279a): ``vllm_cfg.get(NAME, DEFAULT)`` in
``nemo_rl/models/generation/vllm/quantization/fp8.py`` and the field defaults of
``ClippedPGLossConfig`` in ``nemo_rl/algorithms/loss/loss_functions.py``;
``tests/hosts/nemo_rl/test_nemo_rl_native.py`` reads both files of the source snapshot with
:mod:`ast` and compares. ``kv_cache_dtype`` has no default there (``vllm_cfg["kv_cache_dtype"]``):
it is always written where the config lacks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ...capabilities import CAPABILITIES, ENV_BLOCK_FP32_SCALES, ENV_CURRENT_POW2_SCALES
from ...errors import FP8ConfigError, format_value
from .. import NO_DEFAULT, HostContext, NativeRecipe
from .releases import assumed_release
from .spelling import ROUTER_REPLAY, SEQUENCE_ERROR

__all__ = ["VLLM_CFG_DEFAULTS", "LOSS_DEFAULTS", "REQUIRED", "key_default", "read_native"]

_MEGATRON = "policy.megatron_cfg"
_VLLM = "policy.generation.vllm_cfg"

VLLM_CFG_DEFAULTS: dict[str, Any] = {
    "num_first_layers_in_bf16": 0,
    "num_last_layers_in_bf16": 0,
    "quantization_ignored_layer_kws": [],
}
"""``policy.generation.vllm_cfg`` key -> the default NeMo RL's FP8 path reads it with.
``use_deep_gemm`` (default false there) is left out on purpose: it is the kernel switch a
Blackwell target must state off, so it is always written."""

LOSS_DEFAULTS: dict[str, Any] = {
    "use_importance_sampling_correction": False,
    "sequence_level_importance_ratios": False,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
}
"""``loss_fn`` key -> its ``ClippedPGLossConfig`` default."""


REQUIRED = (f"{_VLLM}.kv_cache_dtype",)
"""Keys NeMo RL's FP8 path reads without a default (``init_fp8``: ``vllm_cfg["kv_cache_dtype"]``;
a required field of its ``VllmConfig``): written where no file of the chain sets them, even
with the value that means "off"."""


def key_default(key: str) -> Any:
    """What NeMo RL does with the dotted ``key`` when no file of the chain sets it."""
    parent, _, leaf = key.rpartition(".")
    table = {_VLLM: VLLM_CFG_DEFAULTS, "loss_fn": LOSS_DEFAULTS}.get(parent, {})
    return table.get(leaf, NO_DEFAULT)


def read_native(ctx: HostContext) -> NativeRecipe | None:
    """The recipe NeMo RL's own keys (``fp8_cfg`` / ``model_overrides`` FP4 fields for
    training, ``vllm_cfg.precision`` for generation, ``loss_fn`` importance sampling) spell,
    or None when neither side is FP8."""
    from ..native import match_recipe, scaling_for_megatron_recipe
    from .values import resolved_value

    def value(key: str, default: Any = None) -> Any:
        return _typed(key, resolved_value(ctx.resolved, key, default))

    release = assumed_release(ctx)
    read: list[tuple[str, Any]] = []
    unmatched: list[str] = []
    ignored: list[str] = []
    fields: dict[str, Any] = {}
    training = None
    if value(f"{_MEGATRON}.fp8_cfg.enabled") is True:
        recipe = value(f"{_MEGATRON}.fp8_cfg.fp8_recipe")
        training = scaling_for_megatron_recipe(recipe)
        read += [(f"{_MEGATRON}.fp8_cfg.fp8_recipe", recipe)]
        fields["fp8_format"] = value(f"{_MEGATRON}.fp8_cfg.fp8", "e4m3")
        fields["fp8_param"] = bool(value(f"{_MEGATRON}.fp8_cfg.fp8_param", False))
        if training is None or CAPABILITIES[training].history:
            unmatched.append(
                f"{_MEGATRON}.fp8_cfg.fp8_recipe: {recipe!r}: NeMo RL trains no recipe of ours "
                f"with it (delayed scaling goes stale when the weights change every step)"
            )
            training = None
    elif value(f"{_MEGATRON}.model_overrides.fp4_recipe") is not None and value(
        f"{_MEGATRON}.model_overrides.fp4"
    ):
        recipe = value(f"{_MEGATRON}.model_overrides.fp4_recipe")
        key = f"{_MEGATRON}.model_overrides.fp4_recipe"
        if not _ignored(key, recipe, release, "training runs in BF16", ignored):
            training = scaling_for_megatron_recipe(recipe)
            read += [(key, recipe)]
            fields["fp8_param"] = bool(value(f"{_MEGATRON}.model_overrides.fp4_param", False))
    generation = _generation(value, read, fields, release, ignored)
    if training is None and generation is None:
        if not unmatched and not ignored:
            return None
        return NativeRecipe(
            "nemo-rl", None, tuple(read), unmatched=tuple(unmatched), ignored=tuple(ignored)
        )
    if training is not None and generation is not None and training != generation:
        unmatched.append(
            f"training in {training} scaling and generation in {generation}: no recipe of ours "
            f"is both, and the rollouts do not run the training's scale grid"
        )
        return NativeRecipe(
            "nemo-rl", None, tuple(read), unmatched=tuple(unmatched), ignored=tuple(ignored)
        )
    scaling = training or generation
    assert scaling is not None
    fields["training"] = "fp8" if training else "bf16"
    fields["generation"] = "fp8" if generation else "bf16"
    _training_env(value, scaling, fields, read, training is not None)
    _layers(value, fields, training is not None, generation is not None, release, ignored)
    _importance_sampling(value, fields, read, release)
    _sequence_error(value, fields, read, unmatched)
    if value(ROUTER_REPLAY) is True:
        read.append((ROUTER_REPLAY, True))
        fields["router_replay"] = True
    found = match_recipe("nemo-rl", scaling, fields, read=read, unmatched=unmatched)
    return dataclasses.replace(found, ignored=tuple(ignored))


_FLAGS = frozenset(
    {
        f"{_MEGATRON}.fp8_cfg.enabled",
        f"{_MEGATRON}.fp8_cfg.fp8_param",
        f"{_MEGATRON}.model_overrides.first_last_layers_bf16",
        f"{_VLLM}.is_mx",
        f"{_VLLM}.pow2_weight_scaling_factors",
        "loss_fn.use_importance_sampling_correction",
        "loss_fn.sequence_level_importance_ratios",
        ROUTER_REPLAY,
    }
)
"""The switches the reader reads: NeMo RL tests them for truth, so ``"yes please"`` would be
on there; read here only as true or false (or unset), anything else refused."""

_NAMES = frozenset({f"{_VLLM}.precision", f"{_VLLM}.kv_cache_dtype"})
"""The keys read as names (a string; unset: the default)."""


def _typed(key: str, got: Any) -> Any:
    """``got`` at ``key`` when it has the type the reader reads it as, else a one-line
    refusal naming the key: a malformed key is the user's mistake, never read as a default."""
    if got is None:
        return got
    if key in _FLAGS and not isinstance(got, bool):
        raise FP8ConfigError(
            f"is {format_value(got)}: must be true or false",
            key=key,
            value=got,
            hint="write true or false, or remove it",
        )
    if key in _NAMES and not isinstance(got, str):
        raise FP8ConfigError(
            f"is {format_value(got)}: must be a name (a string)",
            key=key,
            value=got,
            hint="e.g. fp8 or auto" if key.endswith("kv_cache_dtype") else "e.g. fp8 or bfloat16",
        )
    return got


def _ignored(key: str, got: Any, release: str, instead: str, ignored: list[str]) -> bool:
    """Whether NeMo RL ``release`` does not read ``key`` (:data:`nemo_fp8_plugin.stacks.FACTS`);
    if so, the line that says it and what runs ``instead`` is added to ``ignored``: the key is
    left out of the reading, as the release leaves it out of the run."""
    from ...stacks import lookup, nemo_rl_key_fact, release_label

    row = nemo_rl_key_fact(key)
    if row is None or lookup("nemo-rl", row.name, release).present is not False:
        return False
    shown = "true" if got is True else format_value(got)
    ignored.append(
        f"{key}: {shown} is not read by {release_label(release)} (it is in: "
        f"{row.versions.label}): {instead}"
    )
    return True


def _sequence_error(
    value: Callable[..., Any], fields: dict[str, Any], read: list, unmatched: list
) -> None:
    """GRPO's sequence masking (``grpo.seq_logprob_error_threshold``) as
    ``importance_sampling.max_sequence_error``; a threshold no recipe takes (below 1.0: every
    sequence that differs at all, and more, leaves the loss; not a number) is named instead."""
    got = value(SEQUENCE_ERROR)
    if got is None:
        return
    read.append((SEQUENCE_ERROR, got))
    number = isinstance(got, (int, float)) and not isinstance(got, bool)
    if number and 1.0 <= got < float("inf"):
        fields["importance_sampling"]["max_sequence_error"] = float(got)
        return
    unmatched.append(
        f"{SEQUENCE_ERROR}: {got!r}: a sequence's error, the mean of exp(|gen - train|), is 1.0 "
        f"where the two agree; no recipe of ours masks at a threshold that is not a number "
        f"of at least 1.0"
    )


def _generation(
    value: Callable[..., Any], read: list, fields: dict[str, Any], release: str, ignored: list
) -> str | None:
    precision = value(f"{_VLLM}.precision")
    if not (isinstance(precision, str) and precision.lower().startswith("fp8")):
        return None
    read.append((f"{_VLLM}.precision", precision))
    mx = value(f"{_VLLM}.is_mx") is True and not _ignored(
        f"{_VLLM}.is_mx",
        True,
        release,
        "its FP8 rollouts are 128x128 block FP8 (fp32 block scales), not MXFP8",
        ignored,
    )
    if mx:
        read.append((f"{_VLLM}.is_mx", True))
    # the kind NeMo RL's vLLM path generates: E8M0 (MX) scales when is_mx, else fp32 block ones
    kind = next(
        k
        for k, row in CAPABILITIES.items()
        if row.nemo_rl_generation and (row.scale_format == "e8m0") == mx
    )
    if not mx:  # MXFP8's E8M0 scales are powers of two whatever the key says
        fields["pow2_scales"] = value(f"{_VLLM}.pow2_weight_scaling_factors") is True
    kv = value(f"{_VLLM}.kv_cache_dtype", "auto")
    fields["kv_cache"] = "fp8" if isinstance(kv, str) and kv.startswith("fp8") else "auto"
    if fields["kv_cache"] == "fp8":
        read.append((f"{_VLLM}.kv_cache_dtype", kv))
    return kind


def _training_env(
    value: Callable[..., Any], scaling: str, fields: dict, read: list, training: bool
) -> None:
    """Power-of-2 scales on the training side: the TE variable NeMo RL's env_vars pin."""
    if not training:
        return
    row = CAPABILITIES[scaling]
    var = row.te_env
    got = value(f"{_MEGATRON}.env_vars.{var}") if var else None
    if got is None:
        return
    read.append((f"{_MEGATRON}.env_vars.{var}", got))
    if var == ENV_BLOCK_FP32_SCALES:
        fields["pow2_scales"] = str(got).strip() == "0"
    elif var == ENV_CURRENT_POW2_SCALES:
        fields["pow2_scales"] = str(got).strip() == "1"


def _layers(
    value: Callable[..., Any],
    fields: dict[str, Any],
    training: bool,
    generation: bool,
    release: str,
    ignored: list,
) -> None:
    """First/last BF16 layers (vLLM's counts, else the training overrides) and the module
    keywords vLLM keeps unquantized, as ``bf16_layers``."""
    rules: dict[str, Any] = {"first": 0, "last": 0}
    if generation:
        rules["first"] = _layer_count(value, f"{_VLLM}.num_first_layers_in_bf16", 0)
        rules["last"] = _layer_count(value, f"{_VLLM}.num_last_layers_in_bf16", 0)
        kws = value(f"{_VLLM}.quantization_ignored_layer_kws", []) or []
        if isinstance(kws, (list, tuple)) and kws:
            rules["modules"] = [f"*{kw}*" for kw in kws]
    elif (
        training
        and value(f"{_MEGATRON}.model_overrides.first_last_layers_bf16") is True
        and not _ignored(
            f"{_MEGATRON}.model_overrides.first_last_layers_bf16",
            True,
            release,
            "every training layer runs the recipe, none in BF16",
            ignored,
        )
    ):
        start, end = (
            f"{_MEGATRON}.model_overrides.num_layers_at_{w}_in_bf16" for w in ("start", "end")
        )
        rules["first"] = _layer_count(value, start, 1)
        rules["last"] = _layer_count(value, end, 1)
    fields["bf16_layers"] = rules


def _layer_count(value: Callable[..., Any], key: str, default: int) -> int:
    """A layer count as NeMo RL uses it (a range bound: a whole number >= 0), or a one-line
    refusal naming the key (``abc``, ``.inf``, ``[1]``, ``1.5`` are none)."""
    got = value(key, default)
    if got is None:
        return default
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        raise FP8ConfigError(
            "must be a whole number of layers (0 or more)",
            key=key,
            value=got,
            hint="write a count such as 0, 1 or 2",
        )
    return got


def _importance_sampling(
    value: Callable[..., Any], fields: dict[str, Any], read: list, release: str | None
) -> None:
    from .releases import TRUNCATION_KEYS, truncation

    enabled = value("loss_fn.use_importance_sampling_correction") is True
    if enabled:
        read.append(("loss_fn.use_importance_sampling_correction", True))
    block: dict[str, Any] = {"enabled": enabled}
    if enabled:
        block["level"] = (
            "sequence" if value("loss_fn.sequence_level_importance_ratios") is True else "token"
        )
        # read as the release reads them: at v0.6.0 a type without a ratio is inert
        kind, high, low = truncation({k: value(k) for k in TRUNCATION_KEYS}, release)
        block["truncation"] = kind
        if kind is not None:
            high = _ratio(TRUNCATION_KEYS[1], high, positive=True)
            low = _ratio(TRUNCATION_KEYS[2], low, positive=False)
            block["ratio_max"] = high
            # the spelling writes 1 / ratio_max for icepop and seq-mask-tis when none is given
            symmetric = low is not None and low == 1.0 / high
            windowed = kind in ("icepop", "seq-mask-tis")
            block["ratio_min"] = None if (low is None or (windowed and symmetric)) else low
    fields["importance_sampling"] = block


def _ratio(key: str, got: Any, *, positive: bool) -> Any:
    """A truncation ratio as NeMo RL asserts it: a finite number, > 0 for the upper one (its
    ``ClippedPGLossFn`` stops otherwise), >= 0 or unset for the lower one."""
    if got is None and not positive:
        return None
    number = isinstance(got, (int, float)) and not isinstance(got, bool)
    if (
        number
        and got == got
        and abs(got) != float("inf")
        and (got > 0 or (got >= 0 and not positive))
    ):
        return float(got)
    raise FP8ConfigError(
        f"must be a {'positive' if positive else 'non-negative'} number with truncated "
        f"importance sampling on (NeMo RL's loss asserts it at start-up)",
        key=key,
        value=got,
        hint="set a ratio such as 2.0, or turn truncation off (type: null)",
    )
