"""Hostile and careless input: no hang, no silent loss, no traceback.

Work is bounded by counting (Python calls made, through :func:`sys.setprofile`), never by
a clock: the same input gives the same count on any machine. Each test failed before its fix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from counting import calls

import nemo_fp8_plugin
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _unmatched_patterns(tmp_path: Path, n: int, word: str = "nomatch") -> Path:
    pats = "\n".join(f"    - '{word}{i}.*'" for i in range(n))
    path = tmp_path / f"{word}{n}.yaml"
    path.write_text(
        f"precision: fp8_blockwise\nfp8:\n  bf16_layers:\n    modules:\n{pats}\n", encoding="utf-8"
    )
    return path


# --------------------------------------------------------------------------- bounded work


def test_explain_is_linear_in_unmatched_patterns(tmp_path):
    """Each side's warning scanned every unmatched label: 8,000 patterns took 72 s and
    120,000 (within LIMITS) never finished. The calls one more pattern costs must not grow
    with the number of patterns (quadratic: the marginal cost at 200-400 was 1.29x that at
    50-100; linear: 1.06x, the rest Python's regex cache)."""
    from nemo_fp8_plugin.explain import build_report

    # warm what is loaded once per process (imports, the model), on another file
    build_report(_unmatched_patterns(tmp_path, 60, "warm"), model="llama3.1-8b")
    cost = {
        n: calls(build_report, _unmatched_patterns(tmp_path, n), model="llama3.1-8b")
        for n in (50, 100, 200, 400)
    }
    early = (cost[100] - cost[50]) / 50
    late = (cost[400] - cost[200]) / 200
    assert late / early < 1.15, cost


# --------------------------------------------------------------------------- streams


def _cli(*argv, env=None, shell=None, **kw) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(SOURCE), **(env or {}))
    if shell is not None:
        cmd = shell.format(cli=f"{sys.executable} -m nemo_fp8_plugin")
        return subprocess.run(["bash", "-c", cmd], capture_output=True, env=full, timeout=120)
    return subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", *map(os.fspath, argv)],
        capture_output=True,
        env=full,
        timeout=120,
        **kw,
    )


REPO = Path(__file__).resolve().parent.parent
SOURCE = Path(nemo_fp8_plugin.__file__).resolve().parent.parent  # the package under test
BASE = "precision: fp8_blockwise\n"


def test_a_closed_pipe_exits_quietly():
    """``recipes | head -1``: BrokenPipeError was caught as OSError first ("error: Broken
    pipe", exit 2), and the final flush printed "Exception ignored"."""
    proc = _cli(shell="{cli} recipes | head -c 1 >/dev/null; exit ${{PIPESTATUS[0]}}")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr


@pytest.mark.parametrize("command", ["recipes", "explain"])
def test_a_closed_stdout_is_one_line(tmp_path, command):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE)
    args = f"{command} {cfg}" if command == "explain" else command
    proc = _cli(shell="{cli} " + args + " >&-")
    one_line_error(proc.returncode, proc.stderr.decode(), "standard output is closed")


def test_a_closed_stdout_does_not_swallow_an_output_file(tmp_path):
    """With descriptor 1 closed, the temp file of ``-o`` would be descriptor 1."""
    cfg, out = tmp_path / "c.yaml", tmp_path / "out.yaml"
    cfg.write_text(BASE)
    proc = _cli(shell=f"{{cli}} apply {cfg} --host megatron -o {out} >&-")
    assert proc.returncode == 0, proc.stderr
    assert "fp8" in out.read_text()


def test_an_ascii_stdout_with_non_ascii_config_text_is_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# caf\u00e9\nprecision: fp8_blockwise\n", encoding="utf-8")
    proc = _cli("apply", cfg, "--host", "megatron", env={"PYTHONIOENCODING": "ascii"})
    # warnings and notes come first (apply prints them before writing); the error is one line
    errors = "\n".join(
        ln
        for ln in proc.stderr.decode().splitlines()
        if ": warning: " not in ln and ": note: " not in ln
    )
    one_line_error(proc.returncode, errors, "encoding (ascii)", "PYTHONIOENCODING")


def test_an_output_name_with_a_non_utf8_byte_is_written(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE)
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xff.yaml")
    proc = _cli("apply", cfg, "--host", "megatron", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(out) and sorted(os.listdir(tmp_path)) == ["c.yaml", "out\udcff.yaml"]


def test_sigterm_while_apply_writes_leaves_no_temp_file(tmp_path):
    """The SIGTERM lands between the temp file's fsync and its rename."""
    from importlib import util

    spec = util.spec_from_file_location("sweep", REPO / "scripts" / "hostile_sweep.py")
    sweep = util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    sweep.SOURCE = SOURCE
    verdict, detail = sweep.sigterm_case(tmp_path, sys.executable)
    assert verdict == "ok", detail
    assert "exit 143" in detail


def test_sigterm_handler_is_restored_after_a_write(tmp_path):
    from nemo_fp8_plugin._io import atomic_write_text

    before = signal.getsignal(signal.SIGTERM)
    atomic_write_text(tmp_path / "x.txt", "x")
    assert signal.getsignal(signal.SIGTERM) is before


# --------------------------------------------------------------------------- model files


@pytest.mark.parametrize("how", ["--model-config", "fp8.model"])
@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, "[" * 500 + "]" * 500])
def test_a_deeply_nested_config_json_is_one_line(tmp_path, capsys, how, text):
    (tmp_path / "config.json").write_text(text)
    if how == "fp8.model":
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"fp8:\n  recipe: fp8_blockwise\n  model: {tmp_path / 'config.json'}\n")
        rc, _, err = run(capsys, "explain", cfg)
    else:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(BASE)
        rc, _, err = run(capsys, "explain", cfg, "--model-config", tmp_path / "config.json")
    one_line_error(rc, err, how, "nested")


def test_a_config_json_with_a_5000_digit_integer_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE)
    rc, _, err = run(capsys, "explain", cfg, "--model-config", tmp_path / "config.json")
    one_line_error(rc, err, "--model-config", "not a readable config.json")


def test_a_100k_model_name_gives_a_bounded_message(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE)
    rc, _, err = run(capsys, "explain", cfg, "--model", "x" * 100_000)
    one_line_error(rc, err, "--model", "unknown model")
    assert len(err) < 2_000, len(err)


# --------------------------------------------------------------------------- -o OUT.json


@pytest.mark.parametrize(
    "body, key",
    [
        ("m:\n  1: a\n  '1': b\n", "m.1"),
        ("m:\n  true: a\n  'true': b\n", "m.true"),
        ("m:\n  null: a\n  'null': b\n", "m.null"),
        ("lr: .nan\n", "lr"),
        ("lr: -.inf\n", "lr"),
        ("blob: !!binary aGVsbG8=\n", "blob"),
    ],
)
def test_json_output_refuses_what_json_cannot_say(tmp_path, capsys, body, key):
    cfg, out = tmp_path / "c.yaml", tmp_path / "out.json"
    cfg.write_text(BASE + body)
    rc, _, err = run(capsys, "apply", cfg, "--host", "megatron", "-o", out)
    one_line_error(rc, err, f"{key}:")
    assert not out.exists()


def test_json_output_of_distinct_keys_is_strict_json(tmp_path, capsys):
    cfg, out = tmp_path / "c.yaml", tmp_path / "out.json"
    cfg.write_text(BASE + "m:\n  1: a\n  '2': b\n  when: 2024-01-02\n")
    rc, _, err = run(capsys, "apply", cfg, "--host", "megatron", "-o", out)
    assert rc == 0, err
    data = json.loads(out.read_text())
    assert data["m"] == {"1": "a", "2": "b", "when": "2024-01-02"}


# --------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("how", ["--in-place", "-o"])
def test_a_read_only_output_is_refused_unless_forced(tmp_path, capsys, how):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE)
    target = cfg if how == "--in-place" else tmp_path / "out.yaml"
    if how == "-o":
        target.write_text("old\n")
    target.chmod(0o444)
    before = target.read_text()
    argv = ["apply", cfg, "--host", "megatron", *([how] if how == "--in-place" else [how, target])]
    rc, _, err = run(capsys, *argv)
    one_line_error(rc, err, str(target), "read-only", "--force")
    assert target.read_text() == before
    rc, _, err = run(capsys, *argv, "--force")
    assert rc == 0, err
    assert "fp8" in target.read_text()


def test_bench_json_fifo_without_a_reader_is_refused_before_work(tmp_path, capsys, monkeypatch):
    """It was refused only after the whole benchmark (31 s of --quick)."""
    import nemo_fp8_plugin.tools.bench as bench

    def no_work(**kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench, "run_numerics", no_work)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rc, _, err = run(capsys, "bench", "--quick", "--json", fifo)
    one_line_error(rc, err, "--json", "FIFO")


def test_a_checked_fifo_keeps_its_reader(tmp_path):
    """The probe's descriptor is the one the result is written through: the reader sees the
    result, not an end of file when the probe closes."""
    import threading

    from nemo_fp8_plugin._io import atomic_write_text, check_output_file

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    def reader():
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as fh:
            got.append(fh.read())

    check_output_file(fifo, "--json")  # a reader is there: held open
    thread = threading.Thread(target=reader)
    thread.start()
    atomic_write_text(fifo, "result\n")
    thread.join(timeout=30)
    assert got == [b"result\n"]


def test_a_terabyte_demo_is_refused_up_front(tmp_path, capsys):
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(
        "precision: fp8_blockwise\nmodel:\n  num_layers: 4\n  hidden_size: 1024\n"
        "  ffn_hidden_size: 4096\n  num_attention_heads: 128\n  seq_length: 8192\n"
        "  vocab_size: 65536\ntrain:\n  micro_batch_size: 512\n  steps: 1\n"
    )
    from nemo_fp8_plugin.tools.demo import load_demo_config

    with pytest.raises(FP8ConfigError, match="GiB of activations") as info:
        load_demo_config(cfg)
    assert info.value.key == "model.seq_length"


# --------------------------------------------------------------------------- defaults:


@pytest.mark.parametrize("parent", ["b.YAML", "b.json", "b.Yml"])
def test_defaults_of_any_config_file_name_are_followed(tmp_path, capsys, parent):
    text = (
        '{"fp8": {"recipe": "no_such_recipe"}}'
        if parent.endswith("json")
        else "fp8:\n  recipe: no_such_recipe\n"
    )
    (tmp_path / parent).write_text(text)
    (tmp_path / "child.yaml").write_text(f"defaults: {parent}\nprecision: fp8_blockwise\n")
    rc, _, err = run(capsys, "explain", tmp_path / "child.yaml")
    one_line_error(rc, err, "no_such_recipe")


def test_a_defaults_list_with_a_non_string_is_refused(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("x: 1\n")
    (tmp_path / "child.yaml").write_text("defaults: [a.yaml, 3]\nprecision: fp8_blockwise\n")
    rc, _, err = run(capsys, "explain", tmp_path / "child.yaml")
    one_line_error(rc, err, "defaults[1]")


def test_hydra_defaults_are_left_alone(tmp_path, capsys):
    (tmp_path / "child.yaml").write_text(
        "defaults:\n  - model: gpt\n  - _self_\nprecision: fp8_blockwise\n"
    )
    rc, _, err = run(capsys, "explain", tmp_path / "child.yaml")
    assert rc == 0, err


def test_defaults_through_a_symlinked_directory_name_the_parent_nemo_rl_loads(tmp_path, capsys):
    """``defaults: ../base.yaml`` in ``link/child.yaml`` where ``link`` points into
    ``real/sub``: NeMo RL opens ``link/../base.yaml``, which the kernel resolves to
    ``real/base.yaml``; the lexical rewrite named ``tmp/base.yaml`` (another file)."""
    real = tmp_path / "real" / "sub"
    real.mkdir(parents=True)
    (tmp_path / "real" / "base.yaml").write_text("policy:\n  precision: bfloat16\n")
    (tmp_path / "base.yaml").write_text("decoy: true\n")  # what a lexical .. names
    (real / "child.yaml").write_text(
        "defaults: ../base.yaml\npolicy:\n  precision: fp8_blockwise\n"
        "  megatron_cfg:\n    enabled: true\n  dtensor_cfg:\n    enabled: false\n"
    )
    (tmp_path / "link").symlink_to(real)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, _, err = run(
        capsys,
        "apply",
        tmp_path / "link" / "child.yaml",
        "--host",
        "nemo-rl",
        "-o",
        out_dir / "r.yaml",
    )
    assert rc == 0, err
    import yaml

    written = yaml.safe_load((out_dir / "r.yaml").read_text())["defaults"]
    assert (out_dir / written).resolve() == (tmp_path / "real" / "base.yaml").resolve()


def test_json_with_a_surrogate_pair_is_read(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"precision": "fp8_blockwise", "name": "\\ud83d\\ude00"}')
    from nemo_fp8_plugin.config import load_config

    assert load_config(cfg)["name"] == "\U0001f600"
    rc, _, err = run(capsys, "explain", cfg)
    assert rc == 0, err


# --------------------------------------------------------------------------- native keys read back


_MEGATRON_COUNTS = {
    "megatron": "language_model: {num_layers: 32, fp8: e4m3, fp8_recipe: blockwise, "
    "first_last_layers_bf16: true, %s: %s}\n",
    "nemo2": "trainer:\n  plugins:\n    _target_: nemo.lightning.pytorch.plugins.mixed_precision"
    ".MegatronMixedPrecision\n    precision: bf16-mixed\n    fp8: hybrid\n    fp8_recipe: "
    "blockwise\n    first_last_layers_bf16: true\n    %s: %s\n",
    "bridge": "mixed_precision:\n  fp8: hybrid\n  fp8_recipe: blockwise\n  "
    "first_last_layers_bf16: true\n  %s: %s\n",
}


@pytest.mark.parametrize(
    ("host", "value"),
    [("megatron", "abc"), ("nemo2", "[1]"), ("bridge", ".inf"), ("megatron", "-1")],
)
def test_a_native_layer_count_that_is_no_count_is_one_line(tmp_path, capsys, host, value):
    """megatron-core's ``num_layers_at_start_in_bf16`` read back by explain raised ValueError,
    OverflowError or TypeError (megatron, NeMo 2 and Bridge spell it alike)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(_MEGATRON_COUNTS[host] % ("num_layers_at_start_in_bf16", value))
    rc, _, err = run(capsys, "explain", cfg)
    one_line_error(rc, err, "num_layers_at_start_in_bf16", "number of layers")
    cfg.write_text(_MEGATRON_COUNTS[host] % ("num_layers_at_end_in_bf16", "'2'"))
    rc, out, err = run(capsys, "explain", cfg)
    assert rc == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("host", [None, "vllm"])
@pytest.mark.parametrize("value", ["abc", ".inf", "[1]", "-1"])
@pytest.mark.parametrize("side", ["first", "last"])
def test_a_vllm_layer_count_that_is_no_count_is_one_line(tmp_path, capsys, host, value, side):
    """vLLM's ``num_first/last_layers_in_bf16`` read back by explain went through a bare
    ``int()``: ValueError, OverflowError or TypeError, with or without ``--host vllm``."""
    cfg = tmp_path / "v.yaml"
    text = (
        "model: meta-llama/Llama-3.1-8B\nquantization: nemo_fp8\nhf-overrides:\n"
        "  quantization_config:\n    scheme: block\n    num_%s_layers_in_bf16: %s\n"
    )
    cfg.write_text(text % (side, value))
    rc, _, err = run(capsys, "explain", cfg, *(["--host", host] if host else []))
    key = f"hf-overrides.quantization_config.num_{side}_layers_in_bf16"
    one_line_error(rc, err, key, "number of layers")
    cfg.write_text(text % (side, "'2'"))
    rc, out, err = run(capsys, "explain", cfg, *(["--host", host] if host else []))
    assert rc == 0 and "Traceback" not in err, err


def test_a_vllm_scheme_that_is_a_list_is_reported_not_a_type_error(tmp_path, capsys):
    cfg = tmp_path / "v.yaml"
    cfg.write_text(
        "model: meta-llama/Llama-3.1-8B\nquantization: nemo_fp8\nhf_overrides:\n"
        "  quantization_config:\n    quant_method: nemo_fp8\n    scheme: [block]\n"
    )
    rc, out, err = run(capsys, "explain", cfg)
    assert rc == 0 and "Traceback" not in err, err
    assert "scheme: ['block']: not a kind of ours" in out


# --------------------------------------------------------------------------- --hardware


@pytest.mark.parametrize(
    ("hardware", "needle"),
    [
        ("b200,h100", "got a list"),  # was Blackwell: nvfp4 passed for a list holding an H100
        ("h100,b200", "got a list"),  # was Hopper
        ("b2000", "unknown hardware"),  # was B200
        ("h100x", "unknown hardware"),  # was H100
    ],
)
def test_hardware_names_one_gpu_exactly(tmp_path, capsys, hardware, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: nvfp4\nmodel: {num_layers: 4}\n")
    rc, _, err = run(capsys, "explain", cfg, "--hardware", hardware)
    one_line_error(rc, err, "--hardware", needle)
    cfg.write_text(f"fp8: {{recipe: fp8_blockwise, hardware: '{hardware}'}}\n")
    rc, _, err = run(capsys, "explain", cfg)
    one_line_error(rc, err, "hardware", needle)


def test_nvidia_smi_names_still_name_their_gpu():
    """A guard (it passed before): the name ends at a separator, not at the model number."""
    from nemo_fp8_plugin.capabilities import arch_by_name

    names = {
        "NVIDIA H100 80GB HBM3": "hopper",
        "NVIDIA A100-SXM4-80GB": "ampere",
        "NVIDIA A10G": "ampere",
        "NVIDIA GH200 480GB": "hopper",
        "NVIDIA B200": "blackwell",
        "NVIDIA RTX 6000 Ada Generation": "ada",
        "NVIDIA GeForce RTX 4090 D": "ada",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition": "blackwell_sm120",
    }
    assert {n: getattr(arch_by_name(n), "name", None) for n in names} == names


# --------------------------------------------------------------------------- printed names


def test_control_characters_in_file_names_are_escaped_where_printed(tmp_path, capsys):
    """ESC and newline in a file name reached the terminal raw in explain's ``config:`` line
    and apply's ``wrote`` line (export escaped them)."""
    cfg = tmp_path / "a\x1b[31mb\nc.yaml"
    cfg.write_text("precision: fp8_blockwise\nmodel: {num_layers: 4}\n")
    out = tmp_path / "o\x1b[2Jx.yaml"
    printed = []
    for argv in (
        ["explain", cfg],
        ["apply", cfg, "--host", "megatron", "-o", out],
        ["apply", cfg, "--host", "megatron", "--diff"],
    ):
        rc, stdout, stderr = run(capsys, *argv)
        assert rc == 0, stderr
        printed.append(stdout + stderr)
    text = "".join(printed)
    assert "\x1b" not in text and "b\nc.yaml" not in text, text
    assert "config: " + str(tmp_path) + "/a\\x1b[31mb\\nc.yaml\n" in printed[0]
    assert "wrote " + str(tmp_path) + "/o\\x1b[2Jx.yaml\n" in printed[1]
    assert "a\\x1b[31mb\\nc.yaml (nemo-fp8 apply --host megatron)\n" in printed[2]


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "header",
    ["%YAML 1.2\n---\n", "---\n", "# about\n%YAML 1.2\n--- # doc\n"],
)
def test_round_trip_keeps_the_lines_before_the_document(tmp_path, capsys, header):
    """An edit of a flow mapping ruamel respells sends apply to ruamel's own rendering, which does
    not re-emit directives or ``---``: they were dropped unseen."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(header + "# top\nprecision: fp8_blockwise\nmodel: {x:   1}\n")
    rc, out, err = run(capsys, "apply", cfg, "--host", "megatron")
    assert rc == 0, err
    assert out.startswith(header), out


# --------------------------------------------------------------------------- Python API


def test_importance_weights_with_a_huge_ratio_max_names_it():
    import torch

    from nemo_fp8_plugin.rl.importance import importance_weights

    t = torch.zeros(2, 3)
    with pytest.raises(FP8ConfigError) as info:
        importance_weights(t, t, torch.ones(2, 3), truncation="tis", ratio_max=10**400)
    assert info.value.key == "ratio_max"


def test_get_recipe_with_deeply_nested_json_names_recipe():
    from nemo_fp8_plugin.registry import get_recipe

    for text in ('{"recipe": ' + "[" * 5000 + "]" * 5000 + "}", "{" + '"a": {' * 500 + "}" * 501):
        with pytest.raises(FP8ConfigError) as info:
            get_recipe(text)
        assert info.value.key == "recipe"


def test_a_self_referencing_mapping_to_apply_mapping_is_refused():
    from nemo_fp8_plugin.hosts import apply_mapping, get_adapter

    config: dict = {"precision": "fp8_blockwise"}
    config["loop"] = config
    with pytest.raises(FP8ConfigError, match="contains itself") as info:
        apply_mapping(get_adapter("megatron"), config)
    assert info.value.key == "config"


def test_quantize_for_refit_refuses_a_name_given_twice():
    import torch

    from nemo_fp8_plugin.rl.refit import quantize_for_refit

    w = torch.zeros(128, 128)
    pairs = [("model.layers.0.mlp.down_proj.weight", w)] * 2
    with pytest.raises(FP8ConfigError, match="a second time") as info:
        list(quantize_for_refit(pairs, "fp8_blockwise"))
    assert info.value.key == "named_tensors" and info.value.value == pairs[0][0]
