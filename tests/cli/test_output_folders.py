"""An output's folder must exist: every output (``apply -o``, ``analyze --plot``, ``export -o``,
the Python writers) refuses a folder that is not there in one line naming the option and the
path, before any work, and creates nothing. ``apply -o /nonexist/x.yaml`` exited 0 and
created ``/nonexist``; ``analyze --plot p1/p2/h.png`` and ``export -o e1/e2/out`` created
their folders too. An output folder itself (``export -o DIR``) is still created, in a folder
that exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    import torch
    from safetensors.torch import save_file

    ck = tmp_path_factory.mktemp("ck")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 128, generator=gen).to(torch.bfloat16)
    save_file({"model.layers.0.mlp.up_proj.weight": weight}, str(ck / "model.safetensors"))
    (ck / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    return ck


def _argv(command: str, tmp_path: Path, checkpoint: Path, target: Path) -> tuple[list, str]:
    if command == "apply":
        cfg = tmp_path / "a.yaml"
        cfg.write_text("model: {num_layers: 4}\nprecision: fp8_blockwise\n")
        return ["apply", cfg, "-o", target], "--output"
    if command == "analyze":
        return ["analyze", checkpoint, "--plot", target.with_suffix(".png")], "--plot"
    return ["export", checkpoint, "-o", target], "-o"


@pytest.mark.parametrize("command", ["apply", "analyze", "export"])
def test_a_missing_folder_is_refused_not_created(tmp_path, capsys, checkpoint, command):
    argv, key = _argv(command, tmp_path, checkpoint, tmp_path / "no" / "such" / "out")
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert key in lines[0] and f"folder {tmp_path / 'no' / 'such'} does not exist" in lines[0]
    assert not (tmp_path / "no").exists()
    assert captured.out == ""  # refused before the work: nothing analyzed or exported


def test_a_link_to_a_missing_folder_is_refused_too(tmp_path, capsys):
    cfg = tmp_path / "a.yaml"
    cfg.write_text("model: {num_layers: 4}\nprecision: fp8_blockwise\n")
    link = tmp_path / "run.yaml"
    link.symlink_to(tmp_path / "gone" / "run.yaml")
    assert main(["apply", str(cfg), "-o", str(link)]) == 2
    err = capsys.readouterr().err
    assert f"folder {tmp_path / 'gone'} does not exist" in err and err.count("\n") == 1
    assert not (tmp_path / "gone").exists()


def test_an_output_folder_is_created_in_a_folder_that_exists(tmp_path, capsys, checkpoint):
    assert main(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


def test_the_python_writers_refuse_a_missing_folder(tmp_path, checkpoint):
    from nemo_fp8_plugin._io import atomic_write_text
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    with pytest.raises(FileNotFoundError, match="does not exist; it is not created") as err:
        atomic_write_text(tmp_path / "no" / "x.yaml", "a: 1\n")
    assert err.value.filename == str(tmp_path / "no" / "x.yaml")
    with pytest.raises(FP8ConfigError, match="does not exist") as refused:
        export_fp8_checkpoint(checkpoint, tmp_path / "no" / "out")
    assert refused.value.key == "out_dir"
    assert not (tmp_path / "no").exists()
