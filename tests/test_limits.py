"""Bounded work and typed validation at the edges.

Bounded work: every size a user's input controls that drives work has a ceiling
(:data:`nemo_fp8_plugin.errors.LIMITS`: file size, YAML nesting depth, values once aliases
are expanded, alias references, ``defaults:`` chain length and fan-out, layers, experts,
per-module decisions) and past it the command refuses in one line naming the key; each file
of a command is parsed once; error messages render values bounded; a FIFO or device where a
config should be is refused, not read. Typed validation: duplicate keys at any depth (both
positions), duplicate vLLM spellings, ``precision:`` / ``mixed_precision:`` values, host
sections of the wrong type, demo and rl-check values and flags, and the RL library's
arguments (never a boolean guessed from a string).

Each test here failed before its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from counting import calls_and_result

from conftest import unblock_fifo_later
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import LIMITS, FP8ConfigError, format_value


def run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _bomb(levels: int, width: int = 9, where: str = "precision") -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines + [f"{where}: *a{levels - 1}"]) + "\n"


# --------------------------------------------------------------------------- YAML


def test_an_alias_bomb_is_refused_fast_even_where_the_message_shows_the_value(tmp_path):
    """9^8 = 43 million values from a 10-line file, in the one place (a wrong-typed
    ``precision:``) whose error message renders the value: before, that message alone ran
    for minutes and gigabytes. A child process with a timeout, so a regression fails here
    instead of stalling the suite."""
    path = write(tmp_path, _bomb(8))
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", "explain", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    one_line_error(proc.returncode, proc.stderr, "too many values")


@pytest.mark.parametrize("depth", [LIMITS.yaml_depth + 1, 400, 900])
@pytest.mark.parametrize("style", ["flow", "block"])
def test_deep_nesting_is_refused_in_one_line(tmp_path, capsys, depth, style):
    """Below libyaml's own limit (1000), deep nesting reached Python's recursion limit in
    the constructor, deep copies or the JSON writer: a traceback, or an unclear YAML error."""
    if style == "flow":
        text = "precision: fp8_blockwise\nx: " + "[" * depth + "1" + "]" * depth + "\n"
    else:
        text = (
            "precision: fp8_blockwise\n"
            + "".join("  " * i + f"k{i}:\n" for i in range(depth))
            + "  " * depth
            + "leaf: 1\n"
        )
    for argv in (["explain", "--json"], ["apply", "--host", "megatron"]):
        rc, err = run(capsys, argv[0], write(tmp_path, text), *argv[1:])
        one_line_error(rc, err, "levels deep")


def test_nesting_at_the_limit_is_read(tmp_path, capsys):
    text = (
        "precision: fp8_blockwise\nx: "
        + "[" * (LIMITS.yaml_depth - 1)
        + "1"
        + "]" * (LIMITS.yaml_depth - 1)
        + "\n"
    )
    rc, err = run(capsys, "explain", write(tmp_path, text))
    assert rc == 0, err


def test_alias_references_are_bounded(tmp_path, capsys):
    refs = "".join(f"k{i}: {{<<: *b, z: {i}}}\n" for i in range(LIMITS.yaml_aliases + 1))
    rc, err = run(capsys, "explain", write(tmp_path, "base: &b {x: 1}\n" + refs))
    one_line_error(rc, err, "alias references", str(LIMITS.yaml_aliases))
    refs = "".join(f"k{i}: {{<<: *b, z: {i}}}\n" for i in range(50))  # ordinary use
    rc, err = run(capsys, "explain", write(tmp_path, "base: &b {x: 1, y: [1, 2]}\n" + refs))
    assert rc == 0, err


def test_a_config_file_larger_than_the_limit_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(LIMITS, "config_bytes", 1000)
    rc, err = run(capsys, "explain", write(tmp_path, "precision: fp8_blockwise\n#" + "x" * 1000))
    one_line_error(rc, err, "too large", "1000")


@pytest.mark.parametrize(
    "text, key, lines",
    [
        (
            "a:\n  b: 1\n  c:\n    - {x: 1}\n    - x: 1\n      y: 2\n      x: 3\n",
            "a.c[1].x",
            "line 7, column 7; first at line 5, column 7",
        ),
        ("a: [{k: 1, j: 2, k: 3}]\n", "a[0].k", "line 1, column 18; first at line 1, column 6"),
        (
            "a:\n  b:\n    c: 1\n\n\n    c: 2\n",
            "a.b.c",
            "line 6, column 5; first at line 3, column 5",
        ),
        (
            "base: &b {x: 1}\nd:\n  <<: *b\n  y: 1\n  y: 2\n",
            "d.y",
            "line 5, column 3; first at line 4, column 3",
        ),
        ("precision: fp8_blockwise\n1: a\ntrue: b\n", "True", "line 3, column 1; first at line 2"),
    ],
)
def test_duplicate_keys_name_the_dotted_key_and_both_positions(tmp_path, capsys, text, key, lines):
    """Before, a nested duplicate named neither the key's path nor the duplicate's own
    position (only where the enclosing mapping began)."""
    rc, err = run(capsys, "explain", write(tmp_path, text))
    one_line_error(rc, err, f"{key}: duplicate key", lines)


# --------------------------------------------------------------------------- defaults chains


def _chain(tmp_path: Path, length: int) -> Path:
    for i in range(length):
        body = {"policy": {"megatron_cfg": {f"k{i}": i}}}
        if i + 1 < length:
            body["defaults"] = f"p{i + 1}.yaml"
        write(tmp_path, yaml.safe_dump(body), f"p{i}.yaml")
    return write(
        tmp_path,
        "defaults: p0.yaml\npolicy: {precision: fp8_blockwise, megatron_cfg: {enabled: true}}\n",
    )


def test_a_defaults_chain_longer_than_the_limit_is_refused(tmp_path, capsys):
    rc, err = run(capsys, "explain", _chain(tmp_path, LIMITS.defaults_depth + 2))
    one_line_error(rc, err, "defaults", "too long", str(LIMITS.defaults_depth))
    (tmp_path / "short").mkdir()
    rc, err = run(capsys, "explain", _chain(tmp_path / "short", 3))
    assert rc == 0, err


def test_a_defaults_fan_out_is_bounded_and_each_file_parsed_once(tmp_path, capsys, monkeypatch):
    """Two parents sharing a grandparent, ten levels deep: 2^10 paths to the root file.
    Before, every path re-parsed its files (a parse per reference)."""
    import nemo_fp8_plugin.config as config_module

    parsed: list[str] = []
    real = config_module.load_yaml_file
    monkeypatch.setattr(
        config_module, "load_yaml_file", lambda path: parsed.append(Path(path).name) or real(path)
    )
    write(tmp_path, "policy: {megatron_cfg: {enabled: true}}\n", "base.yaml")
    write(tmp_path, "defaults: base.yaml\npolicy: {megatron_cfg: {a: 1}}\n", "a.yaml")
    write(tmp_path, "defaults: base.yaml\npolicy: {megatron_cfg: {b: 1}}\n", "b.yaml")
    top = write(tmp_path, "defaults: [a.yaml, b.yaml]\npolicy: {precision: fp8_blockwise}\n")
    rc, err = run(capsys, "explain", top)
    assert rc == 0, err
    assert sorted(parsed) == ["a.yaml", "b.yaml", "base.yaml", "config.yaml"], parsed
    for i in range(10):  # level i names level i+1 twice
        write(tmp_path, f"defaults: [l{i + 1}.yaml, l{i + 1}.yaml]\n", f"l{i}.yaml")
    write(tmp_path, "policy: {megatron_cfg: {enabled: true}}\n", "l10.yaml")
    rc, err = run(
        capsys,
        "explain",
        write(tmp_path, "defaults: l0.yaml\npolicy: {precision: fp8_blockwise}\n"),
    )
    one_line_error(rc, err, "too many parent files", str(LIMITS.defaults_files))


@pytest.mark.parametrize("command", ["explain", "apply", "doctor"])
def test_each_command_parses_its_config_once(tmp_path, capsys, monkeypatch, command):
    import nemo_fp8_plugin.config as config_module

    parsed: list[str] = []
    real = config_module.load_yaml_file
    monkeypatch.setattr(
        config_module, "load_yaml_file", lambda path: parsed.append(Path(path).name) or real(path)
    )
    write(tmp_path, "policy: {megatron_cfg: {enabled: true}}\n", "parent.yaml")
    cfg = write(
        tmp_path,
        "defaults: parent.yaml\npolicy: {precision: fp8_blockwise, "
        "generation: {backend: vllm, vllm_cfg: {}}}\n",
    )
    extra = {"apply": ["--host", "nemo-rl", "-o", tmp_path / "out.yaml"]}.get(command, [])
    rc, err = run(capsys, command, cfg, *extra)
    # doctor exits 3 for a config that trains in FP8 where Transformer Engine is absent (the
    # test environments have none: docs/recipes.md, "doctor's exit codes")
    assert rc == (3 if command == "doctor" else 0), err
    assert sorted(parsed) == ["config.yaml", "parent.yaml"], parsed


# --------------------------------------------------------------------------- model sizes


@pytest.mark.parametrize(
    "fields, key",
    [
        (
            {
                "model_type": "llama",
                "num_hidden_layers": 100_000,
                "hidden_size": 128,
                "intermediate_size": 128,
            },
            "num_hidden_layers",
        ),
        (
            {
                "model_type": "qwen3_moe",
                "num_hidden_layers": 48,
                "hidden_size": 128,
                "intermediate_size": 128,
                "num_experts": 100_000,
                "moe_intermediate_size": 64,
            },
            "num_experts",
        ),
        (
            {
                "model_type": "qwen3_moe",
                "num_hidden_layers": 1000,
                "hidden_size": 128,
                "intermediate_size": 128,
                "num_experts": 1000,
                "moe_intermediate_size": 64,
            },
            "num_experts",
        ),  # each under its limit, the product (3 million modules) over
        ({"num_layers": 10**8, "hidden_size": 1024}, "model.num_layers"),
    ],
)
def test_model_sizes_are_bounded(fields, key):
    """Before, a layer count in the millions built names for hours (4096 layers x 4096
    experts: 79 s and 9 GB)."""
    from nemo_fp8_plugin.rules import describe_model

    work, err = calls_and_result(describe_model, fields)
    assert isinstance(err, FP8ConfigError) and "more than the limit" in str(err), err
    assert err.key == key
    assert work < 20_000, work  # refused from the sizes, before any name is built


def test_the_largest_real_models_are_within_the_limits():
    from nemo_fp8_plugin.rules import describe_model

    kimi = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "n_routed_experts": 384,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 1536,
    }
    assert describe_model(kimi).num_experts == 384
    assert (
        describe_model(
            {
                "model_type": "llama",
                "num_hidden_layers": 126,
                "hidden_size": 16384,
                "intermediate_size": 53248,
            }
        ).num_layers
        == 126
    )


def test_the_largest_real_moe_with_its_rules_is_within_the_limits():
    """Kimi K2 (61 layers x 384 experts) with seven module rules: described and resolved."""
    from nemo_fp8_plugin.rules import describe_model
    from nemo_fp8_plugin.rules.resolve import check_rule_work

    kimi = describe_model(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "n_routed_experts": 384,
            "moe_intermediate_size": 2048,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 1536,
        }
    )
    from nemo_fp8_plugin.spec import BF16Rules

    names = len(kimi.vllm_modules) + sum(len(m) for _, m in kimi.vllm_modules)
    check_rule_work(BF16Rules(modules=tuple(f"*.rule{i}.*" for i in range(7))), names, "kimi")


@pytest.mark.parametrize(
    ("rules", "limit", "value", "needle"),
    [
        (1_001, None, None, "module rules: 1001"),
        (60, "rule_checks", 10_000, "pairs to match"),
    ],
    ids=["rules", "rules-x-names"],
)
def test_module_rules_are_bounded_before_any_is_matched(
    tmp_path, capsys, monkeypatch, rules, limit, value, needle
):
    """Each rule is matched against every module name and explained alone (1.4 ms a rule on
    Llama 3.1 8B: 16,000 rules took 22 s; five on a 64 x 1,024-expert MoE, minutes)."""
    import importlib

    resolve = importlib.import_module("nemo_fp8_plugin.rules.resolve")
    if limit is not None:
        monkeypatch.setattr(LIMITS, limit, value)
    matched: list[int] = []
    real = resolve._match_unit
    monkeypatch.setattr(resolve, "_match_unit", lambda *a: matched.append(1) or real(*a))
    pats = "\n".join(f"    - 'model.layers.{i % 32}.mlp.nomatch{i}'" for i in range(rules))
    cfg = write(
        tmp_path,
        f"precision: fp8_blockwise\nfp8:\n  model: llama3.1-8b\n  bf16_layers:\n"
        f"    modules:\n{pats}\n",
    )
    rc, err = run(capsys, "explain", cfg)
    one_line_error(rc, err, "bf16_layers.modules", needle)
    assert matched == []


@pytest.mark.parametrize("command", ["explain", "apply"])
def test_module_rules_without_a_model_are_bounded_when_read(tmp_path, capsys, command):
    """With no model the count was checked nowhere: 20,000 rules took explain 14-33 s and
    printed 20,000 warnings, apply 7 s. The Python API reads the same block."""
    from nemo_fp8_plugin.registry import get_recipe

    pats = [f"*layers.{i}.mlp.nomatch" for i in range(LIMITS.bf16_rules + 1)]
    cfg = write(
        tmp_path,
        "precision: fp8_blockwise\nfp8:\n  bf16_layers:\n    modules:\n"
        + "".join(f"    - '{p}'\n" for p in pats),
    )
    out = tmp_path / "out.yaml"
    rc, err = run(capsys, command, cfg, *(["-o", out] if command == "apply" else []))
    one_line_error(rc, err, "fp8.bf16_layers.modules", f"module rules: {len(pats)}")
    assert not out.exists()
    with pytest.raises(FP8ConfigError, match="module rules") as caught:
        get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": pats}})
    assert caught.value.key == "bf16_layers.modules"
    rules = {"modules": pats[: LIMITS.bf16_rules]}
    assert (
        len(get_recipe({"recipe": "fp8_blockwise", "bf16_layers": rules}).bf16_layers.modules)
        == LIMITS.bf16_rules
    )


def test_config_values_are_bounded_where_every_command_stays_fast(tmp_path, capsys):
    """150,000 keys took 7-10 s in every config command (the parse, then each host's copy and
    comparison of the config). Measured by growth, not run: the Python calls one more
    thousand keys costs ``explain``, times the values the limit admits, stay within what a
    config command makes in a few seconds (the 200,000 admitted before: about 3x that)."""

    def explain(keys: int) -> int:
        text = "precision: fp8_blockwise\n" + "".join(f"k{i}: {i}\n" for i in range(keys))
        path = write(tmp_path, text, f"k{keys}.yaml")
        work, (rc, err) = calls_and_result(run, capsys, "explain", path)
        assert rc == 0, err
        return work

    explain(100)  # imports and caches, once per process
    per_thousand = 2 * (explain(1_000) - explain(500))  # about 165,000 calls
    # 150,000 keys: 25 million calls, 7-10 s; the limit's 50,000: about 8 million
    assert per_thousand * LIMITS.yaml_nodes / 1_000 < 12_000_000, per_thousand


def test_too_many_values_are_refused_from_the_parser_before_composing(
    tmp_path, capsys, monkeypatch
):
    """The composer built a node for every value before they were counted: 150,000 keys took
    5 s to be refused (a 16 MiB file, a minute). The parser's events are counted first."""
    from nemo_fp8_plugin import registry

    composed: list[int] = []
    real = registry._check_document
    monkeypatch.setattr(registry, "_check_document", lambda *a: composed.append(1) or real(*a))
    monkeypatch.setattr(LIMITS, "yaml_nodes", 100)
    lines = "".join(f"k{i}: {i}\n" for i in range(300))
    rc, err = run(capsys, "explain", write(tmp_path, "precision: fp8_blockwise\n" + lines))
    one_line_error(rc, err, "too many values")
    assert composed == []


def test_a_huge_layer_count_in_a_config_does_not_hang_explain(tmp_path, capsys):
    text = "precision: fp8_blockwise\nmodel: {num_layers: 100000000, hidden_size: 1024}\n"
    path = write(tmp_path, text)
    run(capsys, "explain", write(tmp_path, text, "warm.yaml"))  # imports, once per process
    work, (rc, err) = calls_and_result(run, capsys, "explain", path)
    assert rc == 0, err  # the rules are not shown; the limit is said
    assert work < 2_000_000, work  # 10^8 layers are never walked


# --------------------------------------------------------------------------- messages


def test_error_values_are_rendered_bounded():
    big = ["x"] * 9
    for _ in range(7):
        big = [big] * 9  # 4.8 million leaves, shared
    work, text = calls_and_result(format_value, big)
    assert len(text) <= 80 and work < 5_000, work  # a few items shown, never all

    class Hostile:
        def __repr__(self):
            raise RuntimeError("no")

    assert format_value(Hostile()).startswith("<Hostile")
    assert len(format_value("y" * 10**7)) <= 80


@pytest.mark.parametrize("key", ["fp8.\x1e", "fp8.a\nb", "fp8.\u2028"])
def test_an_error_is_one_line_whatever_the_key(tmp_path, capsys, key):
    cfg = write(
        tmp_path, yaml.safe_dump({"fp8": {"recipe": "fp8_blockwise", key.split(".")[1]: 1}})
    )
    rc, err = run(capsys, "explain", cfg)
    one_line_error(rc, err, "unknown key")


# --------------------------------------------------------------------------- special files


@pytest.mark.timeout(20)  # a FIFO regression fails here, not at 1200 s
def test_a_fifo_config_is_refused_not_read(tmp_path, capsys):
    """Before, a FIFO read as 'config file not found' from the CLI, and
    ``load_yaml_file`` (the registry's reader) blocked on it."""
    from nemo_fp8_plugin.registry import load_yaml_file

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    writer = unblock_fifo_later(fifo)
    for argv in (["explain", fifo], ["apply", fifo, "--host", "megatron"], ["doctor", fifo]):
        rc, err = run(capsys, *argv)
        one_line_error(rc, err, "FIFO")
    with pytest.raises(FP8ConfigError, match="FIFO"):
        load_yaml_file(fifo)
    assert not writer.found_reader, "the FIFO was opened for reading"


@pytest.mark.timeout(20)  # a FIFO regression fails here, not at 1200 s
def test_a_fifo_parent_is_refused(tmp_path, capsys):
    os.mkfifo(tmp_path / "parent.yaml")
    unblock_fifo_later(tmp_path / "parent.yaml")
    cfg = write(tmp_path, "defaults: parent.yaml\npolicy: {precision: fp8_blockwise}\n")
    rc, err = run(capsys, "explain", cfg)
    one_line_error(rc, err, "FIFO")


# --------------------------------------------------------------------------- typed values


@pytest.mark.parametrize(
    "text, key",
    [
        ("precision: 3\n", "precision"),
        ("precision: true\n", "precision"),
        ("precision: 1.5\n", "precision"),
        ("policy: {precision: false}\n", "policy.precision"),
        ("mixed_precision: [a]\n", "mixed_precision"),
        ("mixed_precision: 7\n", "mixed_precision"),
        ("mixed_precision: true\n", "mixed_precision"),
    ],
)
def test_a_precision_that_is_no_name_is_refused_not_read_as_no_fp8(tmp_path, capsys, text, key):
    """Before, each of these read as "no FP8 recipe requested" and exited 0."""
    for argv in (["explain"], ["apply", "--host", "nemo2"]):
        rc, err = run(capsys, argv[0], write(tmp_path, text), *argv[1:])
        one_line_error(rc, err, f"{key}: expected")


@pytest.mark.parametrize(
    "text",
    [
        "precision: bf16-mixed\n",
        "precision: 16\n",
        "precision: bfloat16\n",
        "precision: null\n",
        "policy: {precision: '${oc.env:P}'}\n",
        "mixed_precision: bf16_mixed\n",
        "mixed_precision: {bf16: true}\n",
    ],
)
def test_the_hosts_own_precisions_pass_through(tmp_path, capsys, text):
    rc, err = run(capsys, "explain", write(tmp_path, text))
    assert rc == 0, err


@pytest.mark.parametrize("key", ["precision", "fp8", "mixed_precision"])
def test_fp8_alone_says_what_to_write(tmp_path, capsys, key):
    """``fp8`` is NeMo RL's vLLM spelling; the nearest name by spelling, ``mxfp8``, is
    another format altogether and was what the error suggested."""
    rc, err = run(capsys, "explain", write(tmp_path, f"{key}: fp8\n"))
    one_line_error(rc, err, "fp8_blockwise", "NeMo RL")
    assert "did you mean 'mxfp8'" not in err


def test_two_spellings_of_one_vllm_option_are_refused(tmp_path, capsys):
    """Before, ``max-model-len`` and ``max_model_len`` were both kept; vLLM reads one."""
    cfg = write(
        tmp_path,
        "model: meta-llama/Llama-3.1-8B-Instruct\nmax-model-len: 4096\n"
        "max_model_len: 8192\nprecision: fp8_blockwise\n",
    )
    for argv in (["apply", cfg, "--host", "vllm"], ["explain", cfg, "--host", "vllm"]):
        rc, err = run(capsys, *argv)
        one_line_error(rc, err, "max_model_len", "max-model-len")


@pytest.mark.parametrize(
    "host, text, key",
    [
        ("nemo2", "precision: fp8_blockwise\ntrainer: {plugins: [1, 2]}\n", "trainer.plugins"),
        ("nemo2", "precision: fp8_blockwise\nmodel: text\n", "model"),
        ("nemo2", "precision: fp8_blockwise\nmodel: {config: [1]}\n", "model.config"),
        ("bridge", "precision: fp8_blockwise\nmodel: [1, 2]\n", "model"),
        ("megatron", "precision: fp8_blockwise\nlanguage_model: [1]\n", "language_model"),
        (
            "nemo-rl",
            "policy: {precision: fp8_blockwise, megatron_cfg: {enabled: true}, generation: [1]}\n",
            "policy.generation",
        ),
        (
            "nemo-rl",
            "policy: {precision: fp8_blockwise, megatron_cfg: {enabled: true}, "
            "generation: {backend: vllm, vllm_cfg: 3}}\n",
            "policy.generation.vllm_cfg",
        ),
        (
            "nemo-rl",
            "policy: {precision: fp8_blockwise, megatron_cfg: {enabled: true}}\nloss_fn: [1]\n",
            "loss_fn",
        ),
        ("vllm", "precision: fp8_blockwise\nmodel: {name: x}\n", "model"),
    ],
)
def test_a_wrong_typed_host_section_is_refused_naming_the_key(tmp_path, capsys, host, text, key):
    """Before, each was passed over or overwritten and apply exited 0."""
    for argv in (
        ["apply", "--host", host, "-o", tmp_path / "out.yaml"],
        ["explain", "--host", host],
    ):
        rc, err = run(capsys, argv[0], write(tmp_path, text), *argv[1:])
        one_line_error(rc, err, f"{key}: expected")
    assert not (tmp_path / "out.yaml").exists()


# --------------------------------------------------------------------------- demo, rl-check


@pytest.mark.parametrize(
    "block, key",
    [
        ("train: {seed: 4294967296}", "train.seed"),
        ("train: {weight_decay: -1.0}", "train.weight_decay"),
        ("train: {lr: .inf}", "train.lr"),
        ("train: {lr: .nan}", "train.lr"),
        ("model: {vocab_size: 100}", "model.vocab_size"),
        ("model: {num_layers: 100000}", "model.num_layers"),
        ("model: {hidden_size: 130, num_attention_heads: 4}", "model.hidden_size"),
        (
            "model: {num_layers: 64, hidden_size: 8192, ffn_hidden_size: 32768, num_attention_heads: 64}",
            "model.num_layers",
        ),
        ("train: {micro_batch_size: 4096}\nmodel: {seq_length: 8192}", "train.micro_batch_size"),
    ],
)
def test_demo_config_values_are_range_checked(tmp_path, block, key):
    """Before, each reached torch or megatron-core (a traceback) or built a model no CPU
    holds."""
    from nemo_fp8_plugin.tools.demo import load_demo_config

    with pytest.raises(FP8ConfigError) as info:
        load_demo_config(write(tmp_path, f"precision: fp8_blockwise\n{block}\n"))
    assert info.value.key == key


@pytest.mark.parametrize(
    "argv, key",
    [
        (["rl-check", "--seed", "-1"], "--seed"),
        (["rl-check", "--seed", str(2**64)], "--seed"),
        (["rl-check", "--steps", "0"], "--steps"),
        (["rl-check", "--steps", "10000000"], "--steps"),
        (["demo", "--steps", "10000000"], "--steps"),
        (["demo", "--steps", "-3"], "--steps"),
    ],
)
def test_demo_and_rl_check_flags_are_range_checked(tmp_path, capsys, monkeypatch, argv, key):
    monkeypatch.chdir(tmp_path)
    work, (rc, err) = calls_and_result(
        run, capsys, *argv, *(["--out", tmp_path / "o"] if argv[0] == "demo" else [])
    )
    one_line_error(rc, err, key)
    assert work < 500_000, work  # refused before any work (a training step is millions)


# --------------------------------------------------------------------------- the RL library


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"fused": "false"}, "fused"),
        ({"tp_rank": 0, "tp_size": "2"}, "tp_size"),
        ({"num_layers": "32"}, "num_layers"),
        ({"num_layers": True}, "num_layers"),
        ({"keep_bf16": "no"}, "keep_bf16"),
        ({"keep_bf16": lambda n: "false"}, "keep_bf16"),
        ({"shard_dim": "1", "tp_rank": 0, "tp_size": 2}, "shard_dim"),
        ({"mx_scale_layout": ["nemo_fp8"]}, "mx_scale_layout"),
        ({"spec": "fp8_bogus"}, "spec"),
        ({"named_tensors": "model.weight"}, "named_tensors"),
        ({"named_tensors": {"a.weight": [[1.0]]}}, "named_tensors"),
    ],
)
def test_quantize_for_refit_names_the_bad_argument(kwargs, key):
    """Before: ``fused="false"`` ran fused (a truthy string), ``tp_size="2"`` raised a raw
    TypeError, a list for a tensor an AttributeError."""
    import torch

    from nemo_fp8_plugin.rl import quantize_for_refit

    args = {
        "named_tensors": {"model.layers.0.mlp.up_proj.weight": torch.ones(128, 128)},
        "spec": "fp8_blockwise",
        **kwargs,
    }
    with pytest.raises(FP8ConfigError) as info:
        list(quantize_for_refit(args.pop("named_tensors"), args.pop("spec"), **args))
    assert info.value.key == key


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"overwrite": "no"}, "overwrite"),
        ({"copy_other_files": 1}, "copy_other_files"),
        ({"out_dir": 3}, "out_dir"),
        ({"spec": 3}, "spec"),
        ({"config": 3}, "config"),
    ],
)
def test_export_names_the_bad_argument(tmp_path, kwargs, key):
    import torch

    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    args = {
        "source": {"model.layers.0.mlp.up_proj.weight": torch.ones(128, 128)},
        "out_dir": tmp_path / "out",
        "spec": "fp8_blockwise",
        "config": {"model_type": "llama", "num_hidden_layers": 1},
        **kwargs,
    }
    with pytest.raises(FP8ConfigError) as info:
        export_fp8_checkpoint(args.pop("source"), args.pop("out_dir"), args.pop("spec"), **args)
    assert info.value.key == key
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "call, key",
    [
        (lambda m, rs, cal: rs(3), "model"),
        (lambda m, rs, cal: rs(m, forward=3), "forward"),
        (lambda m, rs, cal: rs(m, calibrator="x"), "calibrator"),
        (lambda m, rs, cal: rs(m, forward=lambda: None, include_q="false"), "include_q"),
        (lambda m, rs, cal: cal(m, include_q="no"), "include_q"),
    ],
)
def test_refresh_scales_names_the_bad_argument(call, key):
    """Before: a non-module raised a raw TypeError (a weak reference to it), and
    ``include_q="false"`` read as True."""
    import torch

    from nemo_fp8_plugin.rl import KVScaleCalibrator, refresh_scales

    with pytest.raises(FP8ConfigError) as info:
        call(torch.nn.Linear(2, 2), refresh_scales, KVScaleCalibrator)
    assert info.value.key == key


# --------------------------------------------------------------------------- quantizers


def _public_quantizers():
    """Every public quantizer of ``nemo_fp8_plugin.numerics``, called on a tensor ``x``."""
    import torch

    from nemo_fp8_plugin import numerics as N
    from nemo_fp8_plugin.numerics import fused

    one = torch.tensor(1.0)
    return {
        "quantize_nvfp4": lambda x: N.quantize_nvfp4(x.reshape(-1, 2**20)),
        "quantize_nvfp4_reference": lambda x: N.quantize_nvfp4_reference(x.reshape(-1, 2**20)),
        "fake_quant_nvfp4": lambda x: N.fake_quant_nvfp4(x.reshape(-1, 2**20)),
        "fake_quant_per_tensor": lambda x: N.fake_quant_per_tensor(x, "e4m3"),
        "fake_quant_with_scale": lambda x: fused.fake_quant_with_scale(x, one, one, "e4m3"),
        "tensor_amax": lambda x: N.tensor_amax(x),
    }


@pytest.mark.parametrize("name", sorted(_public_quantizers()))
def test_every_public_quantizer_applies_the_tensor_limit(name):
    """quantize_nvfp4 tried to allocate 4 TB for a 2^40-element expanded view (a RuntimeError);
    the FP8 quantizers refused it from the shape."""
    import torch

    x = torch.zeros(1).expand(2**40)  # 8 bytes of storage
    with pytest.raises(FP8ConfigError, match="too many elements") as err:
        _public_quantizers()[name](x)
    assert err.value.key == "x"


def test_nvfp4_refuses_what_it_cannot_quantize_naming_the_argument():
    """K=0 and a sparse tensor raised RuntimeError, a meta-device scale NotImplementedError."""
    import torch

    from nemo_fp8_plugin.numerics import fake_quant_nvfp4, quantize_nvfp4, quantize_with_scale

    cases = [
        (lambda: quantize_nvfp4(torch.zeros(4, 0)), "x", r"last dim \(K\) is 0"),
        (lambda: quantize_nvfp4(torch.eye(16).to_sparse()), "x", "sparse"),
        (lambda: fake_quant_nvfp4(torch.eye(16).to_sparse()), "x", "sparse"),
        (
            lambda: quantize_nvfp4(torch.ones(16, 16), global_amax=torch.ones((), device="meta")),
            "global_amax",
            "meta",
        ),
        (
            lambda: quantize_with_scale(torch.ones(4, 4), torch.ones((), device="meta")),
            "scale",
            "meta",
        ),
    ]
    for call, key, needle in cases:
        with pytest.raises(FP8ConfigError, match=needle) as err:
            call()
        assert err.value.key == key
    assert quantize_nvfp4(torch.zeros(0, 16)).shape == (0, 16)  # no rows: nothing to refuse
