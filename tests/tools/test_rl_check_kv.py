"""rl-check's engine pieces: vLLM's activation numerics in the FP8 linear, the FP8 KV cache
(``E4M3(k / k_scale)``, dequantized in attention) and the trainer-side KV-scale calibration
whose names land on the engine's scale buffers."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_fp8_plugin.numerics import QTensor, fp8_gemm, quantize_blockwise
from nemo_fp8_plugin.numerics.vllm_numerics import quantize_activation_vllm
from nemo_fp8_plugin.rl.kv_scales import KVScaleCalibrator
from nemo_fp8_plugin.tools.rl_check_model import (
    CoreAttention,
    Engine,
    FP8EngineLinear,
    RunningSumTask,
    TinyLlama,
)


def tiny(seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(
        RunningSumTask.VOCAB,
        14,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
    )


def loaded_linear(numerics: str) -> tuple[FP8EngineLinear, QTensor]:
    torch.manual_seed(1)
    w = quantize_blockwise(torch.randn(256, 128), (128, 128))
    lin = FP8EngineLinear(256, 128, pow2_scales=False, numerics=numerics)
    lin.weight.copy_(w.data)
    lin.weight_scale_inv.copy_(w.scale_inv)
    return lin, w


def test_engine_linear_quantizes_activations_as_vllm_does():
    torch.manual_seed(2)
    x = torch.randn(4096, 128).to(torch.bfloat16)
    lin, w = loaded_linear("vllm")
    expected = fp8_gemm(quantize_activation_vllm(x, 128), w, out_dtype=torch.bfloat16)
    assert torch.equal(lin(x), expected)
    te = fp8_gemm(quantize_blockwise(x, (1, 128)), w, out_dtype=torch.bfloat16)
    # vLLM's x / (amax / 448) is not TE's x * (448 / amax): some outputs differ
    assert not torch.equal(lin(x), te)
    trainer, _ = loaded_linear("trainer")
    assert torch.equal(trainer(x), te)


def test_fp8_kv_cache_stores_e4m3_of_k_over_scale_and_reads_it_back_scaled():
    attn = CoreAttention(32, "fp8")
    attn.k_scale.fill_(0.01)
    attn.v_scale.fill_(0.02)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 5, 32).to(torch.bfloat16) for _ in range(3))
    cache: dict = {}
    out = attn(q, k, v, cache)
    assert cache["k"].dtype == torch.float8_e4m3fn and cache["v"].dtype == torch.float8_e4m3fn
    k8 = (k.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (v.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(cache["k"].view(torch.uint8), k8.view(torch.uint8))
    # attention over the dequantized cache (prefill included), with the query quantized as
    # vLLM quantizes it when the KV cache is FP8 (q_scale 1.0 until calibrated)
    kd, vd = k8.float() * 0.01, v8.float() * 0.02
    qd = q.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()
    scores = (qd * (1 / math.sqrt(32))) @ kd.transpose(-1, -2)
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert torch.equal(out, (torch.softmax(scores, -1) @ vd).to(torch.bfloat16))
    # a value beyond 448 * scale saturates instead of overflowing
    attn(q[:, :, :1], torch.full_like(k[:, :, :1], 100.0), v[:, :, :1], cache)
    assert cache["k"][:, :, -1].float().max() == 448.0


def test_bf16_kv_cache_is_untouched():
    attn = CoreAttention(32)
    assert not hasattr(attn, "k_scale")
    q, k, v = (torch.randn(1, 4, 3, 32).to(torch.bfloat16) for _ in range(3))
    cache: dict = {}
    attn(q, k, v, cache)
    assert torch.equal(cache["k"], k)


def test_calibrated_scales_land_on_the_engine_buffers():
    model = tiny().to(torch.bfloat16)
    engine = Engine(model, set(), pow2_scales=False, kv_cache_dtype="fp8")
    assert sorted(engine.kv_scale_names) == sorted(
        f"model.layers.{i}.self_attn.attn.{r}_scale" for i in (0, 1) for r in "kv"
    )
    seen: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):

        def grab(module, args, i=i):
            seen[f"model.layers.{i}.self_attn.attn.k_scale"] = args[1].abs().amax().float()
            seen[f"model.layers.{i}.self_attn.attn.v_scale"] = args[2].abs().amax().float()

        layer.self_attn.attn.register_forward_pre_hook(grab)
    tokens = torch.randint(0, 10, (8, 13))
    calibrator = KVScaleCalibrator(model, include_q=False)
    update = calibrator.calibrate(lambda: model(tokens))
    assert set(update) == set(engine.kv_scale_names)
    for name, scale in update.items():
        expected = torch.tensor(float(seen[name]), dtype=torch.float32) * 1.05 / 448.0
        assert float(scale) == pytest.approx(float(expected), rel=1e-6), name
    engine.load_weights(update.items())
    for name in engine.kv_scale_names:
        assert float(engine.slots[name]) == float(update[name])


def test_token_samples_of_a_bhsd_core_attention():
    model = tiny()
    tokens = torch.randint(0, 10, (3, 13))
    calibrator = KVScaleCalibrator(model, include_q=False, sample="token")
    with calibrator, torch.no_grad():
        model(tokens)
    observed = calibrator.observed()
    # one sample per (batch, position): heads and head_dim reduced
    assert observed["model.layers.0.self_attn"]["k"].numel() == 3 * 13


def test_fp8_kv_engine_generates_close_to_but_not_as_the_bf16_cache():
    template = tiny()
    plain = Engine(template, set(), pow2_scales=False)
    kv = Engine(template, set(), pow2_scales=False, kv_cache_dtype="fp8")
    calibrator = KVScaleCalibrator(plain.model, include_q=False)
    prompts = RunningSumTask(6).prompts(16, torch.Generator().manual_seed(0))
    update = calibrator.calibrate(lambda: plain.model(prompts))
    kv.load_weights(update.items())
    tok, lp_plain = plain.generate(prompts, 6, None)
    _, lp_kv = kv.generate(prompts, 6, None)
    # the engines pick their tokens by themselves; compare the first, which both see alike
    diff = (lp_plain[:, 0] - lp_kv[:, 0]).abs()
    assert diff.max() > 0
    assert diff.max() < 0.1


def test_deepgemm_numerics_requantize_the_refit_to_power_of_two_scales():
    from nemo_fp8_plugin.registry import get_recipe
    from nemo_fp8_plugin.rl import quantize_for_refit
    from nemo_fp8_plugin.tools.rl_check import fp8_modules_of

    template = tiny()
    spec = get_recipe("fp8_blockwise")
    modules = fp8_modules_of(template, spec, 2)
    named = [(n, t.to(torch.bfloat16)) for n, t in template.state_dict().items()]
    payload = list(quantize_for_refit(named, spec, num_layers=2))
    for numerics, pow2 in (("vllm", False), ("vllm_deepgemm_ue8m0", True)):
        engine = Engine(template, modules, pow2_scales=False, numerics=numerics)
        engine.load_weights(payload)
        s = engine.slots["model.layers.0.mlp.up_proj.weight_scale_inv"]
        assert bool((torch.log2(s) == torch.log2(s).round()).all()) == pow2, numerics
