"""KV-cache and Q scales for FP8 attention in vLLM, recalibrated on the trainer every RL step.

An FP8 KV cache stores ``k / k_scale`` and ``v / v_scale`` (E4M3) and FP8 attention also
quantizes ``q / q_scale``; the scales are per attention layer, one fp32 scalar each. In RL
the weights move every step, so the activations move too and the scales must follow.
NeMo RL recalibrates them on the trainer after each step and ships them with the weights;
this module does the same, framework-neutrally.

**Convention** (NeMo RL's ``calibrate_qkv_fp8_scales``, which vLLM's attention consumes):

* Observation: the q, k, v tensors that enter the attention kernel (after the projections,
  q/k norms and RoPE; exactly what goes into the KV cache), captured per layer. Each forward
  call of a layer gives one sample, ``amax = max |k|`` over the whole tensor (``sample="batch"``,
  the default, as NeMo RL); ``sample="token"`` gives one sample per token instead (the max
  over heads and head dim), which lets the percentile clip outlier tokens.
* Percentile: nearest rank over the samples, ``sorted[round(p/100 * (n-1))]`` with ``p``
  = ``percentile`` (default 99.9; with a handful of batch samples that is their max).
* Scale: ``scale = amax_p * margin / 448`` (``margin`` default 1.05; 448 = E4M3's largest
  value), so ``amax_p * margin`` maps to the top of the E4M3 range. vLLM divides by it when
  writing the cache and multiplies when reading. A layer whose samples are all zero gets
  1.0 (vLLM reads a scale <= 0 as "missing").
* Names: vLLM's own parameter names, ``<attention module>.attn.{q,k,v}_scale`` with the
  attention module in Hugging Face naming (``model.layers.3.self_attn.attn.k_scale``). vLLM
  0.32 loads exactly these in every loader: ``AutoWeightsLoader`` models (Llama, Qwen2/3,
  Qwen3-MoE, Mixtral) leave a name that already has ``.attn`` alone (the quantization
  config's cache-scale mapper only adds it to ``...self_attn.{q,k,v}_scale``, and only when
  the model has a quantization config), and ``maybe_remap_kv_scale_name`` (DeepSeek-V2/V3's
  loop) returns a name that is a model parameter unchanged. NeMo RL writes
  ``...self_attn.{k,v}_scale`` and ``...self_attn.attn.q_scale``, which land on the same
  parameters. The ``nemo_fp8`` method keeps those parameters loadable across refits.
  Megatron names (``decoder.layers.3.self_attention``) map to the same Hugging Face names.
* Layer numbers are global. Under pipeline parallelism each stage's ``decoder.layers.<i>``
  counts from 0, so the calibrator takes the layer's global number from megatron-core's own
  ``TransformerLayer.layer_number`` (1-based, ``local + get_transformer_layer_offset(...)``,
  virtual stages included; the core attention's ``layer_number`` where the layer has none),
  or from ``layer_offset=`` for models that do not carry one. Every stage then names its
  layers as the unsplit model does, and the max-merge across ranks never mixes two layers.

**Where the hooks go**: megatron-core's core attention (``DotProductAttention`` /
``TEDotProductAttention`` or a subclass, a forward pre-hook on ``(query, key, value, ...)``, as
NeMo RL does) and Hugging Face attention modules (any module that calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``: the calibrator registers a
recording wrapper around that implementation through transformers' ``AttentionInterface``
and switches the model to it while attached). Any other attention kernel module can opt in:
a module whose class sets ``nemo_fp8_qkv_layout = "bhsd"`` (``[batch, heads, seq,
head_dim]``) or ``"sbhd"`` (megatron-core's) gets the same forward pre-hook on its first three
inputs (q, k, v). Such a module plays vLLM's ``Attention`` layer (``self_attn.attn``): its
scales are named after its parent, so ``model.layers.0.self_attn.attn`` gives
``model.layers.0.self_attn.attn.k_scale``.

Two ways to use it:

* ``refresh_scales(model, forward=lambda: model(batch))``: after an optimizer step, one
  calibration forward without gradients on the updated weights; returns the scales (with
  its wall time), ready to append to the refit payload.
* ``KVScaleCalibrator(model).attach()``: hooks stay on during the step's own forward
  passes (no extra forward) and ``refresh_scales(model)`` turns what they saw into scales.
  These describe the weights before the optimizer step, one step stale.

Over 600 lines on purpose: calibration, vLLM's scale names and the per-step refresh are one
protocol with vLLM's attention layers.
"""

from __future__ import annotations

import re
import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..errors import FP8ConfigError, format_value
from ..numerics.formats import E4M3_MAX

_PreHook = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None]
"""A forward pre-hook with keyword arguments (``register_forward_pre_hook(with_kwargs=True)``)."""

__all__ = [
    "KVScaleCalibrator",
    "ScaleUpdate",
    "refresh_scales",
    "nearest_rank_percentile",
    "vllm_attention_name",
    "vllm_scale_name",
    "merge_max",
    "FP8_E4M3_MAX",
]

FP8_E4M3_MAX = E4M3_MAX
"""Largest finite E4M3 value (448, from ``torch.finfo``: :data:`nemo_fp8_plugin.numerics.formats.E4M3_MAX`): ``amax_p * margin``
maps onto it."""

_MCORE_ATTENTION = ("DotProductAttention", "TEDotProductAttention")
_MEGATRON_LAYER = re.compile(
    r"^(?:.*?\.)?decoder\.layers\.(\d+)\.self_attention(?:\.core_attention)?$"
)
# The last ``layers.<i>`` of a module name: the transformer layer index.
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")
_ROLES = ("q", "k", "v")
# nemo_fp8_qkv_layout -> the heads and head_dim dimensions of its q, k, v.
_CORE_LAYOUTS = {"bhsd": (1, 3), "sbhd": (2, 3)}
_WRAPPER_PREFIX = "nemo_fp8_kv_calibration:"

# Calibrators currently attached, by model (refresh_scales(model) finds them here).
_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, KVScaleCalibrator] = (
    weakref.WeakKeyDictionary()
)


def vllm_attention_name(module_name: str) -> str:
    """The Hugging Face name of an attention module (what vLLM's loader maps scales from).

    ``decoder.layers.3.self_attention.core_attention`` (megatron-core, any wrapper prefix)
    -> ``model.layers.3.self_attn``; Hugging Face names pass through.
    """
    found = _MEGATRON_LAYER.match(module_name)
    if found:
        return f"model.layers.{found.group(1)}.self_attn"
    return module_name


def vllm_scale_name(attention: str, role: str) -> str:
    """vLLM's parameter name of a scale: ``<attention module>.attn.<role>_scale``
    (``model.layers.3.self_attn`` and ``k`` -> ``model.layers.3.self_attn.attn.k_scale``)."""
    return f"{attention}.attn.{role}_scale"


def nearest_rank_percentile(values: torch.Tensor, percentile: float) -> torch.Tensor:
    """``sorted(values)[round(p/100 * (n-1))]`` (NeMo RL's rule), as a 0-d fp32 tensor."""
    flat = values.reshape(-1).float()
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    rank = int(round(percentile / 100.0 * (flat.numel() - 1)))
    rank = max(0, min(flat.numel() - 1, rank))
    return torch.sort(flat).values[rank]


class ScaleUpdate(dict[str, torch.Tensor]):
    """``{name: 0-d fp32 tensor}`` from :func:`refresh_scales`, plus how it was obtained.

    Attributes:
        seconds: wall time of the refresh (calibration forward included, when one ran).
        amax: ``{name: the percentile amax before margin}``, for logging.
        samples: number of samples per layer and role (``{"model.layers.0.self_attn.k": n}``).
    """

    def __init__(
        self,
        *args: Any,
        seconds: float = 0.0,
        amax: dict | None = None,
        samples: dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = seconds
        self.amax = amax or {}
        self.samples = samples or {}


def _check_float(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise FP8ConfigError(
            f"expected a number in [{lo}, {hi}], got {format_value(value)}", key=name, value=value
        )
    return float(value)


class KVScaleCalibrator:
    """Per-layer amax of q, k, v -> the ``q_scale`` / ``k_scale`` / ``v_scale`` vLLM expects.

    Args:
        model: a megatron-core or Hugging Face transformers model (or any module holding
            such attention modules).
        percentile: nearest-rank percentile of the per-layer amax samples, in [0, 100].
            Default 99.9 (NeMo RL).
        margin: factor on the percentile amax, >= 1 leaves headroom. Default 1.05 (NeMo RL).
        include_q: also produce ``q_scale`` (FP8 attention reads it; an FP8 KV cache alone
            needs only k and v). Default True.
        sample: ``"batch"`` (default): one amax per layer per forward call (NeMo RL);
            ``"token"``: one per token (max over heads and head dim).
        fp8_max: the format's largest value. Default 448 (E4M3).
        name_map: module name (with the global layer index, see ``layer_offset``) -> the
            Hugging Face attention module name the scales are named after (the calibrator
            appends ``.attn.<role>_scale``, :func:`vllm_scale_name`). Default
            :func:`vllm_attention_name`.
        layer_offset: global index of this model's first layer, for a pipeline stage whose
            layers do not carry megatron-core's global ``layer_number`` (a hand-split model):
            ``layers.<i>`` becomes ``layers.<i + layer_offset>``. Default None: megatron-core
            layers use their ``layer_number`` (global under pipeline and virtual-pipeline
            parallelism), other models their own index.
        process_group: when ``torch.distributed`` is initialized with more than one rank,
            each rank's percentile amax is merged with the others' by max over this group
            (default: the default group), as NeMo RL does: tensor-parallel ranks see
            different heads, pipeline ranks different layers (named by their global
            number), data-parallel ranks different batches.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = True,
        sample: str = "batch",
        fp8_max: float = FP8_E4M3_MAX,
        name_map: Callable[[str], str] | None = None,
        layer_offset: int | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise FP8ConfigError(
                f"expected a torch.nn.Module, got {format_value(model)}", key="model"
            )
        self.model = model
        self.percentile = _check_float("percentile", percentile, 0.0, 100.0)
        self.margin = _check_float("margin", margin, 1e-6, 1e6)
        self.fp8_max = _check_float("fp8_max", fp8_max, 1e-6, 1e38)
        if sample not in ("batch", "token"):
            raise FP8ConfigError(
                f"expected 'batch' or 'token', got {format_value(sample)}",
                key="sample",
                value=sample,
            )
        self.sample = sample
        if not isinstance(include_q, bool):  # "false" is a mistake, not True
            raise FP8ConfigError(
                f"expected True or False, got {format_value(include_q)}",
                key="include_q",
                value=include_q,
            )
        self.include_q = include_q
        self.name_map = name_map or vllm_attention_name
        if layer_offset is not None and (
            isinstance(layer_offset, bool) or not isinstance(layer_offset, int) or layer_offset < 0
        ):
            raise FP8ConfigError(
                f"expected a layer index >= 0, got {format_value(layer_offset)}",
                key="layer_offset",
                value=layer_offset,
            )
        self.layer_offset = layer_offset
        self.process_group = process_group
        self._samples: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self._handles: list[Any] = []
        self._hf_configs: list[tuple[Any, str]] = []
        self._layers = self._find_layers()
        self.last_seconds = 0.0
        """Wall time of the last :meth:`scales` / :meth:`calibrate` (calibration forward
        included)."""

    # ------------------------------------------------------------------ discovery

    def _find_layers(self) -> dict[torch.nn.Module, tuple[str, str]]:
        """attention module -> (kind, scale-name prefix)."""
        found: dict[torch.nn.Module, tuple[str, str]] = {}
        modules = dict(self.model.named_modules())
        owner: dict[str, str] = {}
        for name, module in modules.items():
            _refuse_latent_attention(name, module, modules)
            # Subclasses count (custom core attentions plug in through the layer spec).
            if any(c.__name__ in _MCORE_ATTENTION for c in type(module).__mro__):
                kind = "mcore"
            elif (
                hasattr(module, "k_proj")
                and hasattr(module, "v_proj")
                and hasattr(getattr(module, "config", None), "_attn_implementation")
            ):
                kind = "hf"
            elif getattr(type(module), "nemo_fp8_qkv_layout", None) in _CORE_LAYOUTS:
                kind = "core"
            else:
                continue
            # vLLM's Attention layer is <attention module>.attn; the scales are named after
            # the attention module (vllm_scale_name adds the .attn back)
            scale_owner = (
                name[: -len(".attn")] if kind == "core" and name.endswith(".attn") else name
            )
            prefix = self.name_map(self._global_name(scale_owner, module, kind, modules))
            if prefix in owner:
                raise FP8ConfigError(
                    f"attention modules {owner[prefix]!r} and {name!r} both name their scales "
                    f"{prefix!r}",
                    key="name_map" if self.name_map is not vllm_attention_name else "model",
                    hint="each layer needs its own global number: pass "
                    "layer_offset or a name_map that tells them apart",
                )
            owner[prefix] = name
            found[module] = (kind, prefix)
        if not found:
            raise FP8ConfigError(
                f"no attention module found in {type(self.model).__name__}: the calibrator hooks "
                f"megatron-core core attention ({', '.join(_MCORE_ATTENTION)}) and Hugging Face "
                f"attention modules (k_proj, v_proj, config._attn_implementation), or a module "
                f"whose class sets nemo_fp8_qkv_layout ('bhsd' or 'sbhd')",
                key="model",
            )
        return found

    def _global_name(
        self, name: str, module: torch.nn.Module, kind: str, modules: dict[str, torch.nn.Module]
    ) -> str:
        """``name`` with its layer index made global (see the ``layer_offset`` argument)."""
        found = list(_LAYER_INDEX.finditer(name))
        if not found:
            return name
        last = found[-1]
        local = int(last.group(1))
        if self.layer_offset is not None:
            index = local + self.layer_offset
        elif kind == "mcore":
            # megatron-core: TransformerLayer.layer_number = local + 1 + the stage's offset
            # (get_transformer_layer_offset); core attention gets the same number.
            layer = modules.get(name[: last.end()].lstrip("."))
            number = _layer_number(layer)
            if number is None:
                number = _layer_number(module)
            index = local if number is None else number - 1
        else:
            index = local
        start = last.start(1)
        return f"{name[:start]}{index}{name[last.end(1) :]}"

    @property
    def layer_names(self) -> list[str]:
        """Scale-name prefixes of the attention layers found, in model order."""
        return [name for _, name in self._layers.values()]

    # ------------------------------------------------------------------ recording

    def _record(
        self,
        layer: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        heads_dims: tuple[int, ...],
    ) -> None:
        for role, t in zip(_ROLES, (q, k, v)):
            if role == "q" and not self.include_q:
                continue
            t = t.detach()
            if self.sample == "batch":
                amax = t.abs().amax().float().reshape(1)
            else:
                amax = t.abs().amax(dim=heads_dims).float().reshape(-1)
            self._samples[layer][role].append(amax)

    def _mcore_hook(self, layer: str) -> _PreHook:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            named = [kwargs.get(n) for n in ("query", "key", "value")]
            q, k, v = (list(args[:3]) + named[len(args[:3]) :])[:3]
            # megatron-core core attention tensors are [seq, batch, heads, head_dim].
            self._record(layer, q, k, v, (2, 3))

        return hook

    def _core_hook(self, layer: str, heads_dims: tuple[int, ...]) -> _PreHook:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            named = [kwargs.get(n) for n in ("q", "k", "v")]
            q, k, v = (list(args[:3]) + named[len(args[:3]) :])[:3]
            self._record(layer, q, k, v, heads_dims)

        return hook

    def attach(self) -> KVScaleCalibrator:
        """Install the hooks; they record every forward call until :meth:`detach`."""
        if self._handles or self._hf_configs:
            return self
        hf_configs: dict[int, Any] = {}
        for module, (kind, layer) in self._layers.items():
            if kind == "mcore":
                self._handles.append(
                    module.register_forward_pre_hook(self._mcore_hook(layer), with_kwargs=True)
                )
            elif kind == "core":
                layout_class: Any = type(module)  # sets nemo_fp8_qkv_layout (_find_layers)
                dims = _CORE_LAYOUTS[layout_class.nemo_fp8_qkv_layout]
                self._handles.append(
                    module.register_forward_pre_hook(self._core_hook(layer, dims), with_kwargs=True)
                )
            else:
                hf_attention: Any = module  # a Hugging Face attention module and its config
                hf_attention._nemo_fp8_kv_record = (weakref.ref(self), layer)
                hf_configs[id(hf_attention.config)] = hf_attention.config
        for config in hf_configs.values():
            base = config._attn_implementation or "eager"
            if base.startswith(_WRAPPER_PREFIX):
                raise FP8ConfigError(
                    "another KV-scale calibrator is attached to this model",
                    key="model",
                    hint="detach it first",
                )
            config._attn_implementation = _hf_wrapper_name(base)
            self._hf_configs.append((config, base))
        _ATTACHED[self.model] = self
        return self

    def detach(self) -> None:
        """Remove the hooks (samples are kept until :meth:`reset`)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for config, base in self._hf_configs:
            config._attn_implementation = base
        self._hf_configs.clear()
        for module, (kind, _) in self._layers.items():
            if kind == "hf" and hasattr(module, "_nemo_fp8_kv_record"):
                del module._nemo_fp8_kv_record
        if _ATTACHED.get(self.model) is self:
            del _ATTACHED[self.model]

    def __enter__(self) -> KVScaleCalibrator:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget the recorded samples."""
        self._samples.clear()

    # ------------------------------------------------------------------ results

    def observed(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{layer: {"q"|"k"|"v": all amax samples (1-D fp32)}}`` recorded since the last reset."""
        return {
            layer: {
                role: torch.cat([s.to("cpu") for s in samples]) for role, samples in roles.items()
            }
            for layer, roles in self._samples.items()
        }

    def scales(self, *, reset: bool = True) -> ScaleUpdate:
        """The scales from the samples so far (and forget them unless ``reset=False``)."""
        start = time.perf_counter()
        out, amaxes, counts = {}, {}, {}
        missing = [layer for layer in self.layer_names if layer not in self._samples]
        if len(missing) == len(self.layer_names):
            raise FP8ConfigError(
                "no q/k/v observed yet: run a forward pass with the calibrator "
                "attached, or pass forward= to refresh_scales",
                key="model",
            )
        for layer, roles in self._samples.items():
            for role in _ROLES:
                if role not in roles:
                    continue
                samples = torch.cat(roles[role])
                amaxes[vllm_scale_name(layer, role)] = float(
                    nearest_rank_percentile(samples, self.percentile)
                )
                counts[f"{layer}.{role}"] = int(samples.numel())
        amaxes = _max_across_ranks(amaxes, self.process_group)
        for key, amax in amaxes.items():
            scale = torch.tensor(amax, dtype=torch.float32) * self.margin / self.fp8_max
            # A zero amax leaves any scale exact; vLLM reads <= 0 as "missing".
            out[key] = scale if scale > 0 else torch.ones((), dtype=torch.float32)
        if reset:
            self.reset()
        seconds = time.perf_counter() - start
        self.last_seconds = seconds
        return ScaleUpdate(out, seconds=seconds, amax=amaxes, samples=counts)

    @torch.no_grad()
    def calibrate(self, forward: Callable[[], Any]) -> ScaleUpdate:
        """Reset, run ``forward()`` (no gradients) with the hooks on, return the scales."""
        start = time.perf_counter()
        was_attached = bool(self._handles or self._hf_configs)
        self.reset()
        self.attach()
        try:
            forward()
        finally:
            if not was_attached:
                self.detach()
        result = self.scales()
        result.seconds = time.perf_counter() - start
        self.last_seconds = result.seconds
        return result

    def as_step_hook(
        self, forward: Callable[[Any], Any] | None = None
    ) -> Callable[[Any, Any], ScaleUpdate]:
        """A ``hook(trainer_or_context, module)`` for the training callbacks' after-optimizer-step
        slot (:mod:`nemo_fp8_plugin.hosts.refresh`): calibrates with ``forward(module)`` when given,
        else turns the samples the attached hooks saw during the step into scales. The last
        result is kept in ``self.last_update``."""
        self.last_update: ScaleUpdate | None = None

        def hook(_context: Any, module: Any) -> ScaleUpdate:
            if forward is not None:
                update = self.calibrate(lambda: forward(module))
            else:
                update = self.scales()
            self.last_update = update
            return update

        return hook


def refresh_scales(
    model: torch.nn.Module,
    forward: Callable[[], Any] | None = None,
    *,
    calibrator: KVScaleCalibrator | None = None,
    percentile: float = 99.9,
    margin: float = 1.05,
    include_q: bool = True,
    sample: str = "batch",
    layer_offset: int | None = None,
    process_group: Any = None,
) -> ScaleUpdate:
    """Fresh ``{q,k,v}_scale`` tensors for every attention layer of ``model``.

    Call after each optimizer step. With ``forward`` (a zero-argument callable running the
    model on a calibration batch) it runs that forward without gradients on the updated
    weights. Without it, it uses the samples recorded since the last refresh by the
    calibrator attached to ``model`` (``KVScaleCalibrator(model).attach()``), and raises
    :class:`~nemo_fp8_plugin.errors.FP8ConfigError` when there is none.

    Returns a :class:`ScaleUpdate`: ``{name: 0-d fp32 tensor}`` named as vLLM's parameters
    (``model.layers.<global i>.self_attn.attn.{q,k,v}_scale``), with
    ``.seconds`` (its wall time, to report per step), ``.amax`` and ``.samples``. Append its
    items to the refit payload: ``payload + list(update.items())``.
    """
    if not isinstance(model, torch.nn.Module):
        raise FP8ConfigError(f"expected a torch.nn.Module, got {format_value(model)}", key="model")
    if forward is not None and not callable(forward):
        raise FP8ConfigError(
            f"expected a zero-argument function or None, got {format_value(forward)}", key="forward"
        )
    if calibrator is not None and not isinstance(calibrator, KVScaleCalibrator):
        raise FP8ConfigError(
            f"expected a KVScaleCalibrator or None, got {format_value(calibrator)}",
            key="calibrator",
        )
    calibrator = calibrator or _ATTACHED.get(model)
    if forward is not None:
        if calibrator is None:
            calibrator = KVScaleCalibrator(
                model,
                percentile=percentile,
                margin=margin,
                include_q=include_q,
                sample=sample,
                layer_offset=layer_offset,
                process_group=process_group,
            )
        return calibrator.calibrate(forward)
    if calibrator is None:
        raise FP8ConfigError(
            "no calibrator is attached to this model and no forward= was given",
            key="forward",
            hint="pass forward=lambda: model(batch), or attach "
            "KVScaleCalibrator(model) before the step",
        )
    return calibrator.scales()


def _max_across_ranks(amaxes: dict[str, float], group: Any) -> dict[str, float]:
    """Merge ``{name: amax}`` over the ranks of ``group`` (max per name, union of names)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return amaxes
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, amaxes, group=group)
    return merge_max(gathered)


def merge_max(parts: list[dict[str, float] | None]) -> dict[str, float]:
    """``{name: amax}`` dicts of several ranks merged: the max per name, the union of names.
    Correct only when a name means the same layer on every rank (global layer numbers)."""
    merged: dict[str, float] = {}
    for part in parts:
        for name, value in (part or {}).items():
            merged[name] = max(merged.get(name, 0.0), value)
    return merged


_MCORE_LATENT_ATTENTION = ("MLASelfAttention", "MultiLatentAttention")


def _refuse_latent_attention(name: str, module: Any, modules: dict[str, Any]) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3, Moonlight, Kimi) has no per-step KV
    scales here: vLLM's MLA caches the compressed latent (``kv_c`` after ``kv_a_layernorm``,
    with ``k_pe``) under one ``k_scale`` per layer (``...self_attn.mla_attn.mla_attn``), which
    calibrating the up-projected keys and values does not measure. Refused rather than
    returning scales vLLM would drop or misread."""
    parent = modules.get(name.rpartition(".")[0]) if "." in name else None
    mcore_mla = parent is not None and any(
        c.__name__ in _MCORE_LATENT_ATTENTION for c in type(parent).__mro__
    )
    if hasattr(module, "kv_a_proj_with_mqa") or (
        mcore_mla and any(c.__name__ in _MCORE_ATTENTION for c in type(module).__mro__)
    ):
        where = name.rpartition(".")[0] if mcore_mla else name
        raise FP8ConfigError(
            f"{where} is multi-head latent attention (MLA): vLLM's FP8 KV cache stores its "
            "compressed latent under one k_scale per layer, which key/value calibration does "
            "not measure, so per-step KV scales are not supported for MLA models",
            key="model",
            hint="keep kv_cache: auto, or serve an FP8 KV cache with vLLM's default scale 1.0 "
            "and no refresh",
        )


def _layer_number(module: Any) -> int | None:
    number = getattr(module, "layer_number", None)
    if isinstance(number, int) and not isinstance(number, bool) and number >= 1:
        return number
    return None


# --------------------------------------------------------------------------- Hugging Face wrapper


def _hf_wrapper_name(base: str) -> str:
    """Register (once) and name the recording wrapper around attention implementation ``base``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = _WRAPPER_PREFIX + base
    if name in AttentionInterface._global_mapping:
        return name

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        record = getattr(module, "_nemo_fp8_kv_record", None)
        if record is not None:
            calibrator = record[0]()
            if calibrator is not None:
                # Hugging Face attention tensors are [batch, heads, seq, head_dim].
                calibrator._record(record[1], query, key, value, (1, 3))
        if base == "eager":
            impl = sys.modules[type(module).__module__].eager_attention_forward
        else:
            impl = AttentionInterface._global_mapping[base]
        return impl(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    mask_base = base if base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "sdpa"
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mask_base])
    return name
