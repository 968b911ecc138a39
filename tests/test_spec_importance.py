"""``importance_sampling.max_sequence_error``: the recipe field behind NeMo RL's
``grpo.seq_logprob_error_threshold`` (its numerics: tests/rl/test_importance_nemo_rl.py)."""

from __future__ import annotations

import pytest

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.spec import ImportanceSampling, RecipeSpec

pytestmark = pytest.mark.torch_free


def test_off_by_default_in_every_preset():
    from nemo_fp8_plugin.registry import default_registry

    for spec in default_registry().specs():
        assert spec.importance_sampling.max_sequence_error is None, spec.name


def test_an_fp8_block_sets_it_and_it_round_trips():
    spec = get_recipe(
        {"recipe": "fp8_blockwise", "importance_sampling": {"max_sequence_error": 1.5}}
    )
    assert spec.importance_sampling.max_sequence_error == 1.5
    assert spec.importance_sampling.truncation is None  # the rest of the block kept
    assert spec.to_dict()["importance_sampling"]["max_sequence_error"] == 1.5
    assert RecipeSpec.from_mapping(spec.to_dict()) == spec
    assert isinstance(ImportanceSampling(max_sequence_error=2).max_sequence_error, float)


@pytest.mark.parametrize("value", [0.99, 0, -1.0, float("inf"), float("nan"), "1.5", True, 1e7])
def test_a_bad_value_names_the_key(value):
    with pytest.raises(FP8ConfigError) as info:
        get_recipe(
            {"recipe": "fp8_blockwise", "importance_sampling": {"max_sequence_error": value}}
        )
    assert info.value.key == "importance_sampling.max_sequence_error"


def test_below_one_says_why():
    with pytest.raises(FP8ConfigError) as info:
        ImportanceSampling(max_sequence_error=0.5)
    assert "every sequence would leave the loss" in str(info.value)
    assert "1.5" in (info.value.hint or "")
