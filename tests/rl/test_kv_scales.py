"""KV/Q scale calibration on real attention modules (Hugging Face Llama, megatron-core).

The expected amaxes are computed independently of the calibrator's hooks: the q/k/v that
enter attention are rebuilt from the model's own pieces (input norm, projections,
transformers' ``apply_rotary_pos_emb``) and the percentile is numpy's ``nearest`` rule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl import KVScaleCalibrator, refresh_scales
from nemo_fp8_plugin.rl.kv_scales import vllm_attention_name

VOCAB = 64


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def llama(request):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=VOCAB,
        attn_implementation=request.param,
    )
    return LlamaForCausalLM(cfg).eval()


def _qkv(model, ids):
    """q, k, v entering each layer's attention, rebuilt outside the attention module."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
        found = []
        for i, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(out.hidden_states[i])
            attn = layer.self_attn
            shape = (*h.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            cos, sin = model.model.rotary_emb(h, position_ids)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            found.append({"q": q, "k": k, "v": v})
    return found


def _nearest(values, p):
    return float(np.percentile(np.asarray(values, dtype=np.float64), p, method="nearest"))


@pytest.mark.parametrize("percentile,margin", [(50.0, 1.05), (99.9, 1.05), (0.0, 1.2)])
def test_batch_samples_follow_percentile_and_margin(llama, percentile, margin):
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 9 + 3 * i), generator=gen) for i in range(5)]
    expected = {}
    for ids in batches:
        for i, roles in enumerate(_qkv(llama, ids)):
            for role, t in roles.items():
                expected.setdefault((i, role), []).append(t.abs().max().item())

    calib = KVScaleCalibrator(llama, percentile=percentile, margin=margin)
    update = refresh_scales(
        llama, forward=lambda: [llama(ids) for ids in batches], calibrator=calib
    )
    assert set(update) == {
        f"model.layers.{i}.self_attn.attn.{r}_scale" for i in range(2) for r in "qkv"
    }
    for (i, role), amaxes in expected.items():
        got = update[f"model.layers.{i}.self_attn.attn.{role}_scale"]
        assert got.dtype == torch.float32 and got.shape == ()
        want = _nearest(amaxes, percentile) * margin / 448.0
        assert math.isclose(got.item(), want, rel_tol=1e-5), (i, role, got.item(), want)
    assert update.seconds > 0
    assert update.samples["model.layers.0.self_attn.k"] == len(batches)
    # The model is back on its own attention implementation afterwards.
    assert llama.config._attn_implementation in ("sdpa", "eager")


def test_token_samples_clip_outlier_tokens(llama):
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(2))
    per_token = {}
    for i, roles in enumerate(_qkv(llama, ids)):
        k = roles["k"]  # [batch, heads, seq, dim]
        per_token[i] = k.abs().amax(dim=(1, 3)).reshape(-1).tolist()
    update = KVScaleCalibrator(llama, percentile=90.0, sample="token", include_q=False).calibrate(
        lambda: llama(ids)
    )
    assert not any(name.endswith("q_scale") for name in update)
    for i, amaxes in per_token.items():
        want = _nearest(amaxes, 90.0) * 1.05 / 448.0
        got = update[f"model.layers.{i}.self_attn.attn.k_scale"].item()
        assert math.isclose(got, want, rel_tol=1e-5)
        assert got < max(amaxes) * 1.05 / 448.0  # the 90th percentile is below the max
    assert update.samples["model.layers.0.self_attn.k"] == 3 * 20


def test_scales_refresh_after_a_weight_update(llama):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    before = refresh_scales(llama, forward=lambda: llama(ids))
    layer = llama.model.layers[1].self_attn
    saved = layer.k_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            layer.k_proj.weight.mul_(2.0)  # RoPE is linear: every k doubles, exactly
        after = refresh_scales(llama, forward=lambda: llama(ids))
    finally:
        with torch.no_grad():
            layer.k_proj.weight.copy_(saved)
    k1 = "model.layers.1.self_attn.attn.k_scale"
    assert after[k1].item() == pytest.approx(2.0 * before[k1].item(), rel=1e-6)
    # v of that layer and everything of layer 0 (upstream of the change) stay put.
    v1 = "model.layers.1.self_attn.attn.v_scale"
    assert after[v1].item() == before[v1].item()
    for role in "qkv":
        name = f"model.layers.0.self_attn.attn.{role}_scale"
        assert after[name].item() == before[name].item()


def test_attached_hooks_record_the_steps_own_forwards(llama):
    batches = [
        torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(s))
        for s in range(3)
    ]
    expected = max(r[1]["v"].abs().max().item() for r in (_qkv(llama, ids) for ids in batches))
    calib = KVScaleCalibrator(llama, percentile=100.0).attach()
    try:
        with torch.no_grad():
            for ids in batches:  # the training step's forwards
                llama(ids)
        update = refresh_scales(llama)
        assert update["model.layers.1.self_attn.attn.v_scale"].item() == pytest.approx(
            expected * 1.05 / 448.0, rel=1e-5
        )
        assert update.samples["model.layers.1.self_attn.v"] == 3
        with pytest.raises(FP8ConfigError, match="no q/k/v observed"):
            refresh_scales(llama)  # samples were consumed by the refresh
    finally:
        calib.detach()
    with pytest.raises(FP8ConfigError, match="no calibrator") as err:
        refresh_scales(llama)
    assert err.value.key == "forward"


def test_step_hook_for_the_training_callbacks(llama):
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    calib = KVScaleCalibrator(llama)
    hook = calib.as_step_hook(lambda module: module(ids))
    update = hook(object(), llama)
    assert calib.last_update is update and len(update) == 6 and calib.last_seconds > 0


def test_zero_amax_gives_scale_one():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=VOCAB,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.zero_()
    update = refresh_scales(model, forward=lambda: model(torch.zeros(1, 4, dtype=torch.long)))
    assert update["model.layers.0.self_attn.attn.v_scale"].item() == 1.0


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"percentile": 101.0}, "percentile"),
        ({"margin": 0}, "margin"),
        ({"sample": "layer"}, "sample"),
        ({"percentile": True}, "percentile"),
    ],
)
def test_bad_settings_name_the_key(llama, kwargs, key):
    with pytest.raises(FP8ConfigError) as err:
        KVScaleCalibrator(llama, **kwargs)
    assert err.value.key == key


def test_model_without_attention_is_refused():
    with pytest.raises(FP8ConfigError, match="no attention module"):
        KVScaleCalibrator(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_megatron_names_map_to_vllm_names():
    assert (
        vllm_attention_name("module.decoder.layers.7.self_attention.core_attention")
        == "model.layers.7.self_attn"
    )
    assert vllm_attention_name("decoder.layers.0.self_attention") == "model.layers.0.self_attn"
    assert vllm_attention_name("model.layers.3.self_attn") == "model.layers.3.self_attn"


def test_megatron_core_attention(tmp_path):
    """megatron-core's GPTModel (the demo model: local layer spec, CPU core attention): the
    calibrator hooks core attention as NeMo RL does. Expected k/v amaxes come from a separate
    hook on ``linear_qkv`` (learned positions, no RoPE: k and v are slices of its output)."""
    from nemo_fp8_plugin.tools.demo.model import GPTSettings, build_gpt

    settings = GPTSettings(
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, seq_length=16
    )
    model = build_gpt(settings, seed=0).eval()
    heads, dim = settings.num_attention_heads, settings.hidden_size // settings.num_attention_heads
    seen = {}

    def grab(i):
        def hook(module, args, output):
            mixed = output[0] if isinstance(output, tuple) else output
            # megatron-core's fused layout: per query group [q (heads/groups * dim), k, v].
            per_group = mixed.view(*mixed.shape[:-1], heads, 3 * dim)
            seen[i] = {
                "k": per_group[..., dim : 2 * dim].abs().max().item(),
                "v": per_group[..., 2 * dim :].abs().max().item(),
            }

        return hook

    handles = [
        layer.self_attention.linear_qkv.register_forward_hook(grab(i))
        for i, layer in enumerate(model.decoder.layers)
    ]
    ids = torch.randint(
        0, settings.vocab_size, (2, settings.seq_length), generator=torch.Generator().manual_seed(0)
    )
    pos = torch.arange(settings.seq_length).unsqueeze(0).expand(2, -1)
    try:
        update = refresh_scales(model, forward=lambda: model(ids, pos, None), include_q=False)
    finally:
        for h in handles:
            h.remove()
    assert set(update) == {
        f"model.layers.{i}.self_attn.attn.{r}_scale" for i in range(2) for r in "kv"
    }
    for i in range(2):
        for role in "kv":
            got = update[f"model.layers.{i}.self_attn.attn.{role}_scale"].item()
            assert got == pytest.approx(seen[i][role] * 1.05 / 448.0, rel=1e-6)


# --------------------------------------------------------------------------- pipeline stages


class _FakePipelineGroup:
    """Stands in for a pipeline process group: megatron-core asks it only for rank and size
    (``get_pg_rank`` / ``get_pg_size``) when it numbers a stage's layers."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _gpt_stage(pp_size: int, pp_rank: int, num_layers: int = 4):
    """A real megatron-core GPTModel, whole (pp_size 1) or one pipeline stage of it, built as
    megatron-core builds a stage: its TransformerBlock holds decoder.layers.0..n-1 and
    TransformerLayer adds get_transformer_layer_offset(...) to their layer_number."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_fp8_plugin.tools.demo.model import cpu_core_attention_class

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        transformer_impl="local",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = cpu_core_attention_class()
    groups = copy.copy(ProcessGroupCollection.use_mpu_process_groups())
    if pp_size > 1:
        groups.pp = _FakePipelineGroup(pp_rank, pp_size)
    torch.manual_seed(0)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type="learned_absolute",
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        pg_collection=groups,
    ).eval()


@pytest.fixture(scope="module")
def pipeline(megatron_cpu):
    """The whole 4-layer model and its two pipeline stages (layers 0-1 and 2-3) holding the
    same weights, with one batch pushed through each."""
    full, first, second = _gpt_stage(1, 0), _gpt_stage(2, 0), _gpt_stage(2, 1)
    weights = full.state_dict()
    for stage, offset in ((first, 0), (second, 2)):
        mine = {}
        for key in stage.state_dict():
            parts = key.split(".")
            if key.startswith("decoder.layers."):
                parts[2] = str(int(parts[2]) + offset)
            mine[key] = weights[".".join(parts)]
        stage.load_state_dict(mine)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)

    def run_first():
        return first(ids, pos, None)

    def run_second():
        with torch.no_grad():
            second.set_input_tensor(run_first())
        return second(None, None, None)

    with torch.no_grad():  # the split model is the whole model
        assert torch.equal(run_second(), full(ids, pos, None))
    return {
        "full": (full, lambda: full(ids, pos, None)),
        "first": (first, run_first),
        "second": (second, run_second),
    }


def test_pipeline_stages_name_their_layers_globally(pipeline):
    """Each stage's decoder.layers.<i> counts from 0; the scales must carry the global layer
    number (megatron-core's layer_number), so that the ranks' max-merge combines every
    layer with itself only. Merged, the two stages give exactly the whole model's scales."""
    from nemo_fp8_plugin.rl.kv_scales import merge_max

    whole = refresh_scales(pipeline["full"][0], forward=pipeline["full"][1])
    first = refresh_scales(pipeline["first"][0], forward=pipeline["first"][1])
    second = refresh_scales(pipeline["second"][0], forward=pipeline["second"][1])

    def names(layers):
        return {f"model.layers.{i}.self_attn.attn.{r}_scale" for i in layers for r in "qkv"}

    assert set(whole) == names(range(4))
    assert set(first) == names([0, 1]) and set(second) == names([2, 3])
    assert merge_max([first.amax, second.amax]) == whole.amax
    for name in second:
        assert torch.equal(second[name], whole[name]), name


def test_model_chunks_of_one_rank_keep_their_global_numbers(pipeline):
    """Virtual pipeline stages: one rank holds several chunks (here both stages in a
    ModuleList, names 0.decoder.layers.0 and 1.decoder.layers.0); each keeps its own global
    layer numbers, and a rank whose chunks would share a name is refused."""
    first, second = pipeline["first"][0], pipeline["second"][0]
    both = torch.nn.ModuleList([first, second])
    update = refresh_scales(both, forward=pipeline["second"][1], include_q=False)
    assert sorted(update) == sorted(
        f"model.layers.{i}.self_attn.attn.{r}_scale" for i in range(4) for r in "kv"
    )
    with pytest.raises(FP8ConfigError, match="both name their scales") as err:
        KVScaleCalibrator(torch.nn.ModuleList([first, _gpt_stage(2, 0)]))
    assert err.value.key == "model"


def test_layer_offset_for_models_without_global_layer_numbers(llama):
    """A hand-split model whose layers do not carry megatron's layer_number: layer_offset
    gives its first layer's global index (the amaxes themselves do not change)."""
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    plain = refresh_scales(llama, forward=lambda: llama(ids))
    shifted = refresh_scales(llama, forward=lambda: llama(ids), layer_offset=6)
    assert set(shifted) == {
        f"model.layers.{i}.self_attn.attn.{r}_scale" for i in (6, 7) for r in "qkv"
    }
    for name, value in plain.items():
        assert torch.equal(
            shifted[name.replace("layers.0.", "layers.6.").replace("layers.1.", "layers.7.")], value
        )
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(FP8ConfigError) as err:
            KVScaleCalibrator(llama, layer_offset=bad)
        assert err.value.key == "layer_offset"


@pytest.mark.parametrize(
    "module,prefix",
    [
        ("model.layers.3.self_attn", "model.layers.3.self_attn"),
        ("module.decoder.layers.7.self_attention.core_attention", "model.layers.7.self_attn"),
    ],
)
@pytest.mark.parametrize("role", ["q", "k", "v"])
def test_scale_names_are_vllm_attention_parameters(module, prefix, role):
    """vLLM 0.32's attention layer is <HF attention module>.attn and its scales are
    parameters q_scale, k_scale, v_scale there (tests/hosts/vllm/test_kv_scale_names.py checks
    these names against vLLM's own loaders)."""
    from nemo_fp8_plugin.rl.kv_scales import vllm_scale_name

    assert vllm_scale_name(vllm_attention_name(module), role) == f"{prefix}.attn.{role}_scale"


def test_latent_attention_is_refused_hugging_face():
    """DeepSeek-V3's real Hugging Face attention (tiny config): MLA caches a compressed latent
    under one scale in vLLM, which key/value calibration does not measure; refused naming
    the module, not answered with scales vLLM would drop."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(FP8ConfigError, match=r"model\.layers\.0\.self_attn is multi-head latent"):
        refresh_scales(model, forward=lambda: model(ids))


def test_latent_attention_is_refused_megatron_core():
    """megatron-core's MLASelfAttention holds an ordinary core attention, which the calibrator
    would otherwise hook. Its constructor needs CUDA (rotary buffers on the current device)
    and TE's core attention (k_channels), so the real class is instantiated without running
    it, holding the demo's real CPU core attention: what is checked is only that the
    calibrator looks at the core attention's parent class."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_fp8_plugin.tools.demo.model import cpu_core_attention_class, init_megatron_cpu

    init_megatron_cpu()
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True
    )
    core = cpu_core_attention_class()(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    mla = MLASelfAttention.__new__(MLASelfAttention)
    torch.nn.Module.__init__(mla)
    mla.core_attention = core
    layer = torch.nn.Module()
    layer.self_attention = mla
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    with pytest.raises(FP8ConfigError, match=r"decoder\.layers\.0\.self_attention is multi-head"):
        KVScaleCalibrator(model)
    # the same core attention under an ordinary parent is hooked
    plain = torch.nn.Module()
    plain.decoder = torch.nn.Module()
    plain.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    plain.decoder.layers[0].self_attention = torch.nn.Module()
    plain.decoder.layers[0].self_attention.core_attention = core
    assert KVScaleCalibrator(plain).layer_names == ["model.layers.0.self_attn"]
