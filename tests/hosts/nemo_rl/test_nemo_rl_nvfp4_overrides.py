"""NVFP4 through NeMo RL: the FP4 fields nvfp4 writes under
``policy.megatron_cfg.model_overrides`` pass NeMo RL's own override check (its source,
read-only test data)."""

from __future__ import annotations

import os

import pytest
import yaml
from nemo_rl_cases import MAIN_STACK, nemo_rl_model_override_functions, resolved

from conftest import nemo_rl_configs
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL


def test_nvfp4_model_overrides_pass_nemo_rls_own_conflict_check(tmp_path):
    """The FP4 fields nvfp4 writes through policy.megatron_cfg.model_overrides are no
    first-class NeMo RL key: its own _validate_model_override_conflicts (setup.py at 7ea279a)
    accepts them, and refuses one that is (the check can fail). Only main has
    model_overrides, so the config is written for main."""
    configs = nemo_rl_configs()
    data = yaml.safe_load((configs / "grpo_math_8B_megatron.yaml").read_text())
    data["defaults"] = os.path.relpath(configs / data["defaults"], tmp_path)
    data["fp8"] = {"recipe": "nvfp4", "fp8_param": True, "hardware": "b200"}
    data["policy"]["sequence_packing"] = {"enabled": False}  # NeMo RL pads for fp8_cfg only
    src, out = tmp_path / "in.yaml", tmp_path / "out.yaml"
    src.write_text(yaml.safe_dump(data, sort_keys=False))
    result = apply_path(NEMO_RL, src, output=out, stack=MAIN_STACK)
    out.write_text(yaml.safe_dump(result.data, sort_keys=False))
    megatron_cfg = dict(resolved(out)["policy"]["megatron_cfg"])
    overrides = megatron_cfg["model_overrides"]
    assert {"fp4", "fp4_recipe", "fp4_param"} <= set(overrides)
    check = nemo_rl_model_override_functions()["_validate_model_override_conflicts"]
    check(megatron_cfg, overrides)
    with pytest.raises(ValueError, match="first-class"):
        check(megatron_cfg, {**overrides, "fp8_cfg": {}})
