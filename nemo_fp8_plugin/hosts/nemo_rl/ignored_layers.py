"""The ignore list NeMo RL hands vLLM for its FP8 rollouts, as each release builds it.

NeMo RL's ``init_fp8`` (``nemo_rl/models/generation/vllm/quantization/fp8.py``) turns three
``policy.generation.vllm_cfg`` keys into ``ignored_layers`` of vLLM's ``fp8`` quantization
config, from the Hugging Face model's parameter names (``model.`` + the base model's name,
``.weight`` dropped):

* ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16``: every parameter of those layers
  (``_get_params_in_layers``: a name containing ``layers.<i>.``). At v0.6.0 and v0.7.0 the
  names of each range are *appended* as one list (~214, ~224), so ``ignored_layers`` holds a
  nested list that vLLM's ``is_layer_skipped`` compares module names with and never matches:
  the layers run in FP8. Main (7ea279a) extends the list (~269). Which release does which is
  the stacks fact ``vllm_cfg.num_first_layers_in_bf16 reaches vLLM's ignored_layers``.
* ``quantization_ignored_layer_kws``: every parameter whose name contains one of the keywords
  (a substring, not a glob), at every release.

vLLM then matches the list its own way (:func:`nemo_fp8_plugin.hosts.vllm.ignore.vllm_exclusions`:
exact names, a fused module by its shards, a fused-MoE layer by any expert entry).
:func:`nemo_rl_ignored_layers` gives the list from a model description's Hugging Face module
names (one per expert, as transformers 4 names them; a keyword naming the whole layer, such
as ``mlp.experts``, catches the fused expert parameters of transformers 5 alike), and
:func:`edge_layer_keywords` the keywords that keep first/last layers in BF16 where the counts
do not reach vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...rules import ModelDescription

__all__ = [
    "COUNTS_REACH_VLLM",
    "counts_reach_vllm",
    "edge_layer_keywords",
    "nemo_rl_ignored_layers",
]

COUNTS_REACH_VLLM = "vllm_cfg.num_first_layers_in_bf16 reaches vLLM's ignored_layers"
"""The :data:`nemo_fp8_plugin.stacks.FACTS` row: the releases whose layer counts keep vLLM
layers in BF16."""


def counts_reach_vllm(release: str | None) -> bool:
    """Whether NeMo RL ``release``'s ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16``
    reach vLLM (a release the table does not know: assumed to, as main does)."""
    from ...stacks import lookup

    return lookup("nemo-rl", COUNTS_REACH_VLLM, release).present is not False


def _layer_of(name: str, layer: int) -> bool:
    return f"layers.{layer}." in name


def edge_layer_keywords(first: int, last: int, num_layers: int) -> list[str]:
    """``quantization_ignored_layer_kws`` entries that keep the first ``first`` and last
    ``last`` of ``num_layers`` layers in BF16: ``layers.<i>.``, the prefix NeMo RL's own
    ``_get_params_in_layers`` matches (``layers.1.`` is not in ``layers.11.``)."""
    layers = list(range(min(first, num_layers)))
    layers += [i for i in range(max(num_layers - last, 0), num_layers) if i not in layers]
    return [f"layers.{i}." for i in layers]


def nemo_rl_ignored_layers(
    model: ModelDescription, vllm_cfg: Mapping[str, Any], release: str | None
) -> list[str]:
    """The ``ignored_layers`` NeMo RL ``release`` hands vLLM for ``vllm_cfg`` (the written
    ``policy.generation.vllm_cfg``) on ``model``, as module names (only the names vLLM's
    matching can hit: linear modules; the output head is not a parameter of the base model
    NeMo RL reads)."""
    names = [n for n in model.hf_linear_modules if n != "lm_head" and not n.endswith(".lm_head")]
    out: list[str] = []
    first = _count(vllm_cfg.get("num_first_layers_in_bf16"))
    last = _count(vllm_cfg.get("num_last_layers_in_bf16"))
    if (first or last) and counts_reach_vllm(release):
        layers = set(range(first)) | set(range(model.num_layers - last, model.num_layers))
        out += [n for n in names if any(_layer_of(n, i) for i in layers)]
    keywords = vllm_cfg.get("quantization_ignored_layer_kws") or []
    if isinstance(keywords, (list, tuple)):
        kws = [str(k) for k in keywords]
        out += [n for n in names if any(kw in n for kw in kws)]
    return list(dict.fromkeys(out))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
