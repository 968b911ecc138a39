"""BF16 rules: model descriptions, per-module resolution, host spellings, per-name decisions.

Architecture sizes are checked against NeMo 2's own model config classes (read from the
installed nemo-toolkit sources with ``ast``: importing ``nemo.collections.llm`` costs a
minute), the NeMo RL Moonlight FP8 recipe is read from the shared NeMo RL configs.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from conftest import nemo_rl_configs
from nemo_fp8_plugin import BF16Rules, FP8ConfigError, get_recipe
from nemo_fp8_plugin.hosts.megatron.rules import to_megatron
from nemo_fp8_plugin.hosts.nemo_rl.rules import to_nemo_rl
from nemo_fp8_plugin.hosts.vllm.rules import to_vllm
from nemo_fp8_plugin.rules import (
    SIDES,
    describe_model,
    from_transformer_config,
    keeps_bf16,
    module_filter,
    resolve,
)

pytestmark = pytest.mark.torch_free

BLOCKWISE = get_recipe("fp8_blockwise")


def with_rules(**rules):
    return BLOCKWISE.replace(bf16_layers=rules)


# --------------------------------------------------------------------------- descriptions


@functools.lru_cache(maxsize=1)
def _nemo_classes() -> dict:
    spec = importlib.util.find_spec("nemo")
    if spec is None:
        pytest.fail("nemo-toolkit is part of the test environment (scripts/install.sh test)")
    root = Path(list(spec.submodule_search_locations)[0])
    classes = {}
    for p in sorted((root / "collections/llm/gpt/model").glob("*.py")):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)
    return classes


def _nemo_config_fields(cls_name: str) -> dict:
    """Field defaults of a NeMo 2 config dataclass and its bases, read with ast."""
    classes = _nemo_classes()

    def fields(name):
        node = classes.get(name)
        if node is None:
            return {}
        out = {}
        for base in node.bases:
            if isinstance(base, ast.Name):
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                try:
                    out[stmt.target.id] = ast.literal_eval(stmt.value)
                except ValueError:
                    out[stmt.target.id] = ast.unparse(stmt.value)
        return out

    return fields(cls_name)


@pytest.mark.parametrize(
    "name, nemo_class",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama31Config8B"),
        ("llama31_8b", "Llama31Config8B"),
        ("meta-llama/Meta-Llama-3-70B-Instruct", "Llama3Config70B"),
        ("meta-llama/Llama-3.1-70B", "Llama31Config70B"),
        ("meta-llama/Llama-3.1-405B-Instruct", "Llama31Config405B"),
        ("meta-llama/Llama-3.2-1B", "Llama32Config1B"),
        ("Qwen/Qwen3-8B", "Qwen3Config8B"),
        ("Qwen3Config32B", "Qwen3Config32B"),
        ("Qwen/Qwen3-30B-A3B", "Qwen3Config30B_A3B"),
        ("qwen3_235b_a22b", "Qwen3Config235B_A22B"),
        ("deepseek-ai/DeepSeek-V3", "DeepSeekV3Config"),
        ("deepseek-ai/DeepSeek-V2-Lite-Chat", "DeepSeekV2LiteConfig"),
        ("GPTConfig126M", "GPTConfig126M"),
        ("gpt-175b", "GPTConfig175B"),
    ],
)
def test_builtin_sizes_match_nemo_config_classes(name, nemo_class):
    ref = _nemo_config_fields(nemo_class)
    m = describe_model(name)
    assert m.num_layers == ref["num_layers"]
    assert m.hidden_size == ref["hidden_size"]
    assert m.ffn_hidden_size == ref["ffn_hidden_size"]
    if "moe_ffn_hidden_size" in ref and m.num_experts:
        assert m.moe_ffn_hidden_size == ref["moe_ffn_hidden_size"]
    if isinstance(ref.get("num_moe_experts"), int) and m.num_experts:
        assert m.num_experts == ref["num_moe_experts"]
    moe_layers = {
        int(mg.split(".")[2]) for mg in m.megatron_linear_modules if mg.endswith(".mlp.router")
    }
    freq = ref.get("moe_layer_freq")
    if (
        isinstance(freq, str) and "[0]" in freq
    ):  # e.g. "field(default_factory=lambda: [0] * 3 + [1] * 58)"
        dense = (
            ast.literal_eval(freq.split("[0] *")[1].split("+")[0].strip()) if "[0] *" in freq else 1
        )
        assert min(moe_layers) == dense


def test_moonlight_structure():
    m = describe_model("moonshotai/Moonlight-16B-A3B-Instruct")
    assert (m.num_layers, m.num_experts, m.num_shared_experts, m.family) == (27, 64, 2, "deepseek")
    # q_lora_rank is null in Moonlight: a plain q_proj, kv_a_proj_with_mqa unfused in vLLM.
    assert "decoder.layers.0.self_attention.linear_q_proj" in m.megatron_linear_modules
    assert "decoder.layers.0.self_attention.linear_q_down_proj" not in m.megatron_linear_modules
    assert m.hf_names("decoder.layers.5.self_attention.linear_kv_down_proj") == (
        "model.layers.5.self_attn.kv_a_proj_with_mqa",
    )
    assert "model.layers.0.mlp.gate" not in m.hf_linear_modules  # first_k_dense_replace = 1
    assert m.vllm_members("model.layers.1.mlp.experts")[:3] == (
        "model.layers.1.mlp.experts.0.gate_proj",
        "model.layers.1.mlp.experts.0.up_proj",
        "model.layers.1.mlp.experts.0.down_proj",
    )
    assert len(m.vllm_members("model.layers.1.mlp.experts")) == 64 * 3
    dsv3 = describe_model("deepseek-v3")
    assert dsv3.vllm_members("model.layers.0.self_attn.fused_qkv_a_proj") == (
        "model.layers.0.self_attn.q_a_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
    )


def test_describe_from_config_json_and_transformer_config(tmp_path):
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 5,
        "hidden_size": 256,
        "intermediate_size": 512,
        "architectures": ["Qwen3ForCausalLM"],
    }
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    for arg in (tmp_path / "ckpt", tmp_path / "ckpt" / "config.json"):
        m = describe_model(str(arg))
        assert m.num_layers == 5 and m.source.endswith("config.json")
    rel = describe_model("ckpt", base_dir=tmp_path)
    assert rel.num_layers == 5

    class FakeTransformerConfig:  # duck-typed on purpose: the real one is in test_rules_megatron
        num_layers, hidden_size, ffn_hidden_size = 6, 128, 256
        num_moe_experts, moe_ffn_hidden_size, moe_layer_freq = 4, 64, [0, 1, 1, 1, 1, 1]
        moe_shared_expert_intermediate_size, gated_linear_unit = None, True
        multi_latent_attention, q_lora_rank = False, None

    m = from_transformer_config(FakeTransformerConfig())
    assert m.num_experts == 4
    assert "decoder.layers.0.mlp.linear_fc1" in m.megatron_linear_modules
    assert "decoder.layers.1.mlp.experts.linear_fc1" in m.megatron_linear_modules


@pytest.mark.parametrize(
    "bad, key, words",
    [
        ("acme/NotAModel-7B", "model", ["--model-config", "llama3.1-8b"]),
        ("./missing/config.json", "model", ["no such file"]),
    ],
)
def test_unknown_model_asks_for_model_config(bad, key, words):
    with pytest.raises(FP8ConfigError) as err:
        describe_model(bad)
    assert err.value.key == key
    for w in words:
        assert w in str(err.value)


def test_bad_config_json_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(FP8ConfigError, match="config.json is not a readable"):
        describe_model(str(p))
    p.write_text(json.dumps({"model_type": "t5", "num_hidden_layers": 2}))
    with pytest.raises(FP8ConfigError) as err:
        describe_model(str(p))
    assert err.value.key == "model_type" and str(p) in str(err.value)
    p.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": "32",
                "hidden_size": 8,
                "intermediate_size": 8,
            }
        )
    )
    with pytest.raises(FP8ConfigError) as err:
        describe_model(str(p))
    assert err.value.key == "num_hidden_layers"


# --------------------------------------------------------------------------- resolution


def test_llama_first_last():
    m = describe_model("meta-llama/Llama-3.1-8B-Instruct")
    spec = with_rules(first=1, last=1)
    for side in SIDES:
        res = resolve(spec, m, side)
        assert len(res.decisions) == 32 * 4 + 1
        for d in res.decisions:
            if d.layer == 0:
                assert (d.precision, d.rule, d.recipe) == ("bf16", "bf16_layers.first", None)
            elif d.layer == 31:
                assert (d.precision, d.rule) == ("bf16", "bf16_layers.last")
            elif d.layer is None:
                assert (d.precision, d.rule) == ("bf16", "builtin:output_head")
            else:
                assert (d.precision, d.rule, d.recipe) == ("fp8", None, "fp8_blockwise")
        assert not res.warnings and not res.unmatched_rules


def test_partial_fused_match_keeps_whole_module_and_warns():
    m = describe_model("llama3.1-8b")
    spec = with_rules(modules=["*q_proj*"])
    train = resolve(spec, m, "training").by_module()
    gen = resolve(spec, m, "generation").by_module()
    assert train["decoder.layers.7.self_attention.linear_qkv"].precision == "bf16"
    assert gen["model.layers.7.self_attn.qkv_proj"].precision == "bf16"
    assert train["decoder.layers.7.self_attention.linear_proj"].precision == "fp8"
    for side in SIDES:
        w = resolve(spec, m, side).warnings
        assert len(w) == 1 and "*q_proj*" in w[0] and "part of 32 fused" in w[0]


def test_unmatched_and_shadowed_rules_are_reported_by_name():
    m = describe_model("llama3.1-8b")
    res = resolve(with_rules(modules=["*a_prj*"]), m, "training")
    assert res.unmatched_rules == ["bf16_layers.modules[0]='*a_prj*'"]
    assert "matches no training module" in res.warnings[0]
    res = resolve(
        with_rules(first=2, modules=["*mlp*", "*down_proj*", "decoder.layers.1.*"]), m, "generation"
    )
    text = "\n".join(res.warnings)
    assert "bf16_layers.modules[1]='*down_proj*' has no effect" in text
    assert "bf16_layers.modules[0]='*mlp*'" in text  # named as the shadowing rule
    assert "bf16_layers.modules[2]='decoder.layers.1.*' has no effect" in text
    assert "bf16_layers.first" in text


@pytest.mark.parametrize(
    "rules, key",
    [
        ({"first": 33}, "bf16_layers.first"),
        ({"last": 40}, "bf16_layers.last"),
        ({"first": 16, "last": 16}, "bf16_layers.last"),
        ({"first": 32}, "bf16_layers.first"),
        ({"modules": ["*"]}, "bf16_layers.modules[0]"),
        ({"first": 1, "modules": ["*self_att*", "*mlp*"]}, "bf16_layers.modules[0]"),
    ],
)
def test_contradictory_rules_raise_naming_the_rule(rules, key):
    m = describe_model("llama3.1-8b")
    with pytest.raises(FP8ConfigError) as err:
        resolve(with_rules(**rules), m, "training")
    assert err.value.key == key


def test_applies_to_and_bf16_side():
    m = describe_model("llama3.1-8b")
    gen_only = with_rules(first=2, applies_to="generation")
    assert all(
        d.precision == "fp8"
        for d in resolve(gen_only, m, "training").decisions
        if d.layer is not None
    )
    assert (
        resolve(gen_only, m, "generation").by_module()["model.layers.1.mlp.down_proj"].rule
        == "bf16_layers.first"
    )
    rl = BLOCKWISE.replace(training="bf16")
    assert {d.rule for d in resolve(rl, m, "training").decisions} == {"training: bf16"}
    assert to_megatron(rl.replace(bf16_layers={"first": 1})).keys == {}


def test_rules_matched_through_the_name_mapping():
    """A glob written in either naming decides the module on both sides."""
    m = describe_model("moonlight-16b-a3b")
    spec = with_rules(modules=["*.linear_fc2"])  # Megatron name
    gen = resolve(spec, m, "generation").by_module()
    assert gen["model.layers.0.mlp.down_proj"].precision == "bf16"
    assert gen["model.layers.3.mlp.shared_experts.down_proj"].precision == "bf16"
    # experts.linear_fc2 holds down_proj only; vLLM fuses all expert projections in one module
    assert gen["model.layers.3.mlp.experts"].precision == "bf16"
    assert any(
        "part of 26 fused generation" in w
        for w in map(str, resolve(spec, m, "generation").warnings)
    )
    spec = with_rules(modules=["*.router", "output_layer"])
    res = resolve(spec, m, "generation")
    assert res.by_module()["model.layers.3.mlp.gate"].rule == "bf16_layers.modules[0]='*.router'"
    assert res.by_module()["lm_head"].rule == "bf16_layers.modules[1]='output_layer'"
    assert len(res.notes) == 2 and "changes nothing" in res.notes[0]


# --------------------------------------------------------------------------- host spellings


def test_moonlight_rules_give_nemo_rl_keywords_of_its_fp8_recipe():
    recipe = nemo_rl_configs() / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml"
    upstream = yaml.safe_load(recipe.read_text())
    want = upstream["policy"]["generation"]["vllm_cfg"]["quantization_ignored_layer_kws"]
    model = describe_model(upstream["policy"]["model_name"])
    spec = with_rules(modules=["*a_proj*", "*b_proj*"])
    for m in (model, None):
        out = to_nemo_rl(spec, m)
        assert out.keys == {
            "policy": {"generation": {"vllm_cfg": {"quantization_ignored_layer_kws": want}}}
        }
        assert want == ["a_proj", "b_proj"]
        assert len(out.warnings) == 2
        for w, label in zip(map(str, out.warnings), ("'*a_proj*'", "'*b_proj*'")):
            assert label in w and "host nemo-rl" in w and "training side" in w
    # The same rules on megatron-core: MLA's down/up projections, every layer.
    mg = to_megatron(spec, model)
    assert [mt["pattern"] for mt in mg.keys["quant_recipe"]["matchers"].values()] == [
        "decoder.layers.*.self_attention.linear_kv_down_proj",
        "decoder.layers.*.self_attention.linear_kv_up_proj",
    ]
    assert not mg.warnings
    # Without a model the leaf translation also names DeepSeek-V3's q_a_proj counterpart;
    # on Moonlight's modules it selects the same ones.
    import fnmatch

    def selected(keys):
        pats = [mt["pattern"] for mt in keys["quant_recipe"]["matchers"].values()]
        return {
            n for n in model.megatron_linear_modules if any(fnmatch.fnmatchcase(n, p) for p in pats)
        }

    assert selected(to_megatron(spec).keys) == selected(mg.keys)
    assert len(selected(mg.keys)) == 27 * 2
    vl = to_vllm(spec, model).keys["ignored_layers"]
    assert len(vl) == 27 * 2 and vl[:2] == [
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.self_attn.kv_b_proj",
    ]


def _nemo_rl_ignored(keywords, model):
    """NeMo RL's rule (nemo_rl/models/generation/fp8.py, init_fp8): a parameter is kept out of
    FP8 when its model.-prefixed name contains a keyword."""
    return {n for n in model.hf_linear_modules if any(k in n for k in keywords)}


@pytest.mark.parametrize(
    "model_name, rules",
    [
        ("llama3.1-8b", {"modules": ["*q_proj*"]}),
        ("llama3.1-8b", {"modules": ["model.layers.3.*", "*.linear_fc2"]}),
        ("qwen3-30b-a3b", {"modules": ["*experts.3.*"]}),
        ("qwen3-30b-a3b", {}),
        ("deepseek-v3", {"modules": ["*kv_a_proj*"]}),
    ],
)
def test_nemo_rl_keywords_reproduce_the_generation_decisions(model_name, rules):
    m = describe_model(model_name)
    spec = with_rules(**rules)
    out = to_nemo_rl(spec, m)
    assert not [w for w in map(str, out.warnings) if "also matches" in w]
    kws = (
        out.keys.get("policy", {})
        .get("generation", {})
        .get("vllm_cfg", {})
        .get("quantization_ignored_layer_kws", [])
    )
    ignored = _nemo_rl_ignored(kws, m)
    res = resolve(spec, m, "generation")
    for d in res.decisions:
        members = m.vllm_members(d.module)
        if d.rule in ("builtin:output_head",) or (
            d.rule == "builtin:router" and not m.vllm_quantizes_router
        ):
            continue
        want = d.precision == "bf16"
        assert {n in ignored for n in members} == {want}, (d, kws)


def test_llama_first_last_spellings():
    m = describe_model("llama3.1-8b")
    spec = with_rules(first=1, last=2)
    assert to_megatron(spec, m).keys == {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 2,
    }
    out = to_nemo_rl(spec, m)
    assert out.keys["policy"]["generation"]["vllm_cfg"] == {
        "num_first_layers_in_bf16": 1,
        "num_last_layers_in_bf16": 2,
    }
    # Training gets them through model_overrides (NeMo RL merges it into the model provider).
    assert out.keys["policy"]["megatron_cfg"]["model_overrides"] == {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 2,
    }
    assert out.warnings == []
    names = to_vllm(spec, m).keys["ignored_layers"]
    assert len(names) == 3 * 7
    assert (
        names[0] == "model.layers.0.self_attn.q_proj"
        and names[-1] == "model.layers.31.mlp.down_proj"
    )
    # Without a model vLLM cannot be spelt (no layer-count key): a warning per rule.
    bare = to_vllm(spec)
    assert bare.keys == {} and len(bare.warnings) == 2 and "host vllm" in str(bare.warnings[0])


def test_qwen3_moe_router_kept_bf16_on_vllm():
    m = describe_model("Qwen/Qwen3-30B-A3B")
    plain = BLOCKWISE
    names = to_vllm(plain, m).keys["ignored_layers"]
    assert names == [f"model.layers.{i}.mlp.gate" for i in range(48)]
    assert to_nemo_rl(plain, m).keys["policy"]["generation"]["vllm_cfg"] == {
        "quantization_ignored_layer_kws": ["mlp.gate"]
    }
    spec = with_rules(modules=["*experts.3.*"])
    names = to_vllm(spec, m).keys["ignored_layers"]
    assert "model.layers.0.mlp.experts" in names and len(names) == 48 * 2


def test_layer_specific_megatron_patterns_warn_about_pipeline_parallelism():
    m = describe_model("llama3.1-8b")
    out = to_megatron(with_rules(modules=["model.layers.3.mlp.*"]), m)
    pats = [mt["pattern"] for mt in out.keys["quant_recipe"]["matchers"].values()]
    assert pats == ["decoder.layers.3.mlp.linear_fc1", "decoder.layers.3.mlp.linear_fc2"]
    assert (
        len(out.warnings) == 1
        and "pipeline" in str(out.warnings[0])
        and "host megatron" in str(out.warnings[0])
    )
    generic = to_megatron(with_rules(modules=["model.layers.3.mlp.*"]))
    assert "without a model description" in str(generic.warnings[0])


# --------------------------------------------------------------------------- per name


RULE_SETS = [
    {"first": 1, "last": 1},
    {"modules": ["*a_proj*", "*b_proj*"]},
    {"modules": ["*down_proj*"], "first": 2},
    {"modules": ["*q_proj*"]},
    {"modules": ["*.linear_fc1"], "applies_to": "generation"},
]


@pytest.mark.parametrize(
    "model_name", ["llama3.1-8b", "moonlight-16b-a3b", "qwen3-30b-a3b", "deepseek-v3"]
)
@pytest.mark.parametrize("rules", RULE_SETS)
def test_name_only_decisions_agree_with_the_model_table(model_name, rules):
    """keeps_bf16 from the name alone (what the refit quantizer does per parameter) agrees
    with the full resolution, for every module under both namings."""
    m = describe_model(model_name)
    spec = with_rules(**rules)
    for side in SIDES:
        table = resolve(spec, m, side).by_module()
        names = list(table)
        if side == "generation":
            names += list(m.hf_linear_modules[:2500])
        for name in names:
            want = keeps_bf16(spec, name, side=side, num_layers=m.num_layers, model=m)
            got = keeps_bf16(spec, name + ".weight", side=side, num_layers=m.num_layers)
            assert (want is None) == (got is None), (side, name, want, got)
            if got is not None and not got.startswith("builtin"):
                assert got == want


def test_module_filter_and_errors():
    m = describe_model("llama3.1-8b")
    spec = with_rules(last=1, modules=["*down_proj*"])
    conv = module_filter(spec, num_layers=32, side="generation")
    assert conv("model.layers.0.self_attn.q_proj", object())
    assert not conv("model.layers.0.mlp.down_proj", object())
    assert not conv("model.layers.31.self_attn.q_proj", object())
    assert not conv("lm_head", object())
    exact = module_filter(spec, num_layers=32, side="training", model=m)
    assert not exact("decoder.layers.5.mlp.linear_fc2", None)
    assert exact("decoder.layers.5.mlp.linear_fc1", None)
    with pytest.raises(FP8ConfigError) as err:
        keeps_bf16(
            BF16Rules(last=1), "model.layers.3.mlp.up_proj", side="training", num_layers=None
        )
    assert err.value.key == "bf16_layers.last"
    with pytest.raises(FP8ConfigError):
        module_filter(BF16Rules(first=40), num_layers=32)
    assert (
        keeps_bf16(
            BLOCKWISE.replace(generation="bf16"),
            "model.layers.3.mlp.up_proj",
            side="generation",
            num_layers=32,
        )
        == "generation: bf16"
    )


def test_rules_import_without_torch_yaml_or_omegaconf():
    """The refit quantizer and the emulation converter call the rules on GPU machines that
    may have nothing but torch; config-only commands have no torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('yaml', 'omegaconf', 'torch'): sys.modules[m] = None\n"
        "from nemo_fp8_plugin import BF16Rules\n"
        "from nemo_fp8_plugin.rules import keeps_bf16, describe_model, resolve\n"
        "from nemo_fp8_plugin.hosts.vllm.rules import to_vllm\n"
        "m = describe_model('llama3.1-8b')\n"
        "assert keeps_bf16(BF16Rules(first=1), 'model.layers.0.mlp.up_proj.weight',"
        " side='generation', num_layers=32) == 'bf16_layers.first'\n"
        "assert len(resolve(BF16Rules(last=1), m, 'training').decisions) == 129\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
