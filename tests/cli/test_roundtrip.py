"""``nemo-fp8 apply`` edits the user's file and writes only where it may.

The central check, on every shipped example and every NeMo RL config (NVIDIA's, in
the repository's ``../shared/data/nemo_rl`` when present, and the copies under ``tests/fixtures``): the line
diff between input and output touches only lines that belong to a key the pipeline reports
writing (``written``) or dropping (``removed``, the request), located with PyYAML's own node
marks, not with the code under test; every comment, blank line, quote and number spelling
elsewhere is kept byte for byte; and ``apply`` on its own output is a no-op byte for byte.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SHARED_NEMO_RL, nemo_rl_configs, shared_nemo_rl
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.config import load_config
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import ADAPTERS, get_adapter, load_context, refuse_other_host, run

pytestmark = pytest.mark.torch_free

EXAMPLES = sorted((REPO / "conf" / "examples").glob("*.yaml"))
SHARED = SHARED_NEMO_RL / "examples" / "configs"
CONFIG_ROOTS = [r for r in (SHARED, nemo_rl_configs()) if r.is_dir()]
NEMO_RL_CONFIGS = [
    (root, p.relative_to(root)) for root in CONFIG_ROOTS for p in sorted(root.rglob("*.yaml"))
]


def _id(case) -> str:
    root, rel = case
    return f"{'shared' if root == SHARED else 'fixtures'}/{rel}"


def test_the_shared_nemo_rl_configs_are_there():
    """The cases above are collected from the shared data only when it is present: say so
    (a skip naming the path; under CI a failure) rather than run fewer cases silently."""
    assert any(shared_nemo_rl("examples/configs").rglob("*.yaml"))


def _copy_configs(root: Path, tmp_path: Path) -> Path:
    """A copy of ``root`` (an ``examples/configs`` folder) with its ``examples`` siblings, so
    ``defaults:`` that climb out of configs (``../../../../examples/modelopt/...``) resolve."""
    examples = tmp_path / "examples"
    shutil.copytree(root.parent, examples)
    return examples / root.name


# --------------------------------------------------------------------------- the line check


def _spans(text: str) -> dict[tuple, tuple[int, int]]:
    """Key path -> (first line, last line) of each mapping entry, from PyYAML's node marks."""

    def last_line(node) -> int:
        if isinstance(node, yaml.ScalarNode) or node.flow_style or not node.value:
            end = node.end_mark
            return end.line if end.column > 0 or end.line == node.start_mark.line else end.line - 1
        children = (
            [c for kv in node.value for c in kv]
            if isinstance(node, yaml.MappingNode)
            else node.value
        )
        return max(last_line(c) for c in children)

    out: dict[tuple, tuple[int, int]] = {}

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                here = path + (key.value,)
                out[here] = (key.start_mark.line, last_line(value))
                walk(value, here)

    walk(yaml.compose(text, Loader=yaml.SafeLoader), ())
    return out


def _tree_paths(written, prefix=()):
    """(path, is_leaf) for every node of the nested ``written`` mapping."""
    for key, value in written.items():
        path = prefix + (str(key),)
        leaf = not (isinstance(value, dict) and value)
        yield path, leaf
        if not leaf:
            yield from _tree_paths(value, path)


def _dotted_path(dotted: str, spans) -> tuple:
    for path in spans:
        if ".".join(path) == dotted:
            return path
    raise AssertionError(f"removed key {dotted} not in the input")


def assert_only_written_lines_change(before: str, after: str, written, removed) -> None:
    old, new = _spans(before), _spans(after)
    parsed = yaml.safe_load(before)
    owned_old: set[int] = set()
    owned_new: set[int] = set()
    for path, leaf in _tree_paths(written or {}):
        node = parsed
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if leaf or not isinstance(node, dict):  # a value replaced, or a key new with its value
            assert path in new, path
            owned_new.update(range(new[path][0], new[path][1] + 1))
            if path in old:
                owned_old.update(range(old[path][0], old[path][1] + 1))
    for dotted in removed:
        first, last = old[_dotted_path(dotted, old)]
        owned_old.update(range(first, last + 1))
    a, b = before.splitlines(), after.splitlines()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        # a block scalar that ended a file without a final newline, now followed by keys:
        # `|` must become `|-` for the value to stay the same
        chomped = {i for i in range(i1, i2) if a[i].endswith("|") and a[i] + "-" in b[j1:j2]}
        stray = [
            f"-{i + 1}: {a[i]}" for i in range(i1, i2) if i not in owned_old and i not in chomped
        ] + [
            f"+{j + 1}: {b[j]}"
            for j in range(j1, j2)
            if j not in owned_new and b[j][:-1] not in {a[i] for i in chomped}
        ]
        assert not stray, "lines outside the written keys changed:\n" + "\n".join(stray)


def apply_cli(capsys, *args) -> tuple[int, str, str]:
    rc = main(["apply", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def check_edit(capsys, config: Path, host: str, out: Path) -> str:
    """Apply, check the line diff and the idempotence, return the output."""
    result = run(get_adapter(host), load_context(config, output=out))
    rc, _, err = apply_cli(capsys, config, "--host", host, "-o", out)
    assert rc == 0, err
    before, after = config.read_text(), out.read_text()
    assert load_config(out, follow_defaults=False) == result.data  # what the host reads
    assert_only_written_lines_change(before, after, result.written, result.removed)
    again = out.with_name("again-" + out.name)
    rc, _, err = apply_cli(capsys, out, "--host", host, "-o", again)
    assert rc == 0, err
    assert again.read_bytes() == out.read_bytes()
    return after


# --------------------------------------------------------------------------- examples


CASES = [(e, h) for e in EXAMPLES for h in ADAPTERS if h != "te"]


@pytest.mark.parametrize("example, host", CASES, ids=lambda v: getattr(v, "name", v))
def test_examples_change_only_the_written_keys(example, host, tmp_path, capsys):
    out = tmp_path / "out.yaml"
    try:
        ctx, adapter = load_context(example), get_adapter(host)
        refuse_other_host(adapter, ctx)  # apply --host refuses another host's config
        run(adapter, ctx)
    except FP8ConfigError:  # a host the example is not for: refused as one line, nothing written
        rc, _, err = apply_cli(capsys, example, "--host", host, "-o", out)
        one_line_error(rc, err)
        assert not out.exists()
        return
    after = check_edit(capsys, example, host, out)
    comments = [ln for ln in example.read_text().splitlines() if ln.lstrip().startswith("#")]
    assert all(c in after.splitlines() for c in comments)  # every comment line survives


def test_transformer_engine_output_is_a_new_document(tmp_path, capsys):
    out = tmp_path / "te.yaml"
    rc, _, err = apply_cli(capsys, EXAMPLES[0], "--host", "te", "-o", out)
    assert rc == 0, err
    assert list(yaml.safe_load(out.read_text())) == ["transformer_engine"]


def test_the_request_line_goes_and_its_neighbours_stay(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "# head\n"
        "precision: fp8_current   # the one line\n"
        "# about the model\n"
        "\n"
        "model:\n"
        "  num_layers: 4     # aligned\n"
        "  hidden_size: 256\n"
        "  lr: 3.0e-7\n"
        "  name: 'tiny'\n"
        "  # trailing note about train\n"
        "train: {steps: 10}\n"
    )
    rc, out, err = apply_cli(capsys, cfg, "--host", "megatron")
    assert rc == 0, err
    assert out.startswith(
        "# head\n# about the model\n\nmodel:\n  num_layers: 4     # aligned\n"
        "  hidden_size: 256\n  lr: 3.0e-7\n  name: 'tiny'\n  fp8: hybrid\n"
    )
    # a new parent goes at the end (fp8_current: keys that differ from megatron-core's defaults)
    assert (
        "  num_layers_at_end_in_bf16: 1\n  # trailing note about train\ntrain: {steps: 10}\n"
        "ddp:\n  fp8_param_gather: true\n" in out
    )


# --------------------------------------------------------------------------- NeMo RL configs


@pytest.mark.parametrize("case", NEMO_RL_CONFIGS, ids=_id)
def test_nemo_rl_config_without_a_request_comes_back_byte_for_byte(case, tmp_path, capsys):
    root, rel = case
    rc, out, err = apply_cli(capsys, root / rel, "--host", "nemo-rl", "--diff")
    assert rc == 0 and out == "", err
    if "fp8" in Path(rel).name:  # NVIDIA's FP8 configs: read back as a recipe, left as is
        assert "already FP8 in NeMo RL's own keys, read as" in err and "left as it is" in err
    else:
        assert "no FP8 recipe requested" in err
    tree = _copy_configs(root, tmp_path)
    sibling = (tree / rel).with_name("out.yaml")  # relative defaults: stay valid as written
    rc, _, err = apply_cli(capsys, tree / rel, "--host", "nemo-rl", "-o", sibling)
    assert rc == 0, err
    assert sibling.read_bytes() == (root / rel).read_bytes()


def _requests(text: str) -> list[str]:
    """The config with an FP8 request added, the ways a user would write one."""
    out = []
    policy = re.search(r"^policy:\n(?:(?:  .*|\s*)\n)*?  precision: .*$", text, re.M)
    if policy:
        line = policy.group(0).splitlines()[-1]
        at = policy.end() - len(line)
        request = "  precision: fp8_blockwise  # FP8 from here on"
        out.append(text[:at] + request + text[policy.end() :])
    tail = text if text.endswith("\n") else text + "\n"
    out.append(tail + "precision: fp8_blockwise\n")
    out.append(tail + "fp8: {recipe: fp8_blockwise, training: bf16}  # FP8 rollouts only\n")
    return out


@pytest.mark.parametrize("case", NEMO_RL_CONFIGS, ids=_id)
def test_nemo_rl_config_with_a_request_changes_only_the_written_keys(case, tmp_path, capsys):
    root, rel = case
    tree = _copy_configs(root, tmp_path)  # the defaults: chain, with its relative paths
    config = tree / rel
    refusals = []
    for text in _requests((root / rel).read_text()):
        config.write_text(text)
        try:
            run(get_adapter("nemo-rl"), load_context(config))
        except FP8ConfigError as err:
            refusals.append(str(err))
            rc, _, stderr = apply_cli(
                capsys, config, "--host", "nemo-rl", "-o", tmp_path / "x.yaml"
            )
            one_line_error(rc, stderr)
            assert not (tmp_path / "x.yaml").exists()
            continue
        check_edit(capsys, config, "nemo-rl", config.with_name("fp8-" + config.name))
        return
    # NVIDIA's FP8 twins already spell FP8 natively: a request on top contradicts them
    assert "fp8" in rel.name, refusals
    assert any("already set" in r for r in refusals), refusals


def test_a_config_whose_parent_holds_the_request_keeps_its_own_text(tmp_path, capsys):
    parent = tmp_path / "base.yaml"
    for name in ("grpo_math_8B_megatron.yaml", "grpo_math_1B_megatron.yaml", "grpo_math_1B.yaml"):
        shutil.copy(nemo_rl_configs() / name, tmp_path / name)
    parent.write_text(
        'defaults: "grpo_math_8B_megatron.yaml"\npolicy:\n  precision: fp8_blockwise\n'
    )
    child = tmp_path / "child.yaml"
    child.write_text("# my run\ndefaults: base.yaml\ngrpo:\n  max_num_steps: 10  # short\n")
    check_edit(capsys, child, "nemo-rl", tmp_path / "out.yaml")


# --------------------------------------------------------------------------- formats


def test_json_stays_json_and_unchanged_json_is_byte_for_byte(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(
        '{"precision": "fp8_blockwise",\n "model": {"num_layers": 4, "hidden_size": 256}}'
    )
    out = tmp_path / "out.json"
    rc, _, err = apply_cli(capsys, cfg, "--host", "megatron", "-o", out)
    assert rc == 0, err
    data = json.loads(out.read_text())
    assert "precision" not in data and data["model"]["fp8_recipe"] == "blockwise"
    rc, again, _ = apply_cli(capsys, out, "--host", "megatron")
    assert rc == 0 and again == out.read_text()
    rc, _, err = apply_cli(capsys, cfg, "--host", "megatron", "--in-place")
    assert rc == 0 and json.loads(cfg.read_text()) == data


def test_crlf_and_a_missing_final_newline_are_kept(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(
        b"# windows\r\nprecision: fp8_current\r\nmodel:\r\n  num_layers: 4\r\n"
        b"  hidden_size: 256\r\n\r\ntrain:\r\n  steps: 1"
    )
    out = tmp_path / "out.yaml"
    rc, _, err = apply_cli(capsys, cfg, "--host", "megatron", "-o", out)
    assert rc == 0, err
    text = out.read_bytes()
    assert b"\n" not in text.replace(b"\r\n", b"")  # every line ends the file's way
    assert text.startswith(
        b"# windows\r\nmodel:\r\n  num_layers: 4\r\n  hidden_size: 256\r\n  fp8: hybrid\r\n"
    )
    assert b"\r\n\r\ntrain:\r\n  steps: 1\r\nddp:\r\n" in text  # the new parent after it


def test_spellings_of_replaced_values_follow_the_file(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"defaults: {nemo_rl_configs() / 'grpo_math_8B_megatron.yaml'}\n"
        "policy:\n  precision: fp8_blockwise\n  generation:\n    vllm_cfg:\n"
        '      use_deep_gemm: False\n      precision: "bfloat16"\n'
        "loss_fn: {use_importance_sampling_correction: false}\n"
    )
    rc, out, err = apply_cli(capsys, cfg, "--host", "nemo-rl")
    assert rc == 0, err
    # use_deep_gemm: the user's own false is a kernel choice, kept as written
    assert "      use_deep_gemm: False\n" in out and '      precision: "fp8"\n' in out
    # the one key that changes: the flow mapping stays flow (the parent already sets the rest)
    assert "loss_fn: {use_importance_sampling_correction: true}\n" in out


def test_a_replaced_boolean_follows_the_files_capitalisation(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"defaults: {nemo_rl_configs() / 'grpo_math_8B_megatron.yaml'}\n"
        "policy:\n  precision: fp8_blockwise\n"
        "loss_fn:\n  use_importance_sampling_correction: False\n"
    )
    rc, out, err = apply_cli(capsys, cfg, "--host", "nemo-rl")
    assert rc == 0, err
    assert "loss_fn:\n  use_importance_sampling_correction: True\n" in out


def test_a_flow_mapping_whose_keys_exist_stays_flow(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"defaults: {nemo_rl_configs() / 'grpo_math_8B_megatron.yaml'}\n"
        "policy:\n  precision: fp8_blockwise\n"
        "loss_fn: {use_importance_sampling_correction: false, "
        "sequence_level_importance_ratios: false, truncated_importance_sampling_type: "
        "null, truncated_importance_sampling_ratio: null, "
        "truncated_importance_sampling_ratio_min: null}  # IS\n"
    )
    out = tmp_path / "o.yaml"
    rc, _, err = apply_cli(capsys, cfg, "--host", "nemo-rl", "-o", out)
    assert rc == 0, err
    assert (
        "loss_fn: {use_importance_sampling_correction: true, "
        "sequence_level_importance_ratios: false, " in out.read_text()
    )


def test_anchors_and_aliases_are_kept(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "precision: fp8_blockwise\nsizes: &sizes {num_layers: 4, hidden_size: 256}\n"
        "model:\n  <<: *sizes\n  seq_length: 128\n"
    )
    rc, out, err = apply_cli(capsys, cfg, "--host", "megatron")
    assert rc == 0, err
    assert "sizes: &sizes {num_layers: 4, hidden_size: 256}\n" in out and "<<: *sizes" in out
    assert yaml.safe_load(out)["model"]["fp8_recipe"] == "blockwise"


# --------------------------------------------------------------------------- safety


@pytest.mark.parametrize(
    "text, needle",
    [
        # YAML 1.1 (the safe loader) and 1.2 (ruamel) read these differently
        ("precision: fp8_blockwise\nmodel: {num_layers: 4, hidden_size: 256}\nflag: yes\n", "flag"),
        (
            "precision: fp8_blockwise\nmodel: {num_layers: 4, hidden_size: 256}\nmode: 0755\n",
            "mode",
        ),
        # what the safe loader refuses, refused before ruamel sees it
        (
            "precision: fp8_blockwise\nx: !!python/object/apply:os.system ['true']\n",
            "python/object",
        ),
        ("precision: fp8_blockwise\nx: !custom 1\n", "custom"),
        ("precision: fp8_blockwise\nmodel:\n  a: 1\n  a: 2\n", "duplicate key"),
    ],
)
def test_what_the_two_parsers_would_read_differently_is_refused(tmp_path, capsys, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    out = tmp_path / "out.yaml"
    rc, _, err = apply_cli(capsys, cfg, "--host", "megatron", "-o", out)
    one_line_error(rc, err, needle)
    assert not out.exists()


@pytest.mark.parametrize(
    ("limit", "what"), [("roundtrip_bytes", "bytes"), ("roundtrip_nodes", "values")]
)
def test_a_file_past_the_edit_limits_is_refused_not_left_running(
    megatron_cfg, capsys, monkeypatch, limit, what
):
    from nemo_fp8_plugin.errors import LIMITS

    monkeypatch.setattr(LIMITS, limit, 2)
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron")
    one_line_error(rc, err, what, "-o OUT.json")


def test_deep_nesting_is_a_one_line_error_or_an_edit(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "precision: fp8_blockwise\nmodel: {num_layers: 4, hidden_size: 256}\n"
        "deep: " + "[" * 300 + "]" * 300 + "\n"
    )
    rc, out, err = apply_cli(capsys, cfg, "--host", "megatron")
    assert "Traceback" not in err
    if rc == 0:
        assert out.endswith("[" * 300 + "]" * 300 + "\n")
    else:
        one_line_error(rc, err)


@pytest.mark.parametrize("header", ["%YAML 1.2\n---\n", "---\n", "# about\n%YAML 1.2\n--- # doc\n"])
def test_a_block_mapping_keeps_its_header_when_the_request_line_below_it_goes(
    tmp_path, capsys, header
):
    """The lines only the source has before the first change (the directives and ``---``,
    which ruamel does not re-emit) are carried over by the merge: with the request the first
    key under them, its removal is that first change (the flow-mapping test of the hostile
    suite reaches ruamel's own rendering instead, which puts the header back by itself)."""
    cfg = tmp_path / "c.yaml"
    body = "model:\n  num_layers: 4  # four\n"
    cfg.write_text(header + "precision: fp8_blockwise\n" + body)
    rc, out, err = apply_cli(capsys, cfg, "--host", "megatron")
    assert rc == 0, err
    assert out == header + body + "  fp8: e4m3\n  fp8_recipe: blockwise\n", out


# --------------------------------------------------------------------------- bounded work


def _ruamel_passes(monkeypatch) -> list[str]:
    """Every ruamel.yaml load and dump an edit makes, by name."""
    from nemo_fp8_plugin import roundtrip

    passes: list[str] = []
    for name in ("_rt_load", "_dump"):
        real = getattr(roundtrip, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            passes.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(roundtrip, name, counted)
    return passes


def test_a_file_past_the_edit_limits_is_refused_before_ruamel_reads_it(
    tmp_path, capsys, monkeypatch
):
    """A one-line flow list of 150k items took 94 s (a 15 MB value 84 s): the line limit let
    both through. Bytes and values are counted from what the safe loader read."""
    passes = _ruamel_passes(monkeypatch)
    cfg = tmp_path / "c.yaml"
    items = ", ".join(["1"] * 6_000)  # 6,000 values: past the 5,000 edited in place
    cfg.write_text(f"precision: fp8_blockwise\nmodel: {{num_layers: 4}}\nitems: [{items}]\n")
    rc, _, err = apply_cli(capsys, cfg, "--host", "megatron")
    one_line_error(rc, err, "too large to edit in place: values", "-o OUT.json")
    cfg.write_text(f"precision: fp8_blockwise\nmodel: {{num_layers: 4}}\nblob: {'x' * 600_000}\n")
    rc, _, err = apply_cli(capsys, cfg, "--host", "megatron")
    one_line_error(rc, err, "too large to edit in place: bytes")
    assert passes == []
    rc, out, _ = apply_cli(capsys, cfg, "--host", "megatron", "-o", tmp_path / "o.json")
    assert rc == 0 and json.loads((tmp_path / "o.json").read_text())["blob"] == "x" * 600_000


MIXED = (
    "precision: fp8_blockwise\n"
    "model:\n"
    "    num_layers: 4\n"
    "    hidden_size: 256\n"
    "other:\n"
    "  list:\n"
    "  - a\n"
    "  -   b: 1\n"
)


def test_an_edit_at_the_limits_takes_three_ruamel_passes(tmp_path, capsys, monkeypatch):
    """Each save was serialized up to 17 times (every indentation tried, each with a new
    load): at the limits an edit now takes one load and two emissions; a small file keeps
    trying the others."""
    from nemo_fp8_plugin.errors import LIMITS
    from nemo_fp8_plugin.roundtrip import _count_values

    cfg = tmp_path / "c.yaml"
    cfg.write_text(MIXED)
    passes = _ruamel_passes(monkeypatch)
    rc, small, err = apply_cli(capsys, cfg, "--host", "megatron")
    assert rc == 0, err
    assert len(passes) > 3  # the file mixes indentations: others are tried
    monkeypatch.setattr(LIMITS, "roundtrip_nodes", _count_values(yaml.safe_load(MIXED)))
    passes.clear()
    rc, at_limit, err = apply_cli(capsys, cfg, "--host", "megatron")
    assert rc == 0, err
    assert sorted(passes) == ["_dump", "_dump", "_rt_load"]
    assert yaml.safe_load(at_limit) == yaml.safe_load(small)


@pytest.mark.timeout(60)  # quadratic: minutes
def test_repeated_lines_do_not_make_the_line_diff_quadratic(tmp_path, capsys):
    """difflib's matcher is quadratic in lines that repeat (20,000 blank lines: 4e8 steps);
    the merge anchors on lines unique to both sides first."""
    cfg = tmp_path / "c.yaml"
    gap = "\n" * 20_000
    cfg.write_text(f"# top\nprecision: fp8_blockwise\n{gap}model: {{num_layers: 4}}\n{gap}x: 1\n")
    rc, out, err = apply_cli(capsys, cfg, "--host", "megatron")
    assert rc == 0, err
    assert out.startswith("# top\n") and out.endswith(f"{gap}x: 1\n")
    assert out.count("\n") >= 40_000


# --------------------------------------------------------------------------- where it writes


@pytest.fixture
def megatron_cfg(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# mine\nprecision: fp8_current\nmodel: {num_layers: 4, hidden_size: 256}\n")
    return cfg


def test_diff_prints_the_change_and_writes_nothing(megatron_cfg, capsys):
    before = megatron_cfg.read_bytes()
    rc, out, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "--diff")
    assert rc == 0, err
    assert out.startswith(
        f"--- {megatron_cfg}\n+++ {megatron_cfg} (nemo-fp8 apply --host megatron)\n"
    )
    assert "-precision: fp8_current\n" in out and "+  fp8_recipe: tensorwise\n" in out
    assert megatron_cfg.read_bytes() == before
    rc, _, _ = apply_cli(capsys, megatron_cfg, "--host", "megatron", "--in-place")
    rc, out, _ = apply_cli(capsys, megatron_cfg, "--host", "megatron", "--diff")
    assert rc == 0 and out == ""  # nothing left to change
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "--diff", "-o", "x.yaml")
    one_line_error(rc, err, "--diff")


def test_in_place_edits_the_input_atomically(megatron_cfg, capsys):
    inode = megatron_cfg.stat().st_ino
    rc, out, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "--in-place")
    assert rc == 0 and out == "", err
    text = megatron_cfg.read_text()
    # keys added to a short flow mapping: block style, one a line
    assert text.startswith("# mine\nmodel:\n  num_layers: 4\n  hidden_size: 256\n  fp8: hybrid\n")
    assert megatron_cfg.stat().st_ino != inode  # a new file renamed over, never half-written
    assert [p.name for p in megatron_cfg.parent.iterdir()] == ["c.yaml"]  # no temp file left
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "--in-place")
    assert rc == 0 and megatron_cfg.read_text() == text and "unchanged" in err
    rc, _, err = apply_cli(
        capsys,
        megatron_cfg,
        "--host",
        "megatron",
        "--in-place",
        "-o",
        megatron_cfg.with_name("other.yaml"),
    )
    one_line_error(rc, err, "--in-place")


def test_in_place_never_writes_a_parent(tmp_path, capsys):
    parent = tmp_path / "base.yaml"
    parent.write_text(f"defaults: {nemo_rl_configs() / 'grpo_math_8B_megatron.yaml'}\n# base\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: base.yaml\npolicy:\n  precision: fp8_blockwise\n")
    before = parent.read_bytes()
    rc, _, err = apply_cli(capsys, child, "--host", "nemo-rl", "--in-place")
    assert rc == 0, err
    assert parent.read_bytes() == before
    assert yaml.safe_load(child.read_text())["defaults"] == "base.yaml"  # still relative


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "relative"])
def test_output_naming_the_input_is_refused(megatron_cfg, capsys, how, monkeypatch):
    before = megatron_cfg.read_bytes()
    target = megatron_cfg
    if how == "symlink":
        target = megatron_cfg.with_name("link.yaml")
        target.symlink_to(megatron_cfg)
    elif how == "hardlink":
        target = megatron_cfg.with_name("hard.yaml")
        os.link(megatron_cfg, target)
    elif how == "relative":
        monkeypatch.chdir(megatron_cfg.parent)
        target = Path("sub/../c.yaml")
        (megatron_cfg.parent / "sub").mkdir()
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", target)
    one_line_error(rc, err, "--output", "--in-place")
    assert megatron_cfg.read_bytes() == before


def test_output_naming_a_parent_of_the_chain_is_refused(tmp_path, capsys):
    grand = tmp_path / "grand.yaml"
    shutil.copy(nemo_rl_configs() / "grpo_math_8B_megatron.yaml", grand)
    base = nemo_rl_configs() / "grpo_math_1B_megatron.yaml"
    grand.write_text(
        grand.read_text().replace('defaults: "grpo_math_1B_megatron.yaml"', f"defaults: {base}")
    )
    parent = tmp_path / "parent.yaml"
    parent.write_text("defaults: grand.yaml\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: parent.yaml\npolicy:\n  precision: fp8_blockwise\n")
    for target in (parent, grand):
        before = target.read_bytes()
        rc, _, err = apply_cli(capsys, child, "--host", "nemo-rl", "-o", target)
        one_line_error(rc, err, "--output", "defaults")
        assert target.read_bytes() == before


def test_dash_is_standard_output(megatron_cfg, capsys):
    rc, out, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", "-")
    assert rc == 0 and out.startswith("# mine\nmodel:"), err
    assert not (megatron_cfg.parent / "-").exists()


def test_dev_null_is_written_through_not_replaced(megatron_cfg, capsys):
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", os.devnull)
    assert rc == 0, err
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_fifo_without_a_reader_is_refused_at_once(megatron_cfg, capsys):
    fifo = megatron_cfg.with_name("pipe")
    os.mkfifo(fifo)
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", fifo)
    one_line_error(rc, err, str(fifo), "FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_fifo_with_a_reader_gets_the_result(megatron_cfg, capsys):
    fifo = megatron_cfg.with_name("pipe")
    os.mkfifo(fifo)
    got: list[bytes] = []
    opened = threading.Event()

    def read():
        with open(fifo, "rb") as fh:
            opened.set()
            got.append(fh.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # open for writing blocks until the reader is there, so wait for the reader's open
    with open(fifo, "wb", buffering=0) as keep:  # noqa: F841 - unblocks the reader's open
        opened.wait(10)
        rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", fifo)
    reader.join(10)
    assert rc == 0, err
    assert got and got[0].startswith(b"# mine\nmodel:")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_symlinked_output_writes_its_target_and_keeps_the_link(megatron_cfg, capsys):
    real = megatron_cfg.with_name("real.yaml")
    real.write_text("old\n")
    link = megatron_cfg.with_name("link.yaml")
    link.symlink_to(real.name)
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", link)
    assert rc == 0, err
    assert link.is_symlink() and real.read_text().startswith("# mine\nmodel:")


def test_a_255_character_name_is_written(megatron_cfg, capsys):
    out = megatron_cfg.with_name("o" * 250 + ".yaml")
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", out)
    assert rc == 0, err
    assert out.read_text().startswith("# mine\n")


def test_an_unwritable_place_is_named_before_any_work(megatron_cfg, capsys):
    """An output whose folder cannot exist (its "folder" is a regular file): refused with the
    path, before any work. (A read-only folder would not do here: CI runs as root, which
    writes into read-only folders.)"""
    blocker = megatron_cfg.parent / "not_a_dir"
    blocker.write_text("a file\n")
    rc, _, err = apply_cli(capsys, megatron_cfg, "--host", "megatron", "-o", blocker / "x.yaml")
    one_line_error(rc, err, str(blocker))
    assert blocker.read_text() == "a file\n"


def test_the_command_line_refuses_as_one_line(megatron_cfg):
    """The same refusal through the console script: exit 2, one line, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_fp8_plugin",
            "apply",
            str(megatron_cfg),
            "--host",
            "megatron",
            "-o",
            str(megatron_cfg),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    one_line_error(proc.returncode, proc.stderr, "names the input config")


# --------------------------------------------------------------------------- vLLM


GLOB = re.compile(r"[*?\[]")


def _ignored(capsys, cfg: Path, *extra) -> tuple[list[str], str]:
    rc, out, err = apply_cli(capsys, cfg, "--host", "vllm", *extra)
    assert rc == 0, err
    return yaml.safe_load(out)["hf-overrides"]["quantization_config"]["ignored_layers"], err


def test_vllm_examples_list_exact_module_names(capsys):
    moonlight = REPO / "conf" / "examples" / "vllm_moonlight_fp8_kv.yaml"
    names, err = _ignored(capsys, moonlight)
    assert names == [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa" for i in range(27)]
    assert "glob" not in err
    llama = REPO / "conf" / "examples" / "vllm_llama8b_fp8_blockwise.yaml"
    assert _ignored(capsys, llama)[0] == []  # no BF16 rule, nothing to list


def test_vllm_rules_become_exact_names_for_a_known_model_and_stay_globs_otherwise(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    body = (
        "tensor-parallel-size: 1\n"
        "fp8: {recipe: fp8_blockwise, bf16_layers: {first: 1, modules: ['*down_proj']}}\n"
    )
    cfg.write_text("model: meta-llama/Llama-3.1-8B-Instruct\n" + body)
    names, _ = _ignored(capsys, cfg)
    assert not any(GLOB.search(n) for n in names)
    assert {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.31.mlp.down_proj",
    } <= set(names)
    assert "model.layers.1.self_attn.q_proj" not in names
    cfg.write_text("model: /checkpoints/private-model\n" + body)
    rc, out, err = apply_cli(capsys, cfg, "--host", "vllm")
    assert rc == 0, err
    quant = yaml.safe_load(out)["hf-overrides"]["quantization_config"]
    # unknown model: the rules travel as written, the plugin's method resolves them in vLLM
    assert quant["ignored_layers"] == ["*down_proj"] and quant["num_first_layers_in_bf16"] == 1
    # --model names the architecture: exact names again
    names, _ = _ignored(capsys, cfg, "--model", "llama3.1-8b")
    assert "model.layers.31.mlp.down_proj" in names and not any(GLOB.search(n) for n in names)


# --------------------------------------------------------------------------- generated files


SCALARS = [
    "1",
    "-3",
    "0.5",
    "3.0e-7",
    "1e-8",
    "1_000",
    "true",
    "False",
    "null",
    "~",
    "",
    "'quoted'",
    '"double"',
    "plain words",
    "${a.b}",
    "0x1F",
    "yes",
    "2024-01-01",
]
"""Spellings a config holds; ``yes`` (YAML 1.1 true, 1.2 a string) must be refused."""


def _value_lines(draw, st, key: str, indent: str) -> list[str]:
    kind = draw(st.sampled_from(["scalar", "map", "flow", "list", "list2", "block"]))
    eol = draw(st.sampled_from(["", "  # note", " # x"]))
    if kind == "scalar":
        return [f"{indent}{key}: {draw(st.sampled_from(SCALARS))}{eol}".rstrip(" ")]
    if kind == "flow":
        flow = draw(st.sampled_from(["[1, 2]", "{a: 1, b: x}", "[]", "{}"]))
        return [f"{indent}{key}: {flow}{eol}"]
    if kind == "block":
        return [f"{indent}{key}: |", f"{indent}  line one", f"{indent}  line two"]
    if kind in ("list", "list2"):
        dash = "- " if kind == "list" else "  - "
        items = draw(st.lists(st.sampled_from(["a", "1", "'q'", "{x: 1}"]), min_size=1, max_size=3))
        return [f"{indent}{key}:"] + [f"{indent}{dash}{i}" for i in items]
    step = draw(st.sampled_from(["  ", "    "]))
    lines = [f"{indent}{key}:{eol}"]
    for j in range(draw(st.integers(1, 3))):
        lines.append(f"{indent}{step}{key}_{j}: {draw(st.sampled_from(SCALARS[:8]))}".rstrip(" "))
        if draw(st.booleans()):
            lines.append(f"{indent}{step}# inside {key}")
    return lines


def _config_text(draw, st) -> str:
    blocks: list[list[str]] = []
    for i in range(draw(st.integers(0, 6))):
        extra = draw(st.sampled_from([[], ["# comment"], [""], ["", "# section"]]))
        blocks.append(extra + _value_lines(draw, st, f"k{i}", ""))
    model = ["model:", "  num_layers: 4", "  hidden_size: 256"]
    if draw(st.booleans()):
        model.append(
            draw(st.sampled_from(["  fp8: null", "  fp8_recipe: ~  # bf16", "  fp8_param:"]))
        )
    blocks.insert(draw(st.integers(0, len(blocks))), model)
    request = draw(
        st.sampled_from(
            [
                "precision: fp8_blockwise",
                "precision: fp8_current  # FP8",
                "fp8:\n  recipe: fp8_blockwise\n  # why\n  pow2_scales: false",
            ]
        )
    )
    blocks.insert(draw(st.integers(0, len(blocks))), request.split("\n"))
    text = "\n".join(line for block in blocks for line in block)
    return text + draw(st.sampled_from(["\n", "", "\n\n"]))


@pytest.mark.slow
def test_generated_configs_edit_only_their_written_keys(capsys):
    """Generated files (comments, blank lines, every scalar spelling, flow and block styles,
    both list indentations, block scalars): apply edits only the written keys and the request,
    or refuses in one line; the output means exactly the pipeline's result; a second apply is
    a no-op. Budget: 60 examples, a few seconds."""
    import tempfile

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.data(), st.sampled_from(["megatron", "nemo2", "bridge"]))
    def check(data, host):
        text = _config_text(data.draw, st)
        with tempfile.TemporaryDirectory() as tmp:
            cfg, out = Path(tmp) / "c.yaml", Path(tmp) / "out.yaml"
            cfg.write_text(text)
            try:
                result = run(get_adapter(host), load_context(cfg, output=out))
            except FP8ConfigError:
                result = None
            rc, _, err = apply_cli(capsys, cfg, "--host", host, "-o", out)
            if rc != 0 or result is None:
                one_line_error(rc, err)
                assert not out.exists()
                assert result is None or "yes" in text  # only the 1.1/1.2 spelling
                return
            assert load_config(out, follow_defaults=False) == result.data
            assert_only_written_lines_change(text, out.read_text(), result.written, result.removed)
            again = Path(tmp) / "again.yaml"
            rc, _, err = apply_cli(capsys, out, "--host", host, "-o", again)
            assert rc == 0 and again.read_bytes() == out.read_bytes(), err

    check()


def test_a_refusal_after_the_pipeline_is_one_line(tmp_path, capsys):
    """apply's release line, warnings and notes come after the output is written: a file it
    cannot edit in place (a NEL key beside a float PyYAML and ruamel read differently) is
    refused in one line, nothing before it."""
    src = tmp_path / "grpo.yaml"
    src.write_text(
        "policy:\n  model_name:\n  - 1.435706254469481e+119\n  - ? '\x85      '\n    : null\n"
        "  precision: fp8_blockwise\n  megatron_cfg:\n    enabled: true\n"
        "  generation:\n    backend: vllm\nloss_fn:\n  token_level_loss: true\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.yaml"
    assert main(["apply", str(src), "--host", "nemo-rl", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nemo-fp8 apply: error: "), err
    assert "in place" in err[0] and not out.exists()
