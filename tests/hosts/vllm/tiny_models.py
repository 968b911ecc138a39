"""Tiny random Hugging Face checkpoints the vLLM tests write (no download)."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
    initializer_range=0.1,
)
"""A tiny random Llama: head_dim 64 (what vLLM's CPU attention takes), every GEMM dimension a
multiple of 128, and a wide enough init that its next-token distributions are peaked (so
FP8 error is visible in the logprobs)."""

MIXTRAL = dict(
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    torch_dtype="bfloat16",
    num_local_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
    initializer_range=0.1,
    sliding_window=None,
)
"""A tiny random Mixtral (4 experts, top 2) for the fused-MoE path."""


def llama_state_dict(config: dict = LLAMA, seed: int = 0):
    """Random weights of a Llama in Hugging Face naming (bf16), from transformers' own init."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def mixtral_state_dict(config: dict = MIXTRAL, seed: int = 0):
    """Random Mixtral weights in the per-expert checkpoint layout vLLM's Mixtral loads
    (``block_sparse_moe.experts.<e>.w1/w2/w3.weight``), built from transformers' init."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**config)).to(torch.bfloat16)
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach()
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5: [E, 2I, H]
            stem = name[: -len("mlp.experts.gate_up_proj")]
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{stem}block_sparse_moe.experts.{e}.w1.weight"] = value[e, :inter].contiguous()
                out[f"{stem}block_sparse_moe.experts.{e}.w3.weight"] = value[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            stem = name[: -len("mlp.experts.down_proj")]
            for e in range(value.shape[0]):
                out[f"{stem}block_sparse_moe.experts.{e}.w2.weight"] = value[e].contiguous()
        else:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value.contiguous()
    return out


def write_checkpoint(directory: Path, config: dict, state_dict: dict) -> Path:
    """config.json + model.safetensors in ``directory`` (a Hugging Face checkpoint)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state_dict, str(directory / "model.safetensors"))
    return directory


def set_numerics(llm, value: str) -> int:
    """Switch every ``nemo_fp8`` layer of a running engine to ``generation_numerics`` ``value``
    (the quantizer reads it at each GEMM); returns the number of layers switched."""

    def run(worker, value=value):
        touched = 0
        for module in worker.model_runner.get_model().modules():
            quantizer = getattr(getattr(module, "quant_method", None), "quantizer", None)
            if quantizer is not None:
                quantizer.numerics = value
                touched += 1
        return touched

    return llm.collective_rpc(run)[0]
