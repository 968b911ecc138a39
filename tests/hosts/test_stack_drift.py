"""Host facts newer than the test environment's megatron-core 0.16.1, written per stack:
``ddp.fp4_param_gather`` (megatron-core >= 0.18) for NVFP4 parameters."""

from __future__ import annotations

import ast

import pytest
import yaml

from conftest import shared_nemo_rl
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.hosts import megatron as mg
from nemo_fp8_plugin.hosts.nemo_rl import NVFP4_PARAM_GATHER_WARNING, native_keys
from nemo_fp8_plugin.registry import get_recipe

NVFP4_PARAMS = "fp8: {recipe: nvfp4, fp8_param: true}\nmodel: {num_layers: 4}\n"


def _apply(tmp_path, capsys, *stack):
    src, out = tmp_path / "in.yaml", tmp_path / "out.yaml"
    src.write_text(NVFP4_PARAMS)
    assert main(["apply", str(src), "--host", "megatron", *stack, "-o", str(out)]) == 0
    return yaml.safe_load(out.read_text()), capsys.readouterr().err


@pytest.mark.parametrize(
    "stack,written",
    [("nemo-rl-main-2026-08-22", True), ("latest", True), ("nemo-2.7", False)],
)
def test_fp4_param_gather_is_written_where_megatron_core_has_it(tmp_path, capsys, stack, written):
    data, err = _apply(tmp_path, capsys, "--stack", stack)
    assert data["model"]["fp4_param"] is True
    assert ("fp4_param_gather" in data.get("ddp", {})) is written
    if written:
        assert data["ddp"]["fp4_param_gather"] is True
    else:
        assert "megatron-core 0.16.1 has no ddp.fp4_param_gather (from 0.18)" in err


@pytest.mark.host
def test_megatron_core_0_16_1_itself_refuses_the_field():
    """Why it is not written for 0.16.1: its real DistributedDataParallelConfig has no such
    field (a TypeError at construction)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    assert "fp4_param_gather" not in DistributedDataParallelConfig.__dataclass_fields__
    spec = get_recipe("nvfp4")
    assert mg.fp4_ddp_fields(spec, "0.16.1") == {}
    assert mg.fp4_ddp_fields(spec, "0.18.0") == {"fp4_param_gather": True}
    assert mg.fp4_ddp_fields(get_recipe("mxfp8"), "0.20.0") == {}
    mg.build_ddp_config(spec)  # still builds on 0.16.1


def test_no_fp4_parameters_no_gather(tmp_path, capsys):
    src, out = tmp_path / "in.yaml", tmp_path / "out.yaml"
    src.write_text("fp8: {recipe: nvfp4, fp8_param: false}\nmodel: {num_layers: 4}\n")
    assert main(["apply", str(src), "--host", "megatron", "--stack", "latest", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["ddp"].get("fp4_param_gather") is False
    assert "fp4_param_gather" not in capsys.readouterr().err


def test_nemo_rl_cannot_set_fp4_param_gather_and_says_so():
    """NeMo RL (main 7ea279a) passes a fixed set of keys to DistributedDataParallelConfig;
    the warning's claim is read from its source."""
    tree = ast.parse(shared_nemo_rl("src/nemo_rl/models/megatron/setup.py").read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "DistributedDataParallelConfig"
    ]
    assert calls and all(
        kw.arg != "fp4_param_gather" and kw.arg is not None for c in calls for kw in c.keywords
    )
    assert (
        NVFP4_PARAM_GATHER_WARNING
        in native_keys(get_recipe("nvfp4"), fp8_param_stated=True).warnings
    )
    assert NVFP4_PARAM_GATHER_WARNING not in native_keys(get_recipe("nvfp4")).warnings


# --------------------------------------------------------------------------- NVFP4 + FP8 attention

NVFP4_DPA = {"recipe": "nvfp4", "fp8_dot_product_attention": True}


def test_the_spec_accepts_nvfp4_fp8_attention():
    """Whether FP8 attention under NVFP4 runs is a host-version question (megatron-core passes
    fp8_dpa to NVFP4BlockScaling from 0.17), so the spec no longer refuses it outright."""
    assert get_recipe(NVFP4_DPA).fp8_dot_product_attention is True


@pytest.mark.host
def test_megatron_core_0_16_1_refuses_it_naming_the_version(tmp_path, capsys):
    src = tmp_path / "in.yaml"
    src.write_text(
        "fp8: {recipe: nvfp4, fp8_dot_product_attention: true}\nmodel: {num_layers: 4}\n"
    )
    for host in ("megatron", "nemo2", "bridge"):
        assert main(["apply", str(src), "--host", host]) == 2
        err = capsys.readouterr().err
        assert "fp8.fp8_dot_product_attention" in err and "megatron-core 0.16.1" in err, host
        assert "from 0.17" in err


def test_a_megatron_core_that_passes_fp8_dpa_gets_it(monkeypatch):
    """With megatron-core 0.19.2 (its get_fp4_recipe passes fp8_dpa; the version is what
    honoured_fp8_fields reports, patched here: 0.19.2 does not install), the field is written."""
    from nemo_fp8_plugin.hosts.megatron import honoured

    patched = honoured.honoured_fp8_fields("0.19.2")
    monkeypatch.setattr(honoured, "honoured_fp8_fields", lambda: patched)
    spec = get_recipe(NVFP4_DPA)
    assert mg.dropped_settings(spec) == []
    keys = mg.transformer_config_fields(spec).keys
    assert keys["fp4"] == "e2m1" and keys["fp8_dot_product_attention"] is True
    assert "fp8_dot_product_attention" not in mg.transformer_config_fields(get_recipe("nvfp4")).keys


def test_nemo_rl_says_training_attention_stays_bf16():
    from nemo_fp8_plugin.hosts.nemo_rl import native_keys as nemo_rl_keys

    warnings = nemo_rl_keys(get_recipe(NVFP4_DPA)).warnings
    assert any("FP8 attention has no fp8_cfg key" in w for w in warnings)
