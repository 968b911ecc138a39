"""The adapter contract and the one pipeline: ``explain`` shows what ``apply`` writes.

The equality is checked from the outside: ``apply`` runs as a command and writes a file;
the test diffs that file against the input with its own flattening (not the pipeline's
``diff_written``) and compares the result with ``explain --json``'s host section. Then the
three wrong results the duplicated paths produced, each pinned.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import NEMO_RL_TRIMMED
from nemo_fp8_plugin.hosts import ADAPTERS, HostAdapter, get_adapter, load_context, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "conf" / "examples").glob("*.yaml")) + [NEMO_RL_TRIMMED]
NEMO_RL = ROOT / "tests" / "fixtures" / "nemo_rl" / "examples" / "configs"

# The host each shipped example is written for, and the other hosts it also serves (a
# megatron-core model config is also a NeMo 2 / Bridge overlay; a NeMo RL config also
# describes the recipe TE builds).
SERVES = {
    "bridge_llama3_8b_pretrain_fp8_blockwise.yaml": ["bridge", "te"],
    "bridge_llama3_8b_pretrain_mxfp8.yaml": ["bridge", "te"],
    "demo_gpt_fp8_blockwise.yaml": ["megatron", "nemo2", "bridge", "te"],
    "llama3_8b_pretrain_fp8_blockwise.yaml": ["megatron", "nemo2", "bridge", "te"],
    "megatron_gpt_fp8_current.yaml": ["megatron", "nemo2", "bridge", "te"],
    "nemo2_llama32_1b_finetune_fp8_blockwise.yaml": ["nemo2", "te"],
    "nemo_rl_grpo_trimmed.yaml": ["nemo-rl", "te"],
    "vllm_llama8b_fp8_blockwise.yaml": ["vllm"],
    "vllm_moonlight_fp8_kv.yaml": ["vllm"],
}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def _leaves(node, prefix=""):
    """Dotted leaves of a nested mapping (lists and scalars are leaves)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def _topmost_missing(dotted: str, tree) -> str | None:
    """The shortest prefix of ``dotted`` that ``tree`` lacks, or None when all is there."""
    node, parts = tree, dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            return ".".join(parts[: i + 1])
        node = node[part]
    return None


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES) == sorted(SERVES)


def test_every_adapter_implements_the_contract():
    for name in ADAPTERS:
        adapter = get_adapter(name)
        assert isinstance(adapter, HostAdapter), name
        assert adapter.name == name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_explain_shows_what_apply_writes(example, tmp_path):
    report = json.loads(cli("explain", example, "--json").stdout)
    source = yaml.safe_load(example.read_text())
    for host in SERVES[example.name]:
        out = tmp_path / f"{host}.yaml"
        done = cli("apply", example, "--host", host, "-o", out)
        assert done.returncode == 0, done.stderr
        written = yaml.safe_load(out.read_text())
        section = report["hosts"][host]
        assert "refused" not in section, section
        if host == "te":  # a new document describing the recipe, not an edit
            assert section["keys"] == written
            continue
        before = dict(_leaves(source))
        after = dict(_leaves(written))
        changed = {k: v for k, v in after.items() if k not in before or before[k] != v}
        # NeMo RL writes `defaults:` paths relative to the output; explain has no output.
        changed.pop("defaults", None)
        shown = dict(_leaves(section["keys"]))
        shown.pop("defaults", None)
        assert shown == changed, host
        gone = sorted({_topmost_missing(k, written) for k in before if k not in after} - {None})
        assert sorted(section.get("removed", [])) == gone, host


def test_explain_refuses_what_the_configs_own_host_refuses(tmp_path):
    # More BF16 layers than the model has: megatron's apply refuses, so explain does.
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "fp8: {recipe: fp8_current, bf16_layers: {first: 3, last: 3}}\n"
        "model: {num_layers: 4, hidden_size: 128}\n"
    )
    applied = cli("apply", cfg, "--host", "megatron")
    explained = cli("explain", cfg)
    assert applied.returncode == explained.returncode == 2
    key = "error: fp8.bf16_layers.last:"
    assert key in applied.stderr and key in explained.stderr


def test_a_command_parses_the_config_once(tmp_path, monkeypatch):
    from nemo_fp8_plugin import config as config_mod
    from nemo_fp8_plugin import explain

    calls = []
    real = config_mod.load_yaml_file

    def counting(path):
        calls.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(config_mod, "load_yaml_file", counting)
    explain.build_report(NEMO_RL / "grpo_math_8B_megatron_fp8.yaml")
    # the file and each parent of its defaults: chain, once each, for all six hosts
    assert len(calls) == len(set(calls)), calls


# --------------------------------------------------------------------------- the three fixes


def _nemo_rl_child(tmp_path, extra: str) -> Path:
    path = tmp_path / "child.yaml"
    path.write_text(f"defaults: {NEMO_RL / 'grpo_math_8B_megatron.yaml'}\n{extra}")
    return path


def test_stated_fp8_param_is_the_same_in_explain_and_apply(tmp_path):
    """Was: explain showed NeMo RL `fp8_param: false` and told the user to state `true`,
    which they had; apply wrote `true`."""
    cfg = _nemo_rl_child(tmp_path, "fp8: {recipe: fp8_blockwise, fp8_param: true}\n")
    report = json.loads(cli("explain", cfg, "--json").stdout)
    section = report["hosts"]["nemo-rl"]
    assert section["keys"]["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_param"] is True
    assert not any("fp8_param" in w for w in section.get("warnings", []))
    out = tmp_path / "out.yaml"
    assert cli("apply", cfg, "--host", "nemo-rl", "-o", out).returncode == 0
    assert yaml.safe_load(out.read_text())["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_param"] is True
    # and a preset's fp8_param: true the user did not state stays false, with the warning
    preset = _nemo_rl_child(tmp_path, "policy: {precision: fp8_current}\n")
    # (fp8_current keeps training layers in BF16: model_overrides, main's)
    main = ("--stack", "nemo-rl-main-2026-08-22")
    section = json.loads(cli("explain", preset, "--json", *main).stdout)["hosts"]["nemo-rl"]
    # (false is the parent's value already, so nothing is written for it)
    assert section["keys"]["policy"]["megatron_cfg"]["fp8_cfg"].get("fp8_param") is not True
    assert any("fp8_param" in w for w in section["warnings"])


@pytest.mark.parametrize(
    "recipe, var, value",
    [
        ("fp8_current", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0"),
        ("fp8_blockwise", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1"),
        ("fp8_subchannel", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0"),
    ],
)
def test_nemo_rl_pins_every_te_variable_the_recipe_depends_on(tmp_path, recipe, var, value):
    """Was: the TE adapter pinned NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=0 for fp8_current,
    NeMo RL wrote nothing, so a cluster-wide `=1` flipped the recipe to power-of-2 scales."""
    cfg = _nemo_rl_child(tmp_path, f"policy: {{precision: {recipe}}}\n")
    # fp8_current's BF16 edge layers reach training through model_overrides (main's)
    data = run(get_adapter("nemo-rl"), load_context(cfg, stack="nemo-rl-main-2026-08-22")).data
    assert data["policy"]["megatron_cfg"]["env_vars"][var] == value
    te = run(get_adapter("te"), load_context(cfg)).data
    assert te["transformer_engine"]["env"] == {var: value}


def test_nemo_rl_keeps_a_stated_fp64_router_and_replaces_an_inherited_one(tmp_path):
    """Was: an explicit `moe_router_dtype: fp64` counted as neutral and became fp32. A value
    the file states is the user's (fp64 is more than FP8 MoE recipes need); one inherited from
    NeMo RL's base config (grpo_math_1B.yaml's fp64) is replaced by fp32, as NVIDIA's FP8
    Moonlight twin does."""
    base = NEMO_RL / "recipes" / "llm" / "grpo-moonlight-16ba3b-4n8g-megatron.yaml"
    stated = tmp_path / "stated.yaml"
    stated.write_text(
        f"defaults: {base}\npolicy:\n  precision: fp8_blockwise\n"
        f"  megatron_cfg:\n    moe_router_dtype: fp64\n"
    )
    data = run(get_adapter("nemo-rl"), load_context(stated)).data
    assert data["policy"]["megatron_cfg"]["moe_router_dtype"] == "fp64"
    inherited = tmp_path / "inherited.yaml"
    inherited.write_text(f"defaults: {base}\npolicy: {{precision: fp8_blockwise}}\n")
    assert load_context(inherited).resolved["policy"]["megatron_cfg"]["moe_router_dtype"] == "fp64"
    data = run(get_adapter("nemo-rl"), load_context(inherited)).data
    assert data["policy"]["megatron_cfg"]["moe_router_dtype"] == "fp32"
    # a lower-precision router stated in the file contradicts the recipe
    low = tmp_path / "low.yaml"
    low.write_text(stated.read_text().replace("fp64", "bf16"))
    done = cli("apply", low, "--host", "nemo-rl")
    assert done.returncode == 2 and "moe_router_dtype" in done.stderr


def test_nemo_rl_values_are_read_with_nemo_rls_resolvers(tmp_path):
    """`${mul:...}` is a number only once resolved with the resolvers NeMo RL registers: an
    expert-parallel size written as an interpolation still marks the model as MoE."""
    from nemo_fp8_plugin.hosts.nemo_rl.values import interpolated, resolved_value

    cfg = {"a": 4, "b": "${mul:${a}, 2}", "c": "${max:${b}, 3}", "d": "${add:1, ${div:${a}, 2}}"}
    assert interpolated(cfg) == {"a": 4, "b": 8, "c": 8, "d": 3.0}
    assert resolved_value(cfg, "c") == 8 and resolved_value(cfg, "missing", 7) == 7
    base = NEMO_RL / "grpo_math_8B_megatron.yaml"
    moe = tmp_path / "moe.yaml"
    moe.write_text(
        f"defaults: {base}\npolicy:\n  precision: fp8_blockwise\n  model_name: my-moe\n"
        f"  megatron_cfg:\n    expert_model_parallel_size: '${{mul:2, 4}}'\n"
    )
    data = run(get_adapter("nemo-rl"), load_context(moe)).data
    assert data["policy"]["megatron_cfg"]["moe_router_dtype"] == "fp32"


def test_explain_says_which_code_runs_for_each_host():
    """Explain says which path each host takes at run time: in NeMo RL, NeMo RL's own FP8
    generation path runs and the plugin's nemo_fp8 vLLM method does not; with vLLM directly
    the nemo_fp8 method is what runs."""
    example = NEMO_RL_TRIMMED
    hosts = json.loads(cli("explain", example, "--json").stdout)["hosts"]
    assert "init_fp8" in hosts["nemo-rl"]["runtime"] and "not used" in hosts["nemo-rl"]["runtime"]
    # vLLM's keys do not go into a NeMo RL config (apply refuses, so explain does).
    assert "not a vllm one" in hosts["vllm"]["refused"]
    vllm = ROOT / "conf" / "examples" / "vllm_llama8b_fp8_blockwise.yaml"
    own = json.loads(cli("explain", vllm, "--json").stdout)["hosts"]["vllm"]
    assert "nemo_fp8 quantization method" in own["runtime"]
    for name, section in hosts.items():
        assert section.get("runtime") or "refused" in section, name
