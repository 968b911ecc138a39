"""Megatron-Bridge's named recipes are ours where their fields are: against Bridge 0.6.2's real
``training/mixed_precision.py`` (from its wheel; Bridge does not install here: see
``test_bridge_adapter.py``, whose loader, with its two annotation-only stubs, is reused).

Which Bridge name is which recipe of ours is derived here from Bridge's own objects: the
``MixedPrecisionConfig`` each registered factory returns against the one Bridge's own class
builds from the block ``apply`` writes for a preset on the same base. Nothing is typed in.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
from test_bridge_adapter import WHEEL, _load_bridge_mixed_precision

from bridge_source import parse_recipes
from conftest import upstream_file
from nemo_fp8_plugin import FP8ConfigError, list_recipes
from nemo_fp8_plugin.hosts import apply_path, bridge, load_context, read_native
from nemo_fp8_plugin.hosts.bridge import recipes

pytestmark = pytest.mark.host

PRESETS = [s.name for s in list_recipes()]


@pytest.fixture(scope="module")
def mp(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        yield _load_bridge_mixed_precision(
            tmp_path_factory.mktemp("bridge"), patch, "bridge_mixed_precision_names"
        )


@pytest.fixture(scope="module")
def source(mp, tmp_path_factory):
    return upstream_file(WHEEL, recipes.SOURCE, tmp_path_factory.mktemp("bridge_src"))


def _names(mp):
    return sorted({fn.__name__ for fn in mp.MIXED_PRECISION_RECIPES.values()})


def _fields(cfg) -> dict:
    return {
        k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(cfg).items()
    }


def _built(mp, block) -> dict:
    """Bridge's own class built from a written block (dtypes as the YAML loader makes them)."""
    args = {
        k: (getattr(torch, v["_target_"].split(".")[1]) if isinstance(v, dict) else v)
        for k, v in block.items()
        if k != "_target_"
    }
    return _fields(mp.MixedPrecisionConfig(**args))


def _apply(tmp_path, data):
    path = tmp_path / "bridge.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return apply_path(bridge.ADAPTER, path)


def _same(a: dict, b: dict) -> bool:
    if not a["fp8"] and not b["fp8"]:  # fp8_recipe is inert without fp8
        a, b = {**a, "fp8_recipe": None}, {**b, "fp8_recipe": None}
    return a == b


@pytest.fixture(scope="module")
def equivalent(mp, tmp_path_factory):
    """(Bridge name, preset) -> whether Bridge's recipe and ``apply``'s block for the preset on
    that recipe's base build the same ``MixedPrecisionConfig`` (Bridge's own class both times)."""
    work = tmp_path_factory.mktemp("eq")
    out = {}
    for name in _names(mp):
        theirs = _fields(mp.get_mixed_precision_config(name))
        base = "fp16_mixed" if theirs["fp16"] else "bf16_mixed"
        for preset in PRESETS:
            block = _apply(work, {"mixed_precision": base, "precision": preset}).data
            out[name, preset] = _same(theirs, _built(mp, block["mixed_precision"]))
    return out


def test_the_recorded_recipes_are_bridges_own(mp, source):
    parsed, unreadable = parse_recipes(source.read_text())
    assert unreadable == []
    assert set(parsed) == set(_names(mp))  # every registered name, no other
    defaults = _fields(mp.MixedPrecisionConfig())
    for name in _names(mp):  # the reader against Bridge's own objects
        own = _fields(mp.get_mixed_precision_config(name))
        changed = {k: v for k, v in own.items() if v != defaults[k]}
        # Bridge's __setattr__ keeps fp8_param / fp4_param equal to the *_gather fields
        assert changed.pop("fp8_param", False) == own["fp8_param_gather"]
        assert changed.pop("fp4_param", False) == own["fp4_param_gather"]
        assert parsed[name] == changed, name
    assert parsed == recipes.RECORDED_RECIPES  # what apply and explain read


def test_bridges_names_for_our_recipes(equivalent):
    found = {name: preset for (name, preset), same in equivalent.items() if same}
    assert found["bf16_with_mxfp8_mixed"] == "mxfp8"  # the pair a user meets first
    assert found[bridge.BRIDGE_RECIPES["nvfp4"]] == "nvfp4"  # register() relies on it
    assert "nemotron_h_bf16_with_fp8_current_scaling_mixed" not in found  # 2+2 BF16 layers


def test_a_bridge_name_with_our_request_is_accepted_exactly_when_equivalent(
    mp, equivalent, tmp_path
):
    for (name, preset), same in equivalent.items():
        theirs = _fields(mp.get_mixed_precision_config(name))
        data = {"mixed_precision": name, "precision": preset}
        if not (theirs["fp8"] or theirs["fp4"]):  # a base recipe: the FP8 fields go onto it
            assert _apply(tmp_path, data).data["mixed_precision"][
                theirs["fp16"] and "fp16" or "bf16"
            ]
            continue
        if not same and preset not in ("mxfp8", "fp8_current"):
            continue  # the refusals: enough of them to see every kind
        if not same:
            with pytest.raises(FP8ConfigError) as err:
                _apply(tmp_path, data)
            assert err.value.key == "mixed_precision", (name, preset)
            continue
        block = _apply(tmp_path, data).data["mixed_precision"]
        assert isinstance(block, dict), (name, preset)  # the one form
        assert _same(_built(mp, block), theirs), (name, preset)


def test_explain_reads_a_bridge_name_as_our_recipe(equivalent, tmp_path):
    path = tmp_path / "bridge.yaml"
    for (name, preset), same in equivalent.items():
        if not same:
            continue
        path.write_text(f"mixed_precision: {name}\n")
        reading = read_native(load_context(path), "bridge")
        assert reading is not None and reading.spec is not None, name
        assert (reading.spec.name, reading.differs) == (preset, ()), name
    path.write_text("mixed_precision: nemotron_h_bf16_with_fp8_current_scaling_mixed\n")
    reading = read_native(load_context(path), "bridge")
    assert reading.spec.name == "fp8_current" and dict(reading.differs)["bf16_layers"] != {}


def test_a_name_bridge_does_not_register_is_still_a_conflict(tmp_path):
    with pytest.raises(FP8ConfigError, match="not a Megatron-Bridge recipe") as err:
        _apply(tmp_path, {"mixed_precision": "bf16_with_fp8_tilewise_mixed", "precision": "mxfp8"})
    assert err.value.key == "mixed_precision"


@pytest.mark.parametrize("preset", PRESETS)
def test_apply_writes_the_block_for_every_recipe(mp, preset, tmp_path):
    block = _apply(tmp_path, {"precision": preset}).data["mixed_precision"]
    assert block["_target_"] == bridge.MIXED_PRECISION_TARGET
    _built(mp, block)  # Bridge's own class takes it
