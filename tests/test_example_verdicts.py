"""The examples end with a one-line verdict: PASS with what they checked, or FAIL (exit 1)
naming what failed (``examples/vllm/refit_loop.py``: tests/hosts/vllm/test_refit_loop_example.py;
``examples/nemo2/finetune_fp8.py --dry-run`` imports NeMo's LLM collection, ~20 s, and is
left to a manual run)."""

from __future__ import annotations

import runpy

import pytest

from conftest import REPO

pytestmark = pytest.mark.host

MEGATRON = REPO / "examples" / "megatron" / "transformer_config_fp8.py"


def test_the_megatron_example_ends_with_its_verdict(capsys):
    from nemo_fp8_plugin import list_recipes

    runpy.run_path(str(MEGATRON), run_name="__main__")
    last = capsys.readouterr().out.splitlines()[-1]
    count = len(list_recipes())  # the built-in six, and any other test registered
    assert last.startswith(f"transformer_config_fp8: PASS: {count} recipes built and validated ")


def test_the_megatron_example_fails_naming_the_recipe(monkeypatch, capsys):
    import nemo_fp8_plugin.hosts.megatron as megatron

    real = megatron.build_transformer_config

    def build(spec, **model):
        if spec.name == "mxfp8":
            raise ValueError("stand-in for megatron-core's refusal")
        return real(spec, **model)

    monkeypatch.setattr(megatron, "build_transformer_config", build)
    with pytest.raises(SystemExit) as end:
        runpy.run_path(str(MEGATRON), run_name="__main__")
    assert end.value.code == (
        "transformer_config_fp8: FAIL: mxfp8: ValueError: stand-in for megatron-core's refusal"
    )
