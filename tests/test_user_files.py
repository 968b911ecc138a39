"""Every file a user names is read through the same checks (``_io.read_user_bytes`` /
``read_user_json``): a regular file only (a FIFO blocked ``analyze --attribution`` forever,
``/dev/zero`` was read forever), its size checked before a byte is read (a 1-2 GB sparse
``config.json`` or rl-check JSON took 2-4 GB and seconds before the refusal), nesting and
digits bounded (``[`` x 100000 and a 5000-digit integer gave tracebacks, and so did a
``model.safetensors.index.json`` nested 3,000 deep under ``analyze``). The BF16 suggestion is
linear in the modules (8,000 layers x 2 modules took 16 s) and a recipe name cannot inject
lines into it. Each test failed before the change."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from conftest import unblock_fifo_later
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import LIMITS, FP8ConfigError

ATTRIBUTION = {
    "settings": {"recipe": "fp8_blockwise", "steps": 4, "attribution_step": -1},
    "summary": {"arms": {"fp8-e2e-is": {"attribution": []}}},
}


def run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def _peak_bytes(fn, *args) -> tuple[int, BaseException | None]:
    """Peak Python allocation while ``fn`` runs (the refusal must come before the read)."""
    tracemalloc.start()
    try:
        fn(*args)
        error = None
    except BaseException as exc:
        error = exc
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, error


# --------------------------------------------------------------------------- analyze --attribution


@pytest.mark.timeout(20)  # a FIFO regression fails here, not at 1200 s
def test_an_attribution_fifo_is_refused_not_read(tmp_path, capsys):
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    writer = unblock_fifo_later(fifo)
    rc, err = run(capsys, "analyze", "--attribution", fifo)
    one_line_error(rc, err, "--attribution", "FIFO")
    assert not writer.found_reader, "the FIFO was opened for reading"


@pytest.mark.timeout(20)
def test_an_attribution_device_is_refused_not_read(capsys):
    rc, err = run(capsys, "analyze", "--attribution", "/dev/zero")
    one_line_error(rc, err, "--attribution", "special file")


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"summary": ' + "9" * 5000 + "}", "[" * 70 + "]" * 70],
    ids=["deep", "digits", "past-the-depth-limit"],
)
def test_attribution_json_past_the_parser_is_one_line(tmp_path, capsys, text):
    path = tmp_path / "run.json"
    path.write_text(text)
    rc, err = run(capsys, "analyze", "--attribution", path)
    one_line_error(rc, err, "--attribution")


def test_an_oversized_attribution_file_is_refused_before_it_is_read(tmp_path):
    from nemo_fp8_plugin.analyze.attribution import attribution_report

    path = _sparse(tmp_path / "run.json", LIMITS.config_bytes + 1)  # 16 MiB of holes
    peak, error = _peak_bytes(attribution_report, path)
    assert isinstance(error, FP8ConfigError) and "too large" in str(error), error
    assert peak < 2**20, peak  # nothing of the file was read


def test_a_recipe_name_cannot_inject_lines_into_the_suggestion(tmp_path, capsys):
    doc = json.loads(json.dumps(ATTRIBUTION))
    doc["settings"]["recipe"] = "fp8_blockwise\nprecision: bf16"
    share = {"mean": 0.5, "ci95": 0.1, "n": 2}
    doc["summary"]["arms"]["fp8-e2e-is"]["attribution"] = [
        {
            "bf16": f"layer.{i}",
            "modules": [f"model.layers.{i}.mlp.down_proj"],
            "removed": share,
            "token_mult_prob_error": share,
        }
        for i in range(2)
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    rc, err = run(capsys, "analyze", "--attribution", path)
    one_line_error(rc, err, "settings.recipe")


def test_the_suggestion_is_linear_in_the_modules():
    """4x the modules must cost about 4x, not 16-64x (``g in rest_units`` scanned a list for
    every unit of every template: 8,000 layers x 2 modules took 16 s). A ratio of CPU times in
    one run, the best of three: a list scan is no Python call, so counting calls cannot see
    it."""
    import time

    from nemo_fp8_plugin.analyze.suggest import suggest_bf16_layers

    def cost(layers: int) -> float:
        mods = [
            f"model.layers.{i}.mlp.{p}" for i in range(layers) for p in ("up_proj", "down_proj")
        ]
        flagged = [m for m in mods if m.endswith("down_proj") and int(m.split(".")[2]) % 2 == 0]
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            suggest_bf16_layers(mods, flagged)
            best = min(best, time.process_time() - start)
        return best

    small, large = cost(100), cost(400)
    assert large < 10 * small, (small, large)  # linear: about 4x; before: about 60x


def test_an_index_nested_too_deep_is_one_line_under_analyze(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors.index.json").write_text("[" * 3000 + "]" * 3000)
    rc, err = run(capsys, "analyze", ck)
    one_line_error(rc, err, "CHECKPOINT", "nested too deeply")


# --------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("how", ["--model-config", "fp8.model", "export --model-config", "export"])
def test_an_oversized_config_json_is_refused_before_it_is_read(tmp_path, capsys, how):
    """A 1 GB sparse config.json reached 2.1-2.3 GB and 7-18 s before the refusal; one byte
    over the limit is enough to show the refusal comes from its size, not its content."""
    big = _sparse(tmp_path / "config.json", LIMITS.config_bytes + 1)
    cfg = tmp_path / "c.yaml"
    if how == "--model-config":
        cfg.write_text("precision: fp8_blockwise\nmodel: {num_layers: 2}\n")
        argv = ["explain", cfg, "--model-config", big]
    elif how == "fp8.model":
        cfg.write_text(f"fp8: {{recipe: fp8_blockwise, model: {big}}}\n")
        argv = ["explain", cfg]
    elif how == "export --model-config":
        argv = ["export", tmp_path, "-o", tmp_path / "out", "--model-config", big]
    else:
        argv = ["export", tmp_path, "-o", tmp_path / "out"]
    if how.startswith("export"):
        import torch
        from safetensors.torch import save_file

        save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    rc, err = run(capsys, *argv)
    one_line_error(rc, err, "too large")
    # what the reader costs (the command's own imports and caches are warm, and not counted)
    if how.startswith("export"):
        from nemo_fp8_plugin.rl import export_fp8_checkpoint

        config = big if how == "export --model-config" else None

        def export():
            export_fp8_checkpoint(tmp_path, tmp_path / "out", config=config)

        peak, error = _peak_bytes(export)
    else:
        from nemo_fp8_plugin.rules import describe_model

        peak, error = _peak_bytes(describe_model, str(big))
    assert isinstance(error, FP8ConfigError) and peak < 2**20, (error, peak)  # never read


# --------------------------------------------------------------------------- a directory given


def _checkpoint(ck: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    ck.mkdir()
    save_file(
        {"model.layers.0.mlp.up_proj.weight": torch.ones(128, 128)}, str(ck / "model.safetensors")
    )
    (ck / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    return ck


@pytest.mark.parametrize("how", ["--attribution", "--samples", "analyze index", "export index"])
def test_a_directory_where_a_file_is_read_is_one_line(tmp_path, capsys, how):
    """A directory opens for reading: os.fdopen refused it with an error naming descriptor 3,
    and printing that error raised a TypeError (a traceback, exit 1)."""
    folder = tmp_path / "given"
    folder.mkdir()
    if how == "--attribution":
        argv, needles = ["analyze", "--attribution", folder], ["--attribution", str(folder)]
    elif how == "--samples":
        ck = _checkpoint(tmp_path / "ck")
        argv = ["analyze", ck, "--activations", "--samples", folder]
        needles = ["--samples", str(folder)]
    else:
        ck = _checkpoint(tmp_path / "ck")
        (ck / "model.safetensors.index.json").mkdir()
        command = how.split()[0]
        argv = [command, ck] + (["-o", tmp_path / "out"] if command == "export" else [])
        needles = ["CHECKPOINT", "model.safetensors.index.json", "directory"]
    rc, err = run(capsys, *argv)
    one_line_error(rc, err, *needles, "directory")
    assert not (tmp_path / "out").exists()


def test_an_os_error_naming_a_descriptor_is_one_line(capsys, monkeypatch):
    """An OSError whose filename is a descriptor number (os.fdopen's) is printed, not a
    second traceback from printing it."""
    from nemo_fp8_plugin.cli import recipes

    def fail(args):
        raise IsADirectoryError(21, "Is a directory", 3)

    monkeypatch.setattr(recipes, "run", fail)
    rc, err = run(capsys, "recipes")
    one_line_error(rc, err, "3: Is a directory")
