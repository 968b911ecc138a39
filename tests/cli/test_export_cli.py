"""`nemo-fp8 export` on careless and hostile input: one line on stderr, exit 2,
the flag or key named, nothing left behind; what is not copied is said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}


def _source(tmp_path: Path, names=("model.layers.0.mlp.up_proj.weight",)) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file(
        {n: torch.randn(128, 128, generator=gen).to(torch.bfloat16) for n in names},
        str(src / "model.safetensors"),
    )
    (src / "config.json").write_text(json.dumps(CONFIG))
    return src


def _refused(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nemo-fp8 export: error: "), err
    assert "Traceback" not in err and "\x1b" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_a_max_shard_size_of_400_nines_is_one_line(tmp_path, capsys):
    src = _source(tmp_path)
    err = _refused(
        capsys,
        ["export", str(src), "-o", str(tmp_path / "out"), "--max-shard-size", "9" * 400],
        "--max-shard-size",
    )
    assert len(err) < 300
    assert not (tmp_path / "out").exists()


def test_the_overwrite_hint_names_the_flag(tmp_path, capsys):
    src = _source(tmp_path)
    (tmp_path / "out").mkdir()
    err = _refused(capsys, ["export", str(src), "-o", str(tmp_path / "out")], "-o", "--overwrite")
    assert "overwrite=True" not in err


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    "file,text,needle",
    [
        ("model.safetensors.index.json", _nested(100_000), "CHECKPOINT"),
        ("config.json", _nested(100_000), "config"),
        ("config.json", '{"num_hidden_layers": ' + "7" * 5000 + "}", "config"),
    ],
)
def test_deeply_nested_or_huge_json_is_one_line(tmp_path, capsys, file, text, needle):
    src = _source(tmp_path)
    (src / file).write_text(text)
    _refused(capsys, ["export", str(src), "-o", str(tmp_path / "out")], needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_skipped_subdirectory_is_said_with_its_name_escaped(tmp_path, capsys):
    src = _source(tmp_path)
    (src / "original").mkdir()
    (src / "evil\x1b[2J").mkdir()
    assert main(["export", str(src), "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("wrote ")
    notes = captured.err.splitlines()
    assert len(notes) == 2 and all("not copied" in n for n in notes), notes
    assert any("original/" in n for n in notes)
    assert "\x1b" not in captured.err and "evil\\x1b[2J/" in captured.err


def test_a_tensor_name_with_escape_sequences_is_printed_escaped(tmp_path, capsys):
    """A name in two shards: the refusal names it, escaped (a terminal would run it)."""
    name = "model.layers.0.mlp.up_proj.weight\x1b]0;pwned\x07"
    src = _source(tmp_path, names=(name,))
    save_file({name: torch.zeros(2, 2, dtype=torch.bfloat16)}, str(src / "model-extra.safetensors"))
    _refused(capsys, ["export", str(src), "-o", str(tmp_path / "out")], "appears in both")


def test_a_single_safetensors_file_is_accepted_as_analyze_accepts_it(tmp_path, capsys):
    src = _source(tmp_path)
    out = tmp_path / "out"
    assert main(["export", str(src / "model.safetensors"), "-o", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 1 weights in FP8")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "fp8"
    )


def test_a_file_without_config_json_beside_it_takes_model_config(tmp_path, capsys):
    """The weights file alone (no config.json in its directory): refused naming the flag
    that supplies one, then exported with ``--model-config``."""
    src = _source(tmp_path)
    elsewhere = tmp_path / "hf_config.json"
    (src / "config.json").rename(elsewhere)
    weights, out = str(src / "model.safetensors"), tmp_path / "out"
    err = _refused(capsys, ["export", weights, "-o", str(out)], "--model-config PATH")
    assert "config=" not in err  # the library's argument, not a flag of this command
    argv = ["export", weights, "-o", str(out), "--model-config", str(elsewhere), "--no-progress"]
    assert main(argv) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == CONFIG["architectures"]
    assert written["quantization_config"]["quant_method"] == "fp8"


def test_an_output_inside_the_checkpoint_directory_leaves_its_own_files_out(tmp_path, capsys):
    """OUT under the source directory: the export's temporary directory and lock are its own,
    neither copied nor reported as a skipped subdirectory."""
    src = _source(tmp_path)
    out = src / "fp8"
    assert main(["export", str(src), "-o", str(out), "--no-progress"]) == 0
    assert "not copied" not in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_missing_source_names_the_argument(tmp_path, capsys):
    _refused(
        capsys,
        ["export", str(tmp_path / "nope.safetensors"), "-o", str(tmp_path / "out")],
        "CHECKPOINT",
        "not found",
    )


def test_an_output_name_with_a_non_utf8_byte_is_written_and_shown_escaped(tmp_path):
    """The temporary names are built from the safe characters of the output's name, and the
    "wrote" line escapes what the terminal's encoding cannot show."""
    import os
    import subprocess
    import sys

    import nemo_fp8_plugin

    src = _source(tmp_path)
    out = tmp_path / os.fsdecode(b"out\xff")
    env = dict(
        os.environ,
        PYTHONPATH=str(Path(nemo_fp8_plugin.__file__).resolve().parents[1]),
        PYTHONIOENCODING="utf-8",
        PYTHONWARNINGS="ignore",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", "export", str(src), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("wrote ") and "out\\udcff" in proc.stdout
    assert (out / "model.safetensors").exists()
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"out\xff", b"src"]


@pytest.mark.parametrize("how", ["directory", "too large", "a list"])
def test_the_checkpoints_own_config_json_is_blamed_on_the_checkpoint(tmp_path, capsys, how):
    """``export ck`` with a bad ck/config.json named --model-config, a flag never passed (and
    a directory there was looked up as config.json/config.json)."""
    src = _source(tmp_path)
    config = src / "config.json"
    config.unlink()
    if how == "directory":
        config.mkdir()
    elif how == "too large":
        from nemo_fp8_plugin.errors import LIMITS

        with open(config, "wb") as fh:
            fh.truncate(LIMITS.config_bytes + 1)
    else:
        config.write_text("[1, 2]")
    err = _refused(capsys, ["export", str(src), "-o", str(tmp_path / "out")], "CHECKPOINT")
    assert "--model-config" not in err.split(" (")[0] and "config.json/config.json" not in err
    if how != "a list":
        assert str(config) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_an_integer_linear_weight_is_refused_naming_it(tmp_path, capsys, dtype):
    """An int8 linear weight and no quantization_config exited 0 ("0 weights in FP8, 1
    tensors as they came") and wrote an FP8 config.json over the integer tensor."""
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    src = _source(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.ones(128, 128, dtype=torch.bfloat16),
        name: torch.ones(128, 128, dtype=dtype),
    }
    save_file(tensors, str(src / "model.safetensors"))
    err = _refused(capsys, ["export", str(src), "-o", str(tmp_path / "out")], "CHECKPOINT", name)
    assert "integer weight" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    with pytest.raises(FP8ConfigError, match=name):  # a state dict: the same
        export_fp8_checkpoint(tensors, tmp_path / "out", config=CONFIG)
