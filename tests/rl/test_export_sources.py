"""What ``export`` takes as a source: never one that is already quantized (its FP8 weights
passed through beside scales of another layout, and its ``quantization_config`` was replaced
without a word), and never a file a symbolic link in the checkpoint points to outside it
(``ln -s ~/.ssh/id_rsa ck/notes.txt`` was copied into the output), while a Hugging Face cache
snapshot, whose files are relative links into ``../../blobs``, keeps working. Each test failed
before the change (the snapshot one only on the new ``outside`` field: it guards the links the
change must keep following)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl import export_fp8_checkpoint

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {
        f"model.layers.0.{lin}.weight": torch.randn(128, 128, generator=gen)
        for lin in ("self_attn.q_proj", "mlp.down_proj")
    }
    sd["model.norm.weight"] = torch.ones(128)
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def _source(directory: Path, config: dict | None = None, sd: dict | None = None) -> Path:
    directory.mkdir(parents=True)
    save_file(sd if sd is not None else _state_dict(), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config or CONFIG))
    return directory


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["export", *map(str, argv), "--no-progress"])
    return rc, capsys.readouterr().err


def test_exporting_an_exported_checkpoint_again_is_refused(tmp_path, capsys):
    """``export ck -o fp8; export fp8 -o mx --recipe mxfp8`` exited 0, "14 weights in FP8",
    writing an MX quantization_config beside 128x128 block scales."""
    src = _source(tmp_path / "ck")
    assert _cli(capsys, src, "-o", tmp_path / "fp8")[0] == 0
    rc, err = _cli(capsys, tmp_path / "fp8", "-o", tmp_path / "mx", "--recipe", "mxfp8")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "CHECKPOINT" in lines[0] and "already quantized" in lines[0] and "fp8" in lines[0]
    assert not (tmp_path / "mx").exists()


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path):
    sd = _state_dict()
    sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"].to(
        torch.float8_e4m3fn
    )
    src = _source(tmp_path / "ck", sd=sd)
    with pytest.raises(FP8ConfigError, match="F8_E4M3") as err:
        export_fp8_checkpoint(src, tmp_path / "out")
    assert err.value.key == "source" and err.value.value == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(FP8ConfigError, match="already quantized"):
        export_fp8_checkpoint(sd, tmp_path / "out", config=CONFIG)  # a state dict too


def test_another_quantization_config_is_refused_not_replaced(tmp_path):
    awq = dict(CONFIG, quantization_config={"quant_method": "awq", "bits": 4})
    src = _source(tmp_path / "ck", config=awq)
    with pytest.raises(FP8ConfigError, match="quant_method: 'awq'") as err:
        export_fp8_checkpoint(src, tmp_path / "out")
    assert err.value.key == "source"
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(_state_dict(), tmp_path / "out", config=awq)
    assert err.value.key == "config"


def test_a_link_out_of_the_checkpoint_is_not_copied(tmp_path, capsys):
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY\n")
    src = _source(tmp_path / "ck")
    (src / "notes.txt").symlink_to(secret)
    (src / "tokenizer.json").write_text("{}")
    (src / "vocab.json").symlink_to("tokenizer.json")  # inside: followed
    result = export_fp8_checkpoint(src, tmp_path / "out")
    assert result.outside == ["notes.txt"]
    assert sorted(p.name for p in result.path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "vocab.json",
    ]
    rc, err = _cli(capsys, src, "-o", tmp_path / "out2")
    assert rc == 0 and "notes.txt of the checkpoint directory not copied" in err
    assert not (tmp_path / "out2" / "notes.txt").exists()


def test_a_config_json_linked_out_of_the_checkpoint_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(CONFIG))
    src = _source(tmp_path / "ck")
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(elsewhere)
    with pytest.raises(FP8ConfigError, match="symbolic link out of") as err:
        export_fp8_checkpoint(src, tmp_path / "out")
    assert err.value.key == "config"
    assert export_fp8_checkpoint(src, tmp_path / "out", config=elsewhere).quantized == 2


def test_a_hugging_face_cache_snapshot_still_exports(tmp_path):
    """A guard: the hub cache's layout, every file a relative link into ``../../blobs``."""
    repo = tmp_path / "hub" / "models--org--tiny"
    staged = _source(tmp_path / "staged")
    (staged / "tokenizer.json").write_text('{"t": 1}')
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, item in enumerate(sorted(staged.iterdir())):
        os.replace(item, repo / "blobs" / f"blob{i}")
        (snapshot / item.name).symlink_to(f"../../blobs/blob{i}")
    result = export_fp8_checkpoint(snapshot, tmp_path / "out")
    assert result.quantized == 2 and result.outside == []
    assert (result.path / "tokenizer.json").read_text() == '{"t": 1}'
    linked = tmp_path / "snap-link"  # the snapshot reached through a link of its own
    linked.symlink_to(snapshot)
    assert export_fp8_checkpoint(linked, tmp_path / "out2").outside == []
