"""explain leads with what changes; recipe fields that do not apply to the recipe (its kind of
scaling, read from the capability row; a side it leaves in BF16) only with ``--full``
(the fields the config's host reads)."""

from __future__ import annotations

import pytest

from conftest import NEMO_RL_TRIMMED, REPO
from nemo_fp8_plugin.capabilities import capability
from nemo_fp8_plugin.explain import build_report, render_text

pytestmark = pytest.mark.torch_free

EXAMPLES = sorted((REPO / "conf" / "examples").glob("*.yaml")) + [NEMO_RL_TRIMMED]


def _fields_line_block(text: str) -> str:
    return text.split("recipe fields:\n", 1)[1].split("\nmodel:", 1)[0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_shipped_example_shows_a_field_its_recipe_does_not_read(path):
    report = build_report(path)
    if report.get("recipe") is None:
        pytest.skip(f"{path.name} asks for no recipe")  # none of them today
    recipe, row = report["recipe"], capability(report["recipe"]["scaling"])
    shown = _fields_line_block(render_text(report))
    values = [line for line in shown.splitlines() if not line.strip().startswith("(")]
    fields = " ".join(values)
    if not row.is_delayed:
        for name in ("amax_history_len", "margin", "reduce_amax", "amax_compute_algo"):
            assert f"{name}:" not in fields, (path.name, name)
    if row.per_tensor:
        assert "weight_block:" not in fields, path.name
    if recipe["training"] == "bf16":
        assert "fp8_wgrad:" not in fields, path.name
    full = render_text(report, full=True)
    assert "amax_history_len" in full and "weight_block" in full  # --full shows every field


def test_a_tensorwise_recipe_hides_tiles_and_says_why(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_current\nmodel: {num_layers: 4, hidden_size: 256}\n")
    text = render_text(build_report(cfg))
    assert "(activation_block, weight_block, gradient_block: tensorwise scaling" in text
    assert "activation_block: null" not in text


def test_generation_only_hides_training_fields_and_the_all_bf16_table(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        NEMO_RL_TRIMMED.read_text().replace(
            "precision: fp8_blockwise", "fp8: {recipe: fp8_blockwise, training: bf16}"
        )
        + "\n"
    )
    report = build_report(cfg, model="meta-llama/Llama-3.1-8B-Instruct")
    text = render_text(report)
    assert "fp8_wgrad:" not in _fields_line_block(text)
    assert "training runs in BF16; --full shows them" in text
    assert "every module in BF16 (the recipe's training side)" in text
    assert "self_attention.linear_qkv" not in text  # the all-BF16 table is one line
    assert "self_attention.linear_qkv" in render_text(report, full=True)
