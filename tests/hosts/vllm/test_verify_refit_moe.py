"""Refit verification of fused-MoE experts: vLLM's own Mixtral MoE block on ``nemo_fp8``
(no engine: the module's layers in vLLM's config context, ``vllm_env``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_fused_moe_experts_split_back_and_check(vllm_env):
    """vLLM's Mixtral MoE block on ``nemo_fp8``: BF16 experts loaded through vLLM's own
    loader (quantized on arrival), read back per expert as w1/w3/w2; a one-tile defect in
    expert 2's w3 is caught by the check."""
    from fake_gpu import moe

    from nemo_fp8_plugin.hosts.vllm.refit_check import RefitCheck, RefitMismatch, engine_weights
    from nemo_fp8_plugin.numerics import quantize_blockwise

    experts = moe(vllm_env, "fp8_blockwise")
    model = torch.nn.Module()
    model.add_module("layers", torch.nn.ModuleList([torch.nn.Module()]))
    model.layers[0].add_module("block_sparse_moe", torch.nn.Module())
    model.layers[0].block_sparse_moe.add_module("experts", experts)
    gen = torch.Generator().manual_seed(5)
    payload = []
    for e in range(4):
        for shard, shape in (("w1", (256, 256)), ("w3", (256, 256)), ("w2", (256, 256))):
            w = (0.05 * torch.randn(shape, generator=gen)).bfloat16()
            payload.append((f"layers.0.block_sparse_moe.experts.{e}.{shard}.weight", w))

    def load(items):
        for name, w in items:
            e, shard = int(name.split(".")[4]), name.split(".")[5]
            param = experts.w2_weight if shard == "w2" else experts.w13_weight
            stem = "w2_weight" if shard == "w2" else "w13_weight"
            param.weight_loader(param, w, stem, shard_id=shard, expert_id=e)

    check = RefitCheck(None, refit=0)
    load(check.watch(model, payload))
    got = {name: (data, scale) for name, data, scale in engine_weights(model)}
    assert len(got) == 12
    for name, w in payload:
        q = quantize_blockwise(w, (128, 128))
        assert torch.equal(got[name][0].view(torch.uint8), q.data.view(torch.uint8)), name
        assert torch.equal(got[name][1], q.scale_inv), name
    assert len(check.verify(model)) == 12

    check = RefitCheck(None, refit=1)
    load(check.watch(model, payload))
    corrupt_at = experts.w13_weight.data[2, 256 + 128 :, :128]  # expert 2, w3, tile (1, 0)
    corrupt_at.view(torch.uint8)[:3, :3] ^= 0x08
    with pytest.raises(RefitMismatch) as err:
        check.verify(model)
    (bad,) = [c for c in err.value.checks if not c.ok]
    assert bad.name == "layers.0.block_sparse_moe.experts.2.w3.weight" and bad.worst.tile == (1, 0)
