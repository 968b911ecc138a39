"""Model configs (Hugging Face ``config.json`` fields) shared by tests in both environments."""

from __future__ import annotations

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 12,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_experts": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mlp_only_layers": [0, 10],
}
"""A small Qwen3-MoE: dense MLPs in layers 0 and 10 (``mlp.gate_up_proj``), routed experts
with a ``mlp.gate`` router elsewhere; what an ignore list that matches by substring widens."""
