"""The vLLM engine defaults ``apply`` leaves out (``hosts/vllm/native.py``) are the installed
vLLM's own ``EngineArgs`` defaults, and an engine config apply wrote reads back through
vLLM's own ``EngineArgs`` unchanged in meaning."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.engine.arg_utils import EngineArgs

from nemo_fp8_plugin.hosts import apply_mapping, get_adapter, mapping_context, read_native
from nemo_fp8_plugin.hosts.vllm.native import ENGINE_DEFAULTS

pytestmark = pytest.mark.vllm


def test_recorded_engine_defaults_are_vllms_own():
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert {k: fields[k] for k in ENGINE_DEFAULTS} == ENGINE_DEFAULTS


def test_a_left_out_option_is_what_engine_args_holds_without_it():
    config = {"model": "m", "max_model_len": 64, "precision": "fp8_blockwise"}
    data = apply_mapping(get_adapter("vllm"), config).data
    assert "kv_cache_dtype" not in data
    kwargs = {k.replace("-", "_"): v for k, v in data.items()}
    assert EngineArgs(**kwargs).kv_cache_dtype == "auto"
    reading = read_native(mapping_context(data), "vllm")
    assert reading.spec.name == "fp8_blockwise" and reading.spec.kv_cache == "auto"
