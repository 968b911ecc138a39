"""FP8 attention is decided for the megatron-core version the command assumes (``--stack``),
not the installed one, on every megatron-core host (megatron, NeMo 2, Megatron-Bridge).

The test environment installs megatron-core 0.16.1, whose ``get_fp4_recipe`` drops
``fp8_dot_product_attention`` under nvfp4 and whose ``get_fp8_recipe`` drops it under MXFP8;
the ``latest`` stack pins megatron-core 0.19.2, which passes both (``stacks.FACTS``, checked
against the 0.17.0 / 0.18.0 / 0.19.2 wheels' source by tests/test_stacks_megatron_source.py).
Before this fix NeMo 2 and Bridge refused the nvfp4 case under ``--stack latest``, reading the
installed 0.16.1.
"""

from __future__ import annotations

import pytest
import yaml

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.dotted import get_path

pytestmark = pytest.mark.host

HOSTS = ("megatron", "nemo2", "bridge")

# Where each host writes fp8_dot_product_attention in its output.
WRITTEN_AT = {
    "megatron": "model.fp8_dot_product_attention",
    "nemo2": "trainer.plugins.fp8_dot_product_attention",
    "bridge": "mixed_precision.fp8_dot_product_attention",
}


def _apply(tmp_path, recipe: str, host: str, stack: str) -> tuple[int, dict | None]:
    src = tmp_path / f"{recipe}.yaml"
    src.write_text(
        f"fp8: {{recipe: {recipe}, fp8_dot_product_attention: true}}\nmodel: {{num_layers: 4}}\n"
    )
    out = tmp_path / f"{recipe}-{host}-{stack}.out.yaml"
    rc = main(["apply", str(src), "--host", host, "--stack", stack, "-o", str(out)])
    return rc, (yaml.safe_load(out.read_text()) if rc == 0 else None)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("host", HOSTS)
def test_the_latest_stack_gets_fp8_attention_although_0_16_1_is_installed(
    tmp_path, capsys, host, recipe
):
    rc, data = _apply(tmp_path, recipe, host, "latest")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "stack: latest" in err
    if host == "bridge" and isinstance(data.get("mixed_precision"), str):
        pytest.fail(f"bridge wrote a recipe name, not the FP8 attention field: {data}")
    assert get_path(data, WRITTEN_AT[host]) is True, data


# nvfp4: the stacks table's row (0.17); mxfp8: the installed 0.16.1 source, which is the
# stack's own release here, names the recipes that honour the field.
@pytest.mark.parametrize("recipe, words", [("nvfp4", "from 0.17"), ("mxfp8", "not for mxfp8")])
@pytest.mark.parametrize("host", HOSTS)
def test_the_nemo_2_7_stack_refuses_it_naming_its_megatron_core(
    tmp_path, capsys, host, recipe, words
):
    rc, _ = _apply(tmp_path, recipe, host, "nemo-2.7")
    err = capsys.readouterr().err
    assert rc == 2
    error = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(error) == 1, err
    assert "fp8.fp8_dot_product_attention" in error[0]
    assert "megatron-core 0.16.1" in error[0] and words in error[0]


def test_a_stack_older_than_the_installed_source_decides_mxfp8_attention(monkeypatch):
    """The stack's release, not the installed source, decides MXFP8's FP8 attention: with an
    installed source that honours it (patched: 0.19.2 does not install) a stack pinning 0.17.0
    is refused naming 0.17.0 and the first release that passes fp8_dpa."""
    from nemo_fp8_plugin.hosts import megatron as mg
    from nemo_fp8_plugin.hosts.megatron import honoured
    from nemo_fp8_plugin.registry import get_recipe

    real = honoured.honoured_fp8_fields
    assert "fp8_dot_product_attention" in real("0.19.2").fields["mxfp8"]
    monkeypatch.setattr(honoured, "honoured_fp8_fields", lambda: real("0.19.2"))
    spec = get_recipe({"recipe": "mxfp8", "fp8_dot_product_attention": True})
    assert mg.dropped_settings(spec) == []
    assert mg.dropped_settings(spec, "0.19.2") == []
    ((key, reason),) = mg.dropped_settings(spec, "0.17.0")
    assert key == "fp8_dot_product_attention"
    assert "megatron-core 0.17.0" in reason and "from 0.18" in reason
