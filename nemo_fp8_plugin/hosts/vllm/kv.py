"""The ``nemo_fp8`` KV-cache method: attention scales a refit can replace every step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

if TYPE_CHECKING:
    from vllm.model_executor.layers.attention import Attention, MLAAttention

    from .config import NemoFp8Config

logger = logging.getLogger(__name__)

__all__ = ["NemoFp8KVCacheMethod"]

_KV_PARAMS = ("k_scale", "v_scale", "q_scale", "prob_scale")


class NemoFp8KVCacheMethod(BaseKVCacheMethod):
    """KV-cache scales that can be refreshed every RL step.

    vLLM's own method copies ``k_scale`` / ``v_scale`` / ``q_scale`` into the attention
    layer's run-time scales once and then deletes the parameters, so a later
    ``load_weights`` has nowhere to write. This method runs the same copy and puts the same
    parameter objects back, so each refit can load fresh scales (names
    ``<layer>.self_attn.attn.{k,v,q}_scale``, as :func:`nemo_fp8_plugin.rl.refresh_scales` returns
    them) and :func:`finish_refit` re-applies them.
    """

    def __init__(self, quant_config: NemoFp8Config, prefix: str = "") -> None:
        super().__init__(quant_config)
        self.prefix = prefix
        self._checked = False

    def _check_dtype(self, layer: Attention | MLAAttention) -> None:
        if self._checked:
            return
        self._checked = True
        asked = getattr(self.quant_config, "kv_cache_dtype", "auto")
        running = getattr(layer, "kv_cache_dtype", "auto")
        if (
            asked not in ("auto", None)
            and running != asked
            and not (asked == "fp8_e4m3" and running == "fp8")
        ):
            logger.warning(
                "nemo_fp8: %s: the recipe asked for a %s KV cache but the engine runs %s "
                "(vLLM's CPU backend stores FP8 caches as E5M2); rollouts will not match "
                "an E4M3 GPU cache",
                self.prefix,
                asked,
                running,
            )

    def process_weights_after_loading(self, layer: Attention | MLAAttention) -> None:
        self._check_dtype(layer)
        kept = {name: getattr(layer, name) for name in _KV_PARAMS if hasattr(layer, name)}
        super().process_weights_after_loading(layer)
        for name, param in kept.items():
            if not hasattr(layer, name):
                setattr(layer, name, param)

    def after_refit(self, layer: Attention | MLAAttention) -> None:
        """Apply the scales loaded by the last refit to the attention layer."""
        self.process_weights_after_loading(layer)
