"""export_fp8_checkpoint when things go wrong: signals, a SIGKILL's leftovers, two
exports at once, and inputs that must be refused naming the tensor or key.

Signals are sent by the exporting process to itself at a chosen step (through a wrapper of
``quantize_for_refit``, or of ``os.replace`` for the directory swap), in a child Python, so
the test sees what a real ``kill`` leaves behind.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nemo_fp8_plugin
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl import export_fp8_checkpoint

# the checkout whose package this test imports (the child Python must run the same code)
REPO = Path(nemo_fp8_plugin.__file__).resolve().parents[1]
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(64, 128, generator=gen)}
    for i in range(2):
        for lin in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            sd[f"model.layers.{i}.{lin}.weight"] = torch.randn(128, 128, generator=gen)
    sd["model.norm.weight"] = torch.ones(128)
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file(_state_dict(), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(CONFIG))
    return src


def _old_output(tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("the old checkpoint")
    return out


_CHILD = r"""
import os, signal, sys
from nemo_fp8_plugin.rl import refit

src, out, where, sig, overwrite = sys.argv[1:6]
sig = getattr(signal, sig)
if where == "write":  # the signal arrives after the third tensor is quantized
    real = refit.quantize_for_refit

    def quantize_for_refit(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 3:
                os.kill(os.getpid(), sig)
            yield item

    refit.quantize_for_refit = quantize_for_refit
else:  # "swap": right after the old directory is moved aside
    real_replace = os.replace

    def replace(a, b, *args, **kwargs):
        real_replace(a, b, *args, **kwargs)
        if str(b).endswith(".old"):
            os.kill(os.getpid(), sig)

    os.replace = replace
from nemo_fp8_plugin.cli import main

argv = ["export", src, "-o", out, "--no-progress"] + (["--overwrite"] if overwrite == "1" else [])
sys.exit(main(argv))
"""


def _run_child(src: Path, out: Path, where: str, sig: str, overwrite: bool):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), where, sig, "1" if overwrite else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(src.parent),
    )


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("where,overwrite", [("write", False), ("write", True), ("swap", True)])
def test_a_signal_restores_the_old_output_and_removes_temp_files(tmp_path, where, overwrite, sig):
    src = _source(tmp_path)
    out = _old_output(tmp_path) if overwrite else tmp_path / "ckpt"
    proc = _run_child(src, out, where, sig, overwrite)
    # "interrupted", not killed: 128 + the signal, as the shell reports one (130, 143)
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert proc.stderr.strip() == "nemo-fp8 export: interrupted"
    if overwrite:
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["ckpt", "src"] if overwrite else ["src"])


@pytest.mark.parametrize("where", ["write", "swap"])
def test_what_a_sigkill_leaves_is_cleaned_by_the_next_run(tmp_path, where):
    src = _source(tmp_path)
    out = _old_output(tmp_path)
    proc = _run_child(src, out, where, "SIGKILL", True)
    assert proc.returncode == -signal.SIGKILL
    assert len(list(tmp_path.iterdir())) > 2  # a temporary directory (and the lock) is left
    if where == "swap":  # killed between the renames: the old output is put back, kept
        with pytest.raises(FP8ConfigError, match="already exists") as err:
            export_fp8_checkpoint(src, out)
        assert err.value.key == "out_dir"
        assert (out / "keep.txt").read_text() == "the old checkpoint"
    else:
        export_fp8_checkpoint(src, out, overwrite=True)
        assert (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "src"]


def test_two_exports_to_one_new_directory_do_not_both_write(tmp_path, monkeypatch):
    """The second export, started while the first one writes, is refused (a lock), and the
    first one's output is what stays."""
    from nemo_fp8_plugin.rl import refit

    src, out = _source(tmp_path), tmp_path / "ckpt"
    real = refit.quantize_for_refit
    seen: list[BaseException | str] = []

    def quantize_for_refit(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 3 and not seen:
                seen.append("started")
                try:
                    export_fp8_checkpoint(src, out, "mxfp8")
                    seen.append("wrote")
                except FP8ConfigError as err:
                    seen.append(err)
            yield item

    monkeypatch.setattr(refit, "quantize_for_refit", quantize_for_refit)
    result = export_fp8_checkpoint(src, out)
    second = seen[1]
    assert isinstance(second, FP8ConfigError) and second.key == "out_dir", second
    assert "another export" in str(second)
    assert result.quantization_config["quant_method"] == "fp8"  # the first one's, not mxfp8
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "fp8"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "src"]


def test_the_exported_directory_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        out = export_fp8_checkpoint(_state_dict(), tmp_path / "ckpt", config=CONFIG).path
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755


def test_an_index_naming_a_tensor_no_shard_holds_is_refused(tmp_path):
    src = _source(tmp_path)
    names = list(load_file(str(src / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map["model.layers.9.mlp.up_proj.weight"] = "model.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FP8ConfigError, match="does not hold it") as err:
        export_fp8_checkpoint(src, tmp_path / "ckpt")
    assert err.value.key == "model.layers.9.mlp.up_proj.weight"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    "name,tensor,match",
    [
        ("model.layers.0.mlp.up_proj.weight", torch.empty(128, 128, device="meta"), "meta"),
        ("__metadata__", torch.ones(4), "metadata"),
    ],
)
def test_a_state_dict_tensor_that_cannot_be_written_is_refused(tmp_path, name, tensor, match):
    sd = _state_dict()
    sd[name] = tensor
    with pytest.raises(FP8ConfigError, match=match) as err:
        export_fp8_checkpoint(sd, tmp_path / "ckpt", config=CONFIG)
    assert err.value.key == name
    assert list(tmp_path.iterdir()) == []


def test_a_header_shape_past_any_real_tensor_is_refused_naming_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    header = {"model.huge": {"dtype": "BF16", "shape": [0, 2**62], "data_offsets": [0, 0]}}
    text = json.dumps(header).encode()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(FP8ConfigError, match="elements") as err:
        export_fp8_checkpoint(src, tmp_path / "ckpt")
    assert err.value.key == "model.huge"


@pytest.mark.parametrize("size", [2**63, 10**400])
def test_max_shard_bytes_past_a_file_offset_is_refused(tmp_path, size):
    with pytest.raises(FP8ConfigError) as err:
        export_fp8_checkpoint(_state_dict(), tmp_path / "ckpt", config=CONFIG, max_shard_bytes=size)
    assert err.value.key == "max_shard_bytes" and len(str(err.value)) < 200


def test_a_subdirectory_of_the_source_is_reported_not_dropped_silently(tmp_path):
    src = _source(tmp_path)
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"x")
    (src / "tokenizer.json").write_text("{}")
    result = export_fp8_checkpoint(src, tmp_path / "ckpt")
    assert result.skipped == ["original/"]
    assert (result.path / "tokenizer.json").exists() and not (result.path / "original").exists()


def test_a_single_safetensors_file_is_a_source(tmp_path):
    src = _source(tmp_path)
    from_dir = load_file(str(export_fp8_checkpoint(src, tmp_path / "a").path / "model.safetensors"))
    result = export_fp8_checkpoint(src / "model.safetensors", tmp_path / "b")
    from_file = load_file(str(result.path / "model.safetensors"))
    assert from_file.keys() == from_dir.keys()
    assert all(
        torch.equal(from_file[k].view(torch.uint8), from_dir[k].view(torch.uint8)) for k in from_dir
    )


def test_one_shard_of_an_indexed_checkpoint_is_refused(tmp_path):
    src = _source(tmp_path)
    names = list(load_file(str(src / "model.safetensors")))
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model.safetensors" for n in names}})
    )
    with pytest.raises(FP8ConfigError, match="one shard") as err:
        export_fp8_checkpoint(src / "model.safetensors", tmp_path / "ckpt")
    assert err.value.key == "source"
