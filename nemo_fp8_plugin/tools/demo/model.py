"""A real megatron-core GPTModel that trains on a CPU, single process.

megatron-core 0.16.1 runs on CPU once three CUDA-only spots are avoided:
* the model-parallel RNG tracker: ``initialize_rng_tracker(inference_rng_tracker=True)``
  instead of ``model_parallel_cuda_manual_seed``;
* ``DotProductAttention`` preallocates its score buffer on the current CUDA device
  (``GlobalMemoryBuffer.get_tensor``): the layer spec swaps in a CPU core attention,
  megatron-core's own extension point for the core-attention submodule;
* rotary embeddings move their frequencies to CUDA: the demo uses learned absolute
  positions.
Linear layers stay megatron-core's own ``ColumnParallelLinear`` / ``RowParallelLinear``
(tensor-parallel size 1), which the FP8 emulation converter swaps like Transformer Engine
would.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["GPTSettings", "init_megatron_cpu", "build_gpt", "cpu_core_attention_class"]


@dataclass(frozen=True)
class GPTSettings:
    """Model shape (the ``model:`` block of the demo config); every field is the
    megatron-core ``TransformerConfig`` / ``GPTModel`` argument of the same name.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width; a multiple of 128 so block-scaled GEMMs have whole tiles.
        ffn_hidden_size: MLP width (multiple of 128).
        num_attention_heads: attention heads (head dim = hidden_size / heads).
        seq_length: tokens per sample (bytes: the vocabulary is the 256 byte values).
        vocab_size: byte-level vocabulary.
    """

    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 512
    num_attention_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron_cpu() -> None:
    """A one-rank gloo process group, megatron-core's model-parallel state (TP=PP=1) and its
    RNG tracker, set up the CPU way. Safe to call again."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def cpu_core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CPUCoreAttention(DotProductAttention):
        """megatron-core's core attention computed with torch's fused SDPA (causal), so no
        CUDA buffer is needed. Same inputs and output layout: [s, b, heads, dim] -> [s, b, h]."""

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:
                key = key.repeat_interleave(groups, dim=2)
                value = value.repeat_interleave(groups, dim=2)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            return ctx.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return CPUCoreAttention


def build_gpt(settings: GPTSettings, seed: int):
    """A freshly initialised GPTModel (fp32 parameters) from ``seed``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_megatron_cpu()
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=settings.num_layers,
        hidden_size=settings.hidden_size,
        ffn_hidden_size=settings.ffn_hidden_size,
        num_attention_heads=settings.num_attention_heads,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        transformer_impl="local",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = cpu_core_attention_class()
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=settings.vocab_size,
        max_sequence_length=settings.seq_length,
        position_embedding_type="learned_absolute",
    )
