"""``nemo-fp8 explain`` for a person: warnings first, the config's own host,
one screen for every shipped example, detail behind flags, and the spelling ``apply`` writes.
``--json`` keeps every host (tests/hosts/test_pipeline.py checks it against ``apply``)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import NEMO_RL_TRIMMED, REPO
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.config import load_config
from nemo_fp8_plugin.hosts import ADAPTERS

pytestmark = pytest.mark.torch_free

EXAMPLES = sorted((REPO / "conf" / "examples").glob("*.yaml")) + [NEMO_RL_TRIMMED]
SCREEN = 60
"""The default view of every shipped example fits this many lines (about 60)."""

OWN = {
    "bridge_llama3_8b_pretrain_fp8_blockwise.yaml": "bridge",
    "bridge_llama3_8b_pretrain_mxfp8.yaml": "bridge",
    "demo_gpt_fp8_blockwise.yaml": "megatron",
    "llama3_8b_pretrain_fp8_blockwise.yaml": "megatron",
    "megatron_gpt_fp8_current.yaml": "megatron",
    "nemo2_llama32_1b_finetune_fp8_blockwise.yaml": "nemo2",
    "nemo_rl_grpo_trimmed.yaml": "nemo-rl",
    "vllm_llama8b_fp8_blockwise.yaml": "vllm",
    "vllm_moonlight_fp8_kv.yaml": "vllm",
}


def explain(capsys, *args) -> str:
    assert main(["explain", *map(str, args)]) == 0
    return capsys.readouterr().out


def host_section(text: str, host: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"apply --host {host} writes"))
    out = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        out.append(line)
    return out


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES) == sorted(OWN)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_default_view_fits_a_screen_and_leads_with_the_configs_host(example, capsys):
    text = explain(capsys, example)
    lines = text.splitlines()
    assert len(lines) <= SCREEN, f"{example.name}: {len(lines)} lines"
    own = OWN[example.name]
    if own == "nemo-rl":  # first, the NeMo RL release the keys are written for
        assert lines.pop(0).startswith("NeMo RL v0.7.0 (")
    assert lines[0] == f"config: {example}"
    assert lines[1].startswith(f"host: {own} (detected")
    shown = re.findall(r"^apply --host (\S+)", text, re.M)
    assert shown == [own]
    others = [ln for ln in lines if ln.startswith("other hosts")]
    assert len(others) == 1 and all(h in others[0] for h in ADAPTERS if h != own)
    # warnings come before the recipe, nothing of the kind after it
    recipe = next(i for i, ln in enumerate(lines) if ln.startswith("recipe: "))
    assert not any(ln.startswith("warning:") for ln in lines[recipe:])


def test_the_line_counts_of_the_default_view(capsys):
    """Measured, to report: every example within one screen."""
    counts = {p.name: len(explain(capsys, p).splitlines()) for p in EXAMPLES}
    assert max(counts.values()) <= SCREEN, counts


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_host_section_spells_what_apply_writes(example, tmp_path, capsys):
    own = OWN[example.name]
    section = host_section(explain(capsys, example), own)
    out = tmp_path / "out.yaml"
    assert main(["apply", str(example), "--host", own, "-o", str(out)]) == 0
    capsys.readouterr()
    written = load_config(out, follow_defaults=False)
    text = out.read_text()
    for line in section:
        key, sep, spelled = line.strip().partition(": ")
        if key in ("removes", "env", "note", "warning") or not sep or "--full lists" in spelled:
            continue
        node = written
        for part in key.split("."):
            node = node[part]
        assert yaml.safe_load(spelled) == node, line
        if not isinstance(node, (list, dict)):  # the same characters as in the file
            assert f"{key.rsplit('.', 1)[-1]}: {spelled}" in text, line


def test_warnings_come_first(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "precision: fp8_blockwise\nfp8: {bf16_layers: {first: 1}}\n"
        "model: {num_layers: 4, hidden_size: 1040}\n"
    )
    lines = explain(capsys, cfg).splitlines()
    assert lines[1].startswith("host: megatron")
    warnings = [i for i, ln in enumerate(lines) if ln.startswith("warning:")]
    assert warnings and warnings == list(range(2, 2 + len(warnings)))
    assert any("not a multiple of 128" in lines[i] for i in warnings)


def test_host_flag_and_all_hosts_show_more(capsys):
    example = NEMO_RL_TRIMMED
    text = explain(capsys, example, "--host", "te")
    assert text.splitlines()[1].startswith("host: te (--host); stack: ")
    assert re.findall(r"^apply --host (\S+)", text, re.M) == ["te"]
    every = explain(capsys, example, "--all-hosts")
    assert re.findall(r"^apply --host ([^\s:]+)", every, re.M) == [
        "nemo-rl",
        *[h for h in ADAPTERS if h != "nemo-rl"],
    ]  # the config's own host first
    assert "other hosts" not in every


def test_full_lists_every_field_and_every_name(capsys):
    moonlight = REPO / "conf" / "examples" / "vllm_moonlight_fp8_kv.yaml"
    short = explain(capsys, moonlight)
    assert "(27 items; --full lists them)" in short
    assert "generation (vLLM module names)" in short
    assert "training (megatron-core module names)" not in short  # vLLM does not train
    assert "(training side not shown" in short
    full = explain(capsys, moonlight, "--full")
    assert "model.layers.13.self_attn.kv_a_proj_with_mqa" in full
    assert "training (megatron-core module names)" in full
    assert re.search(r"^  kv_cache +fp8$", full, re.M)  # one field a line


def test_a_config_of_no_recognisable_host_summarises_them_all(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_blockwise\n")
    text = explain(capsys, cfg)
    assert "host: none detected" in text
    assert "apply --host" not in text
    summary = [ln for ln in text.splitlines() if ln.startswith("hosts (")]
    assert len(summary) == 1 and all(h in summary[0] for h in ADAPTERS)


def test_json_keeps_every_host(capsys):
    example = REPO / "conf" / "examples" / "vllm_llama8b_fp8_blockwise.yaml"
    report = json.loads(explain(capsys, example, "--json"))
    assert list(report["hosts"]) == ["vllm", *[h for h in ADAPTERS if h != "vllm"]]
    assert report["host"] == "vllm"
